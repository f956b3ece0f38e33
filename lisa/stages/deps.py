"""`lisa plan --check-deps`: dvc.yaml's code deps computed from the stages' imports, not kept by hand.

For each dvc.yaml stage (its command `lisa <stage>`), `stage_files` walks the code of the stage's function (the one
lisa.stages.STAGES maps the name to, as run_stage does) with `ast`, and `check` compares the lisa/*.py files it
reaches with the stage's deps under lisa/ (a folder dep stands for the .py files in it). The walk goes by name, per
function rather than per module, since one module holds several stages (lisa/stages/drafter.py: six) and shared
modules (lisa/stages/common.py, lisa/data/corpus.py) import for some of their functions only:
- From the stage's function, the names its code uses are resolved in its module: a function, class or module-level
  name there is walked in turn; an imported name (module-level or inside the function, relative imports resolved)
  leads to the function, class or name it imports, or to a module, whose names read as attributes are walked. A
  module's file counts when one of its names is walked. Modules outside lisa/ are not followed.
- A class brings its class-level code, its dunder and decorated methods (constructor, properties, validators), and
  the methods named by any attribute read in walked code (not counting `self.x` outside the class's module). The
  params' classes (lisa/config.py, lisa/sections.py) count as used by every stage: `p.laion_filter()` or
  `fam.points()` reach their methods by name.
- lisa/config.py, lisa/sections.py and lisa/stages/paths.py are deps of every stage: run_stage loads the params and
  builds the paths of each call. Loading the params (lisa/stages/params.py: the checks against the verifier registry
  and the model presets) is the same for every stage and is not walked.
- Package __init__.py files are never deps: in lisa/ they hold a docstring and re-exports only, and
  lisa/stages/__init__.py, the dispatcher, is the way into every stage, like lisa/cli.py. No module of lisa/ runs
  top-level code beyond definitions and imports (which a walk by name would miss): tests/test_stage_deps.py pins both.
Annotations are not followed (the modules use `from __future__ import annotations`); calls through a value whose
class the walk never met by name (a callback) are found only through the attribute names read. Non-Python deps (data
files) are out of scope.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import yaml

LISA = Path(__file__).resolve().parents[1]  # the lisa package's folder
# run_stage: the params (lisa/config.py and the section types it assembles) and the paths of every stage call
ALWAYS = ("lisa/config.py", "lisa/sections.py", "lisa/stages/paths.py")
PARAMS = ("lisa.config", "lisa.sections")  # the modules of the params' classes


def _file(module: str) -> Path | None:
    """The file of a lisa module (lisa.a.b -> lisa/a/b.py or lisa/a/b/__init__.py), None outside lisa/."""
    parts = module.split(".")
    if parts[0] != "lisa":
        return None
    base = LISA.joinpath(*parts[1:])
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def _is_package(module: str) -> bool:
    f = _file(module)
    return f is not None and f.name == "__init__.py"


def _rel(module: str) -> str:
    return "lisa/" + _file(module).relative_to(LISA).as_posix()


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_file(module).read_text(), filename=str(_file(module)))


def _bindings(node: ast.Import | ast.ImportFrom, module: str) -> dict[str, tuple[str, str | None]]:
    """The names an import statement in `module` binds: name -> (module, None) for a module, (module, attribute)
    for a name imported from one."""
    if isinstance(node, ast.Import):
        return {(a.asname or a.name.split(".")[0]): (a.name if a.asname else a.name.split(".")[0], None)
                for a in node.names}
    base = module if _is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    source = ".".join(p for p in ((base if node.level else ""), node.module or "") if p)
    return {(a.asname or a.name): ((f"{source}.{a.name}", None) if _file(f"{source}.{a.name}") else (source, a.name))
            for a in node.names if a.name != "*"}


@functools.cache
def _symbols(module: str) -> tuple[dict[str, list[ast.AST]], dict[str, tuple[str, str | None]]]:
    """A module's top-level definitions (name -> the statements that bind it) and module-level imports."""
    defs: dict[str, list[ast.AST]] = {}
    imports = {}
    for node in _tree(module).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports |= _bindings(node, module)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs.setdefault(node.name, []).append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        defs.setdefault(n.id, []).append(node)
    return defs, imports


