"""Built-in datasets: real offline files, clear errors, the emoji split by base name."""
import gzip

import numpy as np
import pytest

from lisa.data import datasets as data


def test_fashion_reads_real_files():
    rows = data.fashion_split("test", image_size=32)
    first = [next(rows) for _ in range(3)]
    assert first[0]["image"].size == (32, 32) and first[0]["image"].mode == "RGB"
    assert [r["label"] for r in first] == [9, 2, 1]  # Fashion-MNIST's first test labels: boot, pullover, trouser
    assert np.asarray(first[0]["image"])[:2].max() == 0  # padded on the black background
    assert next(data.fashion_split("train", image_size=16))["image"].size == (16, 16)


def test_truncated_idx_file_is_named(tmp_path):
    raw = gzip.open(data.FASHION_DIR / "t10k-labels-idx1-ubyte.gz").read()
    bad = tmp_path / "cut-idx1-ubyte.gz"
    bad.write_bytes(gzip.compress(raw[:100]))
    with pytest.raises(data.DataError, match="cut-idx1-ubyte.gz.*truncated"):
        data.read_idx(bad)
    with pytest.raises(data.DataError, match="nothing.gz not found"):
        data.read_idx(tmp_path / "nothing.gz")


def test_emoji_entries_and_split_by_base_name():
    entries = data.emoji_entries()
    assert len(entries) > 3500
    names = {e["name"] for e in entries}
    assert {"woman farmer: medium skin tone", "red apple", "grinning face"} <= names
    groups = {}
    for e in entries:
        groups.setdefault(e["group"], set()).add(data.emoji_split_of(e["group"], 0.1))
    assert all(len(sides) == 1 for sides in groups.values())
    farmer = {e["group"] for e in entries if "farmer" in e["name"]}
    assert farmer == {"farmer"}  # man / woman / person farmer and their skin tones share one group
    test_share = sum(data.emoji_split_of(e["group"], 0.1) == "test" for e in entries) / len(entries)
    assert 0.05 < test_share < 0.15


def test_emoji_drawn_in_both_styles():
    from PIL import ImageFont

    font = ImageFont.truetype(str(data.NOTO_FONT), data.NOTO_SIZE)
    tw, noto = data.twemoji_image("1F34E"), data.noto_image("1F34E", font)  # red apple
    assert tw is not None and noto is not None
    img = np.asarray(data.on_white(noto, 32)).astype(int)
    assert img.shape == (32, 32, 3) and (img[0, 0] == 255).all()  # white background
    assert (img[..., 0] - img[..., 1]).max() > 100  # and a red apple
