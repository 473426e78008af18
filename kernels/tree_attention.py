"""Attention of a token tree's draft nodes: each node sees the whole context and its own
ancestors (and itself), never its siblings or their subtrees.

A drafted tree is verified in one forward by laying its nodes out after the context like a
chain; causal attention would then let a node see every earlier node, including other branches.
The tree is given by parent indices in topological order (``parents[i] < i``; -1 for a child of
the root, the last context token), the form the drafters emit, so the mask needs no other input.

- ``tree_mask``: the ``[n, n]`` ancestor-or-self mask, one Triton program per node walking its
  parent pointers.
- ``tree_attention``: one Triton program per (node, query head) with an online softmax over the
  context, then over the tree keys the mask lets it see. The mask is built once and read by
  every head, rather than walking parent pointers once per head.

The torch reference is the test oracle; vLLM-CPU's tree rows take ``tree_attention_torch``,
the same result from a head-major context without per-head copies (``tree_verification.py``). Triton is imported on first use, as in
``projection.py``.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Context or tree keys per loop iteration of the attention kernel.
BLOCK_L = 32


def _check_parents(parents: torch.Tensor) -> None:
    if parents.ndim != 1:
        raise ValueError(f"parents must be [n], got shape {tuple(parents.shape)}")
    if parents.dtype.is_floating_point or parents.dtype == torch.bool:
        raise ValueError(f"parents must hold integer indices, got {parents.dtype}")
    index = torch.arange(len(parents), device=parents.device)
    bad = (parents < -1) | (parents >= index)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"parents[{i}]={int(parents[i])}: a parent must precede its child "
                         "(topological order) and be -1 for a child of the root")


def tree_ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """bool ``[n, n]``: ``mask[i, j]`` iff node ``j`` is node ``i`` or one of its ancestors."""
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
    n = len(parents)
    if q.ndim != 3:
        raise ValueError(f"q must be [n, num_heads, head_dim], got shape {tuple(q.shape)}")
    num_heads, head_dim = q.shape[1:]
    for name, t in (("k_ctx", k_ctx), ("v_ctx", v_ctx), ("k_tree", k_tree), ("v_tree", v_tree)):
        if t.ndim != 3 or t.shape[2] != head_dim:
            raise ValueError(f"{name} must be [tokens, num_kv_heads, {head_dim}], "
                             f"got shape {tuple(t.shape)}")
        if t.shape[1] != k_ctx.shape[1]:
            raise ValueError(f"{name} has {t.shape[1]} kv heads, k_ctx has {k_ctx.shape[1]}")
        if t.dtype not in DTYPES or t.dtype != q.dtype:
            raise ValueError(f"{name} is {t.dtype}; all inputs must share q's dtype "
                             f"({q.dtype}), one of {DTYPES}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if q.shape[0] != n or k_tree.shape[0] != n or v_tree.shape[0] != n:
        raise ValueError(f"q, k_tree and v_tree need one row per node ({n}), got "
                         f"{q.shape[0]}, {k_tree.shape[0]}, {v_tree.shape[0]}")
    if k_ctx.shape[0] != v_ctx.shape[0]:
        raise ValueError(f"k_ctx has {k_ctx.shape[0]} tokens, v_ctx {v_ctx.shape[0]}")
    if num_heads % k_ctx.shape[1]:
        raise ValueError(f"{num_heads} query heads do not divide into {k_ctx.shape[1]} kv heads")


def tree_attention_reference(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                             k_tree: torch.Tensor, v_tree: torch.Tensor, parents: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Attention of ``n`` tree nodes, ``[n, num_heads, head_dim]`` in ``q``'s dtype.

    ``q`` ``[n, num_heads, head_dim]``; ``k_ctx``, ``v_ctx`` ``[L, num_kv_heads, head_dim]``:
    the tokens before the tree, all visible; ``k_tree``, ``v_tree`` ``[n, num_kv_heads,
    head_dim]``. Query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``. The
    softmax is computed in float32."""
    _check(q, k_ctx, v_ctx, k_tree, v_tree, parents)
    group = q.shape[1] // k_ctx.shape[1]
    keys = torch.cat([k_ctx, k_tree]).float().repeat_interleave(group, dim=1)
    values = torch.cat([v_ctx, v_tree]).float().repeat_interleave(group, dim=1)
    visible = torch.cat([torch.ones(len(parents), len(k_ctx), dtype=torch.bool,
                                    device=q.device), tree_ancestor_mask(parents)], dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), values).to(q.dtype)


