"""The decode loops' pure bookkeeping steps under torch.compile when a loop runs with compile=True: a step that
takes tensors and returns tensors, draws no random numbers and makes no host sync (the draws stay in the loop,
passed in), so that its dozens of small element-wise ops over the vocabulary become one or two fused kernels, as
gpt-fast compiles its sampling with its decode step. Eager loops call the plain functions."""
from __future__ import annotations

from typing import Callable

import torch

_FUSED: dict[Callable, Callable] = {}


def fused(fn: Callable, on: bool) -> Callable:
    """fn under torch.compile (inductor, dynamic=False: one graph per input shape), made once per function and
    reused by every call, when `on`; fn itself otherwise. Module-level functions only (the cache is keyed on them)."""
    if not on:
        return fn
    if fn not in _FUSED:
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _FUSED[fn] = torch.compile(fn, dynamic=False)
    return _FUSED[fn]
