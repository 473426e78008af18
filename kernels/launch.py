"""What the kernels' launchers ask of the platform: whether Triton is there, whether it runs
interpreted, and how many programs fill the GPU."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter: ``TRITON_INTERPRET`` was set when Triton
    was first imported (it then interprets ``triton.language`` itself). Triton is not imported
    unless the variable is set."""
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("", "0", "false", "off", "no") \
            or not have_triton():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors; 1 elsewhere (the interpreter runs one program at a
    time)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def context_split(programs: int, context: int, block_l: int, sms: int, min_split_tokens: int,
                  splits: int | None = None) -> tuple[int, int]:
    """How a tree-attention kernel splits a context of ``context`` keys (flash decoding) among
    ``programs`` programs per split: ``(splits, chunk)``, ``chunk`` whole ``block_l``-key tiles
    per split and no split without one. ``splits`` asks for a number; by default as many as
    give the ``sms`` multiprocessors two programs each at most (a third, partial wave would cost
    a whole program's time: on an H200, 64 nodes of Llama-3-8B at 32k took 185 us in 9 splits,
    124 in 8), with at least ``min_split_tokens`` keys apiece."""
    if splits is None:
        splits = min(max(1, 2 * sms // max(1, programs)), -(-context // min_split_tokens))
    tiles = -(-context // block_l)
    chunk = max(1, -(-tiles // max(1, min(splits, tiles)))) * block_l
    return max(1, -(-context // chunk)), chunk
