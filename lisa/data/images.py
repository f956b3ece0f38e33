"""Image helpers: [-1, 1] tensors to PNG grids (written atomically), optionally with a text label per row."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

from lisa.checkpoint import atomic_write


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> [0, 1], clamped."""
    return ((images.float() + 1) / 2).clamp(0, 1)


def save_grid(images: torch.Tensor, path: str | Path, nrow: int, padding: int = 2,
              labels: Optional[Sequence[str]] = None, scale: int = 2) -> Path:
    """Save (B, 3, H, W) images in [-1, 1] as one PNG grid (grid_image), written atomically."""
    img = grid_image(images, nrow, padding, labels, scale)
    atomic_write(path, lambda tmp: img.save(tmp, format="PNG"))
    return Path(path)


def grid_image(images: torch.Tensor, nrow: int, padding: int = 2, labels: Optional[Sequence[str]] = None,
               scale: int = 2):
    """(B, 3, H, W) images in [-1, 1] as one PIL image, a grid with `nrow` images per row, upscaled `scale` times
    (nearest). With `labels` (one per grid row), each row gets its label written on its left."""
    from PIL import Image, ImageDraw, ImageFont
    from torchvision.utils import make_grid  # imported here: torchvision takes seconds to import

    grid = make_grid(to_unit(images), nrow=nrow, padding=padding, pad_value=1.0)
    arr = (grid.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    img = Image.fromarray(arr).resize((grid.shape[2] * scale, grid.shape[1] * scale), Image.NEAREST)
    if labels:
        font = ImageFont.load_default()
        row_h = (images.shape[2] + padding) * scale
        width = max(int(ImageDraw.Draw(img).textlength(str(t), font=font)) for t in labels) + 8
        canvas = Image.new("RGB", (img.width + width, img.height), "white")
        canvas.paste(img, (width, 0))
        draw = ImageDraw.Draw(canvas)
        for i, text in enumerate(labels):
            draw.text((4, padding * scale + i * row_h + row_h // 2 - 6), str(text), fill="black", font=font)
        img = canvas
    return img
