"""The target logit cache: content, explicit schema, resumption equal to an uninterrupted run, and refusals."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lisa.training.cache import CacheError, CacheSpec, cache_schema, open_cache, same_schema, write_cache, write_manifest
from lisa.checkpoint import file_sha256
from tests.helpers import micro_gpt

SHA = "ab" * 32


def data(n=40, T=16, V=64):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (n, T), generator=g), torch.randint(0, 10, (n,), generator=g)


def build(out, spec=CacheSpec(K=8, shard_size=16, batch_size=6, uncond_every=4), **kw):
    torch.manual_seed(0)
    target = micro_gpt()
    tokens, cond = data()
    write_cache(target, SHA, tokens, cond, spec, out, progress=False, **kw)
    return target, tokens, cond, spec


def test_cache_holds_the_targets_distributions(tmp_path):
    target, tokens, cond, spec = build(tmp_path)
    m = write_manifest(tmp_path, SHA, spec, len(tokens), tokens.shape[1])
    assert len(m["shards"]) == 3 and m["tokens"] == (40 + 10) * 16  # every 4th sequence also unconditional
    c = open_cache(tmp_path, SHA)
    assert c.topk_idx.shape == (50, 16, 8) and c.seq.tolist()[:3] == [0, 0, 1]
    assert c.uncond.tolist()[:3] == [False, True, False]
    for row in (0, 1, 7):
        s, drop = int(c.seq[row]), bool(c.uncond[row])
        with torch.inference_mode():
            logits = target.teacher_forced(cond[s : s + 1], tokens[s : s + 1], torch.tensor([drop])).logits[0]
        top, idx = logits.topk(8, dim=-1)
        assert torch.equal(c.topk_idx[row], idx) and torch.equal(c.token[row], tokens[s])
        assert torch.allclose(c.topk_logit[row], top, atol=2e-3 * top.abs().max())  # fp16
        lse = logits.logsumexp(-1)
        assert torch.allclose(c.lse[row], lse, atol=1e-5)
        p = (logits - lse[:, None]).exp()
        assert torch.allclose(c.entropy[row], -(p * p.log()).sum(-1), atol=5e-3)
        assert torch.allclose(c.margin[row], top[:, 0] - top[:, 1], atol=5e-3)
    mass = c.topk_probs().sum(-1)  # the top-8 of 64 codes: most of the mass, never more than all of it
    assert (mass <= 1.01).all() and (mass > 8 / 64).all()


def test_schema_is_explicit_and_compact(tmp_path):
    build(tmp_path)
    schema = pq.read_schema(tmp_path / "shard-00000.parquet")
    assert same_schema(schema, cache_schema(8, SHA)) and not same_schema(schema, cache_schema(8, "cd" * 32))
    for name, item in (("topk_idx", pa.uint16()), ("topk_logit", pa.float16())):
        t = schema.field(name).type
        assert pa.types.is_fixed_size_list(t) and t.list_size == 8 and t.value_type == item


def test_resumed_cache_equals_an_uninterrupted_one(tmp_path):
    build(tmp_path / "clean")
    build(tmp_path / "resumed", stop_after=1)  # killed after its first shard
    assert sorted(p.name for p in (tmp_path / "resumed").glob("shard-*")) == ["shard-00000.parquet"]
    (tmp_path / "resumed" / "shard-00001.parquet").write_bytes(b"half-written by someone else")  # not a shard
    build(tmp_path / "resumed")
    for i in range(3):
        name = f"shard-{i:05d}.parquet"
        assert file_sha256(tmp_path / "clean" / name) == file_sha256(tmp_path / "resumed" / name)


def test_two_workers_write_the_same_shards(tmp_path):
    """Ranks take every other shard; together they write exactly the single-process cache."""
    build(tmp_path / "one")
    build(tmp_path / "two", rank=0, world_size=2)
    build(tmp_path / "two", rank=1, world_size=2)
    for i in range(3):
        name = f"shard-{i:05d}.parquet"
        assert file_sha256(tmp_path / "one" / name) == file_sha256(tmp_path / "two" / name)


def test_readers_refuse_what_does_not_fit(tmp_path):
    target, tokens, cond, spec = build(tmp_path)
    with pytest.raises(CacheError, match="no manifest"):
        open_cache(tmp_path)
    write_manifest(tmp_path, SHA, spec, len(tokens), tokens.shape[1])
    with pytest.raises(CacheError, match="made by target ab"):
        open_cache(tmp_path, "cd" * 32)
    # a shard of another K in place of shard 1: the schema check names the file
    write_cache(target, SHA, tokens, cond, CacheSpec(K=4, shard_size=16, batch_size=6, uncond_every=4),
                tmp_path / "k4", progress=False)
    (tmp_path / "shard-00001.parquet").write_bytes((tmp_path / "k4" / "shard-00001.parquet").read_bytes())
    with pytest.raises(CacheError, match="shard-00001.parquet: schema differs"):
        open_cache(tmp_path, SHA)
    m = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "shard-00001.parquet").unlink()
    with pytest.raises(CacheError, match="missing"):
        open_cache(tmp_path, SHA)
    with pytest.raises(CacheError, match="missing or not a shard"):
        write_manifest(tmp_path, SHA, spec, len(tokens), tokens.shape[1])
    assert m["target_sha256"] == SHA


def test_damaged_files_are_named(tmp_path):
    """A shard whose Parquet footer is gone, a manifest or a calibration sidecar that is not JSON: each an error
    naming the file, never a reader's bare traceback."""
    from lisa.training.calibrate import CalibrationError, load_calibration

    target, tokens, cond, spec = build(tmp_path)
    write_manifest(tmp_path, SHA, spec, len(tokens), tokens.shape[1])
    shard = tmp_path / "shard-00000.parquet"
    good = shard.read_bytes()
    shard.write_bytes(good[:-12])  # the footer cut off
    with pytest.raises(CacheError, match="shard-00000.parquet: not a readable Parquet shard"):
        open_cache(tmp_path, SHA)
    shard.write_bytes(good)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(CacheError, match="manifest.json: not valid JSON"):
        open_cache(tmp_path, SHA)
    cal = tmp_path / "cal" / "calibration.safetensors"
    cal.parent.mkdir()
    cal.write_bytes(b"x")
    cal.with_suffix(".json").write_text("{not json")
    with pytest.raises(CalibrationError, match="calibration.json: not valid JSON"):
        load_calibration(cal, torch.zeros(4, 2))


