"""The speculative loop: greedy speculative decoding equals vanilla greedy token for token (trees and chains,
CFG, batch > 1 with per-row acceptance, c2i and t2i); sampling runs with every verifier."""
import pytest
import torch

from lisa.decoding.generate import SpecConfig, generate, speculative_generate
from lisa.models.drafter import DrafterConfig, build_drafter
from lisa.decoding.sampling import SamplingConfig
from tests.helpers import micro_gpt, micro_t2i


def pair(target):
    return build_drafter(DrafterConfig.for_target(target.config)).eval()


@pytest.mark.parametrize("tree", ["dynamic", "static", "chain", "sampled-chain", "sampled-branching"])
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_speculative_equals_vanilla_c2i(tree, cfg_scale):
    torch.manual_seed(0)
    target = micro_gpt(vocab_size=8)  # a small vocabulary: random drafts are often right, so rounds accept
    drafter = pair(target)
    cond = torch.tensor([0, 3, 7])
    greedy = SamplingConfig(temperature=0.0, cfg_scale=cfg_scale)
    ref, _ = generate(target, cond, greedy)
    if tree == "sampled-chain":  # sampled drafts: greedy accepts the draw equal to the argmax
        spec = SpecConfig("greedy", "chain", 4, draft="sample", siblings="iid")
    elif tree == "sampled-branching":
        spec = SpecConfig("greedy", "dynamic", draft="sample", branching=(3, 2, 1, 1))
    else:
        spec = SpecConfig(verifier="greedy", tree=tree, depth=4, top_k_draft=3, total_tokens=10)
    out, stats = speculative_generate(target, drafter, cond, greedy, spec, torch.Generator().manual_seed(0))
    assert torch.equal(out, ref)
    # drafts were accepted (so the cache compaction ran) and rows advanced by different lengths
    assert stats["tau"] > 1.0 and max(max(r) for r in stats["accept_lengths"]) >= 2
    assert len({tuple(r) for r in stats["accept_lengths"]}) > 1
    lengths = [sum(r) for r in stats["accept_lengths"]]
    assert lengths == [15, 15, 15]  # every row emitted its 15 tokens after the prefill


def test_greedy_speculative_equals_vanilla_t2i():
    torch.manual_seed(0)
    target = micro_t2i(vocab_size=8)
    drafter = pair(target)
    cond = torch.randn(2, 5, 24)
    greedy = SamplingConfig(temperature=0.0, cfg_scale=2.0)
    ref, _ = generate(target, cond, greedy)
    out, stats = speculative_generate(target, drafter, cond, greedy, SpecConfig(verifier="exact", depth=3,
                                                                                top_k_draft=2, total_tokens=6))
    assert torch.equal(out, ref) and stats["tau"] > 1.0


