"""dvc.yaml's code deps are computed, not hand-kept: `lisa plan --check-deps` (lisa/stages/deps.py) walks each
stage function's imports, and the repository's dvc.yaml passes it."""
import ast
from pathlib import Path

import yaml

from lisa.cli import main
from lisa.stages import STAGES
from lisa.stages.deps import _bindings, check, stage_files

ROOT = Path(__file__).resolve().parents[1]


def test_dvc_yaml_code_deps_are_what_the_stages_import():
    """The check CI runs: no stage misses a lisa module it runs or lists one it never imports."""
    assert check(yaml.safe_load((ROOT / "dvc.yaml").read_text()), ROOT) == []


def test_a_missing_and_an_unused_dep_are_reported(tmp_path, capsys):
    """A synthetic dvc.yaml: calibrate without the module it imports lazily, with one it never imports (inside a
    folder dep that also covers files it never runs), next to a correct foreach stage and another command."""
    walked = stage_files(STAGES["calibrate"].run)
    assert {"lisa/stages/drafter.py", "lisa/training/calibrate.py", "lisa/config.py"} <= walked
    deps = sorted(walked - {"lisa/training/calibrate.py"}) + ["lisa/stages/render.py", "data/target/w"]
    (tmp_path / "lisa" / "extra").mkdir(parents=True)
    (tmp_path / "lisa" / "extra" / "a.py").write_text("")
    (tmp_path / "lisa" / "extra" / "notes.txt").write_text("")
    dvc_yaml = {"stages": {
        "calibrate": {"foreach": ["w"], "do": {"cmd": "lisa calibrate --world ${key}", "deps": deps}},
        "premise": {"foreach": ["w"], "do": {"cmd": "lisa premise --world ${key}",
                                             "deps": sorted(stage_files(STAGES["premise"].run))}},
        "table": {"cmd": "lisa table", "deps": sorted(stage_files(STAGES["table"].run)) + ["lisa/extra"]},
        "other": {"cmd": "python -m something", "deps": ["lisa/config.py"]},
        "typo": {"cmd": "lisa calibrat", "deps": []}}}
    assert check(dvc_yaml, tmp_path) == [
        "calibrate: lisa/training/calibrate.py missing (the stage runs it)",
        "calibrate: lisa/stages/render.py never imported (a dep the stage's code does not reach)",
        "table: lisa/extra/a.py never imported (a dep the stage's code does not reach)",
        "typo: runs `lisa calibrat`, not a stage of lisa.stages"]
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml))
    assert main(["plan", "--check-deps", "--lock", str(tmp_path / "dvc.lock")]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "calibrate: lisa/training/calibrate.py missing (the stage runs it)"
    assert len(out.splitlines()) == 4 and "4 code deps" in err


def test_the_walk_is_per_function_and_follows_lazy_and_relative_imports():
    """Two stages of one module (lisa/stages/drafter.py) get what their own functions import, lazily or not."""
    calibrate, arch = stage_files(STAGES["calibrate"].run), stage_files(STAGES["ablate-arch"].run)
    assert "lisa/training/distill.py" not in calibrate and "lisa/bench/regime.py" not in calibrate
    assert {"lisa/training/distill.py", "lisa/bench/regime.py", "lisa/decoding/generate.py"} <= arch
    assert not any(f.endswith("__init__.py") for f in calibrate | arch)
    assert _bindings(ast.parse("from ..decoding import verify, nope").body[0], "lisa.stages.common") == {
        "verify": ("lisa.decoding.verify", None), "nope": ("lisa.decoding", "nope")}
    assert _bindings(ast.parse("from . import tree as t").body[0], "lisa.decoding") == {
        "t": ("lisa.decoding.tree", None)}


def test_what_the_walk_assumes_of_lisa():
    """Package __init__.py files hold a docstring and re-exports only (so they are never deps), and no module runs
    top-level code beyond definitions and imports (which a walk by name would miss)."""
    plain = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.FunctionDef, ast.AsyncFunctionDef,
             ast.ClassDef)
    for f in sorted((ROOT / "lisa").rglob("*.py")):
        if f.name in ("cli.py", "__main__.py") or f == ROOT / "lisa" / "stages" / "__init__.py":
            continue  # the command line and the dispatcher: the ways in, not walked
        body = ast.parse(f.read_text()).body
        body = body[1:] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body
        assert all(isinstance(s, plain) for s in body), f"{f}: top-level code the walk would miss"
        if f.name == "__init__.py":
            names = {t.id for s in body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)}
            assert all(isinstance(s, (ast.Import, ast.ImportFrom, ast.Assign)) for s in body), f
            assert names <= {"__all__", "__version__"}, f