def cli_world(tmp_path, n=48, params_text=None):
    """A micro target and a codes file of n random sequences; the `lisa cache-logits` command line for them."""
    import yaml
    from safetensors.torch import save_file

    from lisa.config import parse_params, profile_text
    from lisa.stages import WorldPaths
    from lisa.stages.build import init_target

    text = params_text or profile_text("micro")
    p = parse_params(yaml.safe_load(text))
    paths = WorldPaths.of("fashion-c2i", tmp_path)
    init_target(p.world("fashion-c2i"), p.init_target, paths)
    tokens, labels = data(n=n)
    codes = tmp_path / "codes.safetensors"
    save_file({"train_codes": tokens.to(torch.int16), "train_labels": labels,
               "train_caption_idx": torch.zeros(n, dtype=torch.long), "test_codes": tokens[:4].to(torch.int16),
               "test_labels": labels[:4].clone(), "test_caption_idx": torch.zeros(4, dtype=torch.long)}, codes)
    params = tmp_path / "params.yaml"
    params.write_text(text)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    common = ["cache-logits", "--world", "fashion-c2i", "--params", str(params), "--codes", str(codes),
              "--target", str(paths.target_file)]
    return bin_dir, env, common


@pytest.mark.slow
def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path):
    """SIGKILL `lisa cache-logits` mid-run, rerun it: every shard and the manifest equal a clean run's."""
    from lisa.config import profile_text

    text = profile_text("micro").replace("max_sequences: 48", "max_sequences: 600").replace("shard_size: 16",
                                                                                            "shard_size: 4")
    bin_dir, env, common = cli_world(tmp_path, n=600, params_text=text)
    cmd = [str(bin_dir / "lisa")] + common
    killed = tmp_path / "killed"
    proc = subprocess.Popen(cmd + ["--out", str(killed), "--report", str(tmp_path / "k.json")], cwd=tmp_path,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(list(killed.glob("shard-*.parquet"))) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(killed.glob("shard-*.parquet")))
    assert 3 <= done < 150 and not (killed / "manifest.json").exists()
    for out in (killed, tmp_path / "clean"):
        r = subprocess.run(cmd + ["--out", str(out), "--report", str(tmp_path / "r.json")], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    a = json.loads((killed / "manifest.json").read_text())
    b = json.loads((tmp_path / "clean" / "manifest.json").read_text())
    assert len(a["shards"]) == 150 and a["shards"] == b["shards"]


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(tmp_path):
    """`torchrun --nproc_per_node 2 lisa cache-logits` (gloo): the shards and manifest of one process."""
    bin_dir, env, common = cli_world(tmp_path)
    for name, launcher in (("one", [str(bin_dir / "lisa")]),
                           ("two", [str(bin_dir / "torchrun"), "--nproc_per_node", "2", "--no-python",
                                    str(bin_dir / "lisa")])):
        proc = subprocess.run(launcher + common + ["--out", str(tmp_path / name), "--report",
                                                   str(tmp_path / f"{name}.json")],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]] and len(one["shards"]) == 3
    assert json.loads((tmp_path / "two.json").read_text())["workers"] == 2


def test_resume_rewrites_a_shard_whose_bytes_changed(tmp_path):
    """A shard corrupted in the middle (footer intact) is not kept by a rerun: its bytes no longer match the hash
    recorded when it was written, so it is written again and the manifest never approves the changed bytes."""
    out = tmp_path / "c"
    target, tokens, cond, spec = build(out)
    shard = out / "shard-00000.parquet"
    good = shard.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    shard.write_bytes(bytes(bad))
    with pytest.raises(CacheError, match="changed since it was written"):
        write_manifest(out, SHA, spec, len(tokens), tokens.shape[1])
    write_cache(target, SHA, tokens, cond, spec, out, progress=False)
    assert shard.read_bytes() == good
    write_manifest(out, SHA, spec, len(tokens), tokens.shape[1])


def test_cache_of_other_settings_is_cleared_not_mixed(tmp_path):
    from lisa.training.cache import IDENTITY, cache_identity, prepare_cache_dir

    out = tmp_path / "c"
    spec = CacheSpec(K=8, shard_size=16, batch_size=6, uncond_every=4)
    tokens, _ = data()
    ident = cache_identity(SHA, spec, len(tokens), tokens.shape[1], {"codes_sha256": "x"})
    assert prepare_cache_dir(out, ident) is None
    build(out, spec)
    n_before = len(list(out.glob("shard-*.parquet")))
    assert prepare_cache_dir(out, ident) is None  # same identity: a resume keeps every shard
    assert len(list(out.glob("shard-*.parquet"))) == n_before
    other = CacheSpec(K=spec.K, shard_size=spec.shard_size * 2, batch_size=spec.batch_size,
                      uncond_every=spec.uncond_every)
    why = prepare_cache_dir(out, cache_identity(SHA, other, len(tokens), tokens.shape[1], {"codes_sha256": "x"}))
    assert why is not None and "spec.shard_size" in why
    assert not list(out.glob("shard-*")) and (out / IDENTITY).is_file()
