"""Locality-informed distillation: neighbourhoods, selection, gate, veto schedule, and the two loss terms."""
import pytest
import torch

from lisa.training.distill import LIDConfig, lid_loss, neighbourhood, veto_exponent


def geometry():
    """Codes 0-3 point near +x, codes 4-7 near +y (8 codes, 2-d)."""
    a = torch.tensor([0.0, 0.05, -0.05, 0.1])
    near_x = torch.stack([torch.cos(a), torch.sin(a)], 1)
    near_y = torch.stack([torch.sin(a), torch.cos(a)], 1)
    return torch.cat([near_x, near_y])


def cached(logits, K):
    top, idx = logits.topk(K, dim=-1)
    return idx, top, logits.logsumexp(-1)


def test_neighbourhood_of_the_centroid():
    e = geometry()
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0]])
    idx, top, _ = cached(p.log().clamp(min=-30), 8)
    hood = neighbourhood(idx, top.exp(), e, top_kc=4, radius=0.05)
    assert hood[0].tolist() == [True] * 4 + [False] * 4


def test_selection_gate_and_veto():
    e = geometry()
    t_logits = torch.tensor([[3.0, 2.5, 2.0, 1.5, -2, -2, -2, -2]] * 3)
    d_logits = torch.stack([t_logits[0],                                     # the drafter agrees
                            torch.tensor([1.0, 1, 1, 1, 4, -2, -2, -2]),    # top-1 outside the neighbourhood
                            torch.tensor([3.0, -2, -2, -2, -2, -2, -2, 2])])  # top-1 inside, shape differs
    idx, top, lse = cached(t_logits, 6)
    cfg = LIDConfig(top_kc=4, radius=0.05, quantile=0.0, joint_k=4, veto_steps=100, w_sel=2.0)
    out = lid_loss(d_logits, idx, top, lse, e, cfg, step=0)
    assert out.in_hood.tolist() == [True, False, True] and out.selected.tolist() == [False, True, False]
    assert out.alpha[0] > 0.9 and out.gate[0] == pytest.approx(1.0, abs=1e-5) and out.gate[1] < 0.5
    assert out.weight.tolist() == pytest.approx([1.0, 3.0, 1.0])  # step 0: the full boost
    late = lid_loss(d_logits, idx, top, lse, e, cfg, step=100)  # veto on: boost scaled by the gate
    assert late.weight[1] == pytest.approx(1.0 + 2.0 * float(out.gate[1]), rel=1e-5)
    assert veto_exponent(50, cfg) == 0.5


def test_terms_reduce_to_the_baseline_when_untruncated():
    """Whole vocabulary cached, kernel_p = 1, equal weights: L_CE is the soft CE to the target, and L_KD is 0 when
    the drafter equals the target."""
    torch.manual_seed(0)
    V = 8
    e = geometry()
    t = torch.randn(5, V)
    d = torch.randn(5, V)
    idx, top, lse = cached(t, V)
    cfg = LIDConfig(top_kc=2, kernel_p=1.0, joint_k=V, w_sel=0.0)
    out = lid_loss(d, idx, top, lse, e, cfg)
    soft_ce = -(t.softmax(-1) * d.log_softmax(-1)).sum(-1).mean()
    assert out.ce == pytest.approx(float(soft_ce), rel=1e-5)
    same = lid_loss(t.clone(), idx, top, lse, e, cfg)
    assert same.kd == pytest.approx(0.0, abs=1e-6)


def test_training_on_the_loss_moves_the_drafter_to_the_target():
    torch.manual_seed(1)
    e = torch.nn.functional.normalize(torch.randn(32, 4), dim=-1)
    t = torch.randn(64, 32) * 2
    idx, top, lse = cached(t, 16)
    d = torch.zeros(64, 32, requires_grad=True)
    opt = torch.optim.Adam([d], lr=0.1)
    cfg = LIDConfig(quantile=0.5)
    first = None
    for step in range(100):
        out = lid_loss(d, idx, top, lse, e, cfg, step)
        first = first if first is not None else float(out.loss.detach())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    agree = (d.argmax(-1) == t.argmax(-1)).float().mean()
    assert float(out.loss.detach()) < 0.5 * first and agree > 0.9 and int(out.selected.sum()) <= 32
