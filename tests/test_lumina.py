"""Lumina-mGPT / Chameleon targets (lisa/models/lumina.py): a tiny random transformers Chameleon checkpoint, written to
a local directory and read back with no network, gives transformers' logits; the image grammar sits exactly in
place in vanilla and speculative decoding (with CFG, batch > 1); batched CFG equals Lumina-mGPT's sequential
passes; a checkpoint with the wrong vocabulary size is a clear error."""
import json
import shutil

import pytest
import torch

from lisa.checkpoint import CheckpointError
from lisa.training.drafter import new_drafter
from lisa.decoding.generate import SpecConfig, generate, speculative_generate
from lisa.models.gpt import Transformer
from lisa.models.lumina import LuminaGrammar, chameleon_codebook, encode_prompts, geometry_codebook, import_chameleon
from lisa.decoding.sampling import SamplingConfig, cfg_logits
from tests.helpers import make_tiny_lumina, make_tiny_vqgan

K = 16  # a tiny codebook: random drafts are sometimes right, so speculative rounds accept
GRAMMAR = LuminaGrammar(codebook_size=K, max_grid=8)
GRID = 3  # 48 px at downsample 16 -> 3x3 codes + 3 EOL + 4 = 16 tokens
PROMPT = 24


@pytest.fixture(scope="module")
def lumina_dir(tmp_path_factory):
    return make_tiny_lumina(tmp_path_factory.mktemp("lumina") / "Lumina-mGPT-tiny", K)


@pytest.fixture(scope="module")
def target(lumina_dir):
    return import_chameleon(lumina_dir, image_size=GRID * 16, prompt_len=PROMPT, grammar=GRAMMAR)


