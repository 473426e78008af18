"""The fused projection kernel, run by Triton's interpreter on CPU, against the torch reference.

Triton chooses interpreter mode for all of ``triton.language`` when it is first imported (its own
helpers such as ``tl.zeros`` are ``@triton.jit`` functions), not per kernel. In a pytest run
that already imported vLLM, and with it Triton, setting ``TRITON_INTERPRET`` is too late; and
setting it before would leave this process's Triton interpreted for every later test. So the
kernel runs in one fresh process with ``TRITON_INTERPRET=1``: this file run as a script, which
projects every case and saves the outputs for the tests here to compare.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from helpers import run_interpreted
from vllm_retrieval_spec.kernels import projection
from vllm_retrieval_spec.kernels.projection import project, project_reference, project_triton

# Both paths upcast the input exactly and compute in float32, so the input dtype does not change
# the error: it is float32 rounding in a different summation order (measured at most 4e-7).
ATOL = 1e-5

SHAPES = [  # (B, H, d): row blocks with a partial last one; H one block, several, ragged; d padded
    (1, 64, 16),
    (3, 576, 64),
    (17, 1000, 48),
    (64, 576, 48),
    (64, 1000, 64),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(b: int, h: int, d: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    # Offset and scaled like real hidden states, so the z-normalisation matters.
    hidden = (torch.randn(b, h, generator=g) * 3 + 1).to(dtype)
    mean = torch.randn(h, generator=g)
    inv_std = torch.rand(h, generator=g) + 0.5
    components = torch.randn(h, d, generator=g) / h**0.5
    return hidden, mean, inv_std, components


def _strided() -> tuple[torch.Tensor, ...]:
    # Hidden states may be a view of a larger buffer; stored components may be transposed.
    hidden, mean, inv_std, components = _inputs(5, 576, 64)
    wide = torch.cat([hidden, hidden], dim=1)[:, ::2]
    return wide, mean, inv_std, components.t().contiguous().t()


def _zero_row(h: int = 64) -> tuple[torch.Tensor, ...]:
    hidden, mean, inv_std, components = _inputs(2, h, 16)
    hidden[0] = mean  # z-normalises to zero: eps must keep the row at zero, not NaN
    return hidden, mean, inv_std, components


SHAPE_CASES = {
    f"B{b}-H{h}-d{d}-{dtype}": functools.partial(_inputs, b, h, d, dtype)
    for b, h, d in SHAPES
    for dtype in DTYPES
}
CASES = {
    **SHAPE_CASES,
    "strided": _strided,
    "zero-row": _zero_row,
    "empty": functools.partial(_inputs, 0, 64, 16),
    # 130 rows >= 2 x 64 x one "multiprocessor": 64-row blocks, a partial last one.
    "large-blocks-B130-H100-d64": functools.partial(_inputs, 130, 100, 64),
    # More dims than one program's tile (MAX_BLOCK_D, set by an H100's shared memory): tiles of
    # dims across programs, normalised by the second kernel; 256 dims: 16-row blocks.
    "wide-B17-H100-d300": functools.partial(_inputs, 17, 100, 300),
    "wide-B130-H100-d256": functools.partial(_inputs, 130, 100, 256),
}
# The hidden dimension split across programs, as a GPU splits it for small batches (the
# interpreter's one "multiprocessor" never asks for it): (inputs, splits asked for).
SPLIT_CASES = {
    "split3-B3-H1000-d48": (functools.partial(_inputs, 3, 1000, 48), 3),
    "split3-B130-H1000-d64": (functools.partial(_inputs, 130, 1000, 64), 3),
    "split50-B5-H200-d16": (functools.partial(_inputs, 5, 200, 16), 50),  # 4: one per tile
    "split3-zero-row": (functools.partial(_zero_row, 300), 4),  # 3 splits of 2 tiles
    "split3-B3-H1000-d600": (functools.partial(_inputs, 3, 1000, 600), 3),  # 3 tiles of dims
}


def _project_cases_interpreted(path: str) -> None:
    """The script's work, in a process started with TRITON_INTERPRET=1."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    # Outputs start as torch.empty, so matching the reference also shows the kernel ran.
    kernels = (tl.zeros, *projection._kernels())
    torch.save({
        "interpreted": [isinstance(f, InterpretedFunction) for f in kernels],
        "outputs": {**{name: project_triton(*make()) for name, make in CASES.items()},
                    **{name: project_triton(*make(), splits=splits)
                       for name, (make, splits) in SPLIT_CASES.items()}},
    }, path)


@pytest.fixture(scope="module")
def triton_outputs(tmp_path_factory) -> dict[str, torch.Tensor]:
    return run_interpreted(__file__, tmp_path_factory.mktemp("kernels"))["outputs"]


@pytest.mark.parametrize("name", [*CASES, *SPLIT_CASES])
def test_triton_matches_reference(triton_outputs, name):
    make = CASES[name] if name in CASES else SPLIT_CASES[name][0]
    expected = project_reference(*make())
    out = triton_outputs[name]
    assert out.dtype == torch.float32 and out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", SHAPE_CASES)
def test_triton_rows_have_unit_norm(triton_outputs, name):
    out = triton_outputs[name]
    torch.testing.assert_close(out.norm(dim=1), torch.ones(len(out)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["zero-row", "split3-zero-row"])
def test_triton_keeps_a_zero_projection_at_zero(triton_outputs, name):
    assert torch.equal(triton_outputs[name][0], torch.zeros(16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_project_on_cpu_is_the_normalised_pca_of_the_zscored_states(dtype):
    import numpy as np

    hidden, mean, inv_std, components = _inputs(3, 64, 16, dtype)
    x = hidden.float().numpy().astype(np.float64)
    y = ((x - mean.numpy()) * inv_std.numpy()) @ components.numpy().astype(np.float64)
    expected = y / np.linalg.norm(y, axis=1, keepdims=True)
    out = project(hidden, mean, inv_std, components)
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "hidden": a["hidden"][0]}, r"hidden must be \[B, H\]"),
        (lambda a: {**a, "hidden": a["hidden"].double()}, "hidden dtype must be one of"),
        (lambda a: {**a, "hidden": a["hidden"].int()}, "hidden dtype must be one of"),
        (lambda a: {**a, "hidden": a["hidden"][:, :32]}, r"mean must be \[H\] = \[32\]"),
        (lambda a: {**a, "inv_std": a["inv_std"][:32]}, r"inv_std must be \[H\] = \[64\]"),
        (lambda a: {**a, "mean": a["mean"][None]}, r"mean must be \[H\]"),
        (lambda a: {**a, "components": a["components"][:32]}, "components must be .* H = 64"),
        (lambda a: {**a, "components": a["components"][0]}, r"components must be \[H, d\]"),
        (lambda a: {**a, "components": a["components"].half()}, "components must be float32"),
        (lambda a: {**a, "mean": a["mean"].double()}, "mean must be float32"),
        (lambda a: {**a, "mean": a["mean"].to("meta")}, "mean is on meta but hidden is on cpu"),
    ],
)
def test_triton_rejects_bad_inputs(change, message):
    args = dict(zip(("hidden", "mean", "inv_std", "components"), _inputs(3, 64, 16)))
    with pytest.raises(ValueError, match=message):
        project_triton(**change(args))


if __name__ == "__main__":
    _project_cases_interpreted(sys.argv[1])
