"""The paged tree-attention kernel (CUDA vLLM's tree rows), run by Triton's interpreter on CPU
in vLLM's GPU cache layout (``kv_cache`` ``[num_blocks, num_kv_heads, block_size, 2 *
head_dim]``, read as ``kv_cache.transpose(1, 2).split(head_dim, -1)``, block size 16, a
shuffled block table), against its torch reference, against the contiguous tree kernel's
reference on the gathered context, and against causal attention for a chain.

As in test_tree_attention.py, the kernels run in one fresh process started with
TRITON_INTERPRET=1 (this file run as a script), which saves every case's output.
"""

from __future__ import annotations

import functools
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from helpers import run_interpreted
from vllm_retrieval_spec.kernels.launch import context_split
from vllm_retrieval_spec.kernels.paged_tree_attention import (
    PagedLaunch,
    PagedTreeBuffers,
    paged_launch,
    paged_tree_attention,
    paged_tree_attention_reference,
    paged_trees,
)
from vllm_retrieval_spec.kernels.tree_attention import tree_ancestor_mask, tree_attention_reference

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
BLOCK_SIZE = 16
# Marks the step's rows no tree computes: the kernel must leave them as they are.
UNTOUCHED = 7.0


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def random_tree(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(-1, i) if i else -1 for i in range(n)]


def rest_like(n: int) -> list[int]:
    return [-1 if i < 4 else i - 4 if i % 5 == 0 else i - 1 for i in range(n)]


@dataclass(frozen=True)
class Case:
    """One step: trees (parents, context length, first computed node) and the model's shape."""
    trees: tuple[tuple[tuple[int, ...], int, int], ...]
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    splits: int | None = None
    block_m: int | None = None


def case(trees, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32, splits=None,
         block_m=None) -> Case:
    return Case(tuple((tuple(p), context, first) for p, context, first in trees), heads,
                kv_heads, head_dim, dtype, splits, block_m)


CASES = {
    "one-chain": case([(chain(7), 40, 0)]),
    "one-chain-bf16": case([(chain(5), 70, 0)], dtype=torch.bfloat16),
    "random-after-chain": case([(random_tree(20, 1), 33, 3)]),
    "three-trees": case([(rest_like(24), 130, 4), (chain(1), 16, 0), (random_tree(9, 2), 0, 0)]),
    "block-edges": case([(random_tree(6, 3), 15, 0), (random_tree(6, 4), 16, 1),
                         (random_tree(6, 5), 17, 2)], heads=2, kv_heads=1, head_dim=128),
    "gqa-fp16": case([(rest_like(40), 64, 4), (random_tree(12, 6), 9, 0)], heads=8, kv_heads=2,
                     head_dim=128, dtype=torch.float16),
    "mha-bf16": case([(random_tree(30, 7), 100, 0)], heads=3, kv_heads=3,
                     dtype=torch.bfloat16),
    "head-dim-48": case([(random_tree(5, 8), 20, 0)], heads=2, kv_heads=2, head_dim=48),
    "split-2": case([(rest_like(24), 130, 4), (random_tree(9, 2), 5, 0)], splits=2),
    "split-3-bf16": case([(random_tree(16, 9), 200, 0), (chain(3), 64, 1)],
                         dtype=torch.bfloat16, splits=3),
    # Rows per program other than the default: a block holds parts of several nodes' groups.
    "rows-32-gqa": case([(rest_like(24), 130, 4), (random_tree(9, 2), 5, 0)], heads=8,
                        kv_heads=2, splits=2, block_m=32),
    "nothing-computed": case([(chain(4), 20, 4)]),
    # No tree has context (the kernel's contract allows it): the nodes attend only each other.
    "no-context": case([(random_tree(5, 10), 0, 0)]),
}


