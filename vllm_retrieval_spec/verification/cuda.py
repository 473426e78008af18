"""CUDA vLLM's paged KV cache for tree verification (``verification.core``): the FLASH_ATTN and
TRITON_ATTN backends, whose tree rows the paged Triton kernel attends again after the backend.

Both backends keep a layer's cache as ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
and read it as ``kv_cache.transpose(1, 2).split(head_size, -1)``: keys and values ``[num_blocks,
block_size, num_kv_heads, head_size]``, plain strided views, so entries are read and written by
indexing, on the forward's stream. A step's trees go to the device once (``PagedTreeBuffers``)
and every layer attends all of them in one launch (``kernels/paged_tree_attention.py``).

Trees are refused at start-up (``tree_refusal``) where the kernel would compute something else
than the backend: another backend, a quantized cache, or an attention feature it lacks; and
(``cuda_tree_verifier``) where the wrapper would not see attention's rows as the backend does:
full CUDA graphs, or attention fused with its output quantization.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_retrieval_spec.verification.core import (
    TreeRow, TreeStep, TreeVerifier, attention_refusal, refuse_unsupported_trees)

#: The backends whose tree rows the paged kernel can recompute: their cache layout is the
#: kernel's, and they attend the rows it overwrites causally like any others.
TREE_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")
#: The widest head the paged kernel's 16-bit tiles fit an H100's shared memory with (256: 164
#: KiB of 227; 512: 324 KiB; tests/test_kernel_compile.py).
MAX_HEAD_SIZE = 256


def tree_refusal(backend: str, impl: Any, kv_cache_dtype: str, use_mla: bool,
                 uses_mrope: bool) -> str | None:
    """Why trees cannot be verified with this attention layer, or None: what no backend
    supports (``core.attention_refusal``), then what the paged kernel lacks. ``impl`` is the
    layer's attention implementation."""
    reason = attention_refusal(impl, use_mla, uses_mrope)
    if reason is not None:
        return reason
    if backend not in TREE_BACKENDS:
        return (f"attention backend {backend} cannot attend tree rows; start vLLM with "
                f"--attention-backend {TREE_BACKENDS[1]} (or {TREE_BACKENDS[0]})")
    if kv_cache_dtype != "auto":
        return f"KV cache dtype {kv_cache_dtype!r}: the kernel reads unquantized caches only"
    head_size = getattr(impl, "head_size", 0)
    if head_size > MAX_HEAD_SIZE:
        return (f"head size {head_size}: the kernel's tiles would need more shared memory than "
                f"a GPU has above {MAX_HEAD_SIZE}")
    return None


