"""The direction of imports: flows -> tasks -> lisa.stages -> the core. The library never imports the orchestration
layer (Prefect, DVC); model files import no other part of lisa but models, config and checkpoints; the core never
imports the pipeline layer; tasks and flows pass paths and metrics, so they import neither torch nor models."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LISA = ROOT / "lisa"
FORBIDDEN = ("prefect", "dvc")


def imports(path: Path) -> list[str]:
    """Every module a file imports, at any depth (function-local imports included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names += [module] + [f"{module}.{a.name}" for a in node.names]
    return names


def offenders(files, banned: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(ROOT)}: {n}" for path in files for n in imports(path)
            if any(n == b or n.startswith(b + ".") for b in banned)]


def test_no_orchestration_imports_in_source():
    assert not offenders(LISA.rglob("*.py"), FORBIDDEN)


def test_models_import_only_models_config_and_checkpoints():
    banned = ("lisa.decoding", "lisa.training", "lisa.stages", "lisa.quality", "lisa.bench", "lisa.data", "lisa.cli")
    assert not offenders((LISA / "models").rglob("*.py"), banned)


def test_core_never_imports_the_pipeline():
    core = [p for p in LISA.rglob("*.py")
            if "stages" not in p.relative_to(LISA).parts and p.name not in ("cli.py", "__main__.py")]
    assert not offenders(core, ("lisa.stages", "lisa.cli"))


def test_tasks_and_flows_import_no_torch_nor_models():
    files = list((ROOT / "tasks").rglob("*.py")) + list((ROOT / "flows").rglob("*.py"))
    assert files and not offenders(files, ("torch", "lisa.models"))


def test_importing_every_module_loads_no_orchestration():
    mods = [".".join(p.relative_to(LISA.parent).with_suffix("").parts) for p in LISA.rglob("*.py")
            if p.name != "__main__.py"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods) +
            f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}]\nprint(bad)\nassert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_is_a_leaf():
    """lisa/config.py and the section types are params as plain data: they import nothing of decoding or models, and
    importing them loads no torch (the code imports the types it shares with them; lisa.stages.params checks what
    only the code can, issue 36)."""
    bad = [n for f in ("config.py", "sections.py") for n in imports(LISA / f)
           if n.startswith(("lisa.decoding", "lisa.models"))]
    assert not bad, bad
    code = ("import sys, lisa.config\nbad = [m for m in sys.modules if m.split('.')[0] == 'torch' or "
            "m.startswith(('lisa.decoding', 'lisa.models'))]\nprint(bad)\nassert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)
