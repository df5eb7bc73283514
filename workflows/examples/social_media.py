"""Social Media (paper Fig. 11): a post's text and its linked image classified by a language model
and a vision model side by side, then fused by a fan-in function.

`classify_text` tokenizes the post (a hashing tokenizer) and runs the transformer text encoder;
`classify_image` runs MobileNetV3-Small on the image. Each puts its logits on the device under a
request-scoped key; `aggregate` waits for both (fan-in), gets the two logit tensors without a copy and
decides the post's topic and whether to flag it.
"""

from __future__ import annotations

from typing import Any

import streambox
from streambox.kernel_compiler.zoo import get_entry

from .imaging import decode_image, resize, softmax_top, tokenize

DEFAULT_SEQ_LEN = 64
DEFAULT_IMAGE_SIZE = 224
TOPICS = (
    "news",
    "sports",
    "music",
    "movies",
    "food",
    "travel",
    "fashion",
    "technology",
    "science",
    "politics",
    "health",
    "finance",
    "gaming",
    "pets",
    "spam",
    "abuse",
)
FLAGGED_TOPICS = frozenset({"spam", "abuse"})


@streambox.function(models=["text_encoder"])
def classify_text(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    text = event.get("text")
    if not isinstance(text, str):
        raise streambox.InvalidInput(f"the event's 'text' must be a string, got {type(text).__name__}")
    length = int(event.get("params", {}).get("seq_len", DEFAULT_SEQ_LEN))
    ids, count = tokenize(text, length, get_entry("text_encoder").vocab_size or 2)
    (logits,) = ctx.infer("text_encoder", ids)
    key = ctx.key("text-logits")
    ctx.put(key, logits, consumers=1)
    return {"post_id": event.get("post_id"), "key": key, "tokens": count}


@streambox.function(models=["mobilenet_v3_small"])
def classify_image(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    size = int(event.get("params", {}).get("image_size", DEFAULT_IMAGE_SIZE))
    (logits,) = ctx.infer("mobilenet_v3_small", resize(decode_image(event.get("image")), size))
    key = ctx.key("image-logits")
    ctx.put(key, logits, consumers=1)
    return {"key": key}


@streambox.function
def aggregate(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    (text,) = event["inputs"]["text"]
    (vision,) = event["inputs"]["vision"]
    topic, topic_confidence = softmax_top(ctx.download(ctx.get(text["key"])))
    image_class, image_confidence = softmax_top(ctx.download(ctx.get(vision["key"])))
    return {
        "post_id": text["post_id"],
        "tokens": text["tokens"],
        "topic": TOPICS[topic % len(TOPICS)],
        "topic_confidence": topic_confidence,
        "image_class": image_class,
        "image_confidence": image_confidence,
        "flagged": TOPICS[topic % len(TOPICS)] in FLAGGED_TOPICS,
    }
