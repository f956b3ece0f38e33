"""method-inputs: one manifest per table cell / scoreboard family naming exactly the files the method reads, and the
stages' run-time check against it (lisa/stages/inputs.py)."""
from pathlib import Path

import pytest
import yaml

from lisa.checkpoint import file_sha256, read_json
from lisa.config import load_params
from lisa.decoding.verify import drafts_tree
from lisa.stages.inputs import check_inputs, method_inputs
from lisa.stages.paths import WorldPaths

ROOT = Path(__file__).resolve().parents[1]


def _world(tmp_path) -> WorldPaths:
    """The files params.yaml's methods read on fashion-c2i, as placeholders: the release and LID drafters, the
    calibration and every named drafter a cell or family drafts with."""
    paths = WorldPaths.of("fashion-c2i", tmp_path)
    p = load_params(ROOT / "params.yaml")
    named = {m.drafter for ms in (p.table.cells, p.scoreboard.families) for m in ms.values()} - {"release", "lid"}
    files = [(paths.drafter_file, "release"), (paths.lid_drafter_file, "lid"), (paths.calibration_file, "cal")]
    for f, text in files + [(paths.drafter_of(n), n) for n in sorted(named)]:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return paths


def test_each_method_names_what_it_reads(tmp_path):
    p, paths = load_params(ROOT / "params.yaml"), _world(tmp_path)
    method_inputs(p, paths)
    sha = {f: file_sha256(f) for f in (paths.drafter_file, paths.lid_drafter_file, paths.calibration_file)}
    for kind, methods in (("cells", p.table.cells), ("families", p.scoreboard.families)):
        for key, m in methods.items():
            reads = read_json(paths.inputs_dir / kind / f"{key}.json")["reads"]
            want = {}
            if m.method != "vanilla" and drafts_tree(m.method):
                f = paths.drafter_of(m.drafter)
                want["drafter"] = {"file": f.as_posix(), "sha256": sha.get(f) or file_sha256(f)}
            if m.method == "gasv":
                want["calibration"] = {"file": paths.calibration_file.as_posix(), "sha256": sha[paths.calibration_file]}
            assert reads == want, (kind, key)
    cells = p.table.cells
    assert read_json(paths.inputs_dir / "cells" / "vanilla.json")["reads"] == {}
    assert set(read_json(paths.inputs_dir / "cells" / "lisa-a.json")["reads"]) == {"drafter", "calibration"}
    assert cells["lisa-a"].drafter == "lid" and cells["exact-sampled"].drafter == "release"
    assert p.scoreboard.families["exact-sampled-cfg"].drafter == "cheap-cfg"  # a named drafter's reader
    assert read_json(paths.inputs_dir / "families" / "exact-sampled-cfg.json")["reads"]["drafter"]["file"] == \
        paths.drafter_of("cheap-cfg").as_posix()


def test_a_retrained_drafter_changes_only_its_readers(tmp_path):
    """What DVC sees: after a new release drafter, only the manifests of the methods that read it differ."""
    p, paths = load_params(ROOT / "params.yaml"), _world(tmp_path)
    method_inputs(p, paths)
    before = {f: f.read_bytes() for f in paths.inputs_dir.glob("*/*.json")}
    paths.drafter_file.write_text("retrained")
    method_inputs(p, paths)
    changed = {f.relative_to(paths.inputs_dir).as_posix() for f, b in before.items() if f.read_bytes() != b}
    readers = {f"{kind}/{k}.json" for kind, ms in (("cells", p.table.cells), ("families", p.scoreboard.families))
               for k, m in ms.items() if m.method != "vanilla" and drafts_tree(m.method) and m.drafter == "release"}
    assert changed == readers and "cells/vanilla.json" not in changed and "cells/lisa-a.json" not in changed


def test_a_named_drafter_is_read_from_its_file(tmp_path):
    """A family that drafts with a named drafter (drafters.named) reads data/drafters/<world>/<name>.safetensors: its
    manifest names that file, and a missing one is an error naming the file and the stage that makes it."""
    from lisa.config import profile_text, parse_params
    from lisa.stages.common import method_resources

    p, paths = parse_params(yaml.safe_load(profile_text("micro"))), _world(tmp_path)
    named = paths.drafter_of("cfg")
    assert named == tmp_path / "data" / "drafters" / "fashion-c2i" / "cfg.safetensors"
    with pytest.raises(FileNotFoundError, match=r"scoreboard.families.exact-sampled-cfg: .*drafter "
                                                r".*cfg.safetensors: not found .*lisa named-drafter --drafter cfg"):
        method_inputs(p, paths)
    with pytest.raises(FileNotFoundError, match="need the cfg drafter.*lisa named-drafter --drafter cfg"):
        method_resources([p.scoreboard.families["exact-sampled-cfg"]], None, {}, None, paths, 8)
    named.parent.mkdir(parents=True, exist_ok=True)
    named.write_text("named")
    method_inputs(p, paths)
    reads = read_json(paths.inputs_dir / "families" / "exact-sampled-cfg.json")["reads"]
    assert reads == {"drafter": {"file": named.as_posix(), "sha256": file_sha256(named)}}


def test_a_method_dropped_from_params_loses_its_manifest(tmp_path):
    p, paths = load_params(ROOT / "params.yaml"), _world(tmp_path)
    method_inputs(p, paths)
    text = yaml.safe_load((ROOT / "params.yaml").read_text())
    del text["table"]["cells"]["gasv-n32"]
    text["table"]["pareto"].remove("gasv-n32")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(text))
    method_inputs(load_params(tmp_path / "params.yaml"), paths)
    assert not (paths.inputs_dir / "cells" / "gasv-n32.json").exists()
    assert (paths.inputs_dir / "cells" / "gasv-n16.json").exists()


def test_check_refuses_files_the_manifest_does_not_name(tmp_path):
    p, paths = load_params(ROOT / "params.yaml"), _world(tmp_path)
    method_inputs(p, paths)
    lisa_a = paths.inputs_dir / "cells" / "lisa-a.json"
    lid, cal = file_sha256(paths.lid_drafter_file), file_sha256(paths.calibration_file)
    check_inputs(lisa_a, lid, cal)
    check_inputs(paths.inputs_dir / "cells" / "vanilla.json", None, None)
    with pytest.raises(ValueError, match="drafter changed"):
        check_inputs(lisa_a, file_sha256(paths.drafter_file), cal)
    with pytest.raises(ValueError, match="calibration changed"):
        check_inputs(lisa_a, lid, None)
    with pytest.raises(ValueError, match="drafter"):  # vanilla loading a drafter: not what its manifest says
        check_inputs(paths.inputs_dir / "cells" / "vanilla.json", lid, None)
    with pytest.raises(FileNotFoundError, match="method-inputs"):
        check_inputs(paths.inputs_dir / "cells" / "nope.json", None, None)
