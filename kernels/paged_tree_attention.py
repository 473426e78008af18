"""Attention of token trees' draft nodes over vLLM's paged KV cache on a GPU: one step's trees,
every request's at once, in one launch per layer.

``tree_attention.py`` attends one tree over a contiguous context. Inside vLLM the context lies
in the paged cache (FLASH_ATTN's and TRITON_ATTN's layout: ``kv_cache.transpose(1, 2)``
split into keys and values, ``[num_blocks, block_size, num_kv_heads, head_dim]`` each) and is
found through each request's row of the block table; the nodes are rows of the step's flattened
``query``/``key``/``value``, and their outputs go to the same rows of the backend's ``output``.
The kernel reads and writes them there, so a step's layers need no gather, scatter or host
read: ``PagedTrees`` (the rows, lengths and masks) is built once per step and read by every
layer. It is the same flash attention as ``tree_attention.py``'s (its online-softmax step), with
the context's key tiles loaded through the block table; a program takes one tree's (node, query
head) rows of one kv head and one split of its context.

``paged_tree_attention_reference`` is the oracle (torch, any device).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import tree_attention
from .launch import context_split, have_triton, interpreting, multiprocessors

_softmax_step: Any = None  # tree_attention's Triton function, bound by _kernels()


@dataclass(frozen=True)
class PagedTrees:
    """One step's trees, as device tensors that every layer reads."""
    node_start: torch.Tensor   # int32 [B]: the step's row of each tree's node 0
    first: torch.Tensor        # int32 [B]: first node computed (earlier ones: a leading chain)
    count: torch.Tensor        # int32 [B]: nodes
    context_len: torch.Tensor  # int32 [B]: cached tokens before node 0, the root included
    table_row: torch.Tensor    # int32 [B]: the tree's row of the block table
    mask: torch.Tensor         # int8 [B, max_nodes, max_nodes]: ancestor-or-self
    max_nodes: int
    max_context: int
    #: The most nodes a tree computes (count - first): the kernel's programs cover these.
    max_rows: int
    #: Trees: every layer's launch reads it, and a tensor's length costs the host more.
    num_trees: int

    def __len__(self) -> int:
        return self.num_trees


