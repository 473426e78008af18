"""DReSD's query projection: z-normalise, project onto PCA components, L2-normalise.

``y = ((x - mean) * inv_std) @ components``, then each row of ``y`` is scaled to unit norm, so a
dot product with the (equally projected) datastore keys is a cosine similarity.

On GPU this runs as one fused Triton kernel: the hidden states are read from memory once, in
their own dtype, and neither the normalised ``[B, H]`` copy nor the unnormalised ``[B, d]``
projection is written out. The query path runs every decoding step on a small batch, so it is
bound by memory traffic and kernel launches, not arithmetic. The torch reference serves CPU and
is the test oracle.

Triton is imported, and the kernel built, on first use: the plugin is imported in every vLLM
process, including CPU-only ones without Triton. (``TRITON_INTERPRET=1`` runs the kernel on CPU,
but Triton reads it when it is first imported; see tests/test_kernels.py.)
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

EPS = 1e-12
HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# tl.dot needs every tile dimension >= 16. Decoding batches are small: a taller row block would
# mostly be masked padding, while larger batches simply get more programs.
BLOCK_B = 16
BLOCK_H = 64


def project_reference(
    hidden: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor, components: torch.Tensor
) -> torch.Tensor:
    """float32 ``[B, d]`` unit rows from ``hidden`` ``[B, H]``; the statistics are float32."""
    projected = ((hidden.float() - mean) * inv_std) @ components
    return projected / projected.norm(dim=1, keepdim=True).clamp_min(EPS)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def project_kernel(
        x_ptr, mean_ptr, inv_std_ptr, comp_ptr, out_ptr,
        B, H, D,
        stride_xb, stride_xh, stride_ch, stride_cd, stride_ob,
        EPS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        cols = tl.arange(0, BLOCK_D)
        row_ok = rows < B
        col_ok = cols < D
        acc = tl.zeros((BLOCK_B, BLOCK_D), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            h_ok = hs < H
            # Masked lanes load zero components, so a ragged H and a padded d add nothing.
            x = tl.load(x_ptr + rows[:, None] * stride_xb + hs[None, :] * stride_xh,
                        mask=row_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
            mu = tl.load(mean_ptr + hs, mask=h_ok, other=0.0)
            scale = tl.load(inv_std_ptr + hs, mask=h_ok, other=0.0)
            comp = tl.load(comp_ptr + hs[:, None] * stride_ch + cols[None, :] * stride_cd,
                           mask=h_ok[:, None] & col_ok[None, :], other=0.0)
            # Full fp32, not the default TF32 (10-bit mantissa): the kernel is memory-bound, so it
            # costs little, and queries stay close to the reference's (used on CPU).
            acc = tl.dot((x - mu[None, :]) * scale[None, :], comp, acc, input_precision="ieee")
        norm = tl.sqrt(tl.sum(acc * acc, axis=1))
        acc = acc / tl.maximum(norm, EPS)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ob + cols[None, :], acc,
                 mask=row_ok[:, None] & col_ok[None, :])

    return project_kernel


def _check(
    hidden: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor, components: torch.Tensor
) -> None:
    if hidden.ndim != 2:
        raise ValueError(f"hidden must be [B, H], got shape {tuple(hidden.shape)}")
    if hidden.dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden dtype must be one of {HIDDEN_DTYPES}, got {hidden.dtype}")
    if components.ndim != 2:
        raise ValueError(f"components must be [H, d], got shape {tuple(components.shape)}")
    h = hidden.shape[1]
    for name, t in (("mean", mean), ("inv_std", inv_std)):
        if t.shape != (h,):
            raise ValueError(f"{name} must be [H] = [{h}], got shape {tuple(t.shape)}")
    if components.shape[0] != h:
        raise ValueError(f"components must be [H, d] with H = {h}, "
                         f"got shape {tuple(components.shape)}")
    for name, t in (("mean", mean), ("inv_std", inv_std), ("components", components)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")


def project_triton(
    hidden: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor, components: torch.Tensor
) -> torch.Tensor:
    """The fused kernel; same contract as :func:`project_reference`."""
    _check(hidden, mean, inv_std, components)
    import triton

    b, h = hidden.shape
    d = components.shape[1]
    # The kernel indexes mean and inv_std with unit stride.
    mean, inv_std = mean.contiguous(), inv_std.contiguous()
    out = torch.empty((b, d), dtype=torch.float32, device=hidden.device)
    _kernel()[(triton.cdiv(b, BLOCK_B),)](
        hidden, mean, inv_std, components, out,
        b, h, d,
        hidden.stride(0), hidden.stride(1), components.stride(0), components.stride(1),
        out.stride(0),
        EPS=EPS, BLOCK_B=BLOCK_B, BLOCK_H=BLOCK_H,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
    )
    return out


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def project(
    hidden: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor, components: torch.Tensor
) -> torch.Tensor:
    """The fused kernel for CUDA tensors when Triton is installed, else the torch reference."""
    if hidden.is_cuda and _have_triton():
        return project_triton(hidden, mean, inv_std, components)
    return project_reference(hidden, mean, inv_std, components)
