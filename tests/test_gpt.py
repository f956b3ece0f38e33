"""Target model invariants: KV-cache decoding == full forward; a masked block == one-by-one decoding; taps."""
import pytest
import torch

from lisa.models.gpt import GPTConfig, apply_rope, default_taps, gpt_config, rope_2d_table, rope_operands
from tests.helpers import micro_gpt, micro_t2i

ATOL = 1e-5


def full_logits(model, cond, tokens):
    x = torch.cat([model.embed_cond(cond), model.embed_tokens(tokens)], dim=1)
    return model(x).logits  # (B, C+T, V): no cache, causal


@pytest.mark.parametrize("make", [micro_gpt, micro_t2i, lambda: micro_gpt(n_kv_head=2)])
def test_incremental_kv_decoding_equals_full_forward(make):
    model = make()
    cfg = model.config
    B, T, C = 3, cfg.block_size - 1, cfg.cls_token_num
    cond = torch.randint(0, 10, (B,)) if cfg.model_type == "c2i" else torch.randn(B, C, cfg.caption_dim)
    tokens = torch.randint(0, cfg.vocab_size, (B, T))
    ref = full_logits(model, cond, tokens)
    model.setup_caches(B, C + T)
    steps = [model(model.embed_cond(cond), torch.arange(C)).logits]
    for t in range(T):
        steps.append(model(model.embed_tokens(tokens[:, t : t + 1]), torch.tensor([C + t])).logits)
    torch.testing.assert_close(torch.cat(steps, 1), ref, atol=ATOL, rtol=0)


def test_teacher_forced_alignment():
    model = micro_gpt()
    cond, tokens = torch.tensor([1, 2]), torch.randint(0, 64, (2, 16))
    out = model.teacher_forced(cond, tokens)
    assert out.logits.shape == (2, 16, 64)
    ref = full_logits(model, cond, tokens[:, :-1])  # position C-1+t predicts token t
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)


def test_masked_block_equals_one_by_one_decoding():
    """A block of N tokens with an explicit (N, prefix + N) mask — here a tree: two branches sharing a root —
    gives the logits each token gets when decoded one by one along its own path."""
    model = micro_gpt()
    C, prefix_tokens = 1, torch.randint(0, 64, (1, 5))
    cond = torch.tensor([3])
    P = C + prefix_tokens.shape[1]  # slots used by the prefix
    # tree: node0 (root, depth 0) -> node1, node2 (depth 1, siblings) ; node1 -> node3 (depth 2)
    tree_tokens = torch.tensor([[7, 11, 13, 17]])
    parents = [-1, 0, 0, 1]
    depth = torch.tensor([0, 1, 1, 2])
    N = len(parents)
    mask = torch.zeros(N, P + N, dtype=torch.bool)
    mask[:, :P] = True
    for i in range(N):
        j = i
        while j >= 0:
            mask[i, P + j] = True
            j = parents[j]
    model.setup_caches(1, P + N + 4)
    model(torch.cat([model.embed_cond(cond), model.embed_tokens(prefix_tokens)], 1), torch.arange(P))
    block = model(model.embed_tokens(tree_tokens), torch.arange(P, P + N), mask=mask, rope_pos=P + depth).logits[0]
    for i in range(N):
        path, j = [], i
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        seq = torch.cat([prefix_tokens, tree_tokens[:, path]], 1)
        ref = full_logits(model, cond, seq)[0, -1]
        torch.testing.assert_close(block[i], ref, atol=ATOL, rtol=0)


def test_per_row_rope_positions_and_masks():
    """Batch rows may sit at different positions (each sample accepts its own length): rope_pos (B, S), mask (B, S, K)."""
    model = micro_gpt()
    cond = torch.tensor([1, 2])
    toks = torch.randint(0, 64, (2, 6))
    ref0 = full_logits(model, cond[:1], toks[:1, :6])[0, -1]
    ref1 = full_logits(model, cond[1:], toks[1:, :4])[0, -1]
    model.setup_caches(2, 16)
    # write row 0's and row 1's histories into the same slots; row 1 only uses 5 slots (1 cond + 4 tokens)
    model(torch.cat([model.embed_cond(cond), model.embed_tokens(toks[:, :5])], 1), torch.arange(6))
    last = torch.stack([toks[0, 5], toks[1, 3]])[:, None]  # (2, 1)
    mask = torch.zeros(2, 1, 7, dtype=torch.bool)
    mask[0, 0, :7] = True  # row 0: slots 0..5 + the new slot 6
    mask[1, 0, :4] = True  # row 1: cond + its first 3 tokens (slots 0..3) ...
    mask[1, 0, 6] = True  # ... and its new token in slot 6
    rope_pos = torch.tensor([[6], [4]])
    out = model(model.embed_tokens(last), torch.tensor([6]), mask=mask, rope_pos=rope_pos).logits[:, -1]
    torch.testing.assert_close(out[0], ref0, atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], ref1, atol=ATOL, rtol=0)


