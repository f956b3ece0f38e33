"""`lisa <stage>` (the CLI, which dvc.yaml calls) and the Prefect task of the same name call every stage function
with identical arguments: the same params sections, world params and paths."""
from pathlib import Path

import pytest

import tasks.stages as tasks
from lisa.cli import main
from lisa.config import profile_text
from lisa.stages import (STAGES, WorldPaths, bench, build, corpora, drafter, inputs, quality, report, sample,
                         scoreboard)

# stage -> (its module, its function, the task of the same name)
FUNCTIONS = {
    "build-dataset": (build, "build_dataset", tasks.build_dataset),
    "train-tokenizer": (build, "train_tokenizer", tasks.train_tokenizer),
    "encode": (build, "encode", tasks.encode),
    "train-target": (build, "train_target", tasks.train_target),
    "init-tokenizer": (build, "init_tokenizer", tasks.init_tokenizer),
    "init-target": (build, "init_target", tasks.init_target),
    "sample": (sample, "sample", tasks.sample),
    "premise": (sample, "premise", tasks.premise),
    "fid-reference": (quality, "fid_reference", tasks.fid_reference),
    "train-judge": (quality, "train_judge", tasks.train_judge),
    "evaluate": (quality, "evaluate", tasks.evaluate),
    "method-inputs": (inputs, "method_inputs", tasks.method_inputs),
    "eval-method": (quality, "eval_method", tasks.eval_method),
    "train-drafter": (drafter, "train_drafter", tasks.train_drafter),
    "cache-logits": (drafter, "cache_logits", tasks.cache_logits),
    "ablate-lid": (drafter, "ablate_lid", tasks.ablate_lid),
    "ablate-arch": (drafter, "ablate_arch", tasks.ablate_arch),
    "named-drafter": (drafter, "named_drafter", tasks.named_drafter),
    "drafter-reference": (drafter, "drafter_reference", tasks.drafter_reference),
    "drafter-table": (drafter, "drafter_table", tasks.drafter_table),
    "calibrate": (drafter, "calibrate", tasks.calibrate),
    "bench-ddp": (drafter, "bench_ddp", tasks.bench_ddp),
    "laion-fixture": (corpora, "laion_fixture", tasks.laion_fixture),
    "build-laion-coco": (corpora, "build_laion_coco", tasks.build_laion_coco),
    "build-self-generated": (corpora, "build_self_generated", tasks.build_self_generated),
    "bench": (bench, "bench", tasks.bench),
    "bench-spec": (bench, "bench_spec", tasks.bench_spec),
    "table": (report, "results_table", tasks.table),
    "summary": (report, "summary", tasks.summary),
    "sweep": (scoreboard, "sweep", tasks.sweep),
    "quality-point": (scoreboard, "quality_point", tasks.quality_point),
    "scoreboard": (scoreboard, "scoreboard", tasks.scoreboard),
}
OPTIONS = {"eval-method": (["--method", "vanilla"], {"method": "vanilla"}),
           "ablate-arch": (["--drafter", "eagle3"], {"drafter": "eagle3"}),
           "named-drafter": (["--drafter", "cfg"], {"drafter": "cfg"}),
           "sweep": (["--family", "vanilla"], {"family": "vanilla"}),
           "quality-point": (["--point", "fashion-c2i-vanilla-s0"], {"point": "fashion-c2i-vanilla-s0"})}


@pytest.fixture
def calls(tmp_path, monkeypatch):
    """A micro params.yaml in the working directory; every stage function records its arguments instead of
    running."""
    monkeypatch.chdir(tmp_path)
    Path("params.yaml").write_text(profile_text("micro"))
    seen = []
    for module, name, _ in FUNCTIONS.values():
        monkeypatch.setattr(module, name, lambda *args, **kwargs: seen.append((args, kwargs)) or {})
    return seen


def test_every_stage_has_a_task_of_its_name():
    assert set(FUNCTIONS) == set(STAGES)
    assert all(task.name == stage for stage, (_, _, task) in FUNCTIONS.items())


@pytest.mark.parametrize("stage", sorted(FUNCTIONS))
def test_cli_and_task_call_a_stage_alike(calls, stage):
    world = "fashion-c2i" if STAGES[stage].world else None
    flags, options = OPTIONS.get(stage, ([], {}))
    assert main([stage, "--params", "params.yaml"] + (["--world", world] if world else []) + flags) == 0
    FUNCTIONS[stage][2].fn("params.yaml", world, **options)
    assert len(calls) == 2 and calls[0] == calls[1]


def test_sample_gets_the_drafter_and_calibration_from_both(calls):
    """The Prefect sample task once passed neither: with sample.method exact, `dvc repro` worked and the flow
    failed."""
    main(["sample", "--world", "fashion-c2i", "--out", "x", "--target", "t.safetensors", "--method", "exact"])
    tasks.sample.fn("params.yaml", "fashion-c2i", out="x", target_file="t.safetensors", method="exact")
    assert calls[0] == calls[1]
    world, p, paths = calls[0][0]
    assert p.method == "exact" and paths == WorldPaths.of("fashion-c2i", samples_dir="x", target_file="t.safetensors")
    assert paths.drafter_file == Path("data/drafter/fashion-c2i/drafter.safetensors")
    assert paths.calibration_file == Path("data/calibration/fashion-c2i/calibration.safetensors")


