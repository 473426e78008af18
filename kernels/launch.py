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


def interpret_requested() -> bool:
    """``TRITON_INTERPRET`` is set: Triton runs kernels on CPU tensors in its interpreter if the
    variable was set when Triton was first imported."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "off", "no")


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors; 1 elsewhere (the interpreter runs one program at a
    time)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
