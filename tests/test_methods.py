"""One method -> one decoder (lisa.decoding.methods): sample, bench-spec and the quality stages (eval-method, sweep,
quality-point) read a named method the same way, on the default and the real profile; the geometry holds what the
verifiers read (their registry entries say what), and `lisa sample --method` takes the table's names."""
from pathlib import Path

import pytest
import torch

from lisa.config import ConfigError, DecodeMethod, load_params, profile_text
from lisa.decoding.methods import decoder_config, geometry_reads, method_geometry
from lisa.decoding.verify import VERIFIERS, Geometry
from lisa.stages.sample import sample_params

ROOT = Path(__file__).resolve().parents[1]


def _params(profile: str, tmp_path):
    if profile == "default":
        return load_params(ROOT / "params.yaml")
    path = tmp_path / f"{profile}.yaml"
    path.write_text(profile_text(profile))
    return load_params(path)


@pytest.mark.parametrize("profile", ["default", "real"])
def test_a_named_method_is_one_decoder_in_every_stage(profile, tmp_path):
    """Each table row's cell (eval-method), its bench_spec.methods entry (bench-spec) and `lisa sample --method` with
    either name give the same DecoderConfig: verifier, options, tree or window, drafter, what of the geometry it
    reads and how many nearest codes. (A verifier's own name in `lisa sample --method` keeps sample's tree.)"""
    p = _params(profile, tmp_path)
    bench = {m.name: m for m in p.bench_spec.methods}
    for name in p.table.rows:
        cell = p.table.cells[name]
        b = cell.bench or name
        want = decoder_config(cell.as_method(name))
        assert decoder_config(bench[b]) == want, (profile, name)
        for n in {name, b} - set(VERIFIERS):
            assert decoder_config(sample_params(p, n)) == want, (profile, n)


def test_the_geometry_holds_what_the_methods_read():
    """A neighbour table only where lantern reads one, as wide as the stage's `neighbours` or the widest k read; the
    codebook for gsd; gasv the calibration, and without one a FileNotFoundError."""
    codebook = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    lantern = DecodeMethod(method="lantern", options={"k": 12})
    assert geometry_reads([DecodeMethod(), DecodeMethod(method="exact")]) == frozenset()
    assert method_geometry([DecodeMethod(method="sjd")], codebook, 8) is None
    g = method_geometry([DecodeMethod(method="gsd", window=4)], codebook, 8)
    assert g.neighbours is None and g.codebook is codebook
    assert method_geometry([lantern], codebook, 8).neighbours.shape == (40, 12)  # raised to the k it reads
    assert method_geometry([lantern], codebook, 16).neighbours.shape == (40, 16)
    assert torch.equal(method_geometry([lantern], codebook, 16).neighbours,
                       Geometry.from_codebook(codebook, 16).neighbours)
    with pytest.raises(FileNotFoundError, match="calibration"):
        method_geometry([DecodeMethod(method="gasv")], codebook, 8)
    assert method_geometry([DecodeMethod(method="gasv")], codebook, 8, calibration="cal").calibration == "cal"


def test_sample_takes_a_method_by_name():
    """`lisa sample --method lisa-sampled` samples the table's configuration (LID drafter included: lisa-a); a
    verifier keeps sample's tree; an unknown name is a ConfigError listing the names."""
    p = load_params(ROOT / "params.yaml")
    s = sample_params(p, "lisa-sampled")
    assert (s.method, s.branching, s.options) == ("gasv", [3, 1, 1, 1, 1, 1], {"kappa": 8.0, "lambda": 0.1, "k": 64})
    assert s.classes == p.sample.classes and s.seed == p.sample.seed
    assert sample_params(p, "lisa-a").drafter == "lid"
    assert sample_params(p, "exact").tree == p.sample.tree and sample_params(p, "exact").method == "exact"
    assert sample_params(p, None) == p.sample and sample_params(p, None, compile=True).compile
    with pytest.raises(ConfigError, match="lisa-sampled"):
        sample_params(p, "nope")