def _methods(cls: ast.ClassDef) -> dict[str, ast.AST]:
    return {m.name: m for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}


class _Uses(ast.NodeVisitor):
    """The names (with the attribute chains read from them), attribute names and import statements in code,
    leaving out annotations."""

    def __init__(self):
        self.chains: list[tuple[str, ...]] = []
        self.attrs: set[str] = set()  # attributes read, but not those of `self`
        self.self_attrs: set[str] = set()
        self.imports: list[ast.Import | ast.ImportFrom] = []

    def visit_Name(self, node):
        self.chains.append((node.id,))

    def visit_Attribute(self, node):
        chain, n = [], node
        while isinstance(n, ast.Attribute):
            chain.append(n.attr)
            n = n.value
        on_self = isinstance(n, ast.Name) and n.id == "self"
        self.attrs.update(chain[:-1] if on_self else chain)
        self.self_attrs.update(chain[-1:] if on_self else [])
        if isinstance(n, ast.Name):
            self.chains.append((n.id, *reversed(chain)))
        else:
            self.visit(n)

    def visit_Import(self, node):
        self.imports.append(node)

    visit_ImportFrom = visit_Import

    def _function(self, node):
        for d in getattr(node, "decorator_list", []):
            self.visit(d)
        for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(d)
        for s in node.body if isinstance(node.body, list) else [node.body]:
            self.visit(s)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)


def _uses(nodes) -> _Uses:
    u = _Uses()
    for n in nodes:
        u.visit(n)
    return u


class _Walk:
    """The lisa files a stage's code reaches."""

    def __init__(self):
        self.files: set[str] = set(ALWAYS)
        self.seen: set[tuple[str, str]] = set()  # (module, name or "Class.method") walked
        self.whole: set[str] = set()  # modules used as values
        self.attrs: set[str] = set()  # attribute names read (not on `self`)
        # the classes whose methods an attribute read reaches: the params' (run_stage builds them) and those used
        self.classes = {(m, n.name): n for m in PARAMS for n in _tree(m).body if isinstance(n, ast.ClassDef)}

    def module(self, module: str) -> None:
        """A module used as a value (passed around, not read by name): all its top-level names."""
        if _file(module) is None or module in self.whole:
            return
        self.whole.add(module)
        for name in _symbols(module)[0] | _symbols(module)[1]:
            self.symbol(module, name)

    def target(self, target: tuple[str, str | None], chain: tuple[str, ...] = ()) -> None:
        """What an imported name refers to: a module (then `chain`: the attributes read from it) or a name in one."""
        module, name = target
        if _file(module) is None:
            return
        if name is None:
            for a in chain:  # `import lisa.a.b` read as lisa.a.b.f, `from lisa.a import b` as b.f
                if _file(f"{module}.{a}") is None:
                    return self.symbol(module, a)
                module = f"{module}.{a}"
            return self.module(module)
        self.symbol(module, name)

    def symbol(self, module: str, name: str) -> None:
        """A top-level name of a module, or "Class.method", and what its code uses."""
        if (module, name) in self.seen:
            return
        self.seen.add((module, name))
        defs, imports = _symbols(module)
        cls, _, method = name.partition(".")
        if method:
            nodes = [_methods(c)[method] for c in defs.get(cls, []) if isinstance(c, ast.ClassDef)
                     and method in _methods(c)]
        elif name in defs:
            nodes = defs[name]
        elif name in imports:  # a re-export
            return self.target(imports[name])
        else:
            return
        if not _is_package(module):
            self.files.add(_rel(module))
        for node in nodes:
            if isinstance(node, ast.ClassDef):
                self.cls(module, node)
            else:
                self.code(module, [node], cls if method else None)

    def cls(self, module: str, node: ast.ClassDef) -> None:
        """A class used: its class-level code, its dunder and decorated methods (the constructor, properties,
        validators), and the methods of the names read as attributes."""
        self.classes[(module, node.name)] = node
        self.code(module, [*node.bases, *node.keywords, *node.decorator_list,
                           *(s for s in node.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)))])
        for m in _methods(node).values():
            if m.name in self.attrs or m.decorator_list or (m.name.startswith("__") and m.name.endswith("__")):
                self.symbol(module, f"{node.name}.{m.name}")

    def code(self, module: str, nodes: list[ast.AST], cls: str | None = None) -> None:
        """The names some code of `module` uses (`cls`: the class whose method it is), resolved in that module."""
        u = _uses(nodes)
        defs, imports = _symbols(module)
        local = {}
        for node in u.imports:
            local |= _bindings(node, module)
        for chain in u.chains:
            head = chain[0]
            if head in local or head in imports:
                self.target((local | imports)[head], chain[1:])
            elif head in defs:
                self.symbol(module, head)
        for a in sorted(u.self_attrs if cls else ()):  # self.f(): a method of the class or of another in its module
            for c in defs:
                self.symbol(module, f"{c}.{a}")
        new = u.attrs - self.attrs
        self.attrs |= new
        for (m, c), node in list(self.classes.items()):
            for a in sorted(new & set(_methods(node))):
                self.symbol(m, f"{c}.{a}")


