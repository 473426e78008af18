"""DReSD's query projection: z-normalise, project onto PCA components, L2-normalise.

``y = ((x - mean) * inv_std) @ components``, then each row of ``y`` is scaled to unit norm, so a
dot product with the (equally projected) datastore keys is a cosine similarity.

On GPU this runs as one fused Triton kernel: the hidden states are read from memory once, in
their own dtype, and the normalised ``[B, H]`` copy is never written out. The query path runs
every decoding step on a small batch, so it is bound by memory traffic and kernel launches, not
arithmetic; and a step's few rows would leave all but one multiprocessor idle, so a large hidden
dimension is split across programs, whose ``[B, d]`` partial sums a second kernel adds up and
normalises. The torch reference serves CPU and is the test oracle.

Triton is imported, and the kernel built, on first use: the plugin is imported in every vLLM
process, including CPU-only ones without Triton. (``TRITON_INTERPRET=1`` runs the kernel on CPU,
but Triton reads it when it is first imported; see tests/test_kernels.py.)
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .launch import have_triton, interpreting, multiprocessors

EPS = 1e-12
HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# tl.dot needs every tile dimension >= 16. A decoding step's batch is small, so its rows fit one
# 16-row block and the hidden dimension is split across programs instead (below); large
# batches (a datastore build) take 64-row blocks, reading the components a quarter as often.
BLOCK_B = 16
BLOCK_B_LARGE = 64
BLOCK_H = 64
#: The hidden dimension is split only from this size on, into slices of at least MIN_SPLIT_H:
#: the second kernel's launch costs more than one program's pass over 576 units (H200, batch
#: 1: 11 us unsplit, 21-26 us split), while 4096 units took 50 us unsplit, 24 us in 16 slices
#: (benchmarks/results/kernels-h200-sweep.md).
MIN_SPLIT_HIDDEN = 1024
MIN_SPLIT_H = 256
#: Projected dims per program at most. Each program keeps BLOCK_H x BLOCK_D float32 tiles of
#: the components in flight in shared memory, which an H100 has 227 KiB of: 512 dims would need
#: over 260 KiB (256: 133 KiB; 64-row blocks need 273 KiB at 256 dims, so take 128 at most). The
#: PCA may keep any number of dims up to the hidden size: wider ones are tiled across programs,
#: whose sums the second kernel normalises, as for a split hidden dimension.
MAX_BLOCK_D = 256
MAX_BLOCK_D_LARGE = 128


def project_reference(
    hidden: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor, components: torch.Tensor
) -> torch.Tensor:
    """float32 ``[B, d]`` unit rows from ``hidden`` ``[B, H]``; the statistics are float32."""
    projected = ((hidden.float() - mean) * inv_std) @ components
    return projected / projected.norm(dim=1, keepdim=True).clamp_min(EPS)


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def project_kernel(
        x_ptr, mean_ptr, inv_std_ptr, comp_ptr, out_ptr, partial_ptr,
        B, H, D, CHUNK_H, WIDTH,
        stride_xb, stride_xh, stride_ch, stride_cd, stride_ob,
        EPS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # Program (i, s, t) projects row block i over hidden units [s * CHUNK_H, (s + 1) *
        # CHUNK_H) onto tile t of the projected dims, [t * BLOCK_D, (t + 1) * BLOCK_D).
        split = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        row_ok = rows < B
        col_ok = cols < D
        both = row_ok[:, None] & col_ok[None, :]
        acc = tl.zeros((BLOCK_B, BLOCK_D), dtype=tl.float32)
        for h0 in range(split * CHUNK_H, tl.minimum(split * CHUNK_H + CHUNK_H, H), BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            h_ok = hs < H
            # Masked lanes load zero components, so a ragged H and a padded d add nothing.
            x = tl.load(x_ptr + rows[:, None] * stride_xb + hs[None, :] * stride_xh,
                        mask=row_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
            mu = tl.load(mean_ptr + hs, mask=h_ok, other=0.0)
            scale = tl.load(inv_std_ptr + hs, mask=h_ok, other=0.0)
            comp = tl.load(comp_ptr + hs[:, None] * stride_ch + cols[None, :] * stride_cd,
                           mask=h_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot((x - mu[None, :]) * scale[None, :], comp, acc,
                         input_precision=PRECISION)
        if SPLIT:
            # Partial sums [splits, B, WIDTH], each program's of its tile of dims;
            # normalise_kernel adds them up.
            tl.store(partial_ptr + (split * B + rows[:, None]) * WIDTH + cols[None, :], acc,
                     mask=both)
        else:
            norm = tl.sqrt(tl.sum(acc * acc, axis=1))
            acc = acc / tl.maximum(norm, EPS)[:, None]
            tl.store(out_ptr + rows[:, None] * stride_ob + cols[None, :], acc, mask=both)

    @triton.jit
    def normalise_kernel(partial_ptr, out_ptr, B, D, WIDTH, SPLITS, stride_ob,
                         EPS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
        # BLOCK_D covers every projected dim: no dot here, so the row needs no shared memory.
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        cols = tl.arange(0, BLOCK_D)
        both = (rows < B)[:, None] & (cols < D)[None, :]
        acc = tl.zeros((BLOCK_B, BLOCK_D), dtype=tl.float32)
        for split in range(0, SPLITS):
            acc += tl.load(partial_ptr + (split * B + rows[:, None]) * WIDTH + cols[None, :],
                           mask=both, other=0.0)
        norm = tl.sqrt(tl.sum(acc * acc, axis=1))
        acc = acc / tl.maximum(norm, EPS)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ob + cols[None, :], acc, mask=both)

    return project_kernel, normalise_kernel


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
    hidden: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor, components: torch.Tensor,
    splits: int | None = None,
) -> torch.Tensor:
    """The fused kernel; same contract as :func:`project_reference`.

    ``splits``: programs per row block (and tile of MAX_BLOCK_D dims), each over a slice of the
    hidden dimension, whose partial sums a second kernel adds up and normalises. By default one
    below MIN_SPLIT_HIDDEN, else as many as give the GPU's multiprocessors two programs each at
    most, in slices of at least MIN_SPLIT_H (one for a CPU under the interpreter)."""
    _check(hidden, mean, inv_std, components)
    import triton

    b, h = hidden.shape
    d = components.shape[1]
    # The kernel indexes mean and inv_std with unit stride.
    mean, inv_std = mean.contiguous(), inv_std.contiguous()
    out = torch.empty((b, d), dtype=torch.float32, device=hidden.device)
    if b == 0:
        return out
    full_d = max(16, triton.next_power_of_2(d))
    block_b = BLOCK_B_LARGE if b >= BLOCK_B_LARGE * 2 * multiprocessors(hidden.device) \
        and full_d <= MAX_BLOCK_D_LARGE else BLOCK_B
    block_d = min(full_d, MAX_BLOCK_D)
    d_tiles = triton.cdiv(d, block_d)
    row_blocks = triton.cdiv(b, block_b)
    h_blocks = triton.cdiv(h, BLOCK_H)
    if splits is None:
        splits = 1 if h < MIN_SPLIT_HIDDEN else min(
            max(1, 2 * multiprocessors(hidden.device) // row_blocks), triton.cdiv(h, MIN_SPLIT_H))
    # Whole BLOCK_H tiles per split, and no split left without one.
    chunk_h = triton.cdiv(h_blocks, max(1, min(splits, h_blocks))) * BLOCK_H
    splits = triton.cdiv(h, chunk_h)
    split = splits > 1 or d_tiles > 1
    width = d_tiles * block_d
    partial = torch.empty((splits, b, width) if split else (0,), dtype=torch.float32,
                          device=hidden.device)
    project_kernel, normalise_kernel = _kernels()
    project_kernel[(row_blocks, splits, d_tiles)](
        hidden, mean, inv_std, components, out, partial,
        b, h, d, chunk_h, width,
        hidden.stride(0), hidden.stride(1), components.stride(0), components.stride(1),
        out.stride(0),
        EPS=EPS, BLOCK_B=block_b, BLOCK_H=BLOCK_H, BLOCK_D=block_d, SPLIT=split,
        PRECISION=_precision(),
    )
    if split:
        normalise_kernel[(row_blocks,)](partial, out, b, d, width, splits, out.stride(0),
                                        EPS=EPS, BLOCK_B=block_b, BLOCK_D=full_d)
    return out


def _precision() -> str:
    """Full fp32 products, not TF32's (10-bit mantissa): queries stay close to the reference's
    (used on CPU). On a GPU, three TF32 products per tile ("tf32x3") give that on the tensor
    cores; the interpreter multiplies in fp32 itself ("ieee")."""
    return "ieee" if interpreting() else "tf32x3"


def project(
    hidden: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor, components: torch.Tensor
) -> torch.Tensor:
    """The fused kernel for CUDA tensors when Triton is installed, else the torch reference."""
    if hidden.is_cuda and have_triton():
        return project_triton(hidden, mean, inv_std, components)
    return project_reference(hidden, mean, inv_std, components)
