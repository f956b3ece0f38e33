"""Checkpoints: safe loading, the official key layout, and clear errors for missing / truncated / wrong files."""
import argparse
import json
from pathlib import Path

import pytest
import torch

from lisa.checkpoint import CheckpointError, read_state_dict, save_artifact
from lisa.models.llamagen import import_llamagen_gpt, import_llamagen_vq, load_target
from lisa.models.vq import VQModel, vq_config
from tests.helpers import micro_gpt, micro_t2i

OFFICIAL = dict(preset="GPT-micro", image_size=4, downsample=1)  # GPT-micro, 4x4 grid


def official_keys(model) -> set[str]:
    return set(model.state_dict())


def test_state_dict_uses_llamagen_key_names():
    keys = official_keys(micro_gpt())
    for k in ["tok_embeddings.weight", "cls_embedding.embedding_table.weight", "layers.0.attention.wqkv.weight",
              "layers.1.attention.wo.weight", "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
              "layers.0.feed_forward.w3.weight", "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight",
              "norm.weight", "output.weight"]:
        assert k in keys, k
    assert not any("kv_cache" in k or "rope" in k or "causal" in k for k in keys)  # buffers are not weights
    t2i = official_keys(micro_t2i())
    assert {"cls_embedding.cap_proj.fc1.weight", "cls_embedding.cap_proj.fc2.weight",
            "cls_embedding.uncond_embedding"} <= t2i


@pytest.mark.parametrize("wrapper", ["model", "module", "state_dict", None])
def test_official_layout_round_trip(tmp_path, wrapper):
    model = micro_gpt()
    sd = model.state_dict()
    blob = sd if wrapper is None else {wrapper: sd, "steps": torch.tensor(7)}
    if wrapper == "module":
        blob = {"module": {f"module.{k}": v for k, v in sd.items()}}  # DDP prefix stripped on load
    torch.save(blob, tmp_path / "c2i_micro.pt")
    loaded = import_llamagen_gpt(tmp_path / "c2i_micro.pt", num_classes=10, **OFFICIAL)
    assert loaded.config.num_classes == 10 and loaded.config.vocab_size == 64
    cond, tokens = torch.tensor([1, 9]), torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(loaded.teacher_forced(cond, tokens).logits, model.teacher_forced(cond, tokens).logits)


def test_t2i_config_inferred_from_shapes(tmp_path):
    model = micro_t2i()
    torch.save({"model": model.state_dict()}, tmp_path / "t2i.pt")
    loaded = import_llamagen_gpt(tmp_path / "t2i.pt", **OFFICIAL)
    assert (loaded.config.model_type, loaded.config.cls_token_num, loaded.config.caption_dim) == ("t2i", 5, 24)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="not found.*nope.pt"):
        import_llamagen_gpt(tmp_path / "nope.pt", **OFFICIAL)


def test_truncated_checkpoint_is_named(tmp_path):
    torch.save({"model": micro_gpt().state_dict()}, tmp_path / "full.pt")
    data = (tmp_path / "full.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cut.pt.*truncated"):
        import_llamagen_gpt(tmp_path / "cut.pt", **OFFICIAL)
    save_artifact(micro_gpt(), tmp_path / "m.safetensors", "gpt", micro_gpt().config)
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="m.safetensors"):
        load_target(tmp_path / "m.safetensors")


def test_sidecar_config_of_the_wrong_type_is_named(tmp_path):
    save_artifact(micro_gpt(), tmp_path / "m.safetensors", "gpt", micro_gpt().config)
    side = tmp_path / "m.json"
    for bad in ("a string", {"n_layer": "two", "dim": None}):
        meta = json.loads(side.read_text())
        meta["config"] = bad
        side.write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match="m.json: its `config` does not build a gpt"):
            load_target(tmp_path / "m.safetensors")


def test_wrong_architecture_names_keys_and_shapes(tmp_path):
    sd = micro_gpt().state_dict()
    sd["layers.0.feed_forward.w1.weight"] = torch.zeros(5, 64)
    del sd["layers.1.ffn_norm.weight"]
    sd["layers.0.attention.bias"] = torch.zeros(3)
    torch.save({"model": sd}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError) as e:
        import_llamagen_gpt(tmp_path / "bad.pt", **OFFICIAL)
    msg = str(e.value)
    assert "bad.pt" in msg and "layers.1.ffn_norm.weight" in msg and "layers.0.attention.bias" in msg
    assert "layers.0.feed_forward.w1.weight: file (5, 64)" in msg


def test_vq_checkpoint_rejected_as_gpt_and_vice_versa(tmp_path):
    vq = VQModel(vq_config("VQ-micro"))
    torch.save({"model": vq.state_dict()}, tmp_path / "vq.pt")
    with pytest.raises(CheckpointError, match="vq.pt.*not a LlamaGen GPT"):
        import_llamagen_gpt(tmp_path / "vq.pt", **OFFICIAL)
    torch.save({"model": micro_gpt().state_dict()}, tmp_path / "gpt.pt")
    with pytest.raises(CheckpointError, match="gpt.pt.*not a LlamaGen VQ"):
        import_llamagen_vq(tmp_path / "gpt.pt")


