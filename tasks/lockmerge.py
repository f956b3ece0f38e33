"""A git merge driver for dvc.lock, for machines that ran different stages of the same DAG.

dvc.lock holds one entry per stage. Two checkouts that ran disjoint stages changed disjoint entries, but a text
merge of YAML can still conflict (both created the file, or added entries at the same place). This merge takes,
per stage, the side that changed it from the common ancestor; a stage changed on both sides to different entries is
a real conflict (the same stage run twice): it is left to the user, as git would.

    git config merge.dvc-lock.driver "python -m tasks.lockmerge %O %A %B"
    echo "dvc.lock merge=dvc-lock" >> .gitattributes
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml


def merge_locks(base: dict, ours: dict, theirs: dict) -> tuple[dict, list[str]]:
    """(the merged lock, the stages changed on both sides to different entries)."""
    b, o, t = (x.get("stages", {}) if x else {} for x in (base, ours, theirs))
    merged, conflicts = {}, []
    for name in list(o) + [n for n in t if n not in o]:
        mine, other, old = o.get(name), t.get(name), b.get(name)
        if mine == other or other == old:
            entry = mine
        elif mine == old:
            entry = other
        else:
            conflicts.append(name)
            entry = mine
        if entry is not None:
            merged[name] = entry
    return {"schema": (ours or theirs or {}).get("schema", "2.0"), "stages": merged}, conflicts


def main(base: str, ours: str, theirs: str) -> int:
    """git's merge-driver call: writes the merge to `ours`; exit 1 on a conflict."""
    load = lambda p: yaml.safe_load(Path(p).read_text()) or {}  # noqa: E731
    merged, conflicts = merge_locks(load(base), load(ours), load(theirs))
    Path(ours).write_text(yaml.safe_dump(merged, sort_keys=False))
    for name in conflicts:
        print(f"dvc.lock: stage {name} was run on both sides with different results: run `dvc repro {name}`",
              file=sys.stderr)
    return 1 if conflicts else 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:4]))
