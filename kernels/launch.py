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
