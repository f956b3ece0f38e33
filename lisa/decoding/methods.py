"""A params.yaml decoding method -> a decoder: the one path behind `lisa sample`, bench-spec and the quality stages
(eval-method, sweep, quality-point).

A method (lisa.config.DecodeMethod) names vanilla or a verifier of lisa.decoding.verify's registry, with its tree
or window and its knobs. What the verifier reads besides the target is its registry entry's (`Verifier.reads`):
the codebook (gsd), a table of each code's nearest codes (lantern), GASV's calibration (gasv); the tree verifiers
also read a drafter (release, LID or named: `DecodeMethod.drafter`). `decoder_config` is a method as the loop reads it,
`method_geometry` the geometry a set of methods reads, `method_decoder` the decoder; a tree "auto" is resolved
first by the cost model on this machine (`auto_tree`, `resolve_auto`).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor
from tqdm import tqdm

from lisa.config import DecodeMethod, DraftTree, seed_for
from lisa.decoding import costmodel, verify
from lisa.decoding.costmodel import sync
from lisa.decoding.generate import SpecConfig, compiled, generate, jacobi_generate, speculative_generate
from lisa.decoding.sampling import SamplingConfig
from lisa.models.gpt import Transformer


@dataclass(frozen=True)
class DecoderConfig:
    """A method as the decode loop reads it (what two stages decoding "the same method" must agree on)."""
    method: str  # vanilla or a verifier
    options: Any  # the verifier's typed options (None: vanilla)
    spec: Optional[SpecConfig]  # a drafter's tree (tree verifiers; None until a tree "auto" is resolved)
    window: Optional[int]  # a Jacobi window (drafter-free verifiers)
    drafter: Optional[str]  # release, lid or a named drafter: the one a tree verifier reads
    reads: frozenset  # what else the verifier reads (Verifier.reads): "codebook", "neighbours", "calibration"
    nearest: Optional[int]  # nearest codes per code the verifier reads from a neighbour table (its option k)


def decoder_config(m: DecodeMethod) -> DecoderConfig:
    """The DecoderConfig of a params.yaml method."""
    if m.method == "vanilla":
        return DecoderConfig("vanilla", None, None, None, None, frozenset(), None)
    reads, options, tree = verify.reads(m.method), verify.method_options(m), verify.drafts_tree(m.method)
    nearest = options.k if reads & {"neighbours", "calibration"} else None
    return DecoderConfig(m.method, options, method_spec(m) if tree and m.tree != "auto" else None,
                         None if tree else m.window, m.drafter if tree else None, reads, nearest)


def geometry_reads(methods) -> frozenset:
    """What of the codebook geometry any of `methods` reads (Verifier.reads; empty: no geometry)."""
    return frozenset().union(*(decoder_config(m).reads for m in methods))


def method_geometry(methods, codebook: Tensor, neighbours: int, calibration=None) -> Optional[verify.Geometry]:
    """The geometry `methods` read, None if none does: the codebook (V, d), a table of each code's nearest codes
    where a verifier reads one, `neighbours` wide or as wide as the widest k a method reads (the V x V work is
    done only then), and the calibration (lisa.training.calibrate, loaded by the caller) where gasv reads it."""
    reads = geometry_reads(methods)
    if not reads:
        return None
    if "calibration" in reads and calibration is None:
        raise FileNotFoundError("gasv needs a calibration (`lisa calibrate`)")
    table = None
    if "neighbours" in reads:
        k = max([neighbours] + [c.nearest for c in map(decoder_config, methods) if "neighbours" in c.reads])
        table = verify.neighbour_table(codebook, k)
    return verify.Geometry(table, codebook, calibration if "calibration" in reads else None)


def decoder(target: Transformer, method: str = "vanilla", drafter=None, spec: Optional[SpecConfig] = None,
            window: int = 16, geometry=None, options=None, measure: bool = False, compile: bool = False) -> Callable:
    """The Python API behind `lisa sample --method`: a function (cond, sampling, generator, cond_mask=None,
    forced=None, clock=None) -> (tokens (B, T), stats) decoding with `method`: "vanilla", or a verifier name
    (greedy / exact / lantern / ... with an EAGLE-3 `drafter` and a `spec` tree; sjd / gsd run drafter-free over a
    `window`). Relaxed verifiers read `geometry` (lisa.decoding.verify.Geometry) and their knobs from `options` (a
    dict or the verifier's typed options, checked here). compile: the models' forwards under torch.compile
    (`compiled`). stats: DecodeStats. method_decoder builds one from a params.yaml method."""
    if method == "vanilla":
        return lambda c, s, g, cond_mask=None, forced=None, clock=None: generate(target, c, s, g, cond_mask=cond_mask,
                                                                      forced=forced, compile=compile)
    if method not in verify.VERIFIERS:
        raise ValueError(f"decoding method {method!r}: not 'vanilla' nor a verifier {sorted(verify.VERIFIERS)}")
    options = verify.verifier_options(method, options)
    if verify.is_jacobi(method):
        return lambda c, s, g, cond_mask=None, forced=None, clock=None: jacobi_generate(
            target, c, s, method, window, g, cond_mask=cond_mask, geometry=geometry, options=options, forced=forced,
            measure=measure, clock=clock, compile=compile)
    if drafter is None:
        raise ValueError(f"decoding method {method!r} verifies a drafter's trees: give a drafter "
                         "(`lisa train-drafter`)")
    spec = dataclasses.replace(spec or SpecConfig(method), verifier=method)
    return lambda c, s, g, cond_mask=None, forced=None, clock=None: speculative_generate(
        target, drafter, c, s, spec, g, cond_mask=cond_mask, geometry=geometry, options=options, forced=forced,
        measure=measure, clock=clock, compile=compile)


def tree_spec(tree: DraftTree, verifier: str) -> SpecConfig:
    """A params.yaml draft tree (a method's, ablate-lid's, ablate-arch's) as the decode loop reads it; tree "auto"
    must be resolved first (`auto_tree`)."""
    if tree.tree == "auto":
        raise ValueError("tree 'auto' is resolved by the cost model before decoding (lisa.decoding.methods.auto_tree)")
    return SpecConfig(verifier, **{f.name: getattr(tree, f.name) for f in dataclasses.fields(DraftTree)}
                      | {"branching": list(tree.branching)})


def method_spec(m: DecodeMethod) -> Optional[SpecConfig]:
    """The SpecConfig of a tree-verified method, None for vanilla / sjd / gsd."""
    return tree_spec(m, m.method) if verify.drafts_tree(m.method) else None


def method_decoder(m: DecodeMethod, target: Transformer, drafter=None, geometry=None, measure: bool = False,
                   compile: bool = False) -> Callable:
    """`decoder` for a params.yaml decoding method: (cond, sampling, generator, cond_mask=None, forced=None) ->
    (tokens, stats) (compile: the forwards under torch.compile). drafter: a drafter, or {"release" | "lid":
    drafter} of which the method's is taken; geometry: `method_geometry`'s (any of the methods' it decodes)."""
    if isinstance(drafter, Mapping):
        drafter = drafter.get(m.drafter) if verify.drafts_tree(m.method) else None
    return decoder(target, m.method, drafter, method_spec(m), m.window, geometry, verify.method_options(m), measure,
                   compile)


def resolve_auto(m, choice):
    """Method m (tree "auto") with the cost model's choice of draft policy and tree."""
    if choice.draft == "sample":
        return replace(m, tree="dynamic", draft="sample", branching=list(choice.branching), depth=choice.depth,
                       total_tokens=choice.total_tokens)
    return replace(m, tree="dynamic", draft="topk", branching=[], depth=choice.depth,
                   total_tokens=choice.total_tokens)


def auto_tree(target: Transformer, drafter, conditions: list[dict], m, sampling: SamplingConfig, seed: int,
              geometry, auto, progress: bool = True, compile: bool = False):
    """Resolve tree "auto" for method m: decode `conditions` with vanilla, with the full top-k calibration tree and
    the widest sampled tree (traced: acceptance) and with a small tree (loop costs), time bare forwards, and pick
    the draft policy and tree of highest predicted speedup (lisa.decoding.costmodel.choose). m.draft "sample"
    restricts the choice to sampled trees. compile: priced in the mode that will run it, the loops and the bare
    forwards under torch.compile (`compiled`; each forward shape compiles on its first call,
    which the timings skip)."""
    device = next(target.parameters()).device
    fwd_target, fwd_drafter = (compiled(target), compiled(drafter)) if compile else (target, drafter)
    rows = (2 if sampling.use_cfg else 1) * conditions[0]["cond"].shape[0]
    k, D = m.top_k_draft, auto.max_depth
    full = k + (D - 1) * k * k  # every node a depth-D dynamic tree drafts
    small = min(s for s in auto.sizes if s >= 2)
    topk = replace(m, draft="topk", branching=[])
    widest = method_spec(replace(m, tree="dynamic", draft="sample", branching=[k] + [1] * (D - 1)))
    specs = [(widest, "sample"), (method_spec(replace(topk, tree="dynamic", depth=2, total_tokens=small)), None)]
    if m.draft != "sample":
        specs.insert(0, (method_spec(replace(topk, tree="dynamic", depth=D, total_tokens=full)), "topk"))
    traces = {"topk": [], "sample": []}
    timed, vanilla_steps = [], []
    runs = [(r, ci, c) for r in range(2) for ci, c in enumerate(conditions)]  # pass 0 warms up
    mode = " compiled" if compile else ""
    for r, ci, c in tqdm(runs, desc=f"auto tree ({m.method}{mode})", unit="run", disable=not progress):
        gen = torch.Generator(device=device).manual_seed(seed_for(seed, ci))
        sync(device)
        t0 = time.perf_counter()
        generate(target, c["cond"], sampling, gen, cond_mask=c.get("cond_mask"), compile=compile)
        sync(device)
        if r:
            vanilla_steps.append((time.perf_counter() - t0) / target.config.block_size)
        for spec, traced in specs:
            gen = torch.Generator(device=device).manual_seed(seed_for(seed, ci))
            rounds: list = []
            sync(device)
            t0 = time.perf_counter()
            _, stats = speculative_generate(target, drafter, c["cond"], sampling, spec, gen,
                                            cond_mask=c.get("cond_mask"), geometry=geometry,
                                            options=verify.method_options(m), trace=rounds if traced and r else None,
                                            compile=compile)
            sync(device)
            if r:
                timed.append((spec, (time.perf_counter() - t0) / stats["rounds"], stats["tau"]))
                if traced:
                    traces[traced] += rounds
    costs = costmodel.measure_costs(fwd_target, fwd_drafter, rows, auto.sizes + [full, widest.nodes], k,
                                    target.config.cls_token_num + target.config.block_size // 2, auto.reps)
    costs.vanilla_step_s = statistics.median(vanilla_steps)
    # the rest of a round: its wall time less the bare forwards it makes (drafting, verification, bookkeeping,
    # and what a forward costs inside the loop beyond a bare one), linear in the tree size

    def drafting(spec, tau):
        if spec.draft == "sample":
            return costs.draft(len(spec.branching), spec.branching[0], chain=spec.branching[0] == 1, commit=tau)
        return costs.draft(spec.depth, k, commit=tau)

    costs.loop_a_s, costs.loop_b_s = costmodel.fit_loop(
        [(spec.nodes, per_round - costs.target(spec.nodes + 1) - drafting(spec, tau)) for spec, per_round, tau in timed])
    profile = costmodel.acceptance_profile(traces["topk"], D) if m.draft != "sample" else None
    sampled = costmodel.sampled_profile(traces["sample"], k, D)
    return costmodel.choose(profile, costs, k, auto.sizes, sampled)
