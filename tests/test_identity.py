"""Identity files (lisa/data/identity.py): the committed dvc.yaml deps that stand in for the DVC-cached folders a fresh
clone lacks (datasets, logit caches, the LAION-COCO fixture). A reader refuses a folder other than the one its
identity file describes, naming both, and a fresh clone's `dvc repro --dry` lists what it would run."""
import json
import subprocess

import pytest

from lisa.data.identity import IdentityError, check_identity, folder_identity, write_identity
from lisa.stages.common import load_images
from lisa.stages.paths import SharedPaths, WorldPaths
from lisa.training.cache import IDENTITY, MANIFEST, CacheError, open_cache


def folder(path, files: dict):
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def test_a_folder_other_than_its_identity_is_refused_naming_both(tmp_path):
    ds = folder(tmp_path / "ds", {"dataset_dict.json": "{}", "train/data.arrow": "a"})
    ident = tmp_path / "identity" / "ds.json"
    write_identity(ident, dataset=ds)
    assert json.loads(ident.read_text()) == {"dataset": folder_identity(ds)}
    assert sorted(folder_identity(ds)) == ["dataset_dict.json", "train/data.arrow"]
    check_identity(ident, dataset=ds)  # the same files: accepted
    (ds / "train" / "data.arrow").write_text("b")
    with pytest.raises(IdentityError, match=rf"{ds} differs from {ident} \(dataset: 1 files differ, e.g. train/data"):
        load_images(ds, ident)  # refused before the dataset is opened
    (ds / "train" / "data.arrow").write_text("a")
    (ds / "extra.arrow").write_text("")
    with pytest.raises(IdentityError, match="extra.arrow"):
        check_identity(ident, dataset=ds)
    with pytest.raises(IdentityError, match=rf"{tmp_path / 'none.json'}: no identity file"):
        check_identity(tmp_path / "none.json", dataset=ds)


def test_a_logit_cache_other_than_the_committed_identity_is_refused(tmp_path):
    cache = folder(tmp_path / "cache", {MANIFEST: "{}", IDENTITY: json.dumps({"target_sha256": "a", "spec": {"K": 8}})})
    committed = folder(tmp_path, {"cache.json": json.dumps({"target_sha256": "a", "spec": {"K": 16}})}) / "cache.json"
    with pytest.raises(CacheError, match=rf"{cache / IDENTITY} differs from {committed} \(spec.K 16 -> 8\)"):
        open_cache(cache, identity_file=committed)


def test_identity_files_follow_the_default_folders_only():
    """A folder named by hand (`lisa train-tokenizer --dataset X`) is not the one the committed identity describes:
    it is read unchecked, unless an identity is named too."""
    p = WorldPaths.of("w", "r")
    assert (str(p.dataset_identity), str(p.cache_identity)) == ("r/data/identity/datasets/w.json",
                                                                "r/data/identity/cache/w.json")
    assert WorldPaths.of("w", dataset_dir="x").dataset_identity is None
    assert str(WorldPaths.of("w", dataset_dir="x", dataset_identity="x.json").dataset_identity) == "x.json"
    moved = WorldPaths.of("w", cache_dir="c")
    assert moved.cache_identity is None and moved.dataset_identity is not None
    assert SharedPaths.of(fixture_dir="f").fixture_identity is None
    # dvc.yaml names the default folders explicitly (`--out data/datasets/w`): the same folder keeps its identity
    assert str(WorldPaths.of("w", dataset_dir="data/datasets/w").dataset_identity) == "data/identity/datasets/w.json"
    assert SharedPaths.of(fixture_dir="data/corpora/laion-coco-fixture").fixture_identity is not None


def test_a_fresh_clone_dry_runs(tmp_path, monkeypatch):
    """A reader that depends on the identity file of a DVC-cached folder, not on the folder: in a clone without the
    folder (no DVC cache, no remote) `dvc repro --dry` lists the stage that builds it and passes the reader, which is
    up to date (a dep on the folder itself fails there: treeverse/dvc#9021)."""
    from dvc.repo import Repo

    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    src = tmp_path / "src"
    src.mkdir()
    subprocess.run(git + ["init", "-q"], cwd=src, check=True)
    build = "mkdir big identity && echo a > big/a && echo {} > identity/big.json"  # a folder and its identity
    read = "cat identity/big.json > out"
    (src / "dvc.yaml").write_text(json.dumps({"stages": {
        "build": {"cmd": build, "outs": ["big", {"identity/big.json": {"cache": False}}]},
        "read": {"cmd": read, "deps": ["identity/big.json"], "outs": [{"out": {"cache": False}}]}}}))
    monkeypatch.chdir(src)  # where Repo.reproduce looks for dvc.yaml
    with Repo.init(str(src)) as repo:
        assert {s.name for s in repo.reproduce()} == {"build", "read"}
    subprocess.run(git + ["add", "-A"], cwd=src, check=True)
    subprocess.run(git + ["commit", "-qm", "built"], cwd=src, check=True)
    clone = tmp_path / "clone"
    subprocess.run(git + ["clone", "-q", str(src), str(clone)], check=True)
    assert not (clone / "big").exists() and (clone / "identity" / "big.json").is_file()
    monkeypatch.chdir(clone)
    with Repo(str(clone)) as repo:
        assert [s.name for s in repo.reproduce(dry=True)] == ["build"]
