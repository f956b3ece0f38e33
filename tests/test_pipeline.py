"""End to end on the micro profile: the CLI and `dvc repro` run the same stages (the Prefect flows: test_flows_micro.py)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lisa.cli import build_parser
from lisa.config import profile_text

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STAGES = ["build-dataset", "train-tokenizer", "encode", "train-target", "init-tokenizer", "init-target", "sample",
          "premise", "fid-reference", "train-judge", "evaluate", "train-drafter", "cache-logits", "ablate-lid",
          "ablate-arch", "named-drafter", "drafter-reference", "drafter-table",
          "laion-fixture", "build-laion-coco", "build-self-generated", "calibrate", "eval-method",
          "table", "bench", "bench-spec", "sweep", "quality-point", "scoreboard"]
DAG = ["build-dataset", "train-tokenizer", "encode", "train-target", "sample", "premise", "fid-reference",
       "train-judge", "evaluate", "train-drafter", "cache-logits", "ablate-lid", "ablate-arch", "named-drafter",
       "drafter-reference", "drafter-table", "bench-spec",
       "laion-fixture", "build-laion-coco", "build-self-generated", "calibrate", "eval-method", "table", "summary",
       "bench", "sweep", "quality-point", "scoreboard"]


def micro_repo(tmp_path: Path) -> Path:
    """A copy of the pipeline definition (dvc.yaml, .dvc/config, the code it depends on) on the micro profile."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ["dvc.yaml", ".dvcignore"]:
        shutil.copy(ROOT / name, repo / name)
    (repo / ".dvc").mkdir()
    shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")
    shutil.copytree(ROOT / "lisa", repo / "lisa", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "params.yaml").write_text(profile_text("micro"))
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    return repo