def stage_files(run) -> set[str]:
    """The lisa/*.py files (paths from the repository root) that the stage function `run` (a Stage's `run`,
    defined in one of lisa/stages/*.py) reaches."""
    code = run.__code__
    module = "lisa." + Path(code.co_filename).resolve().relative_to(LISA).with_suffix("").as_posix().replace("/", ".")
    nodes = [n for n in ast.walk(_tree(module)) if isinstance(n, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef))
             and code.co_firstlineno in (n.lineno, *(d.lineno for d in getattr(n, "decorator_list", [])))
             and (not isinstance(n, ast.FunctionDef) or n.name == code.co_name)]
    if not nodes:
        raise ValueError(f"{code.co_filename}:{code.co_firstlineno}: the stage function {code.co_name} not found")
    w = _Walk()
    w.files.add(_rel(module))
    w.code(module, nodes)
    return w.files


def _stage(entry: dict) -> str | None:
    """The lisa stage a dvc.yaml stage's command runs (`lisa <stage> ...`), None for another command."""
    words = str(entry.get("cmd", "")).split()
    return words[1] if len(words) > 1 and words[0] == "lisa" else None


def _code_deps(deps: list, root: Path) -> set[str]:
    """The lisa/*.py files among a stage's deps: a folder under lisa/ stands for the .py files in it."""
    out = set()
    for d in deps:
        d = str(d).rstrip("/")
        if d != "lisa" and not d.startswith("lisa/"):
            continue
        if (root / d).is_dir():
            out |= {p.relative_to(root).as_posix() for p in (root / d).rglob("*.py") if p.name != "__init__.py"}
        elif d.endswith(".py"):
            out.add(d)
    return out


def check(dvc_yaml: dict, root: str | Path = ".") -> list[str]:
    """One line per disagreement between a dvc.yaml stage's code deps and the lisa files its function reaches: a
    file it runs that its deps miss, or a dep it never imports. root: the folder of dvc.yaml."""
    from lisa.stages import STAGES  # the mapping run_stage uses

    problems = []
    for name, entry in dvc_yaml.get("stages", {}).items():
        entry = entry.get("do", entry)
        stage = _stage(entry)
        if stage is None:
            continue
        if stage not in STAGES:
            problems.append(f"{name}: runs `lisa {stage}`, not a stage of lisa.stages")
            continue
        walked, listed = stage_files(STAGES[stage].run), _code_deps(entry.get("deps", []), Path(root))
        problems += [f"{name}: {f} missing (the stage runs it)" for f in sorted(walked - listed)]
        problems += [f"{name}: {f} never imported (a dep the stage's code does not reach)"
                     for f in sorted(listed - walked)]
    return problems


def main(dvc_yaml_path: str | Path = "dvc.yaml") -> list[str]:
    path = Path(dvc_yaml_path)
    return check(yaml.safe_load(path.read_text()), path.parent)
