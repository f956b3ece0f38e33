"""Identity files: the file list and sha256 of a folder that DVC caches but git does not hold (a world's dataset, the
LAION-COCO fixture), committed in its place as the dvc.yaml dep of the stages that read it.

A fresh clone lacks the folder until its stage rebuilds it, and `dvc repro --dry` hashes every dep of a stage it
lists (treeverse/dvc#9021): a dep on the folder itself fails the dry run. The producing stage writes the identity
(`cache: false`, committed); a reader checks the folder against it before reading, so a stage never reads a folder
other than the one its dep names. An identity maps names to folders: {name: {relative path: sha256}}.
"""
from __future__ import annotations

from pathlib import Path

from lisa.checkpoint import file_sha256, read_json, write_json


class IdentityError(ValueError):
    """A folder whose files differ from its identity file, or an identity file that is missing."""


def folder_identity(path: str | Path) -> dict[str, str]:
    """{path relative to the folder: sha256} of every file under `path`, sorted; a file: {its name: sha256}."""
    path = Path(path)
    if path.is_file():
        return {path.name: file_sha256(path)}
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such folder")
    return {f.relative_to(path).as_posix(): file_sha256(f) for f in sorted(path.rglob("*")) if f.is_file()}


def write_identity(identity_file: str | Path, **folders: str | Path) -> dict:
    """Write the identity of `folders` (name -> path) to identity_file; returns it."""
    identity = {name: folder_identity(path) for name, path in folders.items()}
    write_json(identity_file, identity)
    return identity


def check_identity(identity_file: str | Path, **folders: str | Path) -> None:
    """Refuse `folders` (name -> path) whose files differ from those identity_file records."""
    identity_file = Path(identity_file)
    if not identity_file.is_file():
        built = ", ".join(map(str, folders.values()))
        raise IdentityError(f"{identity_file}: no identity file (the stage that builds {built} writes it)")
    want = read_json(identity_file, IdentityError)
    for name, path in folders.items():
        got = folder_identity(path)
        if got != want.get(name):
            recorded = want.get(name) or {}
            diff = sorted(f for f in set(got) | set(recorded) if got.get(f) != recorded.get(f))
            raise IdentityError(f"{path} differs from {identity_file} ({name}: {len(diff)} files differ, e.g. "
                                f"{', '.join(diff[:3])}): rebuild it with the stage that writes both (`dvc repro`)")

