"""The Prefect flows on the micro profile, end to end: `lisa-full` leaves what `dvc repro` leaves (dvc.lock current,
`dvc repro` then runs nothing, and after a `dvc repro` the flow runs nothing; the stale stages once on a local
2-worker Dask cluster, with every stored log line naming its task), and `recalibrate` imports a fine-tuned
checkpoint without a sidecar and rebuilds exactly what DVC finds stale, or refuses a target whose bytes disagree with
its sidecar in one line."""
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(cmd, cwd) -> str:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def dvc_status(repo) -> dict:
    return json.loads(run([str(BIN / "dvc"), "status", "--json"], repo) or "{}")


def ran(results: dict) -> set[str]:
    return {n for n, r in results.items() if n != "estimate" and r["outcome"] != "skipped"}


@pytest.mark.slow
def test_lisa_full_and_recalibrate_micro(tmp_path, monkeypatch, micro_built):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.testing.utilities import prefect_test_harness
    from safetensors.torch import save_file

    from flows.lisa_full import lisa_full
    from flows.runners import task_runner
    from flows.recalibrate import recalibrate
    from lisa.checkpoint import file_sha256
    from lisa.models.llamagen import load_target
    from tests.conftest import copy_built

    repo = copy_built(micro_built, tmp_path)  # the session's one `dvc repro` of the micro pipeline
    monkeypatch.setenv("PYTHONPATH", str(repo))  # the stages' `lisa` runs the clone's code
    with prefect_test_harness(server_startup_timeout=180):
        assert ran(lisa_full(root=str(repo))) == set()  # after a dvc repro the flow runs nothing
        params = yaml.safe_load((repo / "params.yaml").read_text())
        params["sample"]["per_class"] += 1  # the sample stages and what reads them go stale
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        stale = set(dvc_status(repo))
        on_dask = lisa_full.with_options(task_runner=task_runner("dask", 2))  # a local 2-worker Dask cluster
        run_state = on_dask(root=str(repo), return_state=True)
        first = run_state.result()
        assert ran(first) == stale and {"sample@fashion-c2i", "sample@emoji-t2i"} <= stale  # exactly what DVC finds
        assert dvc_status(repo) == {} and "Running stage" not in run([str(BIN / "dvc"), "repro"], repo)
        assert first["sample@fashion-c2i"]["metrics"]["reports/samples/fashion-c2i/metrics.json"]["images"] == 12
        assert "| fashion-c2i |" in first["estimate"]
        for handler in logging.getLogger("prefect.task_runs").handlers:
            handler.flush()  # the lines stored for the run: each task's named, no library output (tasks.logs)
        with get_client(sync_client=True) as client:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(
                any_=[run_state.state_details.flow_run_id])))
        assert {m.message.split(" | ")[0] for m in logs if m.task_run_id} == set(first)
        assert not any(re.search(r"LOAD_[A-Z]|RETURN_VALUE|Traceback", m.message) for m in logs)

        shutil.rmtree(repo / "data/cache/fashion-c2i")  # the logit cache again, under torchrun with 2 processes
        monkeypatch.setenv("LISA_NPROC_PER_NODE", "2")
        cached = lisa_full(root=str(repo), stages=["cache-logits@fashion-c2i"])["cache-logits@fashion-c2i"]
        monkeypatch.delenv("LISA_NPROC_PER_NODE")
        assert cached["outcome"] == "ran" and cached["metrics"]["reports/cache/fashion-c2i.json"]["workers"] == 2
        assert dvc_status(repo) == {}  # recorded; its consumers see the same identity (data/identity/cache)

        params = yaml.safe_load((repo / "params.yaml").read_text())  # dvc repro first, then the flow: nothing
        params["table"]["seed"] += 1
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        assert "Running stage 'eval-method@" in run([str(BIN / "dvc"), "repro"], repo)
        assert ran(lisa_full(root=str(repo))) == set()

        up = {"fashion-c2i": "up to date", "emoji-t2i": "up to date"}
        target = repo / "data/target/fashion-c2i/model.safetensors"
        os.utime(target, None)  # a touch: same bytes, nothing to do
        assert recalibrate(root=str(repo)) == up

        trained = target.read_bytes()
        model, _ = load_target(target)  # a fine-tuned target as a bare safetensors, no sidecar
        finetuned = repo / "checkpoints/fashion-finetuned.safetensors"
        finetuned.parent.mkdir()
        save_file({k: (v * 1.5 if k == "output.weight" else v).contiguous() for k, v in model.state_dict().items()
                   if not k.startswith(("freqs_cis", "causal_mask"))}, str(finetuned))
        params["worlds"]["fashion-c2i"]["target_checkpoint"] = "checkpoints/fashion-finetuned.safetensors"
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        stale = set(dvc_status(repo))
        status = recalibrate(root=str(repo))
        assert "target_checkpoint now names" in status["fashion-c2i"] and status["emoji-t2i"] == "up to date"
        assert dvc_status(repo) == {}
        rebuilt = set(status["rebuilt"])
        assert {"train-target@fashion-c2i", "calibrate@fashion-c2i", "cache-logits@fashion-c2i"} <= rebuilt
        # the other world untouched, but for its summary (it reads the shared results table) and its method manifests
        # (method-inputs reads data/drafters, every world's named drafters: rewritten the same, so nothing after it)
        assert stale <= rebuilt
        assert not any("emoji-t2i" in s for s in rebuilt - {"summary@emoji-t2i", "method-inputs@emoji-t2i"})
        new_sha = file_sha256(target)
        cal = json.loads((repo / "data/calibration/fashion-c2i/calibration.json").read_text())
        assert cal["made_from"]["target_sha256"] == new_sha
        assert json.loads(target.with_suffix(".json").read_text())["made_from"]["sha256"] == file_sha256(finetuned)

        with finetuned.open("r+b") as f:  # the same path, new bytes: imported again
            f.seek(-4, 2)
            f.write(b"\x00\x00\x80\x3f")
        status = recalibrate(root=str(repo))
        assert "has new bytes" in status["fashion-c2i"] and "calibrate@fashion-c2i" in status["rebuilt"]
        assert dvc_status(repo) == {}

        target.write_bytes(trained)  # other weights dropped over the target, its sidecar left as it was
        state = recalibrate(root=str(repo), return_state=True)
        assert state.is_failed() and "worlds.fashion-c2i.target_checkpoint" in state.message
        assert len(state.message.splitlines()) == 1
