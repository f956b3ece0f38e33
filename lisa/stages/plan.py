"""`lisa plan`: what `make run` (`dvc repro`) is about to do, printed before it starts: the stages it will run and
why, the committed release artifacts it reuses, and the expected time.

It reads the output of `dvc status --json` (the Makefile writes it; lisa itself never imports DVC), dvc.yaml
(which stages have outputs committed to git: `cache: false` under data/) and dvc.lock.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

# Wall seconds per stage and world, measured on the reference machine (2 CPU cores) from a fresh clone, 2026-12-03:
# the stages a fresh clone runs because their outputs are not in git. Anything else that would run is named with
# its reason: it rebuilds a committed artifact, which takes from minutes to hours (its report has the last time).
SECONDS = {"build-dataset": 25, "cache-logits": 45, "laion-fixture": 30, "build-laion-coco": 90,
           "build-self-generated": 65}


def release_families(dvc_yaml: dict) -> set[str]:
    """The stages (foreach families) with an output committed to git under data/: the release artifacts. An identity
    file (data/identity/: the sha256 of a folder that a fresh clone rebuilds) is committed but is no artifact."""
    out = set()
    for name, st in dvc_yaml.get("stages", {}).items():
        for o in st.get("do", st).get("outs", []):
            if isinstance(o, dict) and any(str(k).startswith("data/") and not str(k).startswith("data/identity/")
                                           and (v or {}).get("cache") is False for k, v in o.items()):
                out.add(name)
    return out


def _changes(changes: list) -> list[tuple[str, str]]:
    """dvc status entries of one stage -> [(what, how)]: ("command", "changed"), (path, "modified" | "deleted" |
    "not in cache (output)" ...), ("params.yaml: key", "modified") ..."""
    out = []
    for c in changes:
        if isinstance(c, str):
            out.append((c.replace("changed ", ""), "changed"))
            continue
        for kind, paths in c.items():
            for path, how in paths.items():
                how = f"{how} (output)" if kind == "changed outs" else how
                out += [(path, how)] if isinstance(how, str) else [(f"{path}: {k}", v) for k, v in how.items()]
    return out


def _missing_input(what: str, how: str, outs: set[str]) -> bool:
    """A dependency that another stage rebuilds first (a dataset, a logit cache): if it comes back the same, DVC
    skips the stage."""
    return how == "deleted" and any(what == o or what.startswith(o + "/") for o in outs)


def plan(status: dict, lock: dict, families: set[str]) -> tuple[list[str], bool]:
    """Lines to print, and whether a committed release artifact would be rebuilt. families: release_families."""
    stages = lock.get("stages", {})
    outs = {o["path"] for e in stages.values() for o in e.get("outs", [])}
    release = {s: [o["path"] for o in e.get("outs", []) if o["path"].startswith("data/")]
               for s, e in stages.items() if s.split("@")[0] in families}
    changed = {s: _changes(c) for s, c in status.items()}
    waits = sorted(s for s, c in changed.items() if all(_missing_input(w, h, outs) for w, h in c))
    run = {s: c for s, c in changed.items() if s not in waits}
    rebuilt = sorted(s for s in run if s in release)
    known = sum(SECONDS.get(s.split("@")[0], 0) for s in run)
    lines = [f"make run: {len(run)} of {len(stages)} stages will run; {len(waits)} wait for inputs that are rebuilt "
             f"first (skipped if those come back the same); {len(stages) - len(changed)} are up to date."]
    reused = sorted(p for s, paths in release.items() if s not in run for p in paths)
    if reused:
        lines.append(f"  reused (committed release artifacts): {', '.join(reused)}")
    for s in sorted(run):
        shown = "; ".join(f"{w} {h}" for w, h in run[s][:3]) + (f"; +{len(run[s]) - 3} more" if len(run[s]) > 3 else "")
        lines.append(f"  runs {s}: {shown}")
    if rebuilt:
        lines.append(f"  WARNING: rebuilds committed release artifacts ({', '.join(rebuilt)}): this can take hours; "
                     "see each stage's report for its last duration")
    lines.append(f"  expected: about {max(1, round(known / 60))} minutes on 2 CPU cores"
                 + (" plus the rebuilt artifacts" if rebuilt else ""))
    return lines, bool(rebuilt)


def main(status_path: str | Path, lock_path: str | Path = "dvc.lock") -> list[str]:
    status = json.loads(Path(status_path).read_text() or "{}")
    lock = yaml.safe_load(Path(lock_path).read_text()) if Path(lock_path).is_file() else {}
    dvc_yaml = yaml.safe_load((Path(lock_path).parent / "dvc.yaml").read_text())
    return plan(status, lock, release_families(dvc_yaml))[0]
