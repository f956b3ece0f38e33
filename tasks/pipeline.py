"""The pipeline as dvc.yaml defines it, read through DVC, and the Prefect task that runs one of its stages the way
`dvc repro` does.

`read_dag` expands foreach / matrix items and derives the edges from deps and outs with DVC's own code, so the flow
has no copy of the DAG. `repro` runs `dvc repro --single-item <stage>`: DVC skips a stage it finds up to date,
otherwise runs its command (`lisa <stage> ...`, i.e. lisa.stages.run_stage) and records it in dvc.lock. DVC holds
its repository lock while it checks and records, and releases it while the command runs, so independent stages run
concurrently (`--wait-for-lock` queues the short locked parts)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from prefect import task

from tasks.logs import name_task_logs


@dataclass(frozen=True)
class DagStage:
    """One stage of dvc.yaml after foreach / matrix expansion."""
    name: str                    # DVC's address: build-dataset@fashion-c2i, eval-method@fashion-c2i-vanilla
    cmd: str
    upstream: tuple[str, ...]    # stages whose outs it depends on
    metrics: tuple[str, ...]     # its metrics and JSON reports (_is_metrics), relative to the repository root
    reports: tuple[str, ...] = ()  # its outs a person reads: markdown reports and images (Prefect artifacts)

    @property
    def family(self) -> str:
        return self.name.split("@")[0]


def read_dag(root: str | Path = ".") -> dict[str, DagStage]:
    """Every stage of root/dvc.yaml, upstream before downstream (DVC's own graph)."""
    import networkx as nx
    from dvc.repo import Repo

    root = Path(root).resolve()

    def address(stage) -> str:  # as `dvc repro` takes it in root: name, or path/dvc.yaml:name
        where = Path(stage.dvcfile.path).resolve().relative_to(root)
        return stage.name if where == Path("dvc.yaml") else f"{where}:{stage.name}"

    with Repo(str(root)) as repo:
        graph = repo.index.graph  # edge (stage, a stage whose outs it depends on)
        order = list(reversed(list(nx.topological_sort(graph))))
        return {address(s): DagStage(address(s), s.cmd, tuple(sorted(address(u) for u in graph.successors(s))),
                                     tuple(str(o.def_path) for o in s.outs if _is_metrics(o)),
                                     tuple(str(o.def_path) for o in s.outs
                                           if Path(str(o.def_path)).suffix in REPORT_SUFFIXES))
                for s in order if s.cmd}


REPORT_SUFFIXES = (".md", ".png")


def _is_metrics(out) -> bool:
    """A stage's metrics as the flow reads them: its DVC metrics (dvc.yaml's `metrics`: the small headline files
    `dvc metrics show` lists) and its other JSON outs kept in git (`cache: false`: the stages' detailed reports),
    not the identity files under data/identity/ (a folder's sha256, lisa/data/identity.py)."""
    return bool(out.metric) or (str(out.def_path).endswith(".json") and not out.use_cache
                                and not str(out.def_path).startswith("data/identity/"))


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes) from a stage address and a file name."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower())).strip("-")


def publish(stage: str, root: str | Path, metrics: dict[str, dict], reports: tuple[str, ...] = ()) -> list[str]:
    """The stage's headline results as Prefect artifacts, one key per stage and file (each flow run adds a version):
    its metrics JSON as a table (nested keys joined by dots), its markdown reports as markdown, its images as image
    artifacts (a file:// address on the machine that ran it). Returns the keys."""
    from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact

    keys = []
    for path, values in metrics.items():
        rows = [{"metric": k, "value": v} for k, v in _flatten(values).items()][:500]
        keys.append(artifact_key(stage, Path(path).stem))
        create_table_artifact(rows, key=keys[-1], description=f"{stage}: {path}")
    for rel in reports:
        path = Path(root) / rel
        if not path.is_file():
            continue
        keys.append(artifact_key(stage, path.stem, path.suffix[1:]))
        if path.suffix == ".md":
            create_markdown_artifact(path.read_text()[:200_000], key=keys[-1], description=f"{stage}: {rel}")
        else:
            create_image_artifact(path.resolve().as_uri(), key=keys[-1], description=f"{stage}: {rel}")
    return keys


def _flatten(d, prefix: str = "") -> dict:
    """Scalars of a nested JSON object, keyed by dotted paths (lists of scalars kept as they are)."""
    out = {}
    for k, v in (d.items() if isinstance(d, dict) else []):
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        elif not isinstance(v, list) or all(not isinstance(x, (dict, list)) for x in v[:50]):
            out[name] = v if not isinstance(v, list) else v[:50]
    return out