def tree_attention_torch(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor,
                         k_tree: torch.Tensor, v_tree: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """:func:`tree_attention_reference`'s result, fast on CPU: the path vLLM-CPU's tree rows
    take every layer of every step (``tree_verification``).

    The context comes head-major, as gathered from a paged KV cache: ``keys_t`` ``[num_kv_heads,
    head_dim, L]``, ``values`` ``[num_kv_heads, L, head_dim]``; ``mask`` is
    ``tree_ancestor_mask(parents)``, built once per step rather than per layer. The query heads
    sharing a kv head are batched into one matrix product instead of copying the context once
    per query head (the reference's way): 2-10x faster at 300-800 context tokens."""
    n, num_heads, head_dim = q.shape
    num_kv_heads, _, context = keys_t.shape
    group = num_heads // num_kv_heads
    queries = (q.float() * scale).reshape(n, num_kv_heads, group, head_dim)
    queries = queries.permute(1, 0, 2, 3).reshape(num_kv_heads, n * group, head_dim)
    tree_scores = torch.bmm(queries, k_tree.float().permute(1, 2, 0))
    visible = mask.repeat_interleave(group, dim=0)
    tree_scores = tree_scores.masked_fill(~visible, float("-inf"))
    weights = torch.cat([torch.bmm(queries, keys_t.float()), tree_scores], dim=2).softmax(dim=2)
    out = torch.bmm(weights[:, :, :context], values.float()) + torch.bmm(
        weights[:, :, context:], v_tree.float().transpose(0, 1))
    return out.reshape(num_kv_heads, n, group, head_dim).permute(1, 0, 2, 3).reshape(
        n, num_heads, head_dim).to(q.dtype)


@functools.cache
def _kernels() -> tuple[Any, Any]:
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
    def attention_kernel(
        q_ptr, kc_ptr, vc_ptr, kt_ptr, vt_ptr, mask_ptr, out_ptr,
        L, N, HEAD_DIM, scale,
        stride_qn, stride_qh, stride_kcl, stride_kch, stride_vcl, stride_vch,
        stride_ktn, stride_kth, stride_vtn, stride_vth, stride_m, stride_on, stride_oh,
        GROUP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
    ):
        i = tl.program_id(0)
        h = tl.program_id(1)
        kv = h // GROUP
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + i * stride_qn + h * stride_qh + d, mask=d_ok,
                    other=0.0).to(tl.float32) * scale
        # Running max, normaliser and weighted sum of the online softmax.
        m = tl.max(tl.full([BLOCK_L], float("-inf"), tl.float32), axis=0)
        total = tl.sum(tl.zeros([BLOCK_L], tl.float32), axis=0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        # The context (all visible), then the tree (ancestors and self only): one pass each.
        for part in range(2):
            count = L if part == 0 else N
            for start in range(0, count, BLOCK_L):
                rows = start + tl.arange(0, BLOCK_L)
                ok = rows < count
                if part == 0:
                    k_ptrs = kc_ptr + rows[:, None] * stride_kcl + kv * stride_kch + d[None, :]
                    v_ptrs = vc_ptr + rows[:, None] * stride_vcl + kv * stride_vch + d[None, :]
                else:
                    ok = ok & (tl.load(mask_ptr + i * stride_m + rows, mask=ok, other=0) != 0)
                    k_ptrs = kt_ptr + rows[:, None] * stride_ktn + kv * stride_kth + d[None, :]
                    v_ptrs = vt_ptr + rows[:, None] * stride_vtn + kv * stride_vth + d[None, :]
                both = ok[:, None] & d_ok[None, :]
                k = tl.load(k_ptrs, mask=both, other=0.0).to(tl.float32)
                s = tl.where(ok, tl.sum(k * q[None, :], axis=1), float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=0))
                # A block with nothing visible leaves the state as it was (and no NaN from
                # -inf - -inf while nothing has been seen yet).
                alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
                p = tl.where(ok, tl.exp(s - m_new), 0.0)
                v = tl.load(v_ptrs, mask=both, other=0.0).to(tl.float32)
                total = total * alpha + tl.sum(p, axis=0)
                acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
                m = m_new
        out = acc / total
        tl.store(out_ptr + i * stride_on + h * stride_oh + d,
                 out.to(out_ptr.dtype.element_ty), mask=d_ok)

    return mask_kernel, attention_kernel


def tree_mask_triton(parents: torch.Tensor) -> torch.Tensor:
    """:func:`tree_ancestor_mask` by the Triton kernel."""
    _check_parents(parents)
    n = len(parents)
    mask = torch.zeros((n, n), dtype=torch.int8, device=parents.device)
    if n:
        _kernels()[0][(n,)](parents.to(torch.int32).contiguous(), mask, mask.stride(0))
    return mask.bool()


def tree_attention_triton(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                          k_tree: torch.Tensor, v_tree: torch.Tensor, parents: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """The Triton kernel; same contract as :func:`tree_attention_reference`."""
    _check(q, k_ctx, v_ctx, k_tree, v_tree, parents)
    import triton

    n, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if n == 0:
        return out
    mask = tree_mask_triton(parents).to(torch.int8)
    # The kernel reads the head dimension with unit stride.
    q, k_ctx, v_ctx, k_tree, v_tree = (t if t.stride(2) == 1 else t.contiguous()
                                       for t in (q, k_ctx, v_ctx, k_tree, v_tree))
    _kernels()[1][(n, num_heads)](
        q, k_ctx, v_ctx, k_tree, v_tree, mask, out,
        len(k_ctx), n, head_dim, scale,
        q.stride(0), q.stride(1), k_ctx.stride(0), k_ctx.stride(1), v_ctx.stride(0),
        v_ctx.stride(1), k_tree.stride(0), k_tree.stride(1), v_tree.stride(0), v_tree.stride(1),
        mask.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // k_ctx.shape[1], BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_L=BLOCK_L,
    )
    return out


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """The Triton kernel for CUDA tensors when Triton is installed, else the torch reference."""
    if parents.is_cuda and _have_triton():
        return tree_mask_triton(parents)
    return tree_ancestor_mask(parents)


def tree_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   k_tree: torch.Tensor, v_tree: torch.Tensor, parents: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """The Triton kernel for CUDA tensors when Triton is installed, else the torch reference."""
    if q.is_cuda and _have_triton():
        return tree_attention_triton(q, k_ctx, v_ctx, k_tree, v_tree, parents, scale)
    return tree_attention_reference(q, k_ctx, v_ctx, k_tree, v_tree, parents, scale)
