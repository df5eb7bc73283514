"""Shapes: one function that names the shape in a picture with a model the project trains itself.

The model is no zoo model: ``shapes_model.build`` trains it on drawn pictures and the model pool
holds it as a registered model (``streambox models add`` does the same for anyone's model), so this
workflow is served exactly like a user's own. The model is declared once, by the decorator; the YAML
lists none.
"""

from __future__ import annotations

from typing import Any

import streambox

from .imaging import decode_image, resize, softmax_top
from .shapes_model import CLASSES, MODEL, SIZE


@streambox.function(models=[MODEL])
def classify(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    image = decode_image(event.get("image"))  # JPEG, PNG or .npy; any size
    (logits,) = ctx.infer(MODEL, resize(image, SIZE))
    best, confidence = softmax_top(ctx.download(logits))
    return {"shape": CLASSES[best], "confidence": confidence}
