"""Training loops: a killed run resumes to the same weights as an uninterrupted one; other params restart."""
import torch

from lisa.config import TrainTargetParams, TrainTokenizerParams
from lisa.models.vq import VQModel, vq_config
from lisa.training.loops import train_gpt, train_vq
from tests.helpers import micro_gpt


def vq_run(work, steps_to_run, images):
    cfg = TrainTokenizerParams(steps=6, batch_size=8, warmup=1, restart_every=2, checkpoint_every=1,
                               eval_batch_size=16)
    torch.manual_seed(0)
    model = VQModel(vq_config("VQ-micro"))
    if steps_to_run < cfg.steps:  # simulate a kill after `steps_to_run` steps: train a shorter run, same identity
        import lisa.training.loops as tr

        stop = {"n": 0}
        orig = tr.save_resume

        def save_then_maybe_die(*a, **k):
            orig(*a, **k)
            stop["n"] += 1
            if stop["n"] == steps_to_run:
                raise KeyboardInterrupt

        tr.save_resume = save_then_maybe_die
        try:
            train_vq(model, images, images[:16], cfg, work, progress=False)
        except KeyboardInterrupt:
            pass
        finally:
            tr.save_resume = orig
        torch.manual_seed(0)
        model = VQModel(vq_config("VQ-micro"))
    metrics = train_vq(model, images, images[:16], cfg, work, progress=False)
    return model, metrics


def test_vq_resume_equals_uninterrupted(tmp_path):
    images = torch.randint(0, 256, (32, 3, 16, 16), dtype=torch.uint8)
    a, ma = vq_run(tmp_path / "a", 6, images)
    b, mb = vq_run(tmp_path / "b", 3, images)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(va, vb, rtol=0, atol=0, msg=k)
    ma.pop("train_s"), mb.pop("train_s")
    assert ma == mb and 0 < ma["codebook_usage"] <= 1


def test_gpt_resume_and_fingerprint(tmp_path):
    tokens, cond = torch.randint(0, 64, (24, 16)), torch.randint(0, 10, (24,))
    cfg = TrainTargetParams(steps=4, batch_size=4, warmup=1, checkpoint_every=2, eval_batch_size=8)
    torch.manual_seed(0)
    full = micro_gpt()
    train_gpt(full, tokens, cond, tokens[:8], cond[:8], cfg, tmp_path / "full", progress=False)
    torch.manual_seed(0)
    half = micro_gpt()
    train_gpt(half, tokens, cond, tokens[:8], cond[:8], TrainTargetParams(**{**cfg.__dict__, "steps": 2}),
              tmp_path / "half", progress=False)
    # a resume file of another run (steps=2) is not resumed by a steps=4 run: it restarts from scratch
    torch.manual_seed(0)
    again = micro_gpt()
    m = train_gpt(again, tokens, cond, tokens[:8], cond[:8], cfg, tmp_path / "half", progress=False)
    for va, vb in zip(full.state_dict().values(), again.state_dict().values()):
        torch.testing.assert_close(va, vb, rtol=0, atol=0)
    assert m["heldout_nll_per_token"] > 0


def test_unreadable_resume_file_is_set_aside(tmp_path, capsys):
    """A resume file cut short (a kill or a full disk during its save) is named in a warning, set aside as
    resume.pt.corrupt, and the run starts over to the uninterrupted result instead of failing on it every time."""
    tokens, cond = torch.randint(0, 64, (24, 16)), torch.randint(0, 10, (24,))
    cfg = TrainTargetParams(steps=3, batch_size=4, warmup=1, checkpoint_every=2, eval_batch_size=8)
    torch.manual_seed(0)
    full = micro_gpt()
    train_gpt(full, tokens, cond, tokens[:8], cond[:8], cfg, tmp_path / "full", progress=False)
    resume = tmp_path / "cut" / "resume.pt"
    resume.parent.mkdir()
    resume.write_bytes((tmp_path / "full" / "resume.pt").read_bytes()[:300])  # a truncated zip
    torch.manual_seed(0)
    again = micro_gpt()
    train_gpt(again, tokens, cond, tokens[:8], cond[:8], cfg, tmp_path / "cut", progress=False)
    assert f"{resume}: unreadable resume file" in capsys.readouterr().out
    assert (tmp_path / "cut" / "resume.pt.corrupt").stat().st_size == 300
    for va, vb in zip(full.state_dict().values(), again.state_dict().values()):
        torch.testing.assert_close(va, vb, rtol=0, atol=0)