def select(dag: dict[str, DagStage], targets: list[str]) -> dict[str, DagStage]:
    """The stages `targets` name (an address, or a family: every item of a foreach / matrix) and those they need."""
    unknown = [t for t in targets if not any(t in (s.name, s.family) for s in dag.values())]
    if unknown:
        raise ValueError(f"no stage {', '.join(unknown)} in dvc.yaml; stages: {sorted({s.family for s in dag.values()})}")
    keep = {s.name for s in dag.values() if s.name in targets or s.family in targets}
    for name in reversed(list(dag)):  # downstream first: add what each kept stage needs
        if name in keep:
            keep.update(dag[name].upstream)
    return {n: s for n, s in dag.items() if n in keep}


def _env() -> dict[str, str]:
    """The environment of the flow, with this interpreter's bin folder (dvc, lisa) first on PATH, and unless set,
    OMP_NUM_THREADS = the cores shared among the LISA_WORKERS stages that may run at once (torch would otherwise
    start as many threads as cores in each)."""
    bin_dir = str(Path(sys.executable).parent)
    threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LISA_WORKERS", "2")))
    return {"OMP_NUM_THREADS": str(threads), **os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}


def dvc(args: list[str], root: str | Path = ".") -> subprocess.CompletedProcess:
    """`dvc <args>` in `root` (waits for DVC's lock); raises with DVC's output on failure."""
    cmd = [str(Path(sys.executable).parent / "dvc"), "--wait-for-lock", *args]
    proc = subprocess.run(cmd, cwd=root, env=_env(), capture_output=True, text=True)
    if proc.returncode:
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("ERROR")]
        raise RuntimeError(f"`dvc {' '.join(args)}` failed in {root}: {errors[-1] if errors else ''}\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def outcome(stage: str, log: str) -> str:
    """What `dvc repro --single-item stage` did, from its log: "ran", "skipped" (up to date) or "restored" (from
    DVC's run cache)."""
    quoted = re.escape(f"'{stage}'")
    if re.search(rf"Stage {quoted} didn't change, skipping", log):
        return "skipped"
    if re.search(rf"Stage {quoted} is cached - skipping run, checking out outputs", log):
        return "restored"
    return "ran"


# stages that train or cache across processes under torchrun (DDP / sharded), and the settings of their launch
TORCHRUN_STAGES = ("cache-logits", "train-drafter")


def launch_settings(root: str = ".") -> dict:
    """params.yaml's `launch` section in `root` (lisa.config.LaunchParams; defaults where the file or the section
    is missing), each value overridden by its environment variable: LISA_NPROC_PER_NODE, LISA_NNODES,
    LISA_NODE_RANK, LISA_RDZV_ENDPOINT (per machine of a multi-node run)."""
    import yaml

    from lisa.config import LaunchParams

    path = Path(root) / "params.yaml"  # only its `launch` section: a DVC project of other stages has no lisa params
    raw = (yaml.safe_load(path.read_text()) or {}).get("launch") if path.is_file() else None
    try:
        p = LaunchParams(**(raw or {}))
    except Exception as e:
        raise ValueError(f"{path}: section `launch`: {e}") from None
    env = {k: os.environ.get(f"LISA_{k.upper()}") for k in ("nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint")}
    return {"nproc_per_node": int(env["nproc_per_node"] or p.nproc_per_node), "nnodes": int(env["nnodes"] or p.nnodes),
            "node_rank": int(env["node_rank"] or p.node_rank), "rdzv_endpoint": env["rdzv_endpoint"] or p.rdzv_endpoint}


def torchrun_launch(family: str, root: str = ".") -> list[str]:
    """`torchrun ... --no-python` for a stage of TORCHRUN_STAGES, from the launch settings (launch_settings:
    params.yaml's `launch`, the environment over it): nproc_per_node processes per machine (1 and one machine: a
    plain process, no torchrun), nnodes machines, with rdzv_endpoint (host:port of node 0) and node_rank when there
    are several; [] for a plain process."""
    if family not in TORCHRUN_STAGES:
        return []
    s = launch_settings(root)
    nproc, nnodes = s["nproc_per_node"], s["nnodes"]
    if nproc * nnodes == 1:
        return []
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(nproc), "--nnodes", str(nnodes)]
    if nnodes == 1:
        return cmd + ["--standalone", "--no-python"]
    if not s["rdzv_endpoint"]:
        raise ValueError("launch.nnodes > 1 needs launch.rdzv_endpoint (host:port of node 0) or LISA_RDZV_ENDPOINT")
    return cmd + ["--node_rank", str(s["node_rank"]), "--rdzv_backend", "c10d",
                  "--rdzv_endpoint", s["rdzv_endpoint"], "--no-python"]


