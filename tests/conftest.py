import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def micro_built(tmp_path_factory):
    """One `dvc repro` of the whole pipeline on the micro profile, shared by the tests that start from a built
    pipeline (test_pipeline, test_flows_micro): (its folder, the repro's output). Tests work on copies
    (`copy_built`), never on it."""
    from tests.test_pipeline import BIN, micro_repo, run

    repo = micro_repo(tmp_path_factory.mktemp("micro-built"))
    return repo, run([str(BIN / "dvc"), "repro"], repo)


def copy_built(built, dst):
    """A copy of the built micro pipeline (git repository, DVC cache and outputs) at dst / "repo"."""
    import shutil

    repo = dst / "repo"
    shutil.copytree(built[0], repo, symlinks=True)
    return repo