def test_pickled_objects_are_refused(tmp_path):
    torch.save({"model": argparse.Namespace(payload=1)}, tmp_path / "evil.pt")  # any non-tensor class
    with pytest.raises(CheckpointError, match="evil.pt.*weights-only"):
        read_state_dict(tmp_path / "evil.pt")


def test_artifact_round_trip_and_hash_check(tmp_path):
    model = micro_gpt()
    meta = save_artifact(model, tmp_path / "m.safetensors", "gpt", model.config, step=3, seed=1,
                         made_from={"init": "random"})
    loaded, meta2 = load_target(tmp_path / "m.safetensors")
    assert meta2 == meta and meta["step"] == 3
    cond, tokens = torch.tensor([2]), torch.randint(0, 64, (1, 16))
    torch.testing.assert_close(loaded.teacher_forced(cond, tokens).logits, model.teacher_forced(cond, tokens).logits)
    side = tmp_path / "m.json"
    bad = json.loads(side.read_text())
    bad["sha256"] = "0" * 64
    side.write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="content hash"):
        load_target(tmp_path / "m.safetensors")
    side.unlink()
    with pytest.raises(CheckpointError, match="sidecar"):
        load_target(tmp_path / "m.safetensors")


def test_nan_or_inf_weights_are_refused_on_save_and_load(tmp_path):
    """A diverged model is not saved (nothing written, the message says which tensors); a file that holds NaN or
    inf weights (an official checkpoint, or one edited by hand) is refused at load, naming them, not decoded into
    a grey grid."""
    from lisa.checkpoint import file_sha256, sidecar_path

    model = micro_gpt()
    with torch.no_grad():
        model.norm.weight[3] = float("nan")
    with pytest.raises(CheckpointError, match=r"not saved.*NaN or inf weights in 1 tensors \(norm.weight\)"):
        save_artifact(model, tmp_path / "nan.safetensors", "gpt", model.config)
    assert not (tmp_path / "nan.safetensors").exists() and not (tmp_path / "nan.json").exists()

    good = micro_gpt()
    save_artifact(good, tmp_path / "m.safetensors", "gpt", good.config)
    from safetensors.torch import load_file, save_file
    sd = load_file(tmp_path / "m.safetensors")
    sd["output.weight"][0, 0] = float("inf")
    save_file(sd, tmp_path / "m.safetensors")
    side = json.loads(sidecar_path(tmp_path / "m.safetensors").read_text())
    side["sha256"] = file_sha256(tmp_path / "m.safetensors")  # the sidecar agrees: only the values are bad
    sidecar_path(tmp_path / "m.safetensors").write_text(json.dumps(side))
    with pytest.raises(CheckpointError, match=r"NaN or inf values in 1 tensors: output.weight"):
        load_target(tmp_path / "m.safetensors")


def test_a_target_is_refused_with_another_tokenizer_than_its_codes(tmp_path):
    """The target's sidecar names its training codes, whose sidecar names their tokenizer: another tokenizer (of the
    same codebook size: another world's) is an error naming both files; an unknown lineage is not checked."""
    from lisa.stages.common import check_pair

    root = tmp_path / "root"
    (root / "data/codes/w").mkdir(parents=True)
    (root / "data/codes/w/codes.json").write_text(json.dumps({"sha256": "c" * 64, "tokenizer_sha256": "a" * 64}))
    target = root / "data/target/w/model.safetensors"
    meta = {"made_from": {"codes": "data/codes/w/codes.safetensors", "codes_sha256": "c" * 64}}
    check_pair(target, meta, "tok-a.safetensors", {"sha256": "a" * 64})
    with pytest.raises(ValueError, match=r"trained on the codes of tokenizer aaaaaaaaaaaa.*tok-b.safetensors is "
                                         r"tokenizer bbbbbbbbbbbb"):
        check_pair(target, meta, "tok-b.safetensors", {"sha256": "b" * 64})
    check_pair(target, {"made_from": {"llamagen_checkpoint": "x.pt"}}, "tok-b.safetensors", {"sha256": "b" * 64})
    check_pair(target, {"made_from": {**meta["made_from"], "codes_sha256": "d" * 64}}, "tok-b", {"sha256": "b" * 64})


def test_multi_file_output_is_committed_together(tmp_path):
    """atomic_write_all: a failure while writing any file of the set leaves every old file as it was and no
    temporary; a temporary that a killed run left behind is removed by the next write of its file."""
    from lisa.checkpoint import atomic_write_all, json_writer

    grid, metrics = tmp_path / "grid.png", tmp_path / "metrics.json"
    atomic_write_all({grid: lambda tmp: Path(tmp).write_bytes(b"old"), metrics: json_writer({"v": 1})})

    def crash(tmp):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_all({grid: lambda tmp: Path(tmp).write_bytes(b"new"), metrics: crash})
    assert grid.read_bytes() == b"old" and json.loads(metrics.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.png", "metrics.json"]
    (tmp_path / ".grid.png.abc123.tmp").write_bytes(b"left by kill -9")
    atomic_write_all({grid: lambda tmp: Path(tmp).write_bytes(b"new")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.png", "metrics.json"] and grid.read_bytes() == b"new"
