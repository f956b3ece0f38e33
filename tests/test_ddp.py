"""Drafter training through the CLI as users run it: under torchrun (DDP, gloo) and after a SIGKILL."""
import json
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from lisa.config import profile_text
from tests.test_cache import cli_world


def train_cmd(tmp_path, text, launcher=None, name="run"):
    bin_dir, env, common = cli_world(tmp_path / "world", n=96, params_text=text)
    common[0] = "train-drafter"
    out = tmp_path / name
    args = common + ["--out", str(out / "drafter"), "--report", str(out / "report.json"), "--work",
                     str(out / "work"), "--curves", str(out / "curves")]
    return (launcher or [str(bin_dir / "lisa")]) + args, env, out, bin_dir


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_process_with_accumulation(tmp_path):
    """2 DDP ranks x 1 micro-batch and 1 process x grad_accum 2 split the same batches: the same drafter."""
    base = profile_text("micro").replace("train_drafter:\n  steps: 4", "train_drafter:\n  steps: 6")
    runs = {}
    for name, text, two in (("one", base, False), ("two", base.replace("grad_accum: 2", "grad_accum: 1"), True)):
        cmd, env, out, bin_dir = train_cmd(tmp_path / name, text)
        if two:
            cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", "2", "--no-python"] + cmd
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = (load_file(out / "drafter" / "drafter.safetensors"), json.loads((out / "report.json").read_text()))
    assert runs["two"][1]["world_size"] == 2 and runs["one"][1]["grad_accum"] == 2
    for k, v in runs["one"][0].items():
        torch.testing.assert_close(v, runs["two"][0][k], atol=5e-5, rtol=1e-4, msg=k)
    a = (tmp_path / "one" / "run" / "curves" / "train.csv").read_text().splitlines()
    b = (tmp_path / "two" / "run" / "curves" / "train.csv").read_text().splitlines()
    assert len(a) == len(b) == 7


@pytest.mark.slow
def test_kill_9_during_training_then_resume_equals_an_uninterrupted_run(tmp_path):
    text = profile_text("micro").replace("train_drafter:\n  steps: 4", "train_drafter:\n  steps: 60")
    cmd, env, killed, _ = train_cmd(tmp_path, text, name="killed")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    resume, deadline = killed / "work" / "resume.pt", time.time() + 300
    while not resume.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    step = int(torch.load(resume, weights_only=True)["step"])
    assert 2 <= step < 60 and not (killed / "drafter" / "drafter.safetensors").exists()
    for c in (cmd, train_cmd(tmp_path, text, name="clean")[0]):
        r = subprocess.run(c, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    a = json.loads((killed / "drafter" / "drafter.json").read_text())
    b = json.loads((tmp_path / "clean" / "drafter" / "drafter.json").read_text())
    assert a["sha256"] == b["sha256"]
    assert (killed / "curves" / "train.csv").read_text() == (tmp_path / "clean" / "curves" / "train.csv").read_text()
