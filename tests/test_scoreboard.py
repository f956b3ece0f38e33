"""The scoreboard (lisa/stages/scoreboard.py): its image metrics agree with torch-fidelity, its intervals separate a
known degradation and not two draws of one distribution, its grids and budget picks, and the committed fashion
points at the sample count the scoreboard uses."""
import json
from pathlib import Path

import pytest
import torch
import yaml
from torch_fidelity.metric_prc import prc_features_to_metric

from lisa.config import ConfigError, DecodeMethod, SweepFamily, load_params
from lisa.stages.params import parse_params
from lisa.quality import compare
from lisa.quality.fid import fid_kid
from lisa.stages.scoreboard import pick

ROOT = Path(__file__).resolve().parents[1]


def _feats(n, d, shift=0.0, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * scale + shift


@pytest.mark.parametrize("d", [32, 300])  # d < n: the SVD form; d > n: the Gram form of a resample
def test_metrics_are_torch_fidelitys(d):
    ref, gen = _feats(250, d), _feats(250, d, 0.05, 1.1, seed=1)
    space = compare._Space(compare.Reference.of(ref), gen, 3)
    ours = space(torch.arange(250))
    theirs = fid_kid(ref, gen, kid_subsets=1, kid_subset_size=250)  # one subset of every image: the full-set KID
    prc = prc_features_to_metric(gen, ref, prc_neighborhood=3, prc_batch_size=10000, save_cpu_ram=False,
                                 verbose=False)
    assert ours["fd"] == pytest.approx(theirs["fid"], rel=1e-5)
    assert ours["kid"] == pytest.approx(theirs["kid"], rel=1e-4)
    assert ours["precision"] == pytest.approx(prc["precision"]) and ours["recall"] == pytest.approx(prc["recall"])
    idx = torch.randint(0, 250, (250,), generator=torch.Generator().manual_seed(3))  # a resample, duplicates
    assert space(idx)["fd"] == pytest.approx(compare.frechet(space.ref, gen[idx]), rel=1e-6)


def _metrics(gen, ref, seed=0):
    scores = (gen[:, 0] > 0).double() * 100
    return compare.image_metrics(ref, gen, ref[:, :8], gen[:, :8], scores, "score", bootstrap=60, seed=seed)


def test_intervals_separate_a_degradation_and_not_two_draws():
    """Two draws of the reference law overlap on every metric; a widened law (a temperature above 1) is
    separated on FD, KID and precision, in both feature spaces."""
    ref = _feats(400, 16, seed=0)
    a, b = _metrics(_feats(300, 16, seed=1), ref), _metrics(_feats(300, 16, seed=2), ref, seed=1)
    hot = _metrics(_feats(300, 16, scale=1.4, seed=3), ref)
    assert all(compare.overlaps(a[k], b[k]) for k in a), {k: (a[k], b[k]) for k in a}
    for k in ("fid", "kid", "precision", "judge_fd", "judge_kid"):
        assert not compare.overlaps(a[k], hot[k]) and not compare.overlaps(b[k], hot[k]), k
    assert all(m["lo"] <= m["hi"] for m in hot.values())


def test_family_grid_points():
    fam = SweepFamily(method="gsd", window=16, options={"rank_window": 7}, grid={"prob_gap": [0.05, 0.3],
                                                                                 "window": [8, 16]})
    pts = fam.points()
    assert [label for label, _ in pts] == ["prob_gap0.05-window8", "prob_gap0.05-window16", "prob_gap0.3-window8",
                                           "prob_gap0.3-window16"]
    m = pts[1][1]
    assert isinstance(m, DecodeMethod) and m.window == 16 and isinstance(m.window, int)
    assert m.options == {"rank_window": 7, "prob_gap": 0.05} and fam.options == {"rank_window": 7}
    assert SweepFamily(method="exact").points()[0][0] == "default"


def test_pick_takes_the_highest_tau_within_the_budget():
    pts = [{"label": "a", "tau": 2.0, "tv": 0.04}, {"label": "b", "tau": 3.0, "tv": 0.12},
           {"label": "c", "tau": 3.5, "tv": 0.4}, {"label": "d", "tau": 3.0, "tv": 0.1}]
    assert pick(pts, 0.05)["label"] == "a" and pick(pts, 0.15)["label"] == "d" and pick(pts, 1.0)["label"] == "c"
    assert pick(pts, 0.01) is None
    assert pick(pts[:1], None)["label"] == "a"
    with pytest.raises(ValueError, match="needs a TV budget"):
        pick(pts, None)


def test_bench_spec_times_the_points_the_budgets_pick(tmp_path):
    # every family's pick at every budget joins bench-spec, unless a bench method already is that method; the
    # scoreboard then finds each pick's speedups in the bench report by its method fields
    from dataclasses import asdict

    from lisa.config import BenchMethod, ScoreboardParams
    from lisa.stages.bench import scoreboard_picks
    from lisa.stages.scoreboard import _bench_speedups, _timed

    sb = ScoreboardParams(families={"gsd": SweepFamily(method="gsd", grid={"prob_gap": [0.05, 0.3]}),
                                    "sjd": SweepFamily(method="sjd"), "vanilla": SweepFamily(method="vanilla"),
                                    "unswept": SweepFamily(method="scd-mc")}, budgets=[0.05, 0.15, 0.3])
    sweep = {"gsd": [(0.04, 2.0), (0.2, 2.5)], "sjd": [(0.0, 2.1)], "vanilla": [(0.0, 1.0)]}
    for family, tvs in sweep.items():
        points = [{"label": label, "method": asdict(m), "tau": tau, "tv": tv}
                  for (label, m), (tv, tau) in zip(sb.families[family].points(), tvs)]
        (tmp_path / f"{family}.json").write_text(json.dumps({"points": points}))
    bench = [BenchMethod("vanilla"), BenchMethod("sjd-16", "sjd", window=16)]
    picks = scoreboard_picks(bench, sb, tmp_path)
    # gsd at 0.05 and 0.15 picks prob_gap 0.05, at 0.3 prob_gap 0.3; sjd is a bench method; no sweep, no pick
    assert [m.name for m in picks] == ["gsd[prob_gap0.05]", "gsd[prob_gap0.3]"]
    assert picks[1].method == "gsd" and picks[1].options == {"prob_gap": 0.3}
    report = {"methods": [{"name": m.name, "speedup": s, "decode_method": {k: v for k, v in asdict(m).items()
                                                                           if k != "name"}}
                          for m, s in zip([*bench, *picks], [1.0, 0.9, 1.1, 1.2])], "compiled": []}
    (tmp_path / "bench.json").write_text(json.dumps(report))
    speedups = _bench_speedups(bench, tmp_path / "bench.json")
    point = json.loads((tmp_path / "gsd.json").read_text())["points"][1]
    assert _timed(point, speedups) == {"bench": "gsd[prob_gap0.3]", "eager": 1.2, "compiled": None}


def test_headline_names_the_leader_at_each_budget():
    from lisa.config import ScoreboardParams
    from lisa.stages.scoreboard import _markdown

    sb = ScoreboardParams(families={}, budgets=[0.05, 0.3])

    def cell(tau, eager=None, compiled=None):
        timed = None if eager is None else {"bench": "x", "eager": eager, "compiled": compiled}
        return {"tau": tau, "tv": 0.0, "label": "default", "timed": timed}

    rows = {"vanilla": {"lossless": True, "points": 1, "tv<=0.05": cell(1.0, 1.0, 1.0), "tv<=0.3": cell(1.0, 1.0, 1.0),
                        "indistinguishable": None},
            "exact": {"lossless": True, "points": 1, "tv<=0.05": cell(2.6, 0.6, 0.5), "tv<=0.3": cell(2.6, 0.6, 0.5),
                      "indistinguishable": None},
            "jacobi": {"lossless": True, "points": 1, "tv<=0.05": cell(2.5, 1.1), "tv<=0.3": cell(2.5, 1.1),
                       "indistinguishable": None},
            "relaxed": {"lossless": False, "points": 3, "tv<=0.05": None, "tv<=0.3": cell(4.4, 0.8, 0.7),
                        "indistinguishable": None}}
    md = "\n".join(_markdown("w", sb, {"exact": {"images": 10}}, rows, {}, {}))
    assert "| <= 0.05 | exact (2.60) | jacobi (1.10x) | exact (0.50x) |" in md
    assert "| <= 0.3 | relaxed (4.40) | jacobi (1.10x) | relaxed (0.70x) |" in md


@pytest.mark.parametrize("edit, message", [
    (lambda sb: sb["points"].update({"x": {"world": "fashion-c2i", "family": "nope"}}), "family 'nope'"),
    (lambda sb: sb["points"].update({"x": {"world": "mars", "family": "vanilla"}}), "world 'mars'"),
    (lambda sb: sb["families"].update({"a.b": {"method": "vanilla"}}), "no '.' or '@'"),
    (lambda sb: sb["families"].update({"g": {"method": "lantern", "grid": {"delta": []}}}), "'delta' has no values"),
    (lambda sb: sb["families"].update({"g": {"method": "lantern", "grid": {"speed": [1.0]}}}), "speed"),
])
def test_scoreboard_params_errors_name_the_key(edit, message):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    edit(raw["scoreboard"])
    with pytest.raises(ConfigError, match=message):
        parse_params(raw)


def test_committed_fashion_points_separate_the_control_and_not_vanilla_seeds():
    """At the scoreboard's sample count on the fashion release target: vanilla's three seeds overlap pairwise on
    every metric, and the control (vanilla at temperature 1.3) lies outside vanilla's seed band on Inception FID
    and on the judge's FD."""
    p = load_params(ROOT / "params.yaml").scoreboard
    folder = ROOT / "reports/scoreboard/fashion-c2i/quality"
    pts = {n: json.loads((folder / f"{n}.json").read_text()) for n in p.points if (folder / f"{n}.json").is_file()}
    seeds = [pts[f"fashion-c2i-vanilla-s{i}"]["metrics"] for i in range(3)]
    control = pts["fashion-c2i-control-t13"]["metrics"]
    assert all(pts[n]["samples"] == p.num_samples for n in pts)
    for a in seeds:
        for b in seeds:
            assert all(compare.overlaps(a[k], b[k]) for k in a), {k: (a[k], b[k]) for k in a}
    for k in ("fid", "judge_fd"):
        assert all(not compare.overlaps(control[k], s[k]) for s in seeds), (k, control[k], [s[k] for s in seeds])


def test_cached_decodes_are_keyed_by_the_decoding_code(tmp_path):
    """A sweep / quality point reuses a cached decode only if lisa/decoding and lisa/models are unchanged."""
    from lisa.stages.scoreboard import decode_code
    for d, name in (("decoding", "verify.py"), ("models", "gpt.py"), ("stages", "render.py")):
        (tmp_path / d).mkdir()
        (tmp_path / d / name).write_text("x = 1\n")
    before = decode_code(tmp_path)
    (tmp_path / "stages" / "render.py").write_text("x = 2\n")  # not decoding code
    assert decode_code.__wrapped__(tmp_path) == before
    (tmp_path / "decoding" / "verify.py").write_text("x = 2\n")
    assert decode_code.__wrapped__(tmp_path) != before
    (tmp_path / "decoding" / "verify.py").write_text("x = 1\n")
    (tmp_path / "models" / "lumina.py").write_text("")  # a new module counts too
    assert decode_code.__wrapped__(tmp_path) != before
    assert len(decode_code()) == 12 and decode_code() == decode_code(None)