class PagedTreeBuffers:
    """Persistent buffers a step's ``PagedTrees`` are built into: the metadata goes to the
    device in one copy from pinned host memory, and the masks are built there by the mask
    kernel, so a step allocates nothing once the buffers have grown to its size."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.host = torch.empty(0, dtype=torch.int32)
        self.meta = torch.empty(0, dtype=torch.int32, device=self.device)
        self.masks = torch.empty(0, dtype=torch.int8, device=self.device)
        #: Recorded after each copy from ``host``: the next step waits for it before writing
        #: ``host`` again, as the GPU may not have read it yet.
        self.copied = torch.cuda.Event() if self.device.type == "cuda" else None

    def load(self, parents: Sequence[Sequence[int]], node_start: Sequence[int],
             first: Sequence[int], context_len: Sequence[int],
             table_row: Sequence[int]) -> PagedTrees:
        """``parents[b][i]``: the parent of tree ``b``'s node ``i`` (-1: the root), in
        topological order. The other arguments are ``PagedTrees``' fields, per tree."""
        trees = len(parents)
        counts = [len(p) for p in parents]
        max_nodes = max(counts, default=0)
        for b, p in enumerate(parents):
            tree_attention._check_parents(torch.as_tensor(p, dtype=torch.int64))
            if not 0 <= first[b] <= counts[b]:
                raise ValueError(f"tree {b}: first={first[b]} is not a node index "
                                 f"of its {counts[b]} nodes")
        fields = 5 * trees
        size = fields + trees * max_nodes
        if self.host.numel() < size:
            pin = self.device.type == "cuda"
            self.host = torch.empty(size, dtype=torch.int32, pin_memory=pin)
            self.meta = torch.empty(size, dtype=torch.int32, device=self.device)
        if self.copied is not None:
            self.copied.synchronize()
        host = self.host[:size]
        host[:fields] = torch.tensor([*node_start, *first, *counts, *context_len, *table_row],
                                     dtype=torch.int32)
        table = host[fields:].view(trees, max_nodes)
        table.fill_(-1)
        for b, p in enumerate(parents):
            table[b, :len(p)] = torch.as_tensor(p, dtype=torch.int32)
        meta = self.meta[:size]
        meta.copy_(host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if self.masks.numel() < trees * max_nodes * max_nodes:
            self.masks = torch.empty(trees * max_nodes * max_nodes, dtype=torch.int8,
                                     device=self.device)
        masks = self.masks[:trees * max_nodes * max_nodes].view(trees, max_nodes, max_nodes)
        columns = meta[:fields].view(5, trees)
        _build_masks(meta[fields:].view(trees, max_nodes), columns[2], masks, table, counts)
        return PagedTrees(*columns, masks, max_nodes, max(context_len, default=0),
                          max((c - f for c, f in zip(counts, first)), default=0), trees)


def paged_trees(parents: Sequence[Sequence[int]], node_start: Sequence[int],
                first: Sequence[int], context_len: Sequence[int], table_row: Sequence[int],
                device: torch.device | str) -> PagedTrees:
    """``PagedTreeBuffers(device).load(...)``: one step's trees in fresh buffers."""
    return PagedTreeBuffers(device).load(parents, node_start, first, context_len, table_row)


def _build_masks(parents: torch.Tensor, device_counts: torch.Tensor, masks: torch.Tensor,
                 host_parents: torch.Tensor, counts: list[int]) -> None:
    """Each tree's ancestor mask into ``masks``: by the Triton kernel on the device from
    ``parents`` and ``device_counts``, or in torch from their host copies."""
    masks.zero_()
    trees, max_nodes = parents.shape
    if not trees or not max_nodes:
        return
    if _use_triton(masks):
        _kernels()[0][(max_nodes, trees)](parents, device_counts, masks, max_nodes)
        return
    for b, row in enumerate(host_parents):
        n = counts[b]
        masks[b, :n, :n] = tree_attention.tree_ancestor_mask(row[:n].long()).to(masks.device)


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
           trees: PagedTrees) -> None:
    """Shapes, dtypes and devices only: nothing that reads a GPU tensor's values."""
    if query.ndim != 3:
        raise ValueError(f"query must be [tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if query.dtype not in tree_attention.DTYPES:
        raise ValueError(f"query dtype must be one of {tree_attention.DTYPES}, got {query.dtype}")
    tokens, num_heads, head_dim = query.shape
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.ndim != 4 or t.shape[3] != head_dim:
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, {head_dim}]"
                             f", got {tuple(t.shape)}")
        if t.shape != key_cache.shape:
            raise ValueError(f"value_cache {tuple(value_cache.shape)} and key_cache "
                             f"{tuple(key_cache.shape)} differ")
    num_kv_heads = key_cache.shape[2]
    for name, t in (("key", key), ("value", value)):
        if t.shape != (tokens, num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [{tokens}, {num_kv_heads}, {head_dim}] like query "
                             f"and the cache, got {tuple(t.shape)}")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        if t.dtype != query.dtype:
            raise ValueError(f"{name} is {t.dtype}; all inputs must share query's dtype "
                             f"({query.dtype})")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("block_table", block_table),
                    ("trees.mask", trees.mask)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} kv heads")
    if block_table.ndim != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [rows, max_blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")


def paged_tree_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                   key_cache: torch.Tensor, value_cache: torch.Tensor,
                                   block_table: torch.Tensor, trees: PagedTrees, scale: float,
                                   output: torch.Tensor | None = None) -> torch.Tensor:
    """Each tree's rows ``node_start + first .. node_start + count - 1`` of ``output`` (by
    default a tensor like ``query``, its other rows undefined): the node's query over its
    request's first ``context_len`` cached tokens (found through ``block_table[table_row]``)
    and over the tree nodes' ``key``/``value`` rows its mask shows. In torch, in float32."""
    _check(query, key, value, key_cache, value_cache, block_table, trees)
    output = torch.empty_like(query) if output is None else output
    block_size = key_cache.shape[1]
    meta = zip(*(t.tolist() for t in (trees.node_start, trees.first, trees.count,
                                      trees.context_len, trees.table_row)))
    for b, (start, first, count, context, table_row) in enumerate(meta):
        positions = torch.arange(context, device=query.device)
        blocks = block_table[table_row, positions // block_size].long()
        slots = positions % block_size
        nodes = slice(start, start + count)
        rows = slice(start + first, start + count)
        output[rows] = tree_attention.masked_tree_attention_reference(
            query[rows], key_cache[blocks, slots], value_cache[blocks, slots], key[nodes],
            value[nodes], trees.mask[b, first:count, :count].bool(), scale)
    return output


@dataclass(frozen=True)
class PagedLaunch:
    """The paged kernel's launch: (node, head) rows per program, row blocks per tree and kv
    head, keys per loop iteration, context splits and the keys each takes."""
    block_m: int
    row_blocks: int
    block_l: int
    splits: int
    chunk: int


# Every layer of a step launches alike: computed once, for its first.
@functools.lru_cache(maxsize=64)
def paged_launch(trees: int, rows: int, num_heads: int, num_kv_heads: int, context: int,
                 dtype: torch.dtype, sms: int, splits: int | None = None,
                 block_m: int | None = None,
                 min_split_tokens: int | None = None) -> PagedLaunch:
    """How :func:`paged_tree_attention` launches over ``trees`` trees computing at most ``rows``
    nodes each (``PagedTrees.max_rows``: programs for a leading chain's nodes would have no
    work) over at most ``context`` cached tokens, on a GPU of ``sms`` multiprocessors.
    ``splits``: the context is split across that many programs (flash decoding), whose partial
    softmaxes a second kernel combines; by default ``launch.context_split``'s rule with
    ``min_split_tokens`` (``MIN_SPLIT_TOKENS``). ``block_m``: (node, head) rows per program, a
    power of two of 16 or more; by default ``BLOCK_M`` (``BLOCK_M_FP32`` for float32). The GPU
    check sweeps all three."""
    default_m, block_l = tree_attention.default_tiles(dtype)
    if block_m is None:
        block_m = default_m
    elif block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two of 16 or more, got {block_m}")
    row_blocks = -(-(rows * (num_heads // num_kv_heads)) // block_m)
    splits, chunk = context_split(
        row_blocks * num_kv_heads * trees, context, block_l, sms,
        tree_attention.MIN_SPLIT_TOKENS if min_split_tokens is None else min_split_tokens,
        splits)
    return PagedLaunch(block_m, row_blocks, block_l, splits, chunk)


def paged_tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_table: torch.Tensor, trees: PagedTrees, scale: float,
                         output: torch.Tensor | None = None, splits: int | None = None,
                         block_m: int | None = None,
                         min_split_tokens: int | None = None) -> torch.Tensor:
    """:func:`paged_tree_attention_reference`'s contract, by the Triton kernel, launched as
    :func:`paged_launch` says. Reads no tensor's values on the host, so a step's layers queue
    without waiting for the GPU."""
    import triton

    _check(query, key, value, key_cache, value_cache, block_table, trees)
    output = torch.empty_like(query) if output is None else output
    if not trees.max_rows:
        return output
    strides = [t.stride() for t in (query, key, value, key_cache, value_cache, output)]
    for name, stride in zip(("query", "key", "value", "key_cache", "value_cache", "output"),
                            strides):
        if stride[-1] != 1:
            raise ValueError(f"{name} must have unit stride in its head dimension")
    q_strides, k_strides, v_strides, kc_strides, vc_strides, out_strides = strides
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    launch = paged_launch(len(trees), trees.max_rows, num_heads, num_kv_heads,
                          trees.max_context, query.dtype, multiprocessors(query.device),
                          splits, block_m, min_split_tokens)
    splits, chunk = launch.splits, launch.chunk
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Unsplit, the kernel stores no partials: any pointer will do, and no allocation is made.
    partial = torch.empty((splits, len(trees) * trees.max_nodes * num_heads, 2 + block_d),
                          dtype=torch.float32, device=query.device) if splits > 1 else output
    mask_kernel, attention_kernel, combine_kernel = _kernels()
    attention_kernel[(launch.row_blocks, num_kv_heads, len(trees) * splits)](
        query, key, value, key_cache, value_cache, block_table, output, partial,
        trees.node_start, trees.first, trees.count, trees.context_len, trees.table_row,
        trees.mask, head_dim, scale * math.log2(math.e), chunk, num_heads, trees.max_nodes,
        splits, *q_strides[:2], *k_strides[:2], *v_strides[:2], *kc_strides[:3],
        *vc_strides[:3], block_table.stride(0), *out_strides[:2],
        BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, BLOCK_M=launch.block_m,
        BLOCK_L=launch.block_l, BLOCK_D=block_d,
        DOT_F32=query.dtype == torch.bfloat16 and _interpreting(),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", SPLIT=splits > 1,
        num_stages=tree_attention.NUM_STAGES)
    if splits > 1:
        rows = len(trees) * trees.max_nodes * num_heads
        combine_kernel[(triton.cdiv(rows, tree_attention.BLOCK_R),)](
            partial, output, trees.node_start, trees.first, trees.count, trees.context_len,
            rows, num_heads, trees.max_nodes, head_dim, splits, chunk, *out_strides[:2],
            BLOCK_R=tree_attention.BLOCK_R, BLOCK_D=block_d)
    return output


@functools.cache
def _kernels() -> tuple[Any, Any, Any]:
    # The attention kernel calls tree_attention's softmax step by a module-level name: Triton's
    # interpreter runs a kernel's source again with its module's globals.
    global _softmax_step
    import triton
    import triton.language as tl

    tree_attention._kernels()
    _softmax_step = tree_attention._softmax_step

    @triton.jit
    def mask_kernel(parents_ptr, counts_ptr, mask_ptr, MAX_NODES):
        i = tl.program_id(0)
        tree = tl.program_id(1)
        if i < tl.load(counts_ptr + tree):
            row = mask_ptr + (tree * MAX_NODES + i) * MAX_NODES
            node = i
            while node >= 0:
                tl.store(row + node, 1)
                node = tl.load(parents_ptr + tree * MAX_NODES + node)

    @triton.jit
    def attention_kernel(
        q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, table_ptr, out_ptr, partial_ptr,
        node_start_ptr, first_ptr, count_ptr, context_ptr, table_row_ptr, mask_ptr,
        HEAD_DIM, qk_scale, CHUNK, NUM_HEADS, MAX_NODES, SPLITS,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        stride_table, stride_ot, stride_oh,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
        PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    ):
        kv = tl.program_id(1)
        tree = tl.program_id(2) // SPLITS
        # Split s takes context tokens [s * CHUNK, (s + 1) * CHUNK); a tree's last split (of
        # those its context needs) takes its nodes too.
        split = tl.program_id(2) % SPLITS
        node_start = tl.load(node_start_ptr + tree)
        count = tl.load(count_ptr + tree)
        context = tl.load(context_ptr + tree)
        tree_splits = tl.maximum(1, tl.cdiv(context, CHUNK))
        # Row r of the block is (node, query head) pair number first + r of this kv head,
        # counted from the tree's first computed node.
        first = tl.load(first_ptr + tree) * GROUP + tl.program_id(0) * BLOCK_M
        if (split < tree_splits) & (first < count * GROUP):
            table = table_ptr + tl.load(table_row_ptr + tree).to(tl.int64) * stride_table
            pair = first + tl.arange(0, BLOCK_M)
            node = pair // GROUP
            head = kv * GROUP + pair % GROUP
            row_ok = node < count
            token = (node_start + node).to(tl.int64)
            d = tl.arange(0, BLOCK_D)
            d_ok = d < HEAD_DIM
            cols = tl.arange(0, BLOCK_L)
            q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                        + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            m = tl.full([BLOCK_M], -1.0e30, tl.float32)
            total = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            context_end = tl.minimum(split * CHUNK + CHUNK, context)
            for start in range(split * CHUNK, context_end, BLOCK_L):
                keys = start + cols
                key_ok = keys < context_end
                both = key_ok[:, None] & d_ok[None, :]
                block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
                slot = keys % BLOCK_SIZE
                k = tl.load(kc_ptr + block[:, None] * stride_kcb + slot[:, None] * stride_kcs
                            + kv * stride_kch + d[None, :], mask=both, other=0.0)
                v = tl.load(vc_ptr + block[:, None] * stride_vcb + slot[:, None] * stride_vcs
                            + kv * stride_vch + d[None, :], mask=both, other=0.0)
                m, total, acc = _softmax_step(q, k, v, key_ok[None, :], m, total, acc,
                                              qk_scale, DOT_F32, PRECISION)
            # Ancestors precede their nodes: no row here sees a node past its last one.
            last_node = (tl.minimum(first + BLOCK_M, count * GROUP) - 1) // GROUP
            tree_end = tl.where(split == tree_splits - 1, last_node + 1, 0)
            masks = mask_ptr + tree.to(tl.int64) * MAX_NODES * MAX_NODES
            for start in range(0, tree_end, BLOCK_L):
                keys = start + cols
                key_ok = keys < count
                both = key_ok[:, None] & d_ok[None, :]
                visible = tl.load(masks + node[:, None] * MAX_NODES + keys[None, :],
                                  mask=row_ok[:, None] & key_ok[None, :], other=0) != 0
                key_token = (node_start + keys).to(tl.int64)
                k = tl.load(k_ptr + key_token[:, None] * stride_kt + kv * stride_kh
                            + d[None, :], mask=both, other=0.0)
                v = tl.load(v_ptr + key_token[:, None] * stride_vt + kv * stride_vh
                            + d[None, :], mask=both, other=0.0)
                m, total, acc = _softmax_step(q, k, v, visible, m, total, acc, qk_scale,
                                              DOT_F32, PRECISION)
            if SPLIT:
                # Partials [splits, trees * MAX_NODES * NUM_HEADS, 2 + BLOCK_D]: m, total, acc.
                num_trees = tl.num_programs(2) // SPLITS
                row = ((split * num_trees + tree) * MAX_NODES + node) * NUM_HEADS + head
                base = partial_ptr + row.to(tl.int64) * (2 + BLOCK_D)
                tl.store(base, m, mask=row_ok)
                tl.store(base + 1, total, mask=row_ok)
                tl.store(base[:, None] + 2 + d[None, :], acc, mask=row_ok[:, None])
            else:
                # Every stored row sees at least itself, so total >= 1.
                out = acc / tl.maximum(total, 1.0e-30)[:, None]
                tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                         + d[None, :], out.to(out_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def combine_kernel(partial_ptr, out_ptr, node_start_ptr, first_ptr, count_ptr, context_ptr,
                       ROWS, NUM_HEADS, MAX_NODES, HEAD_DIM, SPLITS, CHUNK, stride_ot,
                       stride_oh, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        # Each row's splits' online softmaxes merged, each rescaled to the largest running max;
        # a row is (tree, node, head), computed where first <= node < count.
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        tree = rows // (MAX_NODES * NUM_HEADS)
        node = rows // NUM_HEADS % MAX_NODES
        head = rows % NUM_HEADS
        in_range = rows < ROWS
        count = tl.load(count_ptr + tree, mask=in_range, other=0)
        row_ok = in_range & (node < count) & (node >= tl.load(first_ptr + tree, mask=in_range,
                                                                other=0))
        tree_splits = tl.maximum(1, tl.cdiv(tl.load(context_ptr + tree, mask=row_ok, other=0),
                                            CHUNK))
        d = tl.arange(0, BLOCK_D)
        m = tl.full([BLOCK_R], -1.0e30, tl.float32)
        for split in range(0, SPLITS):
            ok = row_ok & (split < tree_splits)
            base = partial_ptr + (split * ROWS + rows).to(tl.int64) * (2 + BLOCK_D)
            m = tl.maximum(m, tl.load(base, mask=ok, other=-1.0e30))
        total = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for split in range(0, SPLITS):
            ok = row_ok & (split < tree_splits)
            base = partial_ptr + (split * ROWS + rows).to(tl.int64) * (2 + BLOCK_D)
            weight = tl.where(ok, tl.exp2(tl.load(base, mask=ok, other=-1.0e30) - m), 0.0)
            total += weight * tl.load(base + 1, mask=ok, other=0.0)
            acc += weight[:, None] * tl.load(base[:, None] + 2 + d[None, :], mask=ok[:, None],
                                             other=0.0)
        out = acc / tl.maximum(total, 1.0e-30)[:, None]
        token = (tl.load(node_start_ptr + tree, mask=row_ok, other=0) + node).to(tl.int64)
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])

    return mask_kernel, attention_kernel, combine_kernel


def _interpreting() -> bool:
    """Whether Triton interprets ``triton.language`` and these kernels were built so too."""
    if not interpreting():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return all(isinstance(f, InterpretedFunction) for f in _kernels())


def _use_triton(t: torch.Tensor) -> bool:
    return (t.is_cuda and have_triton()) or _interpreting()