class CudaPagedKV:
    """Tree rows' attention and KV entries in FLASH_ATTN's and TRITON_ATTN's cache."""

    def __init__(self, head_size: int, device: Any) -> None:
        from vllm_retrieval_spec.kernels.paged_tree_attention import PagedTreeBuffers

        self.head_size = head_size
        self.buffers = PagedTreeBuffers(device)

    def refuse_if_too_large(self, num_heads: int, num_kv_heads: int, block_size: int,
                            dtype: Any) -> None:
        """``ConfigError`` if the kernel, split or not, needs more shared memory than this GPU
        gives a program (Triton raises ``OutOfResources`` when it loads one): at head size 256
        an H100 has room, an L4 or an A10 not (106,496 bytes of 101,376). Launched once each on
        a two-node tree, which also compiles them before the first step."""
        import torch
        from triton.runtime.errors import OutOfResources

        from vllm_retrieval_spec.config import ConfigError
        from vllm_retrieval_spec.kernels.paged_tree_attention import paged_tree_attention

        device = self.buffers.device
        trees = self.buffers.load([[-1, 0, 0]], [0], [1], [block_size], [0])
        query = torch.zeros(3, num_heads, self.head_size, dtype=dtype, device=device)
        key = torch.zeros(3, num_kv_heads, self.head_size, dtype=dtype, device=device)
        cache = torch.zeros(1, block_size, num_kv_heads, self.head_size, dtype=dtype,
                            device=device)
        table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        try:
            for splits in (1, 2):
                paged_tree_attention(query, key, key, cache, cache, table, trees, 1.0,
                                     splits=splits)
        except OutOfResources as error:
            raise ConfigError(
                f"tree drafts cannot be verified on this GPU: at head size {self.head_size} "
                f"({dtype}) the tree kernel needs {error.required} bytes of shared memory and "
                f"a program gets {error.limit}; set \"tree\": \"off\"") from None

    def split(self, kv_cache: Any) -> tuple[Any, Any]:
        """Keys and values ``[num_blocks, block_size, num_kv_heads, head_size]`` (views)."""
        return kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

    def prepare(self, rows: list[TreeRow]) -> Any:
        """The step's trees on the device, for every layer: node rows, the first row after each
        leading chain, context lengths (the root included), block-table rows, masks."""
        return self.buffers.load([tree.parents.tolist() for tree in rows],
                                 [tree.query_start + 1 for tree in rows],
                                 [tree.first_branch for tree in rows],
                                 [tree.base + 1 for tree in rows], [tree.row for tree in rows])

    def attend(self, step: TreeStep, query: Any, key: Any, value: Any, kv_cache: Any,
               block_table: Any, output: Any, scale: float) -> None:
        from vllm_retrieval_spec.kernels.paged_tree_attention import paged_tree_attention

        key_cache, value_cache = self.split(kv_cache)
        paged_tree_attention(query, key, value, key_cache, value_cache, block_table,
                             step.attention, scale, output=output)

    @staticmethod
    def mover(source: Any, target: Any, block_size: int) -> Callable[[Any], None]:
        """Copies a layer's entries at ``source`` slots to ``target`` slots: keys and values
        together (an entry's lie side by side in the cache), one gather and one scatter a
        layer, the slots' blocks and offsets found once for every layer."""
        source_blocks, source_offsets = source // block_size, source % block_size
        target_blocks, target_offsets = target // block_size, target % block_size

        def move(kv_cache: Any) -> None:
            kv_cache[target_blocks, :, target_offsets] = \
                kv_cache[source_blocks, :, source_offsets]

        return move


def cuda_tree_verifier(runner: Any) -> TreeVerifier:
    """A verifier for the runner's FLASH_ATTN or TRITON_ATTN layers; ``ConfigError`` where
    trees cannot be verified (``tree_refusal``, or CUDA graphs that capture attention)."""
    from vllm_retrieval_spec.config import ConfigError

    if runner.compilation_config.pass_config.fuse_attn_quant:
        # vLLM then hands attention an output scale and a quantized output, into which the
        # kernel's rows would be written unscaled.
        raise ConfigError("tree drafts cannot be verified with attention fused with its output "
                          "quantization: pass -cc.pass_config.fuse_attn_quant=False, or set "
                          "\"tree\": \"off\"")
    mode = runner.compilation_config.cudagraph_mode
    if mode.has_full_cudagraphs():
        # ``patches.engine_args`` makes the mode PIECEWISE, but vLLM resolves it later
        # (encoder-decoder models, attention+quant fusion), and a config naming our proposer
        # as vLLM's custom_class never passes there: a full graph's replay skips the wrapper
        # that attends the tree rows.
        raise ConfigError(f"tree drafts need attention outside CUDA graphs, and cudagraph_mode "
                          f"{mode.name} replays attention inside them: use "
                          f"-cc.cudagraph_mode=PIECEWISE, or set \"tree\": \"off\"")
    refuse_unsupported_trees(runner, tree_refusal)
    model_config = runner.model_config
    paged = CudaPagedKV(model_config.get_head_size(), runner.device)
    if paged.buffers.device.type == "cuda":
        parallel = runner.parallel_config
        paged.refuse_if_too_large(model_config.get_num_attention_heads(parallel),
                                  model_config.get_num_kv_heads(parallel),
                                  runner.cache_config.block_size, model_config.dtype)
    return TreeVerifier(paged)