def inputs(c: Case, seed: int = 0):
    """The step's query/key/value rows (a leading prefill-like row, then each tree's root and
    nodes), a paged cache holding each tree's context, its block table and ``PagedTrees``."""
    g = torch.Generator().manual_seed(seed)
    parents = [list(p) for p, _, _ in c.trees]
    contexts = [context for _, context, _ in c.trees]
    starts, row = [], 1
    for p in parents:
        starts.append(row + 1)       # the root's row, then the nodes'
        row += 1 + len(p)
    tokens = row + 2
    blocks_per_tree = [-(-context // BLOCK_SIZE) for context in contexts]
    num_blocks = sum(blocks_per_tree) + 3
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    width = max(blocks_per_tree, default=0) + 1
    table = torch.full((len(parents) + 1, width), num_blocks - 1, dtype=torch.int32)
    used = 0
    # Tree b reads row b + 1 of the table: row 0 is another request's.
    for b, blocks in enumerate(blocks_per_tree):
        table[b + 1, :blocks] = torch.tensor(order[used:used + blocks], dtype=torch.int32)
        used += blocks

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(c.dtype)

    kv_cache = rand(num_blocks, c.kv_heads, BLOCK_SIZE, 2 * c.head_dim)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(c.head_dim, dim=-1)
    query = rand(tokens, c.heads, c.head_dim)
    key, value = rand(tokens, c.kv_heads, c.head_dim), rand(tokens, c.kv_heads, c.head_dim)
    trees = paged_trees(parents, starts, [first for _, _, first in c.trees], contexts,
                        list(range(1, len(parents) + 1)), "cpu")
    return query, key, value, key_cache, value_cache, table, trees


def computed_rows(c: Case, trees) -> list[int]:
    return [start + node for start, first, count in zip(trees.node_start.tolist(),
                                                        trees.first.tolist(),
                                                        trees.count.tolist())
            for node in range(first, count)]


def _run_interpreted(path: str) -> None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    import vllm_retrieval_spec
    from vllm_retrieval_spec.kernels import paged_tree_attention as module

    outputs = {}
    for name, c in CASES.items():
        query, key, value, key_cache, value_cache, table, trees = inputs(c)
        outputs[name] = paged_tree_attention(
            query, key, value, key_cache, value_cache, table, trees, c.head_dim ** -0.5,
            output=torch.full_like(query, UNTOUCHED), splits=c.splits, block_m=c.block_m)
    c = CASES["three-trees"]
    masks = paged_trees([list(p) for p, _, _ in c.trees], [1, 30, 40], [0, 0, 0], [0, 0, 0],
                        [0, 0, 0], "cpu").mask
    # Buffers that held a chain's masks, whose ones the mask kernel (it writes ones only) must
    # not see in the next step's masks.
    buffers = PagedTreeBuffers("cpu")
    buffers.load([chain(5)], [0], [0], [0], [0])
    reused = buffers.load([[-1, -1, -1]], [0], [0], [0], [0]).mask
    torch.save({"interpreted": [isinstance(f, InterpretedFunction)
                                for f in (tl.zeros, *module._kernels())],
                "attention": outputs, "masks": masks, "reused_masks": reused,
                "package": vllm_retrieval_spec.__file__}, path)


@pytest.fixture(scope="module")
def triton_outputs(tmp_path_factory) -> dict:
    return run_interpreted(__file__, tmp_path_factory.mktemp("paged-tree-kernels"))


def _assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected.double(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_reference_and_leaves_other_rows(triton_outputs, name):
    c = CASES[name]
    query, key, value, key_cache, value_cache, table, trees = inputs(c)
    expected = paged_tree_attention_reference(query, key, value, key_cache, value_cache, table,
                                              trees, c.head_dim ** -0.5,
                                              output=torch.full_like(query, UNTOUCHED))
    out = triton_outputs["attention"][name]
    rows = computed_rows(c, trees)
    _assert_close(out[rows], expected[rows], c.dtype)
    others = [r for r in range(len(query)) if r not in rows]
    assert torch.equal(out[others], torch.full_like(out[others], UNTOUCHED))


def test_kernel_masks_are_the_ancestor_masks(triton_outputs):
    masks = triton_outputs["masks"]
    for b, (parents, _, _) in enumerate(CASES["three-trees"].trees):
        n = len(parents)
        assert torch.equal(masks[b, :n, :n].bool(), tree_ancestor_mask(torch.tensor(parents)))
        assert not masks[b, n:].any() and not masks[b, :, n:].any()


def test_the_interpreted_run_is_of_this_checkout(triton_outputs):
    # Its script starts its path at tests/: the package must still be this checkout's, not an
    # installed one's.
    root = Path(__file__).resolve().parent.parent
    assert Path(triton_outputs["package"]).resolve().parent.parent == root


def test_kernel_masks_of_reused_buffers_are_the_ancestor_masks(triton_outputs):
    masks = triton_outputs["reused_masks"]
    assert torch.equal(masks[0].bool(), tree_ancestor_mask(torch.tensor([-1, -1, -1])))


@pytest.mark.parametrize("name", ["three-trees", "gqa-fp16", "block-edges", "mha-bf16"])
def test_reference_is_tree_attention_over_the_gathered_context(name):
    """The paged reference against the contiguous one, the context gathered token by token
    through the shuffled block table."""
    c = CASES[name]
    query, key, value, key_cache, value_cache, table, trees = inputs(c)
    out = paged_tree_attention_reference(query, key, value, key_cache, value_cache, table,
                                         trees, 0.1)
    for b, ((parents, context, first), start) in enumerate(zip(c.trees,
                                                              trees.node_start.tolist())):
        slots = [(int(table[b + 1, t // BLOCK_SIZE]), t % BLOCK_SIZE) for t in range(context)]
        k_ctx = torch.stack([key_cache[block, slot] for block, slot in slots]) if slots else \
            key_cache[:0, 0]
        v_ctx = torch.stack([value_cache[block, slot] for block, slot in slots]) if slots else \
            value_cache[:0, 0]
        nodes = slice(start, start + len(parents))
        expected = tree_attention_reference(query[nodes], k_ctx, v_ctx, key[nodes], value[nodes],
                                            torch.tensor(parents), 0.1)
        _assert_close(out[start + first:start + len(parents)], expected[first:], c.dtype)


@pytest.mark.parametrize("name", ["one-chain", "one-chain-bf16"])
def test_a_chain_is_causal_attention(triton_outputs, name):
    c = CASES[name]
    query, key, value, key_cache, value_cache, table, trees = inputs(c)
    (parents, context, _), = c.trees
    start, n = int(trees.node_start[0]), len(parents)
    blocks = table[1, torch.arange(context) // BLOCK_SIZE].long()
    slots = torch.arange(context) % BLOCK_SIZE
    keys = torch.cat([key_cache[blocks, slots], key[start:start + n]]).double()
    values = torch.cat([value_cache[blocks, slots], value[start:start + n]]).double()
    group = c.heads // c.kv_heads
    # Causal attention of the whole sequence (context rows get queries of their own).
    q_all = torch.cat([torch.randn(context, c.heads, c.head_dim).double(),
                       query[start:start + n].double()])
    causal = torch.nn.functional.scaled_dot_product_attention(
        q_all.transpose(0, 1), keys.repeat_interleave(group, 1).transpose(0, 1),
        values.repeat_interleave(group, 1).transpose(0, 1), is_causal=True,
        scale=c.head_dim ** -0.5).transpose(0, 1)[context:]
    _assert_close(triton_outputs["attention"][name][start:start + n], causal, c.dtype)


def test_buffers_are_reused_and_rebuilt_per_step():
    buffers = PagedTreeBuffers("cpu")
    first = buffers.load([chain(3), [-1, -1]], [1, 5], [0, 0], [10, 20], [0, 1])
    host = buffers.host.data_ptr()
    second = buffers.load([[-1, 0]], [2], [1], [7], [3])
    assert buffers.host.data_ptr() == host       # smaller step: no new buffer
    assert second.count.tolist() == [2] and second.first.tolist() == [1]
    assert second.context_len.tolist() == [7] and second.table_row.tolist() == [3]
    assert torch.equal(second.mask[0].bool(), tree_ancestor_mask(torch.tensor([-1, 0])))
    assert second.max_nodes == 2 and second.max_context == 7 and second.max_rows == 1
    assert first.max_nodes == 3 and first.max_context == 20 and first.max_rows == 3


@pytest.mark.parametrize("parents, first, message", [
    ([[-1, 1]], [0], "must precede"),
    ([[-1, 0]], [3], "first=3 is not a node index"),
    ([[-1, 0]], [-1], "first=-1 is not a node index"),
])
def test_bad_trees_are_refused(parents, first, message):
    with pytest.raises(ValueError, match=message):
        paged_trees(parents, [0], first, [0], [0], "cpu")


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "key_cache": a["key_cache"][..., :32]}, "key_cache must be"),
    (lambda a: {**a, "key": a["key"][:, :1]}, "key must be"),
    (lambda a: {**a, "value": a["value"].half()}, "value is torch.float16"),
    (lambda a: {**a, "block_table": a["block_table"].long()}, "block_table must be int32"),
    (lambda a: {**a, "query": a["query"][:, :3]}, "3 query heads do not divide"),
    (lambda a: {**a, "value_cache": a["value_cache"][:-1]}, r"value_cache \(.*\) and key_cache"),
    (lambda a: {**a, "trees": replace(a["trees"], mask=a["trees"].mask.to("meta"))},
     "trees.mask is on meta but query is on cpu"),
])
def test_bad_inputs_are_refused(change, message):
    names = ("query", "key", "value", "key_cache", "value_cache", "block_table", "trees")
    args = dict(zip(names, inputs(CASES["three-trees"])))
    with pytest.raises(ValueError, match=message):
        paged_tree_attention_reference(**change(args), scale=0.1)


if __name__ == "__main__":
    _run_interpreted(sys.argv[1])


def test_the_kernel_refuses_inputs_without_unit_stride_in_the_head_dimension():
    names = ("query", "key", "value", "key_cache", "value_cache", "block_table", "trees")
    args = dict(zip(names, inputs(CASES["three-trees"])))
    strided = torch.empty(*args["query"].shape, 2)[..., 0]
    strided.copy_(args["query"])
    with pytest.raises(ValueError, match="query must have unit stride in its head dimension"):
        paged_tree_attention(**{**args, "query": strided}, scale=0.1)


@pytest.mark.parametrize("block_m", [8, 24])
def test_the_kernel_refuses_rows_per_program_that_are_no_power_of_two_of_16_or_more(block_m):
    names = ("query", "key", "value", "key_cache", "value_cache", "block_table", "trees")
    args = dict(zip(names, inputs(CASES["three-trees"])))
    with pytest.raises(ValueError, match=f"block_m must be a power of two of 16 or more, got "
                                         f"{block_m}"):
        paged_tree_attention(**args, scale=0.1, block_m=block_m)


@pytest.mark.parametrize("programs, context, sms, min_split_tokens, splits, expected", [
    # Two programs per multiprocessor at most: 132 SMs, 32 programs -> 8 splits, if the context
    # has min_split_tokens keys for each.
    (32, 8192, 132, 1024, None, (8, 1024)),
    (32, 8192, 132, 2048, None, (4, 2048)),
    (32, 512, 132, 1024, None, (1, 512)),
    (32, 512, 132, 128, None, (4, 128)),
    # A split takes whole 64-key tiles: 1000 keys are 16 tiles, 3 splits of 6, 6 and 4 tiles.
    (8, 1000, 132, 400, None, (3, 384)),
    # Asked for more splits than tiles: one tile each.
    (8, 100, 132, 16, 5, (2, 64)),
    (8, 0, 132, 1024, None, (1, 64)),
])
def test_context_split(programs, context, sms, min_split_tokens, splits, expected):
    assert context_split(programs, context, 64, sms, min_split_tokens, splits) == expected


def test_paged_launch_counts_row_blocks_over_the_nodes_trees_compute_and_their_heads():
    # Llama-3-8B's heads (32 over 8 kv heads): 64 nodes computed are 256 (node, head) rows per
    # kv head, 4 blocks of 64; 4 x 8 programs, 2 x 132 SMs -> 8 splits of a 2048-token context.
    launch = functools.partial(paged_launch, dtype=torch.bfloat16, sms=132)
    assert launch(1, 64, 32, 8, 2048, block_m=64, min_split_tokens=256) \
        == PagedLaunch(64, 4, 64, 8, 256)
    assert launch(1, 64, 32, 8, 2048, block_m=64, min_split_tokens=4096) \
        == PagedLaunch(64, 4, 64, 1, 2048)
    # Two trees of 16 nodes, 16 rows a block: 4 x 8 x 2 programs -> 4 splits at most.
    assert launch(2, 16, 32, 8, 2048, block_m=16, min_split_tokens=256) \
        == PagedLaunch(16, 4, 64, 4, 512)
    assert launch(2, 16, 32, 8, 2048, splits=3, block_m=16) == PagedLaunch(16, 4, 64, 3, 704)
    # float32 keeps its own rows and keys per program: 3 tiles of 32 keys, a split each.
    assert paged_launch(1, 4, 4, 2, 70, torch.float32, 132, min_split_tokens=16) \
        == PagedLaunch(16, 1, 32, 3, 32)
