"""Verifiers of a draft tree against the target: pure functions with one signature, in a registry.

    verifier(ctx: VerifyContext, generator) -> Verdict

`VerifyContext` carries what any verifier may need: the target's processed probabilities p at the root and at
every node (after CFG, temperature, top-k / top-p: the distribution vanilla sampling draws from), its raw guided
logits (entropy, margin: GASV's uncertainty), the tree with the drafter's distributions q and how its siblings were
drafted (`tree.sampled`: None for the drafter's top-k, "iid" or "wor" for draws from q), and `geometry` (codebook,
neighbour table, calibration) for the geometry-aware verifiers. Everything is batched: each row walks its own tree
and accepts its own length.

The walk (all verifiers): start at the root. Try the current node's children in order; a verifier decides
acceptance and how the residual r changes on rejection. An accepted child becomes the current node; when no child
is accepted (or there are none) the row emits one token sampled from r: the correction after a rejection, or the
bonus token after a leaf. Acceptance length tau counts both. Two walks, by how the siblings were drafted:

  * deterministic siblings (top-k trees, `walk`): r = p at the node; `exact` accepts child x with probability r(x)
    (r normalised) and on rejection sets r(x) = 0 and renormalises. The emitted token is then distributed exactly
    as p: P(x_i) = prod_{j<i} (1 - r_j(x_j)) * r_i(x_i) = p(x_i), and what is left is p conditioned on not any x_j.
    Relaxed verifiers change the acceptance probability and the residual per draft (LANTERN's boosted mass, GASV's
    soft target).
  * sampled siblings (`walk_sampled`): the verifier fixes one target p~ per node (p for `exact`, a relaxation of p
    toward q for the relaxed ones: `transport`) and the walk runs recursive rejection sampling of p~: child x_i,
    drawn from q_i (q for i.i.d. siblings; q without the earlier siblings for draws without replacement), is
    accepted with probability min(1, r_i(x_i) / q_i(x_i)), r_1 = p~, and on rejection r_{i+1} = norm(max(r_i -
    q_i, 0)). The emitted token is distributed exactly as p~ for either scheme (SpecInfer; Jeon et al.'s recursive
    rejection without replacement), so a relaxed verifier's TV to p is TV(p~, p) at each node.
`greedy` accepts the child equal to argmax p and emits argmax p: speculative greedy = vanilla greedy.
A verifier refuses drafts it has no law for: sjd / gsd need sampled drafts (Jacobi windows), and the tree
verifiers check `tree.q` where they need it.

Each verifier's registry entry (`VERIFIERS`, at the end) names its function, a frozen dataclass of its knobs
(LanternOptions, GSDOptions, GASVOptions, PACOptions; NoOptions for greedy / exact / sjd), the only place their
defaults live, and what it needs: a drafter's trees or a Jacobi window (`drafts`), and what it reads of the
codebook geometry (`reads`: the codebook, a neighbour table, a calibration), which the rest of lisa reads from
here (lisa.decoding.methods builds the geometry from it), and the knobs the results table names (`shown`).
`verifier_options(name, dict)` checks a mapping of knobs against its dataclass (an unknown key is a ValueError
naming the verifier and the keys it allows).

Where it lives: the walks and the knobs' typing in lisa.decoding.walk, the relaxed verifiers (lantern, gsd, gasv)
and the codebook geometry in lisa.decoding.relaxed; here the exact verifiers (greedy, exact), the drafter-free
Jacobi baselines (sjd, sjd-pac, scd-mc, scd-gumbel) and the registry. Every name above stays importable from here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, NamedTuple, Optional

import torch
from torch import Tensor

from lisa.decoding.relaxed import GASVOptions, GSDOptions, LanternOptions, gasv, gsd, lantern
from lisa.decoding.walk import (NoOptions, Verdict, VerifyContext, _needs_sampled, _normalise, typed_options, walk,
                                walk_chain, walk_sampled)
# importable from here too: the geometry, the relaxed verifiers' parts, the walks' parts
from lisa.decoding.relaxed import (Geometry, gasv_scores, gsd_group_masses, gsd_groups,  # noqa: F401
                                   lantern_boost, neighbour_table)
from lisa.decoding.walk import children_table, neighbour_edges, option_keys, ratio, sample_residual  # noqa: F401
from lisa.decoding.walk import transport  # noqa: F401


def _argmax(r: Tensor, row=None, ctx=None) -> Tensor:
    return torch.nn.functional.one_hot(r.argmax(-1), r.shape[-1]).to(r.dtype)


def greedy(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Accept the child equal to the target's argmax; emit the argmax (ties: lowest id, like torch.argmax). On
    sampled drafts: recursive rejection of the one-hot argmax, which accepts exactly the child equal to it."""
    verifier_options("greedy", ctx.options)
    if ctx.tree.sampled:
        return walk_sampled(ctx, generator, lambda p, q, row, ctx: _argmax(p), emit_fn=_argmax)

    def accept(r, tok, q_parent, row, ctx):
        return (tok == r.argmax(-1)).float(), r  # r never changes: a rejected child is simply not the argmax

    return walk(ctx, generator, accept, emit_fn=_argmax)


