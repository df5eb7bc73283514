"""Traffic (paper Fig. 11): object detection, then per detected object face recognition (people) or
car recognition (vehicles), one invocation per object (fan-out).

`detect` runs SSDlite320-MobileNetV3's tensor part on the device; anchors, box decoding and
non-maximum suppression run on the CPU with torchvision's own pieces (`build_ssdlite_postprocess`).
People are ranked by the person probability, vehicles by their best vehicle class; per group the best
boxes after NMS are kept, at most `max_people` and `max_vehicles` (a top-k, not a confidence
threshold). The zoo's weights are seeded, not trained: the randomly initialised backbone's activations
vanish, so every anchor gets the same scores and its box unchanged, and an anchor may then lead both
groups. The pipeline is the real one (device inference, CPU decoding and NMS); with trained weights
the same code yields meaningful objects, and the top-k keeps the fan-out width the workflow asks for.
Each object is cut from the CPU image, resized to the recognizer's input, uploaded and put under a
request-scoped key for exactly one consumer.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torchvision.models.detection.image_list import ImageList
from torchvision.ops import clip_boxes_to_image, nms

import streambox
from streambox.kernel_compiler.zoo import build_ssdlite_postprocess

from .imaging import crop_resize, decode_image, resize, softmax_top

PERSON = 1
VEHICLES = {2: "bicycle", 3: "car", 4: "motorcycle", 6: "bus", 8: "truck"}  # COCO category ids
ANCHORS_PER_LOCATION = 6  # SSDlite's default boxes: aspect ratios 2 and 3 at each of its 6 levels
DEFAULTS: dict[str, Any] = {
    "image_size": 320,
    "max_people": 4,
    "max_vehicles": 4,
    "face_size": 224,
    "car_size": 224,
    "nms_iou": 0.45,
    "min_box": 4.0,
}


@functools.cache
def _postprocess() -> tuple[Any, Any]:
    return build_ssdlite_postprocess()


def warm_up() -> None:
    """Run once where the handlers are imported (the proxy's template before it forks, an instance's
    start): SSDlite's post-processing is built ahead of the first request, not during it."""
    _postprocess()


def feature_map_sizes(image_size: int) -> list[int]:
    """Sides of SSDlite's 6 feature maps: strides 16 and 32 of the backbone, then 4 stride-2 blocks
    (every stride-2 convolution has kernel 3 and padding 1, so a side s becomes ceil(s / 2))."""
    sides, side = [], image_size
    for _ in range(4):
        side = math.ceil(side / 2)
    for _ in range(6):
        sides.append(side)
        side = math.ceil(side / 2)
    return sides


@functools.lru_cache(maxsize=8)
def anchors_for(image_size: int, count: int) -> torch.Tensor:
    """SSDlite's default boxes for a square input (the same for every request of that size: made
    once per instance, about 1 ms of the handler's CPU time saved per request)."""
    sides = feature_map_sizes(image_size)
    if ANCHORS_PER_LOCATION * sum(s * s for s in sides) != count:
        raise ValueError(
            f"the detector gave {count} boxes for a {image_size}px image; expected feature maps {sides}"
        )
    generator, _ = _postprocess()
    images = ImageList(torch.empty(1, 3, image_size, image_size), [(image_size, image_size)])
    return generator(images, [torch.empty(1, 1, s, s) for s in sides])[0]


def select_objects(
    regression: torch.Tensor, logits: torch.Tensor, image_size: int, params: dict[str, Any]
) -> list[tuple[str, list[float], float]]:
    """(label, box, score) of the kept objects, people first, each group by falling score."""
    _, coder = _postprocess()
    boxes = coder.decode_single(regression, anchors_for(image_size, regression.shape[0]))
    boxes = clip_boxes_to_image(boxes, (image_size, image_size))
    probs = torch.softmax(logits, dim=-1)
    vehicle_ids = torch.tensor(list(VEHICLES))
    vehicle_scores, vehicle_best = probs[:, vehicle_ids].max(dim=1)
    big_enough = (boxes[:, 2:] - boxes[:, :2]).min(dim=1).values >= params["min_box"]
    idx = torch.nonzero(big_enough).flatten()
    objects = []
    groups = (
        (probs[:, PERSON], None, params["max_people"]),
        (vehicle_scores, vehicle_best, params["max_vehicles"]),
    )
    for scores, best, limit in groups:
        keep = idx[nms(boxes[idx], scores[idx], params["nms_iou"])][: int(limit)]
        for i in keep.tolist():
            label = "person" if best is None else VEHICLES[int(vehicle_ids[best[i]])]
            objects.append((label, boxes[i].tolist(), float(scores[i])))
    return objects


@streambox.function(models=["ssdlite320_mobilenet_v3"])
def detect(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    params = {**DEFAULTS, **event.get("params", {})}
    image = decode_image(event.get("image"))
    size = int(params["image_size"])
    scaled = resize(image, size)[0]
    regression, logits = (ctx.download(h)[0] for h in ctx.infer("ssdlite320_mobilenet_v3", scaled[None]))
    sx, sy = image.shape[2] / size, image.shape[1] / size
    people: list[dict[str, Any]] = []
    vehicles: list[dict[str, Any]] = []
    for label, box, score in select_objects(regression, logits, size, params):
        group, side = (people, params["face_size"]) if label == "person" else (vehicles, params["car_size"])
        key = ctx.key(f"{'person' if label == 'person' else 'vehicle'}/{len(group)}")
        ctx.put(key, ctx.upload(crop_resize(scaled, box, int(side))), consumers=1)
        x1, y1, x2, y2 = box
        group.append(
            {
                "key": key,
                "label": label,
                "score": round(score, 6),
                "box": [round(x1 * sx, 1), round(y1 * sy, 1), round(x2 * sx, 1), round(y2 * sy, 1)],
            }
        )
    return {"people": people, "vehicles": vehicles, "image_shape": list(image.shape[1:])}


def _recognize(ctx: Any, event: dict[str, Any], model: str, field: str) -> dict[str, Any]:
    crop = ctx.get(event["key"])
    (logits,) = ctx.infer(model, crop)
    best, confidence = softmax_top(ctx.download(logits))
    return {"label": event["label"], "box": event["box"], field: best, "confidence": confidence}


@streambox.function(models=["resnet50"])
def recognize_face(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    return _recognize(ctx, event, "resnet50", "identity")


@streambox.function(models=["vgg16"])
def recognize_car(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    return _recognize(ctx, event, "vgg16", "make_model")
