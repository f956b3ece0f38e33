"""Corpus builders: LAION-COCO layout (all three img2dataset formats) and self-generated, read back for training."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lisa.data.corpus import (CorpusError, LaionFilter, build_laion_coco, build_self_generated, make_laion_fixture,
                         read_corpus)
from lisa.models.vq import VQModel, vq_config
from lisa.decoding.sampling import SamplingConfig
from tests.helpers import micro_gpt


class FakeEncoder:
    """A deterministic stand-in for the caption encoder (the real one is exercised by the pipeline test)."""
    path, dim, is_t5 = "fake", 6, False

    def features(self, captions, length):
        g = [torch.Generator().manual_seed(sum(map(ord, c))) for c in captions]
        return torch.stack([torch.randn(length, self.dim, generator=x) for x in g])


@pytest.fixture(scope="module")
def vq():
    """The micro profile's emoji tokenizer, randomly initialised."""
    import yaml

    from lisa.config import parse_params, profile_text

    p = parse_params(yaml.safe_load(profile_text("micro")))
    torch.manual_seed(0)
    return VQModel(vq_config(**p.world("emoji-t2i").tokenizer)).eval()


@pytest.mark.parametrize("fmt", ["parquet", "webdataset", "files"])
def test_laion_coco_build_filters_joins_and_encodes(tmp_path, vq, fmt):
    """img2dataset's real layouts (a per-shard metadata Parquet beside WebDataset tars and `files` folders); a
    download cut short (a truncated JPEG marked a success) is skipped and counted."""
    info = make_laion_fixture(tmp_path / "src", n=40, image_format=fmt, small_every=5, failed_every=8,
                              truncated_every=3)
    assert info["images"] == 40 and info["small"] == 8 and info["failed"] == 5
    assert (tmp_path / "src" / "images" / "00000.parquet").is_file()  # beside the tars / folders too
    meta = pq.read_table(tmp_path / "src" / "metadata" / "part-00000.parquet")
    flt = LaionFilter(min_size=32, max_punsafe=0.5, max_pwatermark=0.8, min_similarity=0.3)
    m = build_laion_coco([tmp_path / "src" / "metadata" / "part-00000.parquet"], tmp_path / "src" / "images", vq,
                         "sha-vq", FakeEncoder(), 4, flt, tmp_path / "out", shard_size=8)
    rows = meta.to_pylist()
    joined = [i for i, r in enumerate(rows) if r["WIDTH"] >= 32 and r["punsafe"] <= 0.5 and r["pwatermark"] <= 0.8
              and r["similarity"] >= 0.3 and i % 8 != 7]
    expect = [i for i in joined if i % 3 != 2]
    assert m["counts"]["metadata_rows"] == 40 and m["counts"]["after_size"] == 32
    assert m["counts"]["joined_with_images"] == len(joined)
    assert m["rows"] == len(expect) > 0 and m["counts"]["unreadable_images"] == len(joined) - len(expect) > 0
    c = read_corpus(tmp_path / "out", "t2i", 4)
    grid = vq.config.image_size // vq.config.downsample
    assert c["tokens"].shape == (len(expect), grid * grid) and c["cond"].shape == (len(expect), 4, 6)
    table = pa.concat_tables([pq.read_table(tmp_path / "out" / s["file"]) for s in m["shards"]])
    assert table.column("caption").to_pylist() == [rows[i]["top_caption"] for i in expect]
    assert table.schema.field("codes").type == pa.list_(pa.int16(), grid * grid)
    # the codes are the tokenizer's codes of the centre-cropped, resized image
    from lisa.data.corpus import read_images, to_square

    jpg = read_images(tmp_path / "src" / "images")[rows[expect[0]]["URL"]]
    x = torch.from_numpy(to_square(jpg, vq.config.image_size))[None].float() / 127.5 - 1
    assert torch.equal(vq.encode(x).flatten(), c["tokens"][0])


def test_laion_coco_errors_name_the_problem(tmp_path, vq):
    make_laion_fixture(tmp_path / "src", n=10)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pq.read_table(tmp_path / "src" / "metadata" / "part-00000.parquet").drop(["punsafe"]), bad)
    with pytest.raises(CorpusError, match=r"bad.parquet: not LAION-COCO metadata: missing columns \['punsafe'\]"):
        build_laion_coco([bad], tmp_path / "src" / "images", vq, "x", FakeEncoder(), 4, LaionFilter(), tmp_path / "o")
    with pytest.raises(CorpusError, match="lack column 'url'"):
        build_laion_coco([tmp_path / "src" / "metadata" / "part-00000.parquet"], tmp_path, vq, "x", FakeEncoder(), 4,
                         LaionFilter(), tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="empty: no fetched images"):
        build_laion_coco([tmp_path / "src" / "metadata" / "part-00000.parquet"], tmp_path / "empty", vq, "x",
                         FakeEncoder(), 4, LaionFilter(), tmp_path / "o")


def test_self_generated_is_resumable_and_records_its_settings(tmp_path):
    torch.manual_seed(0)
    target = micro_gpt()
    cond = torch.arange(10) % 10
    s = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=2.0)
    m = build_self_generated(target, "sha-t", cond, cond.tolist(), [""] * 10, s, 3, tmp_path / "a", shard_size=4,
                             batch_size=3)
    assert m["rows"] == 10 and len(m["shards"]) == 3 and m["target_sha256"] == "sha-t"
    assert m["sampling"] == {"temperature": 1.0, "top_k": 8, "top_p": 1.0, "cfg_scale": 2.0}
    (tmp_path / "a" / m["shards"][1]["file"]).unlink()  # a killed build: one shard missing, no manifest
    (tmp_path / "a" / "manifest.json").unlink()
    again = build_self_generated(target, "sha-t", cond, cond.tolist(), [""] * 10, s, 3, tmp_path / "a",
                                 shard_size=4, batch_size=3)
    assert again["shards"] == m["shards"]
    c = read_corpus(tmp_path / "a", "c2i", 1)
    assert c["tokens"].shape == (10, target.config.block_size) and torch.equal(c["cond"], cond)
    with pytest.raises(CorpusError, match="needs caption_feats"):
        read_corpus(tmp_path / "a", "t2i", 1)
    (tmp_path / "a" / m["shards"][0]["file"]).write_bytes(b"x")
    with pytest.raises(CorpusError, match="shard-00000.parquet: missing or changed"):
        read_corpus(tmp_path / "a", "c2i", 1)