def exact(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Lossless: the sequential rule for deterministic siblings, recursive rejection sampling for sampled ones
    (i.i.d. or without replacement; `walk_sampled` with p~ = p)."""
    verifier_options("exact", ctx.options)
    if ctx.tree.sampled:
        return walk_sampled(ctx, generator)

    def accept(r, tok, q_parent, row, ctx):
        r = _normalise(r)
        return r.gather(1, tok[:, None]).squeeze(1), _normalise(r.scatter(1, tok[:, None], 0.0))

    return walk(ctx, generator, accept)

# ---------------------------------------------------------------------------------------------------------------
# Drafter-free baselines on a chain of Jacobi drafts (lisa.decoding.generate.jacobi_generate): tree.q[:, i] is the
# distribution draft i was sampled from (the target's own, one iteration earlier; uniform for fresh positions).


def sjd(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Speculative Jacobi decoding: accept draft x if u < min(1, p_t(x) / p_{t-1}(x)); the first rejection
    resamples from norm(max(0, p_t - p_{t-1})) (the recursive rejection rule on a chain)."""
    verifier_options("sjd", ctx.options)
    _needs_sampled("sjd", ctx.tree)
    return _jacobi_walk(ctx, generator)


@dataclass(frozen=True)
class PACOptions:
    """SJD-PAC's knobs (lisa.decoding.generate.jacobi_generate builds the window from them)."""
    width: int = 3  # Proactive Drafting: siblings per node on the branching levels (the reference README's 3; paper: 4)
    depth: int = 3  # levels of the proactive tree, its root (the last emitted token) counted as in the reference:
    #                 the first depth - 1 draft levels branch, then one chain runs out to the window
    continuation: bool = True  # Adaptive Continuation: keep the untested drafts through maximal coupling


def sjd_pac(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """SJD-PAC (Kang et al., CVPR 2026) verified exactly: the proactive tree's siblings are drawn without replacement
    from the distribution in tree.q (the cached one of their position), so the walk is recursive rejection
    sampling level by level, taking the first sibling that passes (walk_sampled)."""
    verifier_options("sjd-pac", ctx.options)
    _needs_sampled("sjd-pac", ctx.tree)
    return walk_sampled(ctx, generator)


def scd_mc(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Speculative coupled decoding, maximal coupling (So et al., ICML 2026): verified as SJD; what differs is the
    re-drafting of the window (lisa.decoding.generate.couple), which keeps a draft whose distribution barely moved."""
    verifier_options("scd-mc", ctx.options)
    _needs_sampled("scd-mc", ctx.tree)
    return _jacobi_walk(ctx, generator)


def _jacobi_walk(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """A Jacobi window's exact walk: all levels at once on a chain of i.i.d. drafts (walk_chain), else level by
    level (walk_sampled)."""
    shape = ctx.tree.shape
    if ctx.tree.sampled == "iid" and shape is not None and all(len(lv.groups) == 1 and lv.width == 1
                                                                 for lv in shape.levels):
        return walk_chain(ctx, generator)
    return walk_sampled(ctx, generator)


def scd_gumbel(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Speculative coupled decoding, Gumbel coupling: every token of a position, drafted or emitted, is
    argmax(log dist + g) with one Gumbel noise g per position and code (ctx.noise), shared by every iteration. A
    draft is accepted iff it equals argmax(log p + g), the token the target itself would emit with that noise, and
    the correction / bonus token is that argmax: the output is vanilla sampling driven by g, exact by the
    Gumbel-max theorem (g of a position is independent of everything before it). With measure, the law of each
    emitted token over g is p itself: TV 0."""
    verifier_options("scd-gumbel", ctx.options)
    _needs_sampled("scd-gumbel", ctx.tree)
    if ctx.noise is None or ctx.noise.shape != ctx.p.shape:
        raise ValueError("scd-gumbel needs the Gumbel noise of every row (VerifyContext.noise, shaped like p)")
    B = ctx.p.shape[0]
    want = (ctx.p.log() + ctx.noise).argmax(-1)  # (B, N + 1): the target's token at each row's children position
    ar = torch.arange(B, device=ctx.p.device)

    def accept(r, tok, q_parent, row, ctx):
        return (tok == want[ar, row]).float(), r

    def emit(r, row, ctx):
        return torch.nn.functional.one_hot(want[ar, row], r.shape[-1]).to(r.dtype)

    v = walk(dataclasses.replace(ctx, measure=False), generator, accept, emit_fn=emit)
    if ctx.measure:
        levels = torch.arange(v.path.shape[1] + 1, device=ar.device)[None]
        v.tv = torch.where(levels <= v.n_accepted[:, None], 0.0, float("nan")).expand(B, -1).clone()
    return v


# ---------------------------------------------------------------------------------------------------------------
# The registry: one entry per verifier, saying what it needs besides the target's p and the drafts


VerifierFn = Callable[[VerifyContext, torch.Generator], Verdict]
GEOMETRY = ("codebook", "neighbours", "calibration")


class Verifier(NamedTuple):
    """A registry entry: the function, its knobs and what it needs besides the target's p and the drafts."""
    fn: VerifierFn
    options: type  # a frozen dataclass of the verifier's knobs; its defaults are the only defaults
    drafts: Literal["tree", "jacobi"]  # verifies a drafter's trees (needs a drafter), or drafter-free Jacobi windows
    # what it reads of the codebook geometry (VerifyContext.geometry): "codebook" (the code vectors), "neighbours"
    # (a table of each code's nearest codes, its option k wide), "calibration" (GASV's, its option k wide)
    reads: frozenset = frozenset()
    shown: tuple[str, ...] = ()  # the knobs (params.yaml keys) a results-table cell names, in order


def _entry(name: str) -> Verifier:
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; known: {sorted(VERIFIERS)}")
    return VERIFIERS[name]


def get_verifier(name: str) -> VerifierFn:
    return _entry(name).fn


def is_jacobi(name: str) -> bool:
    """Whether verifier `name` runs drafter-free on Jacobi windows (sjd, gsd) rather than on a drafter's trees."""
    return _entry(name).drafts == "jacobi"


def drafts_tree(name: str) -> bool:
    """Whether method `name` verifies a drafter's trees (and so needs a drafter and a SpecConfig): a verifier whose
    entry drafts "tree"; vanilla and the Jacobi verifiers do not."""
    return name != "vanilla" and _entry(name).drafts == "tree"


def reads(name: str) -> frozenset:
    """What verifier `name` reads of the codebook geometry (Verifier.reads); vanilla reads nothing."""
    return frozenset() if name == "vanilla" else _entry(name).reads


def needs(name: str) -> list[str]:
    """What method `name` needs besides the target, in words (the CLI's help): a drafter's trees or a Jacobi window,
    and the geometry it reads."""
    if name == "vanilla":
        return []
    e = _entry(name)
    words = {"codebook": "the codebook", "neighbours": "a neighbour table", "calibration": "a calibration"}
    return ["a drafter" if e.drafts == "tree" else "a Jacobi window"] + [words[r] for r in GEOMETRY if r in e.reads]


def verifier_options(name: str, options: Optional[Mapping[str, float]] = None):
    """The typed options of verifier `name` from a mapping of knobs (params.yaml's `options`); None = defaults.
    An unknown key, or a fractional value for an integer knob, is a ValueError naming the verifier and the key."""
    return typed_options(name, _entry(name).options, options)


def method_options(m):
    """The typed options of a params.yaml method (lisa.config.DecodeMethod) for its verifier; None for vanilla."""
    return None if m.method == "vanilla" else verifier_options(m.method, m.options)


VERIFIERS: dict[str, Verifier] = {
    "greedy": Verifier(greedy, NoOptions, "tree"),
    "exact": Verifier(exact, NoOptions, "tree"),
    "lantern": Verifier(lantern, LanternOptions, "tree", frozenset({"neighbours"}), ("k", "delta")),
    "sjd": Verifier(sjd, NoOptions, "jacobi"),
    "sjd-pac": Verifier(sjd_pac, PACOptions, "jacobi"),
    "scd-mc": Verifier(scd_mc, NoOptions, "jacobi"),
    "scd-gumbel": Verifier(scd_gumbel, NoOptions, "jacobi"),
    "gsd": Verifier(gsd, GSDOptions, "jacobi", frozenset({"codebook"})),
    "gasv": Verifier(gasv, GASVOptions, "tree", frozenset({"calibration"}), ("kappa", "lambda", "k")),
}
