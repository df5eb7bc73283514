"""The model zoo: the models of the paper's three workflows (Fig. 11), built offline for lowering.

Workflows and the models standing in for them:

- Traffic: object detection -> car recognition (VGG-16) and face recognition (ResNet);
- Image processing: face recognition (ResNet) -> image enhancement (super-resolution);
- Social media: image models plus a text model that translates/classifies posts.

Every torchvision model is built with ``weights=None`` and seeded initialisation: nothing is ever
downloaded, and the same name always yields the same weights.

Object detection (``ssdlite320_mobilenet_v3``): torchvision's full SSDlite detector does not lower into a
static kernel plan: its forward takes a list of images, resizes them on the fly, and its
post-processing (score thresholding, top-k per class, batched NMS) is data dependent -- with torch 2.14
/ torchvision 0.29, ``torch.export`` of the full detector fails with ``GuardOnDataDependentSymNode`` in
that post-processing. The zoo model is therefore the detector's tensor part, MobileNetV3 backbone +
SSDlite head, mapping a normalised 320x320 batch to ``(bbox_regression [B, A, 4], cls_logits [B, A,
91])``. Anchor generation (a function of the image size only), box decoding and NMS run on the CPU in
the function's handler; ``build_ssdlite_postprocess()`` gives those pieces (anchor generator, box
coder) with the same configuration.

Written here (source ``"streambox"``): ``espcn`` (an ESPCN-style sub-pixel super-resolution network)
and ``text_encoder`` (a tiny transformer encoder classifier over token ids). Attention in
``text_encoder`` is written out by hand (matmul + softmax) rather than with ``nn.MultiheadAttention``,
whose inference fast path fuses the whole layer into one op that has no ``.out`` overload.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .op_libraries import import_library

SEED = 0


class UnknownModelError(KeyError):
    """A model name that is not in the zoo; the message lists the names that are."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(name)
        self.name = name
        self.known = sorted(known)

    def __str__(self) -> str:
        return f"unknown model {self.name!r}; known models: {', '.join(self.known)}"


@dataclass(frozen=True)
class ModelEntry:
    """One zoo model. ``input_shape`` excludes the batch dimension."""

    name: str
    builder: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    input_dtype: torch.dtype
    description: str
    source: str  # "torchvision" or "streambox"
    # A cheap input shape that still exercises every layer; tests and smoke runs use it.
    small_input_shape: tuple[int, ...] | None = None
    # Token-id models draw example inputs from [0, vocab_size).
    vocab_size: int | None = None


# --- models written here -------------------------------------------------------------------------