def run(cmd, cwd):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_cli_lists_the_stages(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert all(s in out for s in STAGES)


def test_cli_errors_name_the_problem(tmp_path, capsys):
    from lisa.cli import main

    (tmp_path / "params.yaml").write_text(profile_text("micro").replace("per_class:", "per_klass:"))
    assert main(["sample", "--world", "fashion-c2i", "--params", str(tmp_path / "params.yaml")]) == 2
    assert "unknown key 'per_klass' in section 'sample'" in capsys.readouterr().err


@pytest.mark.slow
def test_dvc_repro_micro(tmp_path, micro_built):
    from tests.conftest import copy_built

    repo, out = copy_built(micro_built, tmp_path), micro_built[1]  # a copy of the session's one `dvc repro`
    for stage in DAG:
        assert f"Running stage '{stage}" in out
    for world in ("fashion-c2i", "emoji-t2i"):
        assert (repo / f"reports/samples/{world}/grid.png").stat().st_size > 0
        assert (repo / f"data/target/{world}/model.safetensors").is_file()
        assert json.loads((repo / f"reports/target/{world}.json").read_text())["heldout_nll_per_token"] > 0
        q = json.loads((repo / f"reports/quality/{world}/metrics.json").read_text())
        ref = json.loads((repo / f"reports/quality/{world}-reference.json").read_text())["vs_heldout"]
        assert q["samples"] == 8 and q["fid"] > 0 and set(ref) == {"train", "reconstruction", "unigram"}
        assert (repo / f"reports/quality/{world}/samples.png").stat().st_size > 0
    assert 0 <= json.loads((repo / "reports/quality/fashion-c2i/metrics.json").read_text())["class_consistency"] <= 100
    assert json.loads((repo / "reports/quality/emoji-t2i/metrics.json").read_text())["clip_score"] >= 0
    for world in ("fashion-c2i", "emoji-t2i"):  # the drafter is trained against this target; every method ran
        drafter = json.loads((repo / f"data/drafter/{world}/drafter.json").read_text())
        target_sha = json.loads((repo / f"data/target/{world}/model.json").read_text())["sha256"]
        spec = json.loads((repo / f"reports/bench/{world}.json").read_text())
        assert drafter["made_from"]["target_sha256"] == target_sha == spec["target_sha256"]
        # the configured methods, then the scoreboard's picks that none of them is (the micro sweep's exact-sampled)
        assert [m["name"] for m in spec["methods"]] == ["vanilla", "exact-tree", "exact-chain", "exact-auto",
                                                         "lantern", "sjd", "gsd", "lisa", *spec["scoreboard_picks"]]
        assert "exact-sampled[default]" in spec["scoreboard_picks"]
        cal = json.loads((repo / f"data/calibration/{world}/calibration.json").read_text())
        assert cal["made_from"]["target_sha256"] == target_sha and spec["calibration_sha256"] == cal["sha256"]
        for cell in ("vanilla", "exact-tree", "lisa", "gasv-k0"):
            c = json.loads((repo / f"reports/quality/{world}/methods/{cell}.json").read_text())
            assert c["samples"] == 8 and c["fid"] > 0 and c["tau"] >= 1.0
            assert (c["tv_mean"] < 1e-5) == (cell in ("vanilla", "exact-tree"))
            assert len((repo / f"reports/quality/{world}/methods/{cell}-tv.csv").read_text().splitlines()) == 1 + 16
        assert all(m["tau"] >= 1.0 and m["speedup"] > 0 for m in spec["methods"])
        assert (repo / f"reports/bench/{world}.png").stat().st_size > 0
        c = json.loads((repo / f"reports/cache/{world}.json").read_text())
        assert c["tokens"] == (48 + 12) * 16 and c["bytes_per_token"] > 0 and c["target_sha256"] == target_sha
        ab = json.loads((repo / f"reports/ablation/{world}/metrics.json").read_text())
        assert ab["baseline_tau"] >= 1.0 and ab["lid_tau"] >= 1.0 and ab["steps"] == 4
        for curves in (repo / f"reports/drafter/{world}", repo / f"reports/ablation/{world}/lid"):
            assert len((curves / "train.csv").read_text().splitlines()) == 1 + 4
            assert len((curves / "heldout.csv").read_text().splitlines()) == 1 + 2
        arch = json.loads((repo / f"reports/ablate-arch/{world}/noffn.json").read_text())  # attention only
        assert arch["config"]["ffn_dim"] == 0 and arch["config"]["dim"] == drafter["config"]["dim"]
        assert arch["tau"] >= 1.0 and arch["speedup_eager"] > 0 and arch["steps"] == 4
        assert all(q > 0 for mode in ("eager", "compiled") for q in arch["step_cost"][mode]["q_ratio"].values())
        assert len((repo / f"reports/ablate-arch/{world}/noffn/heldout.csv").read_text().splitlines()) == 1 + 2
        named = json.loads((repo / f"reports/drafters/{world}/cfg.json").read_text())  # LID + CFG-aware, its own stage
        assert named["steps"] == 4 and named["tau"] >= 1.0 and named["entry"] | {"seed": 0} == {
            "width": 0, "ffn_dim": 0, "n_head": None, "head_rank": 0, "steps": 4, "ttt": "incremental", "seed": 0,
            "loss": "lid", "guided": 0.5}
        assert all(0 < x <= 1 for x in named["heldout"]["heldout_overlap_cfg"])
        assert (repo / f"data/drafters/{world}/cfg.safetensors").is_file()
        table = (repo / f"reports/drafters/{world}.md").read_text()
        assert "| cfg |" in table and "| release (reference) |" in table and "| lid (reference) |" in table
        ref = json.loads((repo / f"reports/drafters/{world}/release.json").read_text())
        assert ref["steps"] == 4 and ref["tau"] >= 1.0 and len(ref["heldout"]["heldout_overlap_cfg"]) == 2
        cfg_family = json.loads((repo / f"reports/scoreboard/{world}/sweep/exact-sampled-cfg.json").read_text())
        assert cfg_family["points"][0]["lossless"] and cfg_family["points"][0]["tau"] >= 1.0
        reads = json.loads((repo / f"data/methods/{world}/families/exact-sampled-cfg.json").read_text())["reads"]
        assert reads["drafter"]["file"] == f"data/drafters/{world}/cfg.safetensors"
        gen = json.loads((repo / f"reports/corpora/self-generated-{world}.json").read_text())
        assert gen["sequences"] == 8 and gen["target_sha256"] == target_sha
        assert "| exact-auto |" in (repo / f"reports/bench/{world}.md").read_text()
    laion = json.loads((repo / "reports/corpora/laion-coco.json").read_text())
    assert laion["counts"]["metadata_rows"] == 40 and 0 < laion["sequences"] < 40
    assert "heldout_topk_mass_s0" in run([str(BIN / "dvc"), "plots", "show", "--json"], repo)
    table = (repo / "reports/table.md").read_text()
    assert "## fashion-c2i" in table and "## emoji-t2i" in table and "| lisa |" in table
    assert (repo / "reports/pareto.png").stat().st_size > 0
    rows = json.loads((repo / "reports/table.json").read_text())
    for world in ("fashion-c2i", "emoji-t2i"):  # the headline: from the scoreboard; the summary: from the headline
        head = json.loads((repo / f"reports/summary/{world}.json").read_text())
        board = json.loads((repo / f"reports/scoreboard/{world}.json").read_text())
        h = rows[world]["headline"]["rows"]
        assert h["LISA-lossless"]["family"] == "exact-sampled" and h["LISA-lossless"]["lossless"]
        assert h["LISA"]["family"] == "gasv-topk" and h["LISA"]["lisa"] and "gasv-topk" not in h
        for k in ("tv<=0.05", "tv<=0.3"):
            mine, theirs = h["LISA"][k], board["families"]["gasv-topk"][k]
            assert (mine is None) == (theirs is None) and (mine is None or mine["tau"] == theirs["tau"])
        assert set(h) == {"LISA-lossless", "LISA", "vanilla", "exact-sampled-cfg"}
        assert head["vanilla_fid"] == rows[world]["cells"]["vanilla"]["fid"]
        if "lossless" in head:  # timed by bench-spec when the sweep's pick is one of its methods
            assert h[head["lossless"]["method"]]["lossless"]
        for k in ("tv<=0.05", "tv<=0.3"):
            key = "0" + k[-1] if k.endswith("0.05") else "30"
            assert (h["LISA"][k] is None and f"tau{key}" not in head.get("lisa", {})) or \
                head["lisa"][f"tau{key}"] == h["LISA"][k]["tau"]
    for world in ("fashion-c2i", "emoji-t2i"):  # the scoreboard: one sweep per family, the frontier of each world
        sw = json.loads((repo / f"reports/scoreboard/{world}/sweep/gasv-topk.json").read_text())
        assert [r["label"] for r in sw["points"]] == ["kappa0-lambda0.5-k4", "kappa1-lambda0.5-k4"]
        assert all(r["tau"] >= 1.0 and r["tv"] > 1e-5 and not r["lossless"] for r in sw["points"])
        exact = json.loads((repo / f"reports/scoreboard/{world}/sweep/exact-sampled.json").read_text())["points"]
        assert len(exact) == 1 and exact[0]["lossless"] and exact[0]["tau"] >= 1.0
        board = json.loads((repo / f"reports/scoreboard/{world}.json").read_text())
        assert set(board["families"]) == {"vanilla", "exact-sampled", "gasv-topk", "exact-sampled-cfg"}
        assert board["families"]["exact-sampled"]["tv<=0.05"]["tau"] == exact[0]["tau"]
        assert (repo / f"reports/scoreboard/{world}.png").stat().st_size > 0
    board = json.loads((repo / "reports/scoreboard/fashion-c2i.json").read_text())
    assert set(board["points"]) == {"fashion-c2i-vanilla-s0", "fashion-c2i-vanilla-s1", "fashion-c2i-gasv-topk-tv30"}
    assert board["vanilla_floor"]["fid"]["seeds"] == 2
    pt = json.loads((repo / "reports/scoreboard/fashion-c2i/quality/fashion-c2i-vanilla-s1.json").read_text())
    assert pt["samples"] == 8 and pt["seed"] == 1 and pt["tau"] == 1.0
    assert {"fid", "kid", "precision", "recall", "judge_fd", "judge_kid", "class_consistency"} == set(pt["metrics"])
    assert all(m["lo"] <= m["hi"] for m in pt["metrics"].values())
    shown = run([str(BIN / "dvc"), "metrics", "show"], repo).splitlines()  # one row per world, a terminal wide
    assert len(shown) == 3 and max(map(len, shown)) <= 200, shown
    bench = json.loads((repo / "reports/bench/vanilla.json").read_text())
    assert [r["cfg_scale"] for r in bench["rows"]] == [1.0, 2.0] and all(r["tokens_per_s"] > 0 for r in bench["rows"])
    assert "didn't change" in run([str(BIN / "dvc"), "repro"], repo)  # nothing reruns
    # a params change reruns only what depends on it
    (repo / "params.yaml").write_text(profile_text("micro").replace("per_class: 2", "per_class: 3"))
    out = run([str(BIN / "dvc"), "repro"], repo)
    assert "Running stage 'sample@fashion-c2i'" in out and "Running stage 'train-target" not in out
    assert "Running stage 'evaluate" not in out and "Running stage 'bench-spec" not in out
    assert json.loads((repo / "reports/samples/fashion-c2i/metrics.json").read_text())["images"] == 12


def test_stages_import_an_official_checkpoint(tmp_path):
    """init-target with `target_checkpoint` imports a LlamaGen-layout file; the sidecar records its hash."""
    import yaml

    from lisa.checkpoint import file_sha256
    from lisa.config import parse_params
    from lisa.stages import WorldPaths
    from lisa.stages.build import init_target, init_tokenizer
    from lisa.stages.sample import sample

    asset = ROOT / "tests" / "assets" / "llamagen_c2i_tiny.pt"
    raw = yaml.safe_load(profile_text("micro"))
    raw["scoreboard"]["points"] = {}  # the profile's points name its own worlds
    raw["worlds"] = {"imported": {"target": {"preset": "GPT-micro"}, "tokenizer": {"preset": "VQ-micro"},
                                  "target_checkpoint": str(asset)}}
    p = parse_params(raw)
    world = p.world("imported")
    paths = WorldPaths.of("imported", tmp_path)
    init_tokenizer(world, p.init_tokenizer, paths)
    out = init_target(world, p.init_target, paths)
    meta = json.loads((paths.target_dir / "model.json").read_text())
    assert meta["made_from"]["sha256"] == file_sha256(asset) and meta["config"]["num_classes"] == 10
    assert out["sha256"] == meta["sha256"]
    metrics = sample(world, p.sample, paths)
    assert metrics["images"] == 8 and (paths.samples_dir / "grid.png").is_file()


@pytest.mark.slow
def test_dvc_repro_lumina_world(tmp_path):
    """The real profile's Lumina-mGPT world through the same DAG (`dvc repro`), on stand-ins in the real formats:
    a tiny random transformers Chameleon directory and Chameleon's vqgan.ckpt layout (imported by train-target /
    train-tokenizer), MS-COCO-layout images and captions files (build-dataset), prompts through the checkpoint's
    tokenizer. Codes become grammar sequences; drafters, the logit cache, LID, calibration, bench-spec, quality cells
    and the table all run on them, and every emitted sequence keeps the image grammar in place."""
    import yaml

    from lisa.models.lumina import import_chameleon
    from tests.helpers import make_tiny_lumina, make_tiny_vqgan
    from tests.test_real_data import coco_folder

    lumina = make_tiny_lumina(tmp_path / "Lumina-mGPT-tiny", 16)
    vqgan, _ = make_tiny_vqgan(lumina, tmp_path / "vqgan.ckpt", 16)
    train, train_caps = coco_folder(tmp_path / "coco" / "train2017", 24, 100)
    val, val_caps = coco_folder(tmp_path / "coco" / "val2017", 8, 500)
    # 16 px images at the VQGAN's downsample 2 -> 8 x 8 codes: a grid of 8 (image_size 128 at Lumina's 16 px / code)
    cfg = import_chameleon(lumina, image_size=128, prompt_len=24,
                           grammar=__import__("lisa.models.lumina", fromlist=["LuminaGrammar"]).LuminaGrammar(16, max_grid=8)).config
    repo = micro_repo(tmp_path)
    params = yaml.safe_load(profile_text("micro"))
    from dataclasses import asdict

    params["scoreboard"]["points"] = {}  # the profile's points name its own worlds
    params["drafters"]["runs"] = {"lumina-micro-cfg": {"world": "lumina-micro", "drafter": "cfg"}}  # and its runs
    params["worlds"] = {"lumina-micro": {
        "dataset": {"name": "coco", "image_size": 16, "path": str(train), "captions": str(train_caps),
                    "test_path": str(val), "test_captions": str(val_caps)},
        "tokenizer": {"preset": "VQ-micro"}, "target": asdict(cfg), "caption_encoder": None,
        "target_checkpoint": str(lumina), "tokenizer_checkpoint": str(vqgan),
        "sampling": {"cfg_scale": 3.0, "top_k": 8}}}
    params["sample"]["prompts"] = ["a red apple", "a grey coat"]
    params["premise"]["neighbours"] = [4, 8]  # 16 codes
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    w = "lumina-micro"
    run([str(BIN / "dvc"), "repro", "table", f"sample@{w}", f"premise@{w}", f"build-self-generated@{w}"], repo)
    target = json.loads((repo / f"reports/target/{w}.json").read_text())
    assert target["imported"] == str(lumina) and 0 < target["heldout_nll_per_token"] < 10
    assert json.loads((repo / f"reports/tokenizer/{w}.json").read_text())["imported"] == str(vqgan)
    from lisa.checkpoint import read_state_dict
    from lisa.models.gpt import square_image_grammar

    grammar = square_image_grammar(16, cfg.block_size)
    codes = read_state_dict(repo / f"data/codes/{w}/codes.safetensors")
    assert (codes["train_codes"][:, grammar >= 0] == grammar[grammar >= 0]).all()
    assert not codes["caption_feats"].is_floating_point() and (codes["caption_feats"] == -1).any()  # packed ids
    tokens = torch_load(repo / f"reports/samples/{w}/tokens.pt")["tokens"]
    assert (tokens[:, grammar >= 0] == grammar[grammar >= 0]).all() and (tokens[:, grammar < 0] < 16).all()
    spec = json.loads((repo / f"reports/bench/{w}.json").read_text())
    assert spec["sampling"]["cfg_scale"] == 3.0 and all(m["tau"] >= 1.0 for m in spec["methods"])
    for cell in ("vanilla", "exact-tree", "lisa"):
        c = json.loads((repo / f"reports/quality/{w}/methods/{cell}.json").read_text())
        assert c["samples"] == 8 and c["fid"] > 0
    assert f"## {w}" in (repo / "reports/table.md").read_text()
    named = json.loads((repo / f"reports/drafters/{w}/cfg.json").read_text())  # LID + CFG-aware on an lm target
    assert named["tau"] >= 1.0 and all(0 < x <= 1 for x in named["heldout"]["heldout_overlap_cfg"])
    gen = json.loads((repo / f"reports/corpora/self-generated-{w}.json").read_text())
    assert gen["sequences"] == 8


def torch_load(path):
    import torch

    return torch.load(path, weights_only=True)
