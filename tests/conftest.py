import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # under pytest-xdist: the cores shared among the workers, for torch
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("OMP_NUM_THREADS", _threads)  # the subprocesses (dvc repro, lisa, torchrun) too
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def micro_built(tmp_path_factory):
    """One `dvc repro` of the whole pipeline on the micro profile, shared by the tests that start from a built
    pipeline (test_pipeline, test_flows_micro): (its folder, the repro's output). Tests work on copies
    (`copy_built`), never on it. Under pytest-xdist (`make test` runs `-n auto`) the workers share one build: the
    first to ask makes it under a file lock in their common temporary folder, the others wait for it and reuse it."""
    from filelock import FileLock

    from tests.test_pipeline import BIN, micro_repo, run

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        repo = micro_repo(tmp_path_factory.mktemp("micro-built"))
        return repo, run([str(BIN / "dvc"), "repro"], repo)
    shared = tmp_path_factory.getbasetemp().parent  # the session's folder, above each worker's own
    done = shared / "micro-built" / "repro.log"
    with FileLock(str(shared / "micro-built.lock")):
        if not done.is_file():
            (shared / "micro-built").mkdir(exist_ok=True)
            repo = micro_repo(shared / "micro-built")
            log = run([str(BIN / "dvc"), "repro"], repo)
            done.write_text(log)
    return shared / "micro-built" / "repo", done.read_text()


def copy_built(built, dst):
    """A copy of the built micro pipeline (git repository, DVC cache and outputs) at dst / "repo"."""
    import shutil

    repo = dst / "repo"
    shutil.copytree(built[0], repo, symlinks=True)
    return repo