class ESPCN(nn.Module):
    """ESPCN-like super-resolution (Shi et al. 2016): convolutions at low resolution, then a
    sub-pixel (pixel-shuffle) layer upsamples by ``scale``. Written for StreamBox's image enhancement."""

    def __init__(self, channels: int = 3, scale: int = 2, features: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, features, 5, padding=2),
            nn.Tanh(),
            nn.Conv2d(features, features // 2, 3, padding=1),
            nn.Tanh(),
            nn.Conv2d(features // 2, channels * scale * scale, 3, padding=1),
        )
        self.shuffle = nn.PixelShuffle(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shuffle(self.body(x)))


class _EncoderLayer(nn.Module):
    """Pre-norm transformer encoder layer with attention spelled out (see module docstring)."""

    def __init__(self, dim: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, ff), nn.GELU(), nn.Linear(ff, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        attn = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(hd), dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.ff(self.norm2(x))


class TextEncoder(nn.Module):
    """Tiny transformer encoder classifier over int64 token ids ``[B, T]`` -> logits ``[B, classes]``:
    token + learned position embeddings, ``layers`` encoder layers, mean pooling, linear head.
    Written for StreamBox's social-media workflow (post translation/classification)."""

    def __init__(
        self,
        vocab: int = 8000,
        dim: int = 128,
        heads: int = 4,
        ff: int = 256,
        layers: int = 2,
        max_len: int = 128,
        classes: int = 16,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.layers = nn.ModuleList(_EncoderLayer(dim, heads, ff) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(dim=1))


class SSDLiteTensorPart(nn.Module):
    """SSDlite320-MobileNetV3 without its data-dependent pre/post-processing (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        det = _ssdlite320()
        self.backbone = det.backbone
        self.head = det.head

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = list(self.backbone(images).values())
        out = self.head(features)
        return out["bbox_regression"], out["cls_logits"]


def build_ssdlite_postprocess() -> tuple[nn.Module, object]:
    """The CPU-side pieces of SSDlite320 that the handler needs: (anchor generator, box coder)."""
    det = _ssdlite320()
    return det.anchor_generator, det.box_coder


# --- the zoo ---------------------------------------------------------------------------------------


def _torchvision(module: str) -> Any:
    """`torchvision.<module>`, imported when a model is built: a process that only loads lowered plans
    (the proxy) never pays for it (`op_libraries`)."""
    return import_library(f"torchvision.{module}")


def _ssdlite320() -> nn.Module:
    return _torchvision("models.detection").ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None)


def _tv(name: str) -> Callable[[], nn.Module]:
    return lambda: getattr(_torchvision("models"), name)(weights=None)


ZOO: dict[str, ModelEntry] = {
    e.name: e
    for e in [
        ModelEntry(
            "ssdlite320_mobilenet_v3",
            SSDLiteTensorPart,
            (3, 320, 320),
            torch.float32,
            "object detection: SSDlite320 MobileNetV3-Large backbone + head (box decoding/NMS on CPU)",
            "torchvision",
            small_input_shape=(3, 64, 64),
        ),
        ModelEntry(
            "resnet18",
            _tv("resnet18"),
            (3, 224, 224),
            torch.float32,
            "face recognition: ResNet-18",
            "torchvision",
            small_input_shape=(3, 32, 32),
        ),
        ModelEntry(
            "resnet50",
            _tv("resnet50"),
            (3, 224, 224),
            torch.float32,
            "face recognition: ResNet-50",
            "torchvision",
            small_input_shape=(3, 32, 32),
        ),
        ModelEntry(
            "vgg16",
            _tv("vgg16"),
            (3, 224, 224),
            torch.float32,
            "car recognition: VGG-16 (138M parameters, 528 MB of fp32 weights)",
            "torchvision",
            small_input_shape=(3, 32, 32),
        ),
        ModelEntry(
            "espcn",
            ESPCN,
            (3, 224, 224),
            torch.float32,
            "image enhancement: ESPCN-style x2 super-resolution (written for StreamBox)",
            "streambox",
            small_input_shape=(3, 16, 16),
        ),
        ModelEntry(
            "text_encoder",
            TextEncoder,
            (64,),
            torch.int64,
            "text classification/translation: 2-layer transformer encoder over token ids "
            "(written for StreamBox)",
            "streambox",
            small_input_shape=(16,),
            vocab_size=8000,
        ),
        ModelEntry(
            "alexnet",
            _tv("alexnet"),
            (3, 224, 224),
            torch.float32,
            "image classification: AlexNet",
            "torchvision",
            small_input_shape=(3, 64, 64),
        ),
        ModelEntry(
            "mobilenet_v3_small",
            _tv("mobilenet_v3_small"),
            (3, 224, 224),
            torch.float32,
            "image classification: MobileNetV3-Small",
            "torchvision",
            small_input_shape=(3, 32, 32),
        ),
    ]
}


def get_entry(name: str) -> ModelEntry:
    try:
        return ZOO[name]
    except KeyError:
        raise UnknownModelError(name, list(ZOO)) from None


def build_model(name: str) -> nn.Module:
    """The zoo model ``name`` in eval mode, with weights from a fixed seed (never downloaded)."""
    entry = get_entry(name)
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = entry.builder()
    return model.eval()


def example_input(name: str, batch: int, input_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A seeded example input ``[batch, *input_shape]`` (default shape: the entry's)."""
    entry = get_entry(name)
    shape = (batch, *(input_shape if input_shape is not None else entry.input_shape))
    gen = torch.Generator().manual_seed(SEED + 1)
    if entry.input_dtype.is_floating_point:
        return torch.rand(shape, generator=gen, dtype=entry.input_dtype)
    return torch.randint(0, entry.vocab_size or 2, shape, generator=gen, dtype=entry.input_dtype)
