"""A fresh clone's `make run` reuses every committed release artifact: dvc.lock is current, and after the cheap
stages (datasets, logit caches) DVC sees nothing to redo for a stage whose outputs are committed under data/."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CHEAP = ("build-dataset", "cache-logits")  # what a fresh clone rebuilds before anything else: not in git


def dvc(args, cwd, check=True):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([str(BIN / "dvc"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=1500)
    assert not check or proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def tracked(repo: Path) -> set[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, text=True, check=True).stdout
    return {p for p in out.split("\0") if p}


def stale(status: dict, files: set[str]) -> dict[str, list[str]]:
    """Per stage, what in git changed since dvc.lock recorded it: the command, params, committed dependencies."""
    out = {}
    for stage, changes in status.items():
        why = []
        for c in changes:
            if c == "changed command":
                why.append("command")
            elif isinstance(c, dict):
                for path, how in c.get("changed deps", {}).items():
                    if isinstance(how, dict):  # params file: {key: "modified" | "new" | "deleted"}
                        why += [f"param {k} {v}" for k, v in how.items()]
                    elif path in files and how == "modified":
                        why.append(f"{path} {how}")
        if why:
            out[stage] = why
    return out


def release_stages(repo: Path) -> dict[str, list[str]]:
    """Stages with an output committed to git under data/ (tokenizers, targets, judges, drafters, calibrations,
    reference features, codes): their outputs are what a fresh clone must reuse. Not the identity files
    (data/identity/) of what a fresh clone rebuilds."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    files = tracked(repo)
    out = {}
    for stage, entry in lock.items():
        outs = [o["path"] for o in entry.get("outs", []) if o["path"].startswith("data/")
                and not o["path"].startswith("data/identity/")]
        committed = [o for o in outs if o in files or any(f.startswith(o + "/") for f in files)]
        if committed:
            out[stage] = committed
    return out


def test_dvc_lock_is_current():
    """Every stage's command, params and committed dependencies equal what dvc.lock recorded: a stale lock makes a
    fresh clone re-run the stage and everything after it (retraining the release targets)."""
    status = json.loads(dvc(["status", "--json"], ROOT).stdout or "{}")
    assert not stale(status, tracked(ROOT)), (
        "dvc.lock is stale (run the stage, or `dvc commit` it when the change cannot alter its outputs):\n"
        + "\n".join(f"  {s}: {', '.join(w)}" for s, w in sorted(stale(status, tracked(ROOT)).items())))


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory) -> Path:
    """The committed tree as a new user gets it (tracked files only, a new git repository)."""
    repo = tmp_path_factory.mktemp("clone") / "lisa"
    for f in sorted(tracked(ROOT)):
        src = ROOT / f
        if src.is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / f)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "clone"], cwd=repo,
                   check=True)
    return repo


@pytest.mark.slow
def test_fresh_clone_reuses_release_artifacts(fresh_clone):
    repo = fresh_clone
    release = release_stages(repo)
    assert any(s.startswith("train-target@") for s in release) and any(s.startswith("encode@") for s in release)
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    cheap = [s for s in lock if s.split("@")[0] in CHEAP]
    dvc(["repro", "--single-item", *cheap], repo)
    status = json.loads(dvc(["status", "--json"], repo).stdout or "{}")
    redo = {s: status[s] for s in release if s in status}
    assert not redo, f"a fresh clone would rebuild committed release artifacts: {json.dumps(redo, indent=1)}"


@pytest.mark.slow
def test_a_failed_run_keeps_the_committed_artifact(fresh_clone):
    """persist: a release stage that re-runs and fails leaves the committed file in place (DVC does not delete it
    first), byte for byte."""
    repo = fresh_clone
    target = repo / "data/target/fashion-c2i/model.safetensors"
    before = target.read_bytes()
    params = repo / "params.yaml"
    text = params.read_text()
    params.write_text(text.replace("\ntrain_target:", "\ntrain_target:\n  lr_typo: 1", 1))
    try:
        proc = dvc(["repro", "--single-item", "train-target@fashion-c2i"], repo, check=False)
        assert proc.returncode != 0 and "lr_typo" in proc.stdout + proc.stderr
        assert target.read_bytes() == before
    finally:
        params.write_text(text)


def test_plan_names_what_runs_what_waits_and_what_rebuilds():
    """`lisa plan` (make run's first lines): missing outputs run; a stage whose only change is an input that
    another stage rebuilds waits; a changed code dependency of a release stage is a warning."""
    from lisa.stages.plan import plan, release_families

    lock = {"stages": {"build-dataset@w": {"outs": [{"path": "data/datasets/w"}]},
                       "train-target@w": {"outs": [{"path": "data/target/w"}]},
                       "encode@w": {"outs": [{"path": "data/codes/w"}]}}}
    families = release_families(yaml.safe_load((ROOT / "dvc.yaml").read_text()))
    assert {"train-target", "encode", "calibrate", "train-drafter"} <= families and "build-dataset" not in families
    status = {"build-dataset@w": [{"changed outs": {"data/datasets/w": "deleted"}}],
              "encode@w": [{"changed deps": {"data/datasets/w": "deleted"}}]}
    lines, rebuilt = plan(status, lock, families)
    assert not rebuilt and "1 of 3 stages will run; 1 wait" in lines[0]
    assert any(l.startswith("  runs build-dataset@w") for l in lines) and "data/target/w" in lines[1]
    status["train-target@w"] = [{"changed deps": {"lisa/models/gpt.py": "modified"}}]
    lines, rebuilt = plan(status, lock, families)
    assert rebuilt and "WARNING" in lines[-2] and "train-target@w" in lines[-2]
