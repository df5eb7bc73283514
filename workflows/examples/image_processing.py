"""Image Processing (paper Fig. 11): face recognition, then image enhancement of the same picture.

`recognize` decodes the request's image, resizes it on the CPU, uploads it once and runs ResNet-18
on it; it then puts the uploaded image under a request-scoped key, so that `enhance` runs the ESPCN
super-resolution model on the very same device tensor (a hand-over, no copy and no second upload).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import streambox

from .imaging import decode_image, encode_image, image_to_uint8, resize, softmax_top

DEFAULT_IMAGE_SIZE = 224


@streambox.function(models=["resnet18"])
def recognize(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    params = event.get("params", {})
    image = decode_image(event.get("image"))
    x = ctx.upload(resize(image, int(params.get("image_size", DEFAULT_IMAGE_SIZE))))
    (logits,) = ctx.infer("resnet18", x)
    identity, confidence = softmax_top(ctx.download(logits))
    key = ctx.key("image")
    ctx.put(key, x, consumers=1)
    return {
        "key": key,
        "identity": identity,
        "confidence": confidence,
        "return_image": bool(event.get("return_image", False)),
    }


@streambox.function(models=["espcn"])
def enhance(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    x = ctx.get(event["key"])
    (y,) = ctx.infer("espcn", x)
    enhanced = image_to_uint8(ctx.download(y)[0])
    result: dict[str, Any] = {
        "identity": event["identity"],
        "confidence": event["confidence"],
        "input_shape": list(x.shape[2:]),
        "enhanced_shape": list(enhanced.shape),
        "enhanced_mean": round(float(np.mean(enhanced)), 4),
    }
    if event.get("return_image"):
        result["image"] = encode_image(enhanced)
    return result
