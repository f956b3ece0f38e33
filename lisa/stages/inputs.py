"""`method-inputs`: what each decoding method of a world reads besides the target, as small files DVC depends on.

eval-method, sweep and quality-point decode one method each. A drafter-free method (vanilla, the Jacobi family)
reads no drafter and no calibration, a tree method one drafter (the release one, the LID one or a named one), gasv
also the calibration. dvc.yaml cannot give a matrix stage per-item deps (deps are checked as a list before interpolation, a
list does not interpolate, a dict-valued matrix item reads as its key), so this stage writes one manifest per method,
data/methods/<world>/cells/<cell>.json (table.cells) and families/<family>.json (scoreboard.families): the files the
method reads and their sha256. Those stages depend on their method's manifest instead of on every drafter and
calibration of the world: a retrained drafter or a new calibration rewrites only the manifests of the methods that
read it (DVC compares the files' hashes), so only their stages re-run. The stages check at run time that what they
load is what their manifest names (`check_inputs`)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from lisa.checkpoint import atomic_write_all, file_sha256, json_writer, read_json
from lisa.config import DecodeMethod, Params
from lisa.decoding.methods import decoder_config
from lisa.stages.paths import Stage, WorldPaths


def method_reads(m: DecodeMethod, paths: WorldPaths) -> dict[str, Path]:
    """{what: file} a method reads besides the target, tokenizer and data: its drafter (tree verifiers) and the
    calibration (a verifier whose registry entry reads one: gasv), as lisa.decoding.methods.decoder_config says."""
    c, reads = decoder_config(m), {}
    if c.drafter is not None:
        reads["drafter"] = paths.drafter_of(c.drafter)
    if "calibration" in c.reads:
        reads["calibration"] = paths.calibration_file
    return reads


def manifest(m: DecodeMethod, paths: WorldPaths) -> dict:
    """A method's manifest: its verifier and, per file it reads, the path and the sha256 of its bytes."""
    out = {"method": m.method, "reads": {}}
    for what, f in method_reads(m, paths).items():
        if not Path(f).is_file():
            raise FileNotFoundError(f"method {m.method!r} reads the {what} {f}: not found"
                                    + (f" (`{paths.drafter_maker(m.drafter)}`)" if what == "drafter" else ""))
        out["reads"][what] = {"file": Path(f).as_posix(), "sha256": file_sha256(f)}
    return out


def method_inputs(p: Params, paths: WorldPaths) -> dict:
    """Every table cell's and scoreboard family's manifest -> inputs_dir/{cells,families}/<key>.json (one output,
    written together). Returns {key: number of files read} per kind."""
    files, summary = {}, {}
    for kind, section, methods in (("cells", "table", p.table.cells),
                                   ("families", "scoreboard", p.scoreboard.families)):
        for key, m in methods.items():
            try:
                doc = manifest(m, paths)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"{section}.{kind}.{key}: {e}") from None
            files[paths.inputs_dir / kind / f"{key}.json"] = json_writer(doc)
            summary[f"{kind}/{key}"] = len(doc["reads"])
    atomic_write_all(files)
    for stale in set(paths.inputs_dir.glob("*/*.json")) - set(files):  # a method no longer in params.yaml
        stale.unlink()
    return summary


def check_inputs(manifest_file: Path, drafter_sha: Optional[str], calibration_sha: Optional[str]) -> None:
    """Refuse to run a method on files its manifest does not name: drafter_sha / calibration_sha are the sha256 of
    what the stage loaded (None: nothing loaded). A stage run by hand after a drafter or calibration changed, before
    `method-inputs` re-ran, stops here."""
    if not Path(manifest_file).is_file():
        raise FileNotFoundError(f"{manifest_file}: no manifest of what this method reads: run "
                                f"`dvc repro method-inputs@<world>` (or `lisa method-inputs --world W`)")
    reads = read_json(manifest_file)["reads"]
    for what, sha in (("drafter", drafter_sha), ("calibration", calibration_sha)):
        want = reads.get(what, {}).get("sha256")
        if want != sha:
            raise ValueError(f"{manifest_file} records the {what} {want and want[:12]}, the stage loaded "
                             f"{sha and sha[:12]}: the {what} changed since `method-inputs` ran; run "
                             f"`dvc repro method-inputs@<world>` first")


STAGES = {
    "method-inputs": Stage(lambda c: method_inputs(c.params, c.paths), out="inputs_dir"),
}
