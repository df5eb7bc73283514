"""The three workflows of the paper's Fig. 11, as YAML files plus their handlers.

- ``image-processing``: face recognition (ResNet-18) -> image enhancement (ESPCN);
- ``traffic``: object detection (SSDlite320) -> per object face (ResNet-50) or car recognition (VGG-16);
- ``traffic-b16``: Traffic at the paper's batch size (section 3): up to 16 objects of each kind per
  image, their recognitions run as batch-16 inferences (Fig. 12's memory comparison at that batch);
- ``social-media``: text encoder and MobileNetV3 on a post -> fan-in aggregation;
- ``shapes`` (not the paper's): a shape classifier the project trains itself, served as a registered
  model (``shapes_model``); using the example registers it in the model pool first, once.

The YAML files use the models' realistic input sizes. `load_example(name, small=True)` swaps in the
zoo's small input shapes (what the tests run: every layer, a fraction of the work), and
`sample_event(name, seed)` makes a seeded synthetic request (no downloads).
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ..spec import WorkflowSpec
from .imaging import encode_image, synthetic_image

EXAMPLES: dict[str, str] = {
    "image-processing": "image_processing.yaml",
    "traffic": "traffic.yaml",
    "traffic-b16": "traffic_b16.yaml",
    "social-media": "social_media.yaml",
    "shapes": "shapes.yaml",
}

_SMALL_TRAFFIC = {
    "detect": {
        "image_size": 64,
        "face_size": 32,
        "car_size": 32,
        "max_people": 2,
        "max_vehicles": 2,
        "min_box": 1.0,
    },
}

#: Per workflow, per function: params replacing the realistic input sizes by the zoo's small ones.
SMALL_PARAMS: dict[str, dict[str, dict[str, Any]]] = {
    "image-processing": {"recognize": {"image_size": 32}},
    "traffic": _SMALL_TRAFFIC,
    "traffic-b16": copy.deepcopy(_SMALL_TRAFFIC),
    "social-media": {"text": {"seq_len": 16}, "vision": {"image_size": 32}},
    "shapes": {},  # already small
}

_POSTS = (
    "the match last night was incredible what a goal in the final minute",
    "new phone review battery life is great but the camera is only average",
    "cheap watches click this link now limited offer buy buy buy",
    "our trip to the mountains with the dog best weekend of the year",
)


def _check(name: str) -> str:
    if name not in EXAMPLES:
        raise KeyError(f"unknown example workflow {name!r}; examples: {', '.join(EXAMPLES)}")
    return name


def example_path(name: str) -> Path:
    """The YAML file of a bundled workflow (a real file inside the installed package). The model of
    ``shapes`` is trained and registered in the model pool first if the pool lacks it."""
    if _check(name) == "shapes":
        from .shapes_model import ensure_registered

        ensure_registered()
    return Path(str(resources.files(__name__).joinpath(EXAMPLES[_check(name)])))


def load_example(name: str, *, small: bool = False) -> WorkflowSpec:
    from ..validation import validate_file

    spec = validate_file(example_path(name))
    return spec.with_params(SMALL_PARAMS[name]) if small else spec


def sample_event(name: str, seed: int = 0, *, height: int = 240, width: int = 320) -> dict[str, Any]:
    """A seeded synthetic request for a bundled workflow."""
    if _check(name) == "shapes":
        from .shapes_model import CLASSES, draw_shape

        rng = np.random.default_rng(seed)
        return {"image": encode_image(draw_shape(CLASSES[seed % len(CLASSES)], rng))}
    image = encode_image(synthetic_image(seed, height, width))
    if _check(name) == "social-media":
        return {"post_id": f"post-{seed}", "text": _POSTS[seed % len(_POSTS)], "image": image}
    return {"image": image}


__all__ = ["EXAMPLES", "SMALL_PARAMS", "example_path", "load_example", "sample_event"]
