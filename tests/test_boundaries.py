"""The library never imports the orchestration layer (Prefect, DVC): tasks/ and flows/ wrap it, not the reverse."""
import ast
import subprocess
import sys
from pathlib import Path

LISA = Path(__file__).resolve().parents[1] / "lisa"
FORBIDDEN = ("prefect", "dvc")


def test_no_orchestration_imports_in_source():
    offenders = []
    for path in LISA.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders


def test_importing_every_module_loads_no_orchestration():
    mods = [".".join(p.relative_to(LISA.parent).with_suffix("").parts) for p in LISA.rglob("*.py")
            if p.name != "__main__.py"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods) +
            f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}]\nprint(bad)\nassert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)