def _repro_torchrun(stage: str, cmd: str, launch: list[str], root: str) -> str:
    """What `dvc repro --single-item` does, with the stage's command under torchrun: skip it if DVC finds it up to
    date, else run it and record it in dvc.lock (`dvc commit`)."""
    if stage not in json.loads(dvc(["status", "--json", stage], root).stdout or "{}"):
        return "skipped"
    env = _env() | {"DVC_STAGE": stage}  # as DVC sets it: the stage may write its committed outputs
    proc = subprocess.run(launch + shlex.split(cmd), cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"`{' '.join(launch)} {cmd}` failed in {root}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    dvc(["commit", "--force", stage], root)
    return "ran"


@task(name="repro", task_run_name="{stage}")
def repro(stage: str, root: str = ".", metrics: tuple[str, ...] = (), stale: bool = True,
          upstream: list[dict] | None = None, cmd: str = "", reports: tuple[str, ...] = ()) -> dict:
    """`dvc repro --single-item stage` in `root`: {"stage", "outcome": ran | skipped | restored, "metrics": {path:
    its JSON}, "artifacts": the Prefect artifact keys of its metrics and `reports` (publish)}. `upstream`: the
    results of the stages it depends on, run first. A stage that `dvc status` found up to date before the flow
    started (stale=False), none of whose upstream stages has run since, is still up to date: it is skipped without
    asking DVC again. A stage of TORCHRUN_STAGES runs its command `cmd` under torchrun when the settings ask for
    several processes (torchrun_launch)."""
    name_task_logs()  # in the process that runs the task (a Dask worker too), whatever configured logging since
    launch = torchrun_launch(stage.split("@")[0], root)
    if not stale and all(u["outcome"] == "skipped" for u in upstream or []):
        done = "skipped"
    elif launch:
        done = _repro_torchrun(stage, cmd, launch, root)
    else:
        proc = dvc(["repro", "--single-item", stage], root)
        done = outcome(stage, proc.stdout + proc.stderr)
    print(done)  # logged as `<stage> | <outcome>` (tasks.logs)
    read = {m: json.loads((Path(root) / m).read_text()) for m in metrics if (Path(root) / m).is_file()}
    return {"stage": stage, "outcome": done, "metrics": read, "artifacts": publish(stage, root, read, reports)}


@task(name="new-target")
def new_target(world: str, root: str = ".") -> dict:
    """{"changed": why the world's target checkpoint changed, or None} after making the change DVC's, so that the
    DAG then rebuilds what depends on it; {"refused": one line} instead when the target cannot be used:
    - `worlds.<world>.target_checkpoint` set (an official .pt, a bare .safetensors, a transformers folder) and its
      bytes differ from those the target was imported from: `dvc repro --force` of train-target imports it (it
      writes the sidecar) and records it (a changed path needs nothing: DVC sees the param);
    - data/target/<world>/model.safetensors replaced by a file in lisa's format (its sidecar matches its bytes)
      that the calibration was not made for: `dvc commit` records it as train-target's output.
    A target whose bytes disagree with its sidecar (or that has none) is refused: the line says what to do."""
    name_task_logs()
    from lisa.checkpoint import CheckpointError
    try:
        return {"changed": _new_target(world, root)}
    except CheckpointError as e:
        return {"refused": str(e)}


def _new_target(world: str, root: str = ".") -> str | None:
    from lisa.checkpoint import CheckpointError, file_sha256, sidecar_path
    from lisa.config import load_params
    from lisa.stages import WorldPaths
    from lisa.stages.drafter import needs_recalibration

    w = load_params(Path(root) / "params.yaml").world(world)
    paths = WorldPaths.of(world, root)
    if not (paths.target_file.is_file() and (paths.calibration_dir / "calibration.json").is_file()):
        return None  # not built yet: lisa-full builds it
    side = sidecar_path(paths.target_file)
    meta = json.loads(side.read_text()) if side.is_file() else {}
    if meta.get("sha256") != file_sha256(paths.target_file):
        raise CheckpointError(
            f"{paths.target_file}: its bytes are not those its sidecar {side.name} records (or it has none): to use "
            f"new weights (a .pt or a .safetensors), name the file in params.yaml at worlds.{world}.target_checkpoint "
            f"and run again; to go back, `git checkout {paths.target_dir}`")
    if w.target_checkpoint:
        made = meta.get("made_from", {})
        if made.get("llamagen_checkpoint") != w.target_checkpoint:  # DVC sees the param: train-target imports it
            return f"worlds.{world}.target_checkpoint now names {w.target_checkpoint}"
        ckpt = Path(w.target_checkpoint) if Path(w.target_checkpoint).is_absolute() else Path(root) / w.target_checkpoint
        now = file_sha256(ckpt) if ckpt.is_file() else None  # a transformers folder: DVC's params only
        if now is None or made.get("sha256") == now:
            return None
        dvc(["repro", "--force", "--single-item", f"train-target@{world}"], root)
        return f"{w.target_checkpoint} has new bytes (sha256 {now[:12]}, imported {made.get('sha256', '')[:12]})"
    why = needs_recalibration(paths.target_file, paths.calibration_dir)
    if why is not None:
        dvc(["commit", "--force", f"train-target@{world}"], root)
    return why
