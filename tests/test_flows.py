"""The Prefect flows run dvc.yaml's DAG with DVC's semantics: the task graph comes from dvc.yaml (foreach items,
deps / outs edges), an up-to-date stage is skipped, what ran is recorded in dvc.lock (so `dvc status` is clean and
`dvc repro` runs nothing after a flow run, and the flow runs nothing after `dvc repro`), and independent stages fan
out on a thread pool or a local Dask cluster. On a toy dvc.yaml of a few `python -c` stages, in seconds; the micro
profile end to end is in test_flows_micro.py."""
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# make@<item> writes out/<item>.txt from params sizes.<item> (after `sleep` seconds); join reads both
WRITE = "import os, sys, time, yaml; time.sleep(float(sys.argv[2])); os.makedirs('out', exist_ok=True); " \
        "open(f'out/{sys.argv[1]}.txt', 'w').write(str(yaml.safe_load(open('params.yaml'))['sizes'][sys.argv[1]]))"
JOIN = "import json; json.dump({'total': sum(int(open(f'out/{w}.txt').read()) for w in 'ab')}, open('m.json', 'w'))"


def toy_dvc_yaml(sleep: float = 0.0, items=("a", "b")) -> dict:
    return {"stages": {
        "make": {"foreach": list(items), "do": {"cmd": f'python -c "{WRITE}" ${{item}} {sleep}',
                                                "params": ["sizes.${item}"], "outs": ["out/${item}.txt"]}},
        "join": {"cmd": f'python -c "{JOIN}"', "deps": ["out/a.txt", "out/b.txt"],
                 "metrics": [{"m.json": {"cache": False}}]}}}


