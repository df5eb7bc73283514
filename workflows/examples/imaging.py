"""CPU-side helpers of the example handlers: the image wire format, synthetic images, resizing,
cropping and a toy tokenizer. Nothing here touches the device.

Images travel in events as base64 text of a JPEG or PNG file, or of a `.npy` file holding a uint8
array `[height, width, 3]` (RGB) (``workflows/image_input.py``). The gateway never decodes them: the
entry function does, resizes on the CPU and uploads the tensor through `ctx.upload`, so the gateway
needs no device and the bytes reach the GPU once.
"""

from __future__ import annotations

import base64
import io
import zlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from streambox.sdk import InvalidInput

from ..image_input import decode_image_field


def encode_image(image: np.ndarray) -> str:
    """A uint8 `[H, W, 3]` array as base64 text of its `.npy` bytes."""
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"an image is a uint8 array [height, width, 3], got {image.dtype} {image.shape}")
    buffer = io.BytesIO()
    np.save(buffer, image, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image(text: object) -> torch.Tensor:
    """The event's image (base64 of JPEG, PNG or `.npy` bytes) as a float tensor `[3, H, W]` in [0, 1];
    `InvalidInput` (the gateway's 400) when it is not one."""
    try:
        return decode_image_field(text)
    except ValueError as error:
        raise InvalidInput(str(error)) from None


def image_to_uint8(image: torch.Tensor) -> np.ndarray:
    """`[3, H, W]` floats in [0, 1] back to a uint8 `[H, W, 3]` array."""
    return image.clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()


def synthetic_image(seed: int, height: int = 480, width: int = 640) -> np.ndarray:
    """A seeded street-like picture: a sky-to-road gradient with coloured boxes and discs on it."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    top, bottom = rng.uniform(0.4, 1.0, 3), rng.uniform(0.0, 0.5, 3)
    image = np.broadcast_to(top * (1 - y) + bottom * y, (height, width, 3)).copy()
    rows, cols = np.mgrid[0:height, 0:width]
    for _ in range(int(rng.integers(3, 9))):
        h = int(rng.integers(max(2, height // 10), max(3, height // 3)))
        w = int(rng.integers(max(2, width // 10), max(3, width // 3)))
        r0, c0 = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
        colour = rng.uniform(0.0, 1.0, 3)
        if rng.random() < 0.5:
            image[r0 : r0 + h, c0 : c0 + w] = colour
        else:
            inside = ((rows - r0 - h / 2) / (h / 2)) ** 2 + ((cols - c0 - w / 2) / (w / 2)) ** 2 <= 1.0
            image[inside] = colour
    image += rng.normal(0.0, 0.02, image.shape).astype(np.float32)
    return (np.clip(image, 0.0, 1.0) * 255).round().astype(np.uint8)


def resize(image: torch.Tensor, size: int | Sequence[int]) -> torch.Tensor:
    """`[3, H, W]` -> a batch of one `[1, 3, h, w]` (bilinear, antialiased when shrinking)."""
    hw = (size, size) if isinstance(size, int) else tuple(size)
    return F.interpolate(image[None], size=hw, mode="bilinear", align_corners=False, antialias=True)


def crop_resize(image: torch.Tensor, box: Sequence[float], size: int) -> torch.Tensor:
    """The box `(x1, y1, x2, y2)` (pixels of `image`) cut out and resized to `[1, 3, size, size]`."""
    _, height, width = image.shape
    x1, y1 = int(max(0, min(width - 1, box[0]))), int(max(0, min(height - 1, box[1])))
    x2 = int(max(x1 + 1, min(width, round(box[2]))))
    y2 = int(max(y1 + 1, min(height, round(box[3]))))
    return resize(image[:, y1:y2, x1:x2], size)


def tokenize(text: str, length: int, vocab: int) -> tuple[torch.Tensor, int]:
    """Words hashed to ids in [2, vocab) (0 = padding, 1 = unknown), padded or cut to `length`:
    a `[1, length]` int64 batch and the number of real tokens."""
    ids = [2 + zlib.crc32(word.encode()) % (vocab - 2) for word in text.lower().split()][:length]
    count = len(ids)
    return torch.tensor([ids + [0] * (length - count)], dtype=torch.int64), count


def softmax_top(logits: torch.Tensor) -> tuple[int, float]:
    """Index and probability of the best class of a `[1, classes]` logits row."""
    probs = torch.softmax(logits.double().reshape(-1), dim=0)
    best = int(torch.argmax(probs))
    return best, round(float(probs[best]), 6)