def test_paths_are_those_of_dvc_yaml():
    """WorldPaths spells out the outs of dvc.yaml (and the committed artifacts' places)."""
    p = WorldPaths.of("w", "root")
    assert p.target_file == Path("root/data/target/w/model.safetensors")
    assert p.tokenizer_file == Path("root/data/tokenizer/w/tokenizer.safetensors")
    assert p.lid_drafter_file == Path("root/data/ablation/w/lid.safetensors")
    assert p.cells_dir == Path("root/reports/quality/w/methods")
    assert p.self_generated_report == Path("root/reports/corpora/self-generated-w.json")
    moved = WorldPaths.of("w", "root", target_dir="elsewhere")
    assert moved.target_file == Path("elsewhere/model.safetensors")


def _git_repo(path: Path) -> Path:
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    for cmd in (["init", "-q"], ["config", "user.email", "t@t"], ["config", "user.name", "t"]):
        subprocess.run(["git", *cmd], cwd=path, check=True)
    return path


def test_a_hand_run_refuses_to_overwrite_what_git_holds(tmp_path, monkeypatch, capsys):
    """`lisa sample` by hand in a checkout whose grid is committed: refused, naming the files and the ways out;
    --out elsewhere, --force, or DVC's own run (DVC_STAGE) go ahead; untracked outputs never stop it."""
    import subprocess

    repo = _git_repo(tmp_path / "repo")
    monkeypatch.chdir(repo)
    Path("params.yaml").write_text(profile_text("micro"))
    ran = []
    monkeypatch.setattr(sample, "sample", lambda *args, **kwargs: ran.append(kwargs) or {})
    assert main(["sample", "--world", "fashion-c2i"]) == 0 and len(ran) == 1  # nothing committed yet
    grid = Path("reports/samples/fashion-c2i/grid.png")
    grid.parent.mkdir(parents=True)
    grid.write_bytes(b"png")
    subprocess.run(["git", "add", "-A"], check=True)
    subprocess.run(["git", "commit", "-qm", "release"], check=True)
    assert main(["sample", "--world", "fashion-c2i"]) == 2 and len(ran) == 1
    err = capsys.readouterr().err
    assert "reports/samples/fashion-c2i/ (1 file)" in err and "dvc repro sample@fashion-c2i" in err
    assert "--out" in err and "--force" in err
    assert main(["sample", "--world", "fashion-c2i", "--out", str(tmp_path / "elsewhere")]) == 0
    assert main(["sample", "--world", "fashion-c2i", "--force"]) == 0
    monkeypatch.setenv("DVC_STAGE", "sample@fashion-c2i")
    assert main(["sample", "--world", "fashion-c2i"]) == 0 and len(ran) == 4
    assert grid.read_bytes() == b"png"  # the stage function was replaced: nothing was written by the test


def test_a_profile_gets_a_workspace_of_its_own(tmp_path, monkeypatch, capsys):
    """`lisa profile micro --workspace DIR`: a git worktree of HEAD with the profile as params.yaml and this
    checkout's DVC cache; the checkout's own params.yaml and files are untouched; a non-empty DIR is refused."""
    import subprocess

    repo = _git_repo(tmp_path / "repo")
    (repo / ".dvc").mkdir()
    (repo / ".dvc" / "config").write_text("[core]\n    no_scm = false\n")
    (repo / "params.yaml").write_text("# the default profile\n")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=repo, check=True)
    monkeypatch.chdir(repo)
    ws = tmp_path / "micro"
    assert main(["profile", "micro", "--workspace", str(ws)]) == 0
    assert (ws / "params.yaml").read_text() == profile_text("micro")
    assert (repo / "params.yaml").read_text() == "# the default profile\n"
    assert str(repo / ".dvc" / "cache") in (ws / ".dvc" / "config.local").read_text()
    assert str(ws) in subprocess.run(["git", "worktree", "list"], capture_output=True, text=True).stdout
    assert "dvc repro" in capsys.readouterr().err
    assert main(["profile", "micro", "--workspace", str(ws)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_os_errors_name_the_path_and_leave_the_old_file(tmp_path, monkeypatch, capsys):
    """A full disk mid-write, --out over an existing file: one error line naming what failed, exit 2, no traceback;
    the file being replaced keeps its old bytes and no temporary file is left (lisa.checkpoint.atomic_write)."""
    import errno

    from lisa.checkpoint import atomic_write

    monkeypatch.chdir(tmp_path)
    Path("params.yaml").write_text(profile_text("micro"))
    out = tmp_path / "premise.json"
    out.write_text("old")

    def disk_full(*args, **kwargs):
        def write(tmp):
            Path(tmp).write_text("partial")
            raise OSError(errno.ENOSPC, "No space left on device", tmp)

        atomic_write(out, write)

    monkeypatch.setattr(sample, "premise", disk_full)
    assert main(["premise", "--world", "fashion-c2i", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lisa premise: error:") and "No space left on device" in err and "Traceback" not in err
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml", "premise.json"]

    monkeypatch.setattr(sample, "premise", lambda *a, **k: atomic_write(out / "inside.json",
                                                                        lambda t: Path(t).write_text("new")))
    assert main(["premise", "--world", "fashion-c2i", "--out", str(out / "inside.json")]) == 2
    err = capsys.readouterr().err  # a file where a folder must be
    assert "premise.json" in err and "Traceback" not in err and out.read_text() == "old"
