"""Image helpers: [-1, 1] tensors to PNG grids (written atomically)."""
from __future__ import annotations

from pathlib import Path

import torch

from lisa.checkpoint import atomic_write


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> [0, 1], clamped."""
    return ((images.float() + 1) / 2).clamp(0, 1)


def save_grid(images: torch.Tensor, path: str | Path, nrow: int, padding: int = 2) -> Path:
    """Save (B, 3, H, W) images in [-1, 1] as one PNG grid with `nrow` images per row."""
    from torchvision.utils import make_grid, save_image  # imported here: torchvision takes seconds to import

    grid = make_grid(to_unit(images), nrow=nrow, padding=padding, pad_value=1.0)
    atomic_write(path, lambda tmp: save_image(grid, tmp, format="PNG"))
    return Path(path)