def git(args, repo):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def dvc(args, repo) -> str:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([str(BIN / "dvc"), *args], cwd=repo, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def toy_repo(path: Path, sleep: float = 0.0, items=("a", "b", "c", "d")) -> Path:
    """A git + DVC repository with the toy dvc.yaml (make@<item> for `items`, join of a and b)."""
    path.mkdir()
    git(["init", "-q"], path)
    dvc(["init", "-q"], path)
    dvc(["config", "core.analytics", "false"], path)
    (path / "dvc.yaml").write_text(yaml.safe_dump(toy_dvc_yaml(sleep, items), sort_keys=False))
    (path / "params.yaml").write_text(yaml.safe_dump({"sizes": {w: i + 1 for i, w in enumerate(items)}}))
    git(["add", "-A"], path)
    git(["commit", "-qm", "toy"], path)
    return path


def ran(results: dict) -> set[str]:
    """The stages that ran or were restored from DVC's run cache."""
    return {n for n, r in results.items() if n != "estimate" and r["outcome"] != "skipped"}


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture
def flow(monkeypatch):
    """lisa-full without `lisa estimate` (the toy repository has no lisa params)."""
    import flows.lisa_full as module

    monkeypatch.setattr(module, "estimate", lambda params_path: "")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # Dask workers import tasks/ from this checkout
    return module.lisa_full


def test_dag_comes_from_dvc_yaml(tmp_path):
    """Stages, foreach items and the edges from deps / outs, as DVC reads them; a stage added to dvc.yaml appears
    with no edit to flows/."""
    from tasks.pipeline import read_dag, select

    repo = toy_repo(tmp_path / "toy")
    dag = read_dag(repo)
    assert set(dag) == {"make@a", "make@b", "make@c", "make@d", "join"}
    assert dag["join"].upstream == ("make@a", "make@b") and dag["make@a"].upstream == ()
    assert list(dag).index("join") > max(list(dag).index(f"make@{w}") for w in "ab")
    assert dag["join"].metrics == ("m.json",) and dag["join"].family == "join"
    assert set(select(dag, ["join"])) == {"make@a", "make@b", "join"}
    assert set(select(dag, ["make"])) == {"make@a", "make@b", "make@c", "make@d"}
    with pytest.raises(ValueError, match="no stage nope"):
        select(dag, ["nope"])
    spec = yaml.safe_load((repo / "dvc.yaml").read_text())
    spec["stages"]["report"] = {"cmd": "cp m.json r.json", "deps": ["m.json"], "outs": ["r.json"]}
    (repo / "dvc.yaml").write_text(yaml.safe_dump(spec))
    assert read_dag(repo)["report"].upstream == ("join",)


def test_stage_results_become_prefect_artifacts(tmp_path, harness):
    """A stage's metrics (a table, nested keys dotted), markdown reports and images (file:// addresses) are
    Prefect artifacts keyed by stage and file."""
    from prefect import flow
    from prefect.artifacts import Artifact

    from tasks.pipeline import artifact_key, publish

    (tmp_path / "reports").mkdir()
    (tmp_path / "reports/bench.md").write_text("## Bench\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    (tmp_path / "reports/grid.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    metrics = {"reports/m.json": {"tau": 2.5, "speed": {"eager": 1.1, "compiled": 0.9}, "hist": [1, 2]}}

    @flow
    def one():
        return publish("bench-spec@fashion-c2i", tmp_path, metrics,
                       ("reports/bench.md", "reports/grid.png", "reports/missing.md"))

    keys = one()
    assert keys == ["bench-spec-fashion-c2i-m", "bench-spec-fashion-c2i-bench-md", "bench-spec-fashion-c2i-grid-png"]
    table = Artifact.get(keys[0])
    assert table.type == "table" and "speed.compiled" in str(table.data) and "0.9" in str(table.data)
    assert Artifact.get(keys[1]).type == "markdown" and "## Bench" in Artifact.get(keys[1]).data
    assert Artifact.get(keys[2]).type == "image" and "file://" in str(Artifact.get(keys[2]).data)
    assert artifact_key("eval-method@emoji-t2i-lisa_sampled", "x.y") == "eval-method-emoji-t2i-lisa-sampled-x-y"


def test_outcome_reads_dvc_log():
    from tasks.pipeline import outcome

    assert outcome("make@a", "Stage 'make@a' didn't change, skipping\n") == "skipped"
    assert outcome("make@a", "Running stage 'make@a':\n> python ...\n") == "ran"
    assert outcome("make@a", "Stage 'make@a' is cached - skipping run, checking out outputs\n") == "restored"


def test_flow_keeps_dvc_semantics_both_ways(tmp_path, harness, flow):
    repo = toy_repo(tmp_path / "toy")
    first = flow(root=str(repo))
    assert ran(first) == {"make@a", "make@b", "make@c", "make@d", "join"}
    assert first["join"]["metrics"] == {"m.json": {"total": 3}} and first["join"]["artifacts"] == ["join-m"]
    assert json.loads(dvc(["status", "--json"], repo)) == {}       # the lock is current ...
    assert "Running stage" not in dvc(["repro"], repo)             # ... so dvc repro runs nothing
    assert ran(flow(root=str(repo))) == set()                      # nor does the flow again

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["sizes"]["a"] = 10
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    assert ran(flow(root=str(repo))) == {"make@a", "join"}         # what dvc repro would run, no more
    assert json.loads(dvc(["status", "--json"], repo)) == {}

    params["sizes"]["b"] = 20                                      # the other direction: dvc repro first ...
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    log = dvc(["repro"], repo)
    assert "Running stage 'make@b'" in log and "Running stage 'make@a'" not in log
    assert ran(flow(root=str(repo))) == set()                      # ... then the flow finds nothing to do

    (repo / "out/c.txt").unlink()                                  # a missing output: as dvc repro, restored
    results = flow(root=str(repo), stages=["make"])                # from DVC's run cache, nothing else runs
    assert ran(results) == {"make@c"} and results["make@c"]["outcome"] == "restored"


def test_flow_run_logs_name_their_task(tmp_path, harness, flow):
    """`prefect flow-run logs` prints a stored line's message alone: every task's lines start with the task run's
    name (the stage), and the stored lines are the flow's and the tasks' own, no library output."""
    import logging
    import re

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    repo = toy_repo(tmp_path / "toy", items=("a", "b"))
    state = flow(root=str(repo), return_state=True)
    for handler in logging.getLogger("prefect.task_runs").handlers:
        handler.flush()  # the API handler's queue: sent before reading back
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    tasks = [log.message for log in logs if log.task_run_id]
    named = {m.split(" | ")[0] for m in tasks}
    assert named == {"make@a", "make@b", "join"}, tasks
    for stage in named:
        assert f"{stage} | Finished in state Completed()" in tasks
        assert f"{stage} | ran" in tasks
    flow_lines = [log.message for log in logs if not log.task_run_id]
    assert any("lisa-full: 3 of 3 stages ran" in m for m in flow_lines), flow_lines
    assert not any(re.search(r"LOAD_[A-Z]|RETURN_VALUE|Traceback", log.message) for log in logs)


def test_a_failed_stage_fails_the_flow_and_stops_its_downstream(tmp_path, harness, flow):
    repo = toy_repo(tmp_path / "toy")
    spec = yaml.safe_load((repo / "dvc.yaml").read_text())
    spec["stages"]["make"]["do"]["cmd"] = "python -c 'raise SystemExit(1)'"
    (repo / "dvc.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(RuntimeError, match="make@a") as e:
        flow(root=str(repo))
    assert "join" in str(e.value) and not (repo / "m.json").exists()


def test_independent_stages_fan_out_on_dask(tmp_path, harness, flow):
    """Four independent 6-second stages: a running local Dask cluster of 2 workers (one thread each), reached
    through its address as a user's cluster would be, against one stage at a time."""
    pytest.importorskip("prefect_dask")
    from distributed import Client, LocalCluster

    from flows.runners import task_runner

    def wall(runner, name):
        repo = toy_repo(tmp_path / name, sleep=6.0)
        start = time.perf_counter()
        results = flow.with_options(task_runner=runner)(root=str(repo), stages=["make"])
        assert len(ran(results)) == 4 and json.loads(dvc(["status", "--json", "make"], repo)) == {}
        return time.perf_counter() - start

    sequential = wall(task_runner("threads", 1), "seq")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.run(importlib.import_module, "tasks.pipeline")  # a warm cluster, as a user's long-lived one is
        dask = wall(task_runner("dask", address=cluster.scheduler_address), "dask")
    print(f"toy fan-out: sequential {sequential:.1f} s, Dask 2 workers {dask:.1f} s, ratio {dask / sequential:.2f}")
    assert dask <= 0.75 * sequential


def test_task_runner_is_a_setting(monkeypatch):
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.runners import task_runner

    monkeypatch.setenv("LISA_WORKERS", "3")
    assert isinstance(task_runner(), ThreadPoolTaskRunner) and task_runner()._max_workers == 3
    monkeypatch.setenv("LISA_TASK_RUNNER", "nope")
    with pytest.raises(ValueError, match="threads or dask"):
        task_runner()
    if pytest.importorskip("prefect_dask"):
        monkeypatch.setenv("LISA_TASK_RUNNER", "dask")
        monkeypatch.setenv("LISA_DASK_ADDRESS", "tcp://10.0.0.1:8786")
        assert task_runner().address == "tcp://10.0.0.1:8786"


def test_help_names_the_dvc_stages_and_plan_runs_alone(tmp_path, capsys):
    """`lisa --help` says which commands are dvc.yaml stages (truly), and `lisa plan` works as the README names
    it: it runs `dvc status --json` itself."""
    from lisa.cli import COMMANDS, OUTSIDE_DVC, build_parser, main
    from tasks.pipeline import read_dag

    families = {s.family for s in read_dag(ROOT).values()}
    assert families == set(COMMANDS) - set(OUTSIDE_DVC)
    text = build_parser().format_help()
    assert all(c in text for c in OUTSIDE_DVC) and "of dvc.yaml" in text
    repo = toy_repo(tmp_path / "toy")
    assert main(["plan", "--lock", str(repo / "dvc.lock")]) == 0
    assert "5 of 0 stages will run" in capsys.readouterr().out
    dvc(["repro"], repo)
    assert main(["plan", "--lock", str(repo / "dvc.lock")]) == 0
    assert "0 of 5 stages will run" in capsys.readouterr().out


def test_two_machines_share_the_dag_through_a_dvc_remote(tmp_path, harness, flow):
    """docs/pipeline.md, several machines, simulated: two clones of one repository and a local-folder DVC remote.
    Each runs other stages, pushes its outputs and its dvc.lock; the merge (tasks/lockmerge.py as git's merge
    driver) keeps both machines' entries, and after `dvc pull` the rest of the DAG needs only what neither ran."""
    from tasks.lockmerge import merge_locks

    toy = toy_repo(tmp_path / "toy")
    dvc(["remote", "add", "-d", "store", str(tmp_path / "store")], toy)
    (toy / ".gitattributes").write_text("dvc.lock merge=dvc-lock\n")
    git(["add", "-A"], toy)
    git(["commit", "-qm", "remote"], toy)
    git(["clone", "-q", "--bare", str(toy), str(tmp_path / "origin.git")], tmp_path)
    clones = {}
    for name, stages in (("A", ["make@a", "make@c"]), ("B", ["make@b", "make@d"])):
        repo = clones[name] = tmp_path / name
        git(["clone", "-q", str(tmp_path / "origin.git"), str(repo)], tmp_path)
        git(["config", "merge.dvc-lock.driver", f"{sys.executable} -m tasks.lockmerge %O %A %B"], repo)
        assert ran(flow(root=str(repo), stages=stages)) == set(stages)
        dvc(["push"], repo)
        git(["add", "dvc.lock"], repo)
        git(["commit", "-qm", f"machine {name}"], repo)
    git(["push", "-q"], clones["A"])
    git(["pull", "-q", "--no-rebase", "--no-edit"], clones["B"])  # A's lock merged into B's
    b = clones["B"]
    lock = yaml.safe_load((b / "dvc.lock").read_text())["stages"]
    assert set(lock) == {"make@a", "make@b", "make@c", "make@d"}
    dvc(["pull"], b)                                               # A's outputs, from the remote
    assert (b / "out/a.txt").read_text() == "1"
    assert ran(flow(root=str(b))) == {"join"}                      # only what neither machine ran
    assert json.loads(dvc(["status", "--json"], b)) == {}

    entry = {"cmd": "x"}
    assert merge_locks({}, {"stages": {"s": entry}}, {"stages": {"s": {"cmd": "y"}}})[1] == ["s"]


def test_torchrun_launch_is_a_setting(monkeypatch):
    """cache-logits and train-drafter run under torchrun when the settings ask for several processes; other stages
    and one process run plainly (the 2-process run itself: test_flows_micro.py)."""
    from tasks.pipeline import torchrun_launch

    assert torchrun_launch("cache-logits") == []
    monkeypatch.setenv("LISA_NPROC_PER_NODE", "2")
    launch = torchrun_launch("train-drafter")
    assert launch[0].endswith("torchrun") and launch[1:] == ["--nproc_per_node", "2", "--nnodes", "1", "--standalone",
                                                              "--no-python"]
    assert torchrun_launch("calibrate") == []
    monkeypatch.setenv("LISA_NNODES", "2")
    monkeypatch.setenv("LISA_NODE_RANK", "1")
    monkeypatch.setenv("LISA_RDZV_ENDPOINT", "node0:29400")
    assert torchrun_launch("cache-logits")[-7:] == ["--node_rank", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                                                     "node0:29400", "--no-python"]


def test_torchrun_launch_from_params(tmp_path, monkeypatch):
    """params.yaml's `launch` section sets the processes; the environment overrides it per machine."""
    from lisa.config import profile_text
    from tasks.pipeline import torchrun_launch

    for k in ("LISA_NPROC_PER_NODE", "LISA_NNODES", "LISA_NODE_RANK", "LISA_RDZV_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "params.yaml").write_text(profile_text("micro") + "\nlaunch: {nproc_per_node: 3}\n")
    assert torchrun_launch("cache-logits", str(tmp_path))[1:4] == ["--nproc_per_node", "3", "--nnodes"]
    monkeypatch.setenv("LISA_NPROC_PER_NODE", "1")
    assert torchrun_launch("cache-logits", str(tmp_path)) == []
    monkeypatch.delenv("LISA_NPROC_PER_NODE")
    (tmp_path / "params.yaml").write_text(profile_text("micro") + "\nlaunch: {nproc_per_node: 2, nnodes: 2}\n")
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        torchrun_launch("train-drafter", str(tmp_path))
    (tmp_path / "params.yaml").write_text(profile_text("micro") + "\nlaunch: {nproc_per_node: 0}\n")
    with pytest.raises(Exception, match="nproc_per_node"):
        torchrun_launch("train-drafter", str(tmp_path))