def test_sampling_runs_and_is_reproducible():
    target = micro_gpt(vocab_size=16)
    drafter = pair(target)
    s = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=2.0)
    spec = SpecConfig(verifier="exact", depth=3, top_k_draft=2, total_tokens=5)
    a, _ = speculative_generate(target, drafter, torch.tensor([1, 2]), s, spec, torch.Generator().manual_seed(3))
    b, _ = speculative_generate(target, drafter, torch.tensor([1, 2]), s, spec, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (2, 16) and int(a.max()) < 16


@pytest.mark.parametrize("verifier,options,window", [
    ("sjd", {}, 5), ("gsd", {}, 5), ("scd-mc", {}, 5), ("scd-gumbel", {}, 5),
    ("sjd-pac", {"width": 2, "depth": 3}, 7), ("sjd-pac", {"width": 3, "depth": 2, "continuation": 0}, 5)])
def test_jacobi_greedy_equals_vanilla(verifier, options, window):
    from lisa.decoding.generate import jacobi_generate
    from lisa.decoding.verify import Geometry

    target = micro_gpt(vocab_size=8)
    greedy = SamplingConfig(temperature=0.0, cfg_scale=2.0)
    cond = torch.tensor([1, 4, 9])
    ref, _ = generate(target, cond, greedy)
    geo = Geometry.from_codebook(torch.randn(8, 4), k=4)
    out, stats = jacobi_generate(target, cond, greedy, verifier, window=window, geometry=geo, options=options)
    assert torch.equal(out, ref) and all(sum(r) == 15 for r in stats["accept_lengths"])
    assert stats["tau"] > 1.0 and len({tuple(r) for r in stats["accept_lengths"]}) > 1


def target_joint(target, s, V, n=4, cls=5):
    """The exact distribution of n-token sequences under the target with sampling config s (every prefix
    enumerated: V**n cells)."""
    from lisa.decoding.generate import guided
    from lisa.decoding.sampling import logits_to_probs

    seqs = torch.cartesian_prod(*[torch.arange(V)] * n)
    with torch.no_grad():
        c = torch.full((len(seqs),), cls)
        drop = torch.cat([torch.zeros(len(seqs), dtype=torch.bool), torch.ones(len(seqs), dtype=torch.bool)])
        both = target.teacher_forced(torch.cat([c, c]), torch.cat([seqs, seqs]), drop=drop)
        p = logits_to_probs(guided(both.logits, s), s.temperature, s.top_k, s.top_p)
    return p.gather(2, seqs[..., None]).squeeze(-1).prod(-1).double()


def assert_follows(out, joint, V):
    """out (B, n) follows joint (V**n,): nothing outside its support, chi-square p > 1e-3 over the support."""
    from scipy.stats import chisquare

    n = out.shape[1]
    cell = (out * V ** torch.arange(n - 1, -1, -1)).sum(1)
    counts = torch.bincount(cell, minlength=V**n).double()
    keep = joint > 0
    assert counts[~keep].sum() == 0  # nothing outside top-k / top-p is ever emitted
    expected = joint[keep] / joint[keep].sum() * counts[keep].sum()
    assert chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 1e-3


# End to end over 1e5 sequences of 4 tokens: a round's cache compaction (KVCache.move) is exercised, which a
# 3-token test does not catch (with compaction a no-op, 3 tokens still pass; 4 fail at TV 0.065).
N_DRAWS, N_TOKENS = 100_000, 4


def joint_target(V=4):
    """A one-layer micro target: the 1e5-sequence runs below stay within seconds."""
    torch.manual_seed(1)
    return micro_gpt(vocab_size=V, dim=32, n_layer=1)


def test_sjd_sampling_matches_the_target_joint():
    from lisa.decoding.generate import jacobi_generate

    V = 4
    target = joint_target(V)
    s = SamplingConfig(temperature=1.0, top_k=3, cfg_scale=2.0)
    out, stats = jacobi_generate(target, torch.full((N_DRAWS,), 5), s, "sjd", window=3,
                                 generator=torch.Generator().manual_seed(0), num_tokens=N_TOKENS)
    assert stats["tau"] > 1.0
    assert_follows(out, target_joint(target, s, V), V)


@pytest.mark.parametrize("verifier,options,window,sampling", [
    ("scd-mc", {}, 3, SamplingConfig(temperature=1.0, top_k=3, cfg_scale=2.0)),
    ("scd-gumbel", {}, 3, SamplingConfig(temperature=1.0, top_k=3, cfg_scale=2.0)),
    ("sjd-pac", {"width": 2, "depth": 3}, 6, SamplingConfig(temperature=1.0, top_k=3, top_p=0.9, cfg_scale=2.0)),
], ids=["scd-maximal", "scd-gumbel", "sjd-pac-tree"])
def test_coupled_jacobi_sampling_matches_the_target_joint(verifier, options, window, sampling):
    """SCD (both couplings) and SJD-PAC (a proactive tree: siblings without replacement, then a chain; the
    continuation's coupled drafts), end to end with CFG and top-k / top-p over 1e5 sequences of 4 tokens: the joint
    is the target's (chi-square), and drafts are accepted."""
    from lisa.decoding.generate import jacobi_generate

    V = 4
    target = joint_target(V)
    out, stats = jacobi_generate(target, torch.full((N_DRAWS,), 5), sampling, verifier, window=window,
                                 options=options, generator=torch.Generator().manual_seed(0), num_tokens=N_TOKENS)
    assert stats["tau"] > 1.5
    assert_follows(out, target_joint(target, sampling, V), V)


@pytest.mark.parametrize("spec,sampling", [
    (SpecConfig("exact", "dynamic", 2, 2, 4), SamplingConfig(temperature=1.0, top_k=3, top_p=0.9, cfg_scale=2.0)),
    (SpecConfig("exact", "chain", 3, draft="sample", siblings="iid"),
     SamplingConfig(temperature=1.0, top_k=3, cfg_scale=2.0)),
    (SpecConfig("exact", "dynamic", draft="sample", siblings="wor", branching=(2, 2)),
     SamplingConfig(temperature=1.0, top_p=0.8, cfg_scale=2.0)),
    (SpecConfig("exact", "static", 2, 2, 4, draft="sample", siblings="iid"),
     SamplingConfig(temperature=0.8, top_k=3, cfg_scale=2.0)),
], ids=["topk-dynamic", "sampled-iid-chain", "sampled-wor-branching-topp", "sampled-iid-static"])
def test_exact_speculative_sampling_matches_the_target_joint(spec, sampling):
    """End to end: 4-token sequences from the loop (top-k or sampled drafts, exact verification, CFG on target and
    drafter, top-k / top-p) follow the target's joint distribution, computed exactly (chi-square)."""
    V = 4
    target = joint_target(V)
    drafter = pair(target)
    cond = torch.full((N_DRAWS,), 5)
    out, stats = speculative_generate(target, drafter, cond, sampling, spec, torch.Generator().manual_seed(0),
                                      num_tokens=N_TOKENS)
    assert stats["tau"] > 1.0 and max(max(r) for r in stats["accept_lengths"][:100]) >= 2
    assert_follows(out, target_joint(target, sampling, V), V)


def test_sample_stage_takes_a_method(tmp_path):
    """`lisa sample --method exact|sjd`: a grid made with speculative decoding, tau and time in its metrics."""
    import dataclasses

    import yaml

    from lisa.checkpoint import save_artifact
    from lisa.config import parse_params, profile_text
    from lisa.training.drafter import new_drafter
    from lisa.models.llamagen import load_target
    from lisa.stages import WorldPaths
    from lisa.stages.build import init_target, init_tokenizer
    from lisa.stages.sample import sample

    p = parse_params(yaml.safe_load(profile_text("micro")))
    world = p.world("fashion-c2i")
    paths = WorldPaths.of("fashion-c2i", tmp_path)
    init_tokenizer(world, p.init_tokenizer, paths)
    init_target(world, p.init_target, paths)
    target, meta = load_target(paths.target_file)
    d = new_drafter(target)
    save_artifact(d, paths.drafter_file, "drafter", d.config, made_from={"target_sha256": meta["sha256"]})
    for method in ("exact", "sjd", "lantern"):
        params = dataclasses.replace(p.sample, method=method)
        m = sample(world, params, dataclasses.replace(paths, samples_dir=tmp_path / method))
        assert m["method"] == method and m["tau"] >= 1.0 and (tmp_path / method / "grid.png").is_file()
    m = sample(world, dataclasses.replace(p.sample, method="exact", tree="auto"),
               dataclasses.replace(paths, samples_dir=tmp_path / "auto"))
    assert m["auto_tree"]["depth"] >= 1 and "predicted" in m["auto_tree"]["why"]
    with pytest.raises(ValueError, match="unknown verifier 'magic'"):
        sample(world, dataclasses.replace(p.sample, method="magic"),
               dataclasses.replace(paths, samples_dir=tmp_path / "x"))


def test_forced_grammar_tokens_every_method():
    """Grammar tokens (say an end-of-line token 7 after every row of 4) appear exactly where forced, with vanilla,
    speculative (tree and chain) and Jacobi decoding; greedy speculative still equals greedy vanilla."""
    from lisa.decoding.generate import jacobi_generate
    from lisa.decoding.verify import Geometry

    torch.manual_seed(0)
    target = micro_gpt(vocab_size=8)
    drafter = pair(target)
    forced = torch.full((16,), -1, dtype=torch.long)
    forced[3::4] = 7
    cond = torch.tensor([0, 3, 5])
    at = forced >= 0
    for sampling in (SamplingConfig(temperature=0.0, cfg_scale=2.0), SamplingConfig(temperature=1.0, cfg_scale=2.0)):
        gen = torch.Generator().manual_seed(1)
        ref, _ = generate(target, cond, sampling, gen, forced=forced)
        outs = [ref]
        for spec in (SpecConfig("exact", "dynamic", 3, 2, 6), SpecConfig("greedy", "chain", 3),
                     SpecConfig("lantern", "dynamic", 3, 2, 6), SpecConfig("exact", "chain", 3, draft="sample"),
                     SpecConfig("greedy", "dynamic", draft="sample", branching=(2, 2, 1)),
                     SpecConfig("lantern", "static", 3, 2, 6, draft="sample", siblings="iid")):
            if spec.verifier == "greedy" and not sampling.greedy:
                continue
            out, _ = speculative_generate(target, drafter, cond, sampling, spec, gen, forced=forced,
                                          geometry=Geometry.from_codebook(torch.randn(8, 4), 4), options={"k": 3} if spec.verifier == "lantern" else {})
            outs.append(out)
        for v, o, w in (("sjd", {}, 4), ("gsd", {}, 4), ("scd-mc", {}, 4), ("scd-gumbel", {}, 4),
                        ("sjd-pac", {"width": 2, "depth": 2}, 4)):
            out, _ = jacobi_generate(target, cond, sampling, v, w, gen, forced=forced, options=o,
                                     geometry=Geometry.from_codebook(torch.randn(8, 4), 4))
            outs.append(out)
        for out in outs:
            assert (out[:, at] == 7).all()
            if sampling.greedy:
                assert torch.equal(out, ref)
        # free positions keep sampling the model (7 is not forced elsewhere, and other tokens do appear there)
        assert (ref[:, ~at] != 7).any()


@pytest.mark.slow
def test_compiled_decoding_equals_eager_greedy():
    """compile=True (the forwards under torch.compile, static shapes, the drafter's commit padded to one width):
    vanilla, a sampled tree and a Jacobi window decode the same greedy tokens as the eager vanilla loop, and a
    second call reuses the compiled graphs (no recompilation)."""
    import torch._dynamo
    from lisa.decoding.methods import decoder

    torch.manual_seed(0)
    target = micro_gpt(vocab_size=8)
    drafter = pair(target)
    cond = torch.tensor([0, 3, 7])
    greedy = SamplingConfig(temperature=0.0, cfg_scale=3.0)
    ref, _ = generate(target, cond, greedy)
    spec = SpecConfig("greedy", "dynamic", draft="sample", branching=(3, 2, 1, 1))
    decoders = {"vanilla": decoder(target, "vanilla", compile=True),
                "greedy": decoder(target, "greedy", drafter, spec, compile=True),
                "sjd": decoder(target, "sjd", window=5, compile=True)}
    torch._dynamo.reset()
    for name, dec in decoders.items():
        out, stats = dec(cond, greedy, torch.Generator().manual_seed(0))
        assert torch.equal(out, ref), name
        if name != "vanilla":
            assert stats["tau"] > 1.0 and len({tuple(r) for r in stats["accept_lengths"]}) > 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        for name, dec in decoders.items():
            assert torch.equal(dec(cond, greedy, torch.Generator().manual_seed(1))[0], ref), name


@pytest.mark.parametrize("shape", ["sampled", "static"])
def test_fixed_shape_drafting_equals_node_by_node(shape):
    # a tree whose shape is fixed before drafting takes its expansion plan (static masks and inputs); the same tree,
    # drafted node by node as a dynamic tree is (each node's mask row built from its parent's), comes out identical
    from lisa.decoding import draft as D
    from lisa.decoding import generate as G
    from lisa.decoding.tree import branching_choices, sampled_tree, static_choices, static_tree, tree_shape

    torch.manual_seed(0)
    target = micro_gpt(vocab_size=16)
    drafter = pair(target)
    s = SamplingConfig(temperature=1.0, cfg_scale=2.0)
    b = G.start(target, torch.tensor([1, 5]), s, None, None, None, extra_slots=20)
    taps = tuple(drafter.config.taps)
    drafter.setup_caches(b.GB, b.T + 24)
    with torch.inference_mode():
        first, out = G.prefill(target, b, s, torch.Generator().manual_seed(0), taps)
        zero = torch.zeros(2, dtype=torch.long)
        logits, hidden = D.commit_pairs(drafter, b, drafter.fuse([h[:, -1:] for h in out.hidden]), first[:, None],
                                        zero, zero)
        n = torch.ones(2, dtype=torch.long)
        policy = "sample" if shape == "sampled" else "topk"
        root = D._draft_dist(s, b.grammar, policy)(logits[:, None], n[:, None])[:, 0]
        choices = branching_choices((3, 2, 1)) if shape == "sampled" else static_choices(3, 3, 8)
        trees = []
        for expander in ("fixed", "node"):
            expand = (D._fixed_expander(drafter, b, tree_shape(choices), hidden, n, s, policy) if expander == "fixed"
                      else D._node_expander(drafter, b, hidden, n, s, policy))
            trees.append(sampled_tree(root, expand, choices, "wor", torch.Generator().manual_seed(7))
                         if shape == "sampled" else static_tree(root, expand, choices))
    a, c = trees
    for field in ("tokens", "parents", "depth", "scores", "q"):
        assert torch.equal(getattr(a, field), getattr(c, field)), field


def test_pooled_tau_pools_the_live_rounds_of_every_decode():
    from lisa.decoding.generate import pooled_tau
    assert pooled_tau([{"accept_lengths": [[3, 1, 0], [2, 0, 0]]}, {"accept_lengths": [[4]]}]) == 10 / 4