def test_taps_return_block_outputs():
    model = micro_gpt(n_layer=4)
    cond, tokens = torch.tensor([1]), torch.randint(0, 64, (1, 8))
    out = model.teacher_forced(cond, tokens, taps=(0, 3))
    assert len(out.hidden) == 2 and out.hidden[0].shape == (1, 8, 64)
    x = torch.cat([model.embed_cond(cond), model.embed_tokens(tokens[:, :-1])], 1)
    h = model.layers[0](x, rope_operands(model.rope[:8][None]), None, None)
    torch.testing.assert_close(out.hidden[0], h, atol=ATOL, rtol=0)
    assert not torch.allclose(out.hidden[0], out.hidden[1])
    assert default_taps(36) == (2, 18, 33) and default_taps(2) == (1, 1, 0)


def test_rope_is_the_pairwise_rotation_bit_for_bit():
    # the operands form (x * (c, c) + swap(x) * (-s, s)) does LlamaGen's float operations in its order
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 16) * 10
    table = rope_2d_table(grid_size=4, head_dim=16, base=10000, cls_token_num=3)[torch.randint(0, 19, (2, 5))]
    xs, r = x.reshape(2, 5, 3, 8, 2), table[:, :, None]
    ref = torch.stack([xs[..., 0] * r[..., 0] - xs[..., 1] * r[..., 1],
                       xs[..., 1] * r[..., 0] + xs[..., 0] * r[..., 1]], -1).flatten(3)
    assert torch.equal(apply_rope(x, rope_operands(table)), ref)


def test_rope_zero_for_condition_and_2d_layout():
    table = rope_2d_table(grid_size=4, head_dim=16, base=10000, cls_token_num=3)
    assert table.shape == (3 + 16, 8, 2)
    assert table[:3].abs().sum() == 0  # condition positions: cos = sin = 0 (as LlamaGen)
    # token (row r, col c) sits at 3 + 4r + c: first half of the pairs rotates with r, second with c
    t = table[3:].view(4, 4, 8, 2)
    torch.testing.assert_close(t[:, 0, :4], t[:, 3, :4])  # row frequencies don't depend on the column
    torch.testing.assert_close(t[0, :, 4:], t[3, :, 4:])  # column frequencies don't depend on the row
    assert torch.allclose(t[0, 0, :, 0], torch.ones(8))  # origin: no rotation


def test_named_presets_and_config_fields():
    xl = gpt_config("GPT-XL")
    assert (xl.n_layer, xl.n_head, xl.dim, xl.vocab_size) == (36, 20, 1280, 16384)
    b = gpt_config("GPT-B", block_size=576)
    assert b.grid_size == 24 and b.ffn_hidden == 2048
    with pytest.raises(ValueError, match="unknown GPTConfig preset"):
        gpt_config("GPT-XXXXL")
    with pytest.raises(ValueError, match="unknown field.*n_layers"):
        GPTConfig.from_dict({"n_layers": 3})
    with pytest.raises(ValueError, match="square"):
        gpt_config("GPT-micro", block_size=15)


def test_cfg_null_class_and_uncond_caption():
    model = micro_gpt()
    drop = torch.tensor([False, True])
    e = model.embed_cond(torch.tensor([3, 3]), drop)
    torch.testing.assert_close(e[1, 0], model.cls_embedding.embedding_table.weight[10])  # null = num_classes
    t2i = micro_t2i()
    feats = torch.randn(2, 5, 24)
    e = t2i.embed_cond(feats, drop)
    torch.testing.assert_close(e[1], t2i.cls_embedding.cap_proj(t2i.cls_embedding.uncond_embedding))
    torch.testing.assert_close(e[0], t2i.cls_embedding.cap_proj(feats[0]))
