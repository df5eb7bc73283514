"""A shape classifier the project trains itself: circle, square or triangle in a small RGB picture.

The data is drawn here (seeded: a random background, one filled shape of random colour, size and
place, a little noise), so the weights mean something without any download, and a test can check the
answers. ``build`` is an ordinary model factory (``package.module:build``): it trains the network
(a few seconds on a CPU, deterministic for a seed) and returns it with its input shape, and
``ensure_registered`` registers it in the model pool through the same path as any user model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

CLASSES = ("circle", "square", "triangle")
SIZE = 16
MODEL = "shapes"
FACTORY = "streambox.workflows.examples.shapes_model:build"
SEED = 0


def draw_shape(kind: str, rng: np.random.Generator, size: int = SIZE) -> np.ndarray:
    """A uint8 ``[size, size, 3]`` picture of one filled ``kind`` on a plain, noisy background."""
    if kind not in CLASSES:
        raise ValueError(f"unknown shape {kind!r}; shapes: {', '.join(CLASSES)}")
    background = rng.uniform(0.0, 1.0, 3)
    colour = rng.uniform(0.0, 1.0, 3)
    while np.abs(colour - background).mean() < 0.3:  # keep the shape visible
        colour = rng.uniform(0.0, 1.0, 3)
    r = rng.uniform(size * 0.25, size * 0.45)
    cy, cx = rng.uniform(r, size - r, 2)
    rows, cols = np.mgrid[0:size, 0:size] + 0.5
    dy, dx = rows - cy, cols - cx
    if kind == "circle":
        inside = dy**2 + dx**2 <= r**2
    elif kind == "square":
        half = r * 0.85
        inside = (np.abs(dy) <= half) & (np.abs(dx) <= half)
    else:  # an upright triangle: apex at the top, base at the bottom
        top, bottom = cy - r, cy + r * 0.7
        width = (rows - top) / (bottom - top) * r * 1.1
        inside = (rows >= top) & (rows <= bottom) & (np.abs(dx) <= width)
    image = np.where(inside[..., None], colour, background)
    image = image + rng.normal(0.0, 0.03, image.shape)
    return (np.clip(image, 0.0, 1.0) * 255).round().astype(np.uint8)


def dataset(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` pictures as floats ``[count, 3, SIZE, SIZE]`` in [0, 1] and their class indices."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(CLASSES), count)
    images = np.stack([draw_shape(CLASSES[k], rng) for k in labels])
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255.0)
    return x, torch.from_numpy(labels)


class ShapeNet(nn.Module):
    """Two small convolutions and a linear head over ``[B, 3, 16, 16]`` -> logits ``[B, 3]``."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(16 * (SIZE // 4) ** 2, len(CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def train(seed: int = SEED, samples: int = 4000, epochs: int = 10, batch: int = 48) -> ShapeNet:
    """A ``ShapeNet`` trained on ``samples`` drawn pictures (Adam, cross-entropy), in eval mode."""
    x, y = dataset(samples, seed)
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):  # seeding must not disturb the caller's RNG
        torch.manual_seed(seed)
        # One thread: this small network trains several times faster so on a shared CPU.
        torch.set_num_threads(1)
        net = ShapeNet()
        optimiser = torch.optim.Adam(net.parameters(), lr=3e-3)
        for _ in range(epochs):
            order = torch.randperm(samples)
            for start in range(0, samples, batch):
                idx = order[start : start + batch]
                loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
        torch.set_num_threads(threads)
    return net.eval()


def accuracy(net: nn.Module, count: int = 300, seed: int = SEED + 1000) -> float:
    """The share of ``count`` fresh pictures (another seed than training's) ``net`` gets right."""
    x, y = dataset(count, seed)
    with torch.no_grad():
        return float((net(x).argmax(dim=1) == y).float().mean())


def build() -> tuple[nn.Module, tuple[int, int, int]]:
    """The model factory ``streambox models add shapes --factory ...`` calls."""
    return train(), (3, SIZE, SIZE)


def ensure_registered(pool: Path | str | None = None) -> str:
    """Register the trained classifier as ``shapes`` unless the pool has it; its ``name@version``."""
    from streambox.kernel_compiler import registry
    from streambox.kernel_compiler.model_pool import default_root

    root = Path(pool) if pool is not None else default_root()
    record = registry.find(root, MODEL)
    if record is None:
        try:
            record = registry.register(root, MODEL, factory=FACTORY)
        except (OSError, registry.RegisteredMeanwhile):  # another process registered it at the same moment
            record = registry.find(root, MODEL)
            if record is None:
                raise
    return record.ref