@torch.no_grad()
def guided_logits_sequential(model: Transformer, prompt: torch.Tensor, prompt_mask: torch.Tensor,
                             tokens: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """Guided logits (B, T, V) of a teacher-forced sequence, the conditional and the unconditional (image part
    only) passes run separately, as Lumina-mGPT does. The decode loops batch them; this is the reference."""
    c = model.teacher_forced(prompt, tokens, cond_mask=prompt_mask).logits
    drop = torch.ones(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    u = model.teacher_forced(prompt, tokens, drop=drop, cond_mask=prompt_mask).logits
    return cfg_logits(torch.cat([c, u]), cfg_scale)


def prompts(lumina_dir):
    return encode_prompts(lumina_dir, ["a red apple", "a cat on the mat", "apple"], PROMPT, GRID * 16)


def test_offline_load_matches_transformers(lumina_dir, target, monkeypatch):
    from transformers import ChameleonForConditionalGeneration

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = ChameleonForConditionalGeneration.from_pretrained(str(lumina_dir), local_files_only=True).eval()
    assert target.config.vocab_size == GRAMMAR.vocab_size and target.config.text_vocab_size == 8900
    assert target.token_ids[:K].tolist() == list(range(4, 4 + K))  # from the vocabulary_map
    assert target.token_ids[K:K + 3].tolist() == [8197, 8196, 8803]
    ids, mask = prompts(lumina_dir)
    assert mask[:, -1].all() and not mask[:, 0].all()  # left padded
    forced = GRAMMAR.forced(GRID, GRID)
    tokens = torch.where(forced >= 0, forced, torch.randint(0, K, (3, len(forced))))
    with torch.no_grad():
        ours = target.teacher_forced(ids, tokens, cond_mask=mask).logits  # (B, T, V)
        full = torch.cat([ids, target.token_ids[tokens]], 1)
        am = torch.cat([mask, torch.ones_like(tokens, dtype=torch.bool)], 1).long()
        pos = (am.cumsum(1) - 1).clamp(min=0)
        h = hf.model(input_ids=full, attention_mask=am, position_ids=pos).last_hidden_state
        ref = hf.lm_head(h)[:, PROMPT - 1 : -1][..., target.token_ids]
    free = forced < 0
    assert ref[:, free, :K].std() > 0.5  # a real signal, not near-zero random-init logits
    torch.testing.assert_close(ours[:, free, :K], ref[:, free, :K], atol=2e-4, rtol=2e-4)
    assert (ours[:, free, K:] == -1e4).all()  # grammar ids are never sampled at code positions
    # grammar positions: the forced token with log-prob 0 (what decoding emits), so losses there are 0
    logp = ours[:, ~free].log_softmax(-1).gather(-1, tokens[:, ~free, None])
    assert torch.allclose(logp, torch.zeros_like(logp))
    # the VQ-VAE codebook from the same checkpoint, extended over the grammar ids for the geometry table
    book = chameleon_codebook(lumina_dir)
    torch.testing.assert_close(book, hf.model.vqmodel.quantize.embedding.weight.float())
    geo = geometry_codebook(book, target.config.vocab_size)
    assert geo.shape[0] == target.config.vocab_size and (geo[:K, book.shape[1]:] == 0).all()


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_grammar_in_place_vanilla_and_speculative(lumina_dir, target, cfg_scale):
    ids, mask = prompts(lumina_dir)
    forced = GRAMMAR.forced(GRID, GRID)
    fixed = forced >= 0
    sampling = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=cfg_scale)
    drafter = new_drafter(target).eval()
    runs = {"vanilla": generate(target, ids, sampling, torch.Generator().manual_seed(0), cond_mask=mask,
                                forced=forced)[0]}
    from lisa.decoding.verify import Geometry

    # a relaxed verifier too: LANTERN moves mass between codebook neighbours, never onto a grammar id
    geometry = Geometry.from_codebook(geometry_codebook(chameleon_codebook(lumina_dir), target.config.vocab_size), 8)
    for tree, verifier in (("dynamic", "exact"), ("chain", "exact"), ("dynamic", "lantern")):
        spec = SpecConfig(verifier=verifier, tree=tree, depth=3, top_k_draft=3, total_tokens=6)
        runs[tree + verifier], stats = speculative_generate(
            target, drafter, ids, sampling, spec, torch.Generator().manual_seed(1), cond_mask=mask, forced=forced,
            geometry=geometry, options={"k": 8, "delta": 0.5} if verifier == "lantern" else {})
        assert sum(stats["accept_lengths"][0]) == len(forced) - 1
    for name, out in runs.items():
        assert out.shape == (3, GRAMMAR.sequence_length(GRID, GRID)), name
        assert (out[:, fixed] == forced[fixed]).all(), name  # SOI, sizes, EOL after each row, EOI
        assert (out[:, ~fixed] < K).all(), name  # codes only elsewhere
        assert GRAMMAR.codes(out, GRID, GRID).shape == (3, GRID, GRID)


def test_greedy_speculative_equals_vanilla_and_batched_cfg_equals_sequential(lumina_dir, target):
    ids, mask = prompts(lumina_dir)
    forced = GRAMMAR.forced(GRID, GRID)
    greedy = SamplingConfig(temperature=0.0, cfg_scale=3.0)
    ref, _ = generate(target, ids, greedy, cond_mask=mask, forced=forced)
    out, _ = speculative_generate(target, new_drafter(target).eval(), ids, greedy,
                                  SpecConfig(verifier="greedy", depth=3, top_k_draft=3, total_tokens=6),
                                  cond_mask=mask, forced=forced)
    assert torch.equal(out, ref)
    # the cached, batched CFG decode picks the argmax of Lumina-mGPT's two separate, uncached passes
    seq = guided_logits_sequential(target, ids, mask, ref, 3.0)
    free = forced < 0
    assert torch.equal(seq.argmax(-1)[:, free], ref[:, free])
    batched = cfg_logits(target.teacher_forced(torch.cat([ids, ids]), torch.cat([ref, ref]),
                                               drop=torch.tensor([False] * 3 + [True] * 3),
                                               cond_mask=torch.cat([mask, mask])).logits, 3.0)
    torch.testing.assert_close(batched, seq)


def test_wrong_vocab_size_is_a_clear_error(lumina_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(lumina_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vocab_size"] = 8000  # cannot hold the grammar ids (8803 ...)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: vocab_size 8000 cannot hold"):
        import_chameleon(bad, image_size=GRID * 16, prompt_len=PROMPT, grammar=GRAMMAR)
    cfg["vocab_size"] = 9000  # large enough, but not what the weights have
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"embed_tokens\.weight has shape \(8900, 64\) but config\.json says "
                                              r"vocab_size 9000"):
        import_chameleon(bad, image_size=GRID * 16, prompt_len=PROMPT, grammar=GRAMMAR)


def test_grammar_layout():
    g = LuminaGrammar()  # Lumina-mGPT-7B-768: 48 x 48 codes + 48 EOL + 4 = 2356 tokens
    f = g.forced(48, 48)
    assert len(f) == 2356 == g.sequence_length(48, 48)
    ids = g.checkpoint_ids(torch.arange(8192) + 4)[f[f >= 0]]
    assert ids[:3].tolist() == [8197, 8804 + 48, 8804 + 48] and ids[-1] == 8196
    assert (ids[3:-1] == 8803).all() and len(ids) == 48 + 4
    assert (f.view(-1)[3:-1].view(48, 49)[:, :48] == -1).all()


def test_init_target_imports_a_lumina_directory(lumina_dir, target, tmp_path):
    """The pipeline's init-target stage: a world whose target_checkpoint is a Chameleon directory is imported into
    our artifact format (config and id map included), reloads, and decodes with the grammar in place."""
    from dataclasses import asdict

    from lisa.config import InitTargetParams, WorldParams
    from lisa.models.llamagen import load_target
    from lisa.stages import WorldPaths
    from lisa.stages.build import init_target

    world = WorldParams(target=asdict(target.config), tokenizer={"preset": "VQ-micro"},
                        target_checkpoint=str(lumina_dir))
    info = init_target(world, InitTargetParams(), WorldPaths.of("w", tmp_path, target_dir=tmp_path / "target"))
    model, meta = load_target(tmp_path / "target" / "model.safetensors")
    assert meta["made_from"]["llamagen_checkpoint"] == str(lumina_dir) and info["sha256"] == meta["sha256"]
    assert torch.equal(model.token_ids, target.token_ids)
    ids, mask = prompts(lumina_dir)
    forced = GRAMMAR.forced(GRID, GRID)
    out, _ = generate(model, ids, SamplingConfig(top_k=4, cfg_scale=3.0), torch.Generator().manual_seed(0),
                      cond_mask=mask, forced=forced)
    assert (out[:, forced >= 0] == forced[forced >= 0]).all()
    # the grammar is the model's own: decoding with no `forced`, and packed prompts (-1 = padding), gives it too
    assert torch.equal(model.grammar, forced) and torch.equal(target.grammar, forced)
    packed = torch.where(mask, ids, -1)
    again, _ = generate(model, packed, SamplingConfig(top_k=4, cfg_scale=3.0), torch.Generator().manual_seed(0))
    assert torch.equal(again, out)
    assert model.image_codes(out).shape == (3, GRID * GRID) and (model.image_codes(out) < K).all()
    bad = WorldParams(target={**asdict(target.config), "n_layer": 5}, tokenizer={"preset": "VQ-micro"},
                      target_checkpoint=str(lumina_dir))
    with pytest.raises(CheckpointError, match="n_layer"):
        init_target(bad, InitTargetParams(), WorldPaths.of("w", tmp_path, target_dir=tmp_path / "bad"))


def test_chameleon_vqgan_import_matches_transformers_encoder(lumina_dir, tmp_path):
    """Chameleon's VQGAN in the taming layout of vqgan.ckpt: the encoder half comes from the transformers
    checkpoint (whose VQ-VAE is encoder-only), the decoder half is written in the same layout; the imported
    tokenizer gives transformers' codes, decodes (B, h, w) codes to images, and a decoder-less directory is a clear
    error."""
    from transformers import ChameleonForConditionalGeneration

    from lisa.models.lumina import import_chameleon_vq

    hf = ChameleonForConditionalGeneration.from_pretrained(str(lumina_dir), local_files_only=True).eval()
    with pytest.raises(CheckpointError, match="has no decoder"):
        import_chameleon_vq(lumina_dir, image_size=16)
    _, taming = make_tiny_vqgan(lumina_dir, tmp_path / "vqgan.ckpt", K)
    vq = import_chameleon_vq(tmp_path / "vqgan.ckpt", image_size=16)
    assert vq.config.codebook_embed_dim == 8 and not vq.config.level_attn and not vq.config.codebook_l2_norm
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        ref = hf.model.vqmodel.encode(x).image_tokens.view(2, 8, 8)
        codes = vq.encode(x)
        assert torch.equal(codes, ref)
        torch.testing.assert_close(vq.decoder.conv_out.weight, taming["decoder.conv_out.weight"])
        assert vq.decode(codes).shape == (2, 3, 16, 16)


def test_lumina_world_imports_and_samples_images(lumina_dir, target, tmp_path):
    """A Lumina-mGPT world end to end through the stage functions: init-tokenizer imports Chameleon's VQGAN,
    init-target the transformers directory, and `sample` encodes the prompts with the checkpoint's tokenizer,
    decodes with the grammar in place, strips it and draws an image grid."""
    from dataclasses import asdict

    from lisa.config import InitTargetParams, InitTokenizerParams, SampleParams, WorldParams
    from lisa.stages import WorldPaths
    from lisa.stages.build import init_target, init_tokenizer
    from lisa.stages.sample import sample

    make_tiny_vqgan(lumina_dir, tmp_path / "vqgan.ckpt", K)
    world = WorldParams(target=asdict(target.config), tokenizer={"preset": "VQ-16"},
                        target_checkpoint=str(lumina_dir), tokenizer_checkpoint=str(tmp_path / "vqgan.ckpt"),
                        sampling={"cfg_scale": 3.0, "top_k": 8})
    paths = WorldPaths.of("w", tmp_path, tokenizer_dir=tmp_path / "tok", target_dir=tmp_path / "target",
                          samples_dir=tmp_path / "samples")
    init_tokenizer(world, InitTokenizerParams(), paths)
    init_target(world, InitTargetParams(), paths)
    m = sample(world, SampleParams(prompts=["a red apple", "a cat on the mat"], per_class=2, batch_size=4), paths)
    tokens = torch.load(tmp_path / "samples" / "tokens.pt", weights_only=True)["tokens"]
    forced = GRAMMAR.forced(GRID, GRID)
    assert m["images"] == 4 and tokens.shape == (4, len(forced))
    assert (tokens[:, forced >= 0] == forced[forced >= 0]).all()
    assert (tmp_path / "samples" / "grid.png").is_file()
