"""The tree-attention and tree-mask kernels, run by Triton's interpreter on CPU, against the
torch references and against independent formulations (parent walks in Python,
``scaled_dot_product_attention`` in float64 with an explicit mask, causal attention for a chain).

As in test_kernels.py, the kernels run in one fresh process started with TRITON_INTERPRET=1
(this file run as a script), which saves every case's output for the tests here to compare.
The interpreter is slow, so its cases are small; larger shapes (128 nodes, thousands of context
tokens) check the reference, which the CPU path runs.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from helpers import run_interpreted
from vllm_retrieval_spec.kernels import tree_attention as kernels
from vllm_retrieval_spec.kernels.tree_attention import (
    tree_ancestor_mask,
    tree_attention,
    tree_attention_masked_triton,
    tree_attention_reference,
    tree_attention_torch,
    tree_attention_triton,
    tree_mask,
    tree_mask_triton,
)

# Against a float64 computation from the same (rounded) inputs: the output's own rounding, and
# for 16-bit inputs the kernel's P rounded to that dtype before P @ V.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def chain(n: int) -> torch.Tensor:
    return torch.arange(n) - 1


def star(n: int) -> torch.Tensor:
    return torch.full((n,), -1)


def random_tree(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([int(torch.randint(-1, i, (), generator=g)) if i else -1
                         for i in range(n)], dtype=torch.long)


def rest_like(n: int = 64) -> torch.Tensor:
    """REST's shape: a few heavy first tokens, each continued by a long chain with branches."""
    parents = []
    for i in range(n):
        if i < 4:
            parents.append(-1)
        elif i % 5 == 0:
            parents.append(i - 4)           # a branch off an earlier chain
        else:
            parents.append(i - 1)
    return torch.tensor(parents)


TREES = {"chain-7": chain(7), "star-5": star(5), "random-20": random_tree(20),
         "rest-64": rest_like(), "single": chain(1), "random-128": random_tree(128, seed=1),
         "chain-40": chain(40), "empty": chain(0)}


def walked_mask(parents: torch.Tensor) -> torch.Tensor:
    """The ancestor-or-self mask by walking each node's parents: independent of the module."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        node = i
        while node >= 0:
            mask[i, node] = True
            node = int(parents[node])
    return mask


def make_inputs(parents: torch.Tensor, context: int, heads: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed * 7919 + len(parents) * 131 + context)
    n = len(parents)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return (rand(n, heads, head_dim), rand(context, kv_heads, head_dim),
            rand(context, kv_heads, head_dim), rand(n, kv_heads, head_dim),
            rand(n, kv_heads, head_dim), parents)


def oracle(q, k_ctx, v_ctx, k_tree, v_tree, parents, scale) -> torch.Tensor:
    """float64 scaled_dot_product_attention over context + tree with the walked mask."""
    group = q.shape[1] // k_ctx.shape[1]
    keys = torch.cat([k_ctx, k_tree]).double().repeat_interleave(group, dim=1).transpose(0, 1)
    values = torch.cat([v_ctx, v_tree]).double().repeat_interleave(group, dim=1).transpose(0, 1)
    visible = torch.cat([torch.ones(len(parents), len(k_ctx), dtype=torch.bool),
                         walked_mask(parents)], dim=1)
    return torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), keys, values, attn_mask=visible, scale=scale).transpose(0, 1)


def causal(q, k_ctx, v_ctx, k_tree, v_tree, scale) -> torch.Tensor:
    """Plain causal self-attention (``is_causal=True``) over the sequence context + chain, in
    float64; the chain's rows. The context rows get queries of their own, ignored."""
    group = q.shape[1] // k_ctx.shape[1]
    g = torch.Generator().manual_seed(99)
    q_all = torch.cat([torch.randn(len(k_ctx), *q.shape[1:], generator=g).double(), q.double()])
    keys = torch.cat([k_ctx, k_tree]).double().repeat_interleave(group, dim=1)
    values = torch.cat([v_ctx, v_tree]).double().repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q_all.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), is_causal=True,
        scale=scale).transpose(0, 1)
    return out[len(k_ctx):]


def _strided(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    # q with a non-unit head-dim stride (copied by the wrapper); keys and values as views of
    # larger or transposed buffers (read through their strides).
    q, k_ctx, v_ctx, k_tree, v_tree, parents = make_inputs(random_tree(12, 3), 50, 4, 2, 64,
                                                           dtype)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_ctx = torch.cat([k_ctx, k_ctx], dim=2)[..., :64]
    v_ctx = v_ctx.transpose(0, 1).contiguous().transpose(0, 1)
    k_tree = torch.cat([k_tree, torch.zeros_like(k_tree)], dim=1)[:, :2]
    return q, k_ctx, v_ctx, k_tree, v_tree, parents


# name: (tree, context length, heads, kv heads, head dim, dtype, scale); interpreted, so small.
# Context lengths cross tile boundaries (32 keys for float32, 64 otherwise).
CASES = {
    f"{tree}-L{context}-h{heads}/{kv}-d{dim}-{str(dtype)[6:]}" + ("-peaky" if scale else ""):
        (tree, context, heads, kv, dim, dtype, scale or dim ** -0.5)
    for tree, context, heads, kv, dim, dtype, scale in [
        ("chain-7", 40, 4, 2, 64, torch.float32, None),
        ("star-5", 33, 3, 3, 64, torch.float32, None),       # MHA
        ("random-20", 70, 2, 1, 128, torch.float32, None),
        ("rest-64", 20, 2, 2, 64, torch.float32, None),
        ("random-128", 16, 1, 1, 64, torch.float32, None),   # 128 nodes: 8 row blocks
        ("single", 5, 2, 1, 64, torch.float32, None),        # n = 1
        ("single", 0, 2, 1, 64, torch.float32, None),        # n = 1, no context
        ("random-20", 0, 2, 1, 64, torch.float32, None),     # no context
        ("chain-40", 64, 2, 2, 64, torch.float32, 1.0),      # large scores: the max moves
        ("star-5", 9, 2, 2, 48, torch.float32, None),        # head dim padded to 64
        ("random-20", 31, 4, 2, 64, torch.float16, None),
        ("rest-64", 70, 8, 2, 128, torch.float16, None),     # 4 query heads per kv head
        ("chain-7", 31, 4, 2, 64, torch.bfloat16, None),
        ("rest-64", 130, 8, 2, 128, torch.bfloat16, None),
        ("random-128", 0, 2, 2, 64, torch.bfloat16, None),
    ]}
STRIDED = {f"strided-{str(dtype)[6:]}": dtype for dtype in (torch.float32, torch.bfloat16)}
# The context split across programs, as a GPU splits it (the interpreter's one "multiprocessor"
# never asks for it): case, splits asked for. Key tiles are 32 (float32) or 64 tokens long.
SPLIT_CASES = {
    "chain-40-L64-h2/2-d64-float32-peaky": 2,      # the max moves between splits
    "rest-64-L130-h8/2-d128-bfloat16": 3,          # the last split: 2 context tokens + the tree
    "random-20-L70-h2/1-d128-float32": 5,          # 3 tiles: 3 splits
    "random-20-L31-h4/2-d64-float16": 2,           # 1 tile: 1 split
    "single-L0-h2/1-d64-float32": 4,               # no context: 1 split, the tree alone
}


def case_inputs(name: str) -> tuple[tuple[torch.Tensor, ...], float]:
    if name in STRIDED:
        return _strided(STRIDED[name]), 0.125
    tree, context, heads, kv, dim, dtype, scale = CASES[name]
    return make_inputs(TREES[tree], context, heads, kv, dim, dtype), scale


def _run_interpreted(path: str) -> None:
    """The script's work, in a process started with TRITON_INTERPRET=1."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    # Outputs start as torch.empty, so matching the reference also shows the kernel ran.
    dispatch_inputs, dispatch_scale = case_inputs("chain-7-L40-h4/2-d64-float32")
    torch.save({
        "interpreted": [isinstance(f, InterpretedFunction) for f in (tl.zeros,
                                                                      *kernels._kernels())],
        "attention": {name: tree_attention_triton(*inputs, scale)
                      for name in [*CASES, *STRIDED] for inputs, scale in [case_inputs(name)]},
        "masks": {name: tree_mask_triton(parents) for name, parents in TREES.items()},
        "split": {name: tree_attention_masked_triton(*inputs[:5], tree_mask_triton(inputs[5]),
                                                     scale, splits=splits)
                  for name, splits in SPLIT_CASES.items() for inputs, scale in [case_inputs(name)]},
        # The public functions take the kernels on CPU tensors under the interpreter.
        "uses_triton": kernels._use_triton(torch.zeros(1)),
        "public_mask": tree_mask(TREES["random-20"]),
        "public_attention": tree_attention(*dispatch_inputs, dispatch_scale),
    }, path)


@pytest.fixture(scope="module")
def triton_outputs(tmp_path_factory) -> dict:
    return run_interpreted(__file__, tmp_path_factory.mktemp("tree-kernels"))


def _assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected.double(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("name", [*CASES, *STRIDED])
def test_triton_attention_matches_reference_and_oracle(triton_outputs, name):
    inputs, scale = case_inputs(name)
    expected = tree_attention_reference(*inputs, scale)
    out = triton_outputs["attention"][name]
    assert out.dtype == expected.dtype and out.shape == expected.shape
    _assert_close(out, expected, out.dtype)
    _assert_close(out, oracle(*inputs, scale), out.dtype)


@pytest.mark.parametrize("name", SPLIT_CASES)
def test_split_context_matches_reference_and_the_unsplit_kernel(triton_outputs, name):
    inputs, scale = case_inputs(name)
    out = triton_outputs["split"][name]
    _assert_close(out, tree_attention_reference(*inputs, scale), out.dtype)
    _assert_close(out, oracle(*inputs, scale), out.dtype)
    _assert_close(out, triton_outputs["attention"][name], out.dtype)


@pytest.mark.parametrize("name", [name for name in CASES if name.startswith("chain")])
def test_triton_chain_is_causal_attention(triton_outputs, name):
    (q, k_ctx, v_ctx, k_tree, v_tree, _), scale = case_inputs(name)
    _assert_close(triton_outputs["attention"][name], causal(q, k_ctx, v_ctx, k_tree, v_tree,
                                                            scale), q.dtype)


@pytest.mark.parametrize("name", [name for name in CASES if name.startswith("single-L0")])
def test_triton_lone_node_without_context_returns_its_value(triton_outputs, name):
    (q, _, _, _, v_tree, _), _ = case_inputs(name)
    group = q.shape[1] // v_tree.shape[1]
    torch.testing.assert_close(triton_outputs["attention"][name],
                               v_tree.repeat_interleave(group, dim=1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", TREES)
def test_triton_mask_matches_reference(triton_outputs, name):
    out = triton_outputs["masks"][name]
    assert out.dtype == torch.bool
    assert torch.equal(out, tree_ancestor_mask(TREES[name]))
    assert torch.equal(out, walked_mask(TREES[name]))


def test_public_functions_run_the_kernels_under_the_interpreter(triton_outputs):
    assert triton_outputs["uses_triton"]
    assert torch.equal(triton_outputs["public_mask"], walked_mask(TREES["random-20"]))
    assert torch.equal(triton_outputs["public_attention"],
                       triton_outputs["attention"]["chain-7-L40-h4/2-d64-float32"])


@pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="interpreter in this process")
def test_public_functions_run_the_references_on_cpu():
    assert not kernels._use_triton(torch.zeros(1))
    inputs = make_inputs(rest_like(), 40, 4, 2, 64, torch.float32)
    assert torch.equal(tree_attention(*inputs, 0.125), tree_attention_reference(*inputs, 0.125))
    assert torch.equal(tree_mask(rest_like()), tree_ancestor_mask(rest_like()))


def cache_blocks(k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, ...]:
    """The context as vLLM-CPU's paged cache yields it (tree_verification.PagedKV.blocks_of):
    its whole blocks, keys ``[blocks, kv heads, head_dim, block_size]`` and values ``[blocks,
    kv heads, block_size, head_dim]``, here in reverse order, then the last partial block's
    keys ``[kv heads, head_dim, tokens]`` and values ``[kv heads, tokens, head_dim]``."""
    tokens, kv, dim = k_ctx.shape
    whole = tokens // block_size * block_size
    keys, values = (t[:whole].reshape(-1, block_size, kv, dim).flip(0) for t in (k_ctx, v_ctx))
    return (keys.permute(0, 2, 3, 1), values.transpose(1, 2), k_ctx[whole:].permute(1, 2, 0),
            v_ctx[whole:].transpose(0, 1))


@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("name", [*CASES, *STRIDED])
def test_cpu_path_matches_reference(name, block_size):
    (q, k_ctx, v_ctx, k_tree, v_tree, parents), scale = case_inputs(name)
    expected = tree_attention_reference(q, k_ctx, v_ctx, k_tree, v_tree, parents, scale)
    out = tree_attention_torch(q, *cache_blocks(k_ctx, v_ctx, block_size), k_tree, v_tree,
                               tree_ancestor_mask(parents), scale)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    _assert_close(out, expected, expected.dtype)


@pytest.mark.parametrize("first", [0, 3, 19])
def test_cpu_path_computes_only_the_last_rows_when_given_them(first):
    # vLLM-CPU's tree rows after the leading chain: queries and mask rows from `first` on,
    # against every node's keys and values.
    inputs, scale = case_inputs("random-20-L70-h2/1-d128-float32")
    q, k_ctx, v_ctx, k_tree, v_tree, parents = inputs
    expected = tree_attention_reference(q, k_ctx, v_ctx, k_tree, v_tree, parents, scale)
    out = tree_attention_torch(q[first:], *cache_blocks(k_ctx, v_ctx, 16), k_tree, v_tree,
                               tree_ancestor_mask(parents)[first:], scale)
    assert out.shape == expected[first:].shape
    _assert_close(out, expected[first:], torch.float32)


def test_ancestor_mask_of_a_small_tree():
    #   root -> 0 -> 2, root -> 1 -> 3 -> 4
    mask = tree_ancestor_mask(torch.tensor([-1, -1, 0, 1, 3]))
    assert mask.int().tolist() == [[1, 0, 0, 0, 0],
                                   [0, 1, 0, 0, 0],
                                   [1, 0, 1, 0, 0],
                                   [0, 1, 0, 1, 0],
                                   [0, 1, 0, 1, 1]]
    assert torch.equal(tree_ancestor_mask(chain(6)), torch.ones(6, 6, dtype=torch.bool).tril())
    assert torch.equal(tree_ancestor_mask(star(6)), torch.eye(6, dtype=torch.bool))
    assert tree_ancestor_mask(chain(0)).shape == (0, 0)


@pytest.mark.parametrize("seed", range(5))
def test_ancestor_mask_of_random_trees_is_the_parent_walk(seed):
    parents = random_tree(100, seed)
    assert torch.equal(tree_ancestor_mask(parents), walked_mask(parents))
    # Other integer dtypes are accepted.
    assert torch.equal(tree_ancestor_mask(parents.int()), walked_mask(parents))


# Beyond what the interpreter can run quickly: up to 128 nodes, thousands of context tokens.
LARGE = [("random-128", 3000, 8, 2, 128), ("rest-64", 2048, 4, 4, 64),
         ("star-5", 1000, 6, 1, 64), ("chain-40", 700, 4, 2, 128), ("random-128", 0, 2, 1, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tree, context, heads, kv, dim", LARGE)
def test_reference_matches_masked_sdpa(tree, context, heads, kv, dim, dtype):
    inputs = make_inputs(TREES[tree], context, heads, kv, dim, dtype, seed=1)
    out = tree_attention(*inputs, dim ** -0.5)
    assert out.dtype == dtype and out.shape == (len(TREES[tree]), heads, dim)
    _assert_close(out, oracle(*inputs, dim ** -0.5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, context, kv_heads", [(9, 30, 1), (9, 30, 3), (64, 1500, 2),
                                                  (5, 0, 6)])
def test_a_chain_is_causal_attention_over_context_and_chain(n, context, kv_heads, dtype):
    q, k_ctx, v_ctx, k_tree, v_tree, parents = make_inputs(chain(n), context, 6, kv_heads, 64,
                                                           dtype)
    out = tree_attention(q, k_ctx, v_ctx, k_tree, v_tree, parents, 0.125)
    _assert_close(out, causal(q, k_ctx, v_ctx, k_tree, v_tree, 0.125), dtype)


def test_a_star_node_sees_the_context_and_itself():
    q, k_ctx, v_ctx, k_tree, v_tree, parents = make_inputs(star(6), 25, 2, 2, 64, torch.float32)
    out = tree_attention(q, k_ctx, v_ctx, k_tree, v_tree, parents, 0.125)
    for i in range(6):
        alone = tree_attention(q[i:i + 1], k_ctx, v_ctx, k_tree[i:i + 1], v_tree[i:i + 1],
                               chain(1), 0.125)
        torch.testing.assert_close(out[i:i + 1], alone, atol=1e-6, rtol=1e-6)


def test_a_node_ignores_its_siblings_subtrees():
    # Changing keys and values outside a node's ancestry leaves that node's output unchanged;
    # changing an ancestor's does not.
    parents = torch.tensor([-1, -1, 0, 1, 3])
    q, k_ctx, v_ctx, k_tree, v_tree, _ = make_inputs(parents, 12, 2, 1, 64, torch.float32)
    before = tree_attention(q, k_ctx, v_ctx, k_tree, v_tree, parents, 0.125)
    k_other, v_other = k_tree.clone(), v_tree.clone()
    k_other[[0, 2]] += 5
    v_other[[0, 2]] -= 3
    after = tree_attention(q, k_ctx, v_ctx, k_other, v_other, parents, 0.125)
    torch.testing.assert_close(after[[1, 3, 4]], before[[1, 3, 4]], atol=0, rtol=0)
    assert not torch.allclose(after[[0, 2]], before[[0, 2]])


def test_an_empty_tree_gives_an_empty_output():
    inputs = make_inputs(chain(0), 10, 4, 2, 64, torch.float16)
    for function in (tree_attention_reference, tree_attention_triton):
        out = function(*inputs, 0.125)
        assert out.shape == (0, 4, 64) and out.dtype == torch.float16


def _valid_args() -> dict:
    names = ("q", "k_ctx", "v_ctx", "k_tree", "v_tree", "parents")
    return dict(zip(names, make_inputs(chain(4), 8, 4, 2, 64, torch.float32)))


BAD_PARENTS = [
    (torch.tensor([-1, 1, 0, 2]), r"parents\[1\]=1: a parent must precede its child"),
    (torch.tensor([-1, 0, 5, 2]), r"parents\[2\]=5: a parent must precede its child"),
    (torch.tensor([-1, -2, 0, 2]), r"parents\[1\]=-2"),
    (torch.tensor([0, -1, 0, 2]), r"parents\[0\]=0"),
    (torch.tensor([[-1, 0, 1, 2]]), r"parents must be \[n\]"),
    (torch.tensor(-1), r"parents must be \[n\]"),
    (torch.tensor([-1.0, 0, 1, 2]), "integer indices"),
    (torch.tensor([True, False, False, False]), "integer indices"),
]


@pytest.mark.parametrize("change, message", [
    *[(lambda a, p=p: {**a, "parents": p}, message) for p, message in BAD_PARENTS],
    (lambda a: {**a, "q": a["q"][:3]}, r"one row per node \(4\)"),
    (lambda a: {**a, "k_tree": a["k_tree"][:3]}, r"one row per node \(4\)"),
    (lambda a: {**a, "q": a["q"][0]}, r"q must be \[n, num_heads, head_dim\]"),
    (lambda a: {**a, "q": a["q"][:, :3]}, "3 query heads do not divide into 2 kv heads"),
    (lambda a: {**a, "k_ctx": a["k_ctx"][:, :0], "v_ctx": a["v_ctx"][:, :0],
                "k_tree": a["k_tree"][:, :0], "v_tree": a["v_tree"][:, :0]},
     "4 query heads do not divide into 0 kv heads"),
    (lambda a: {**a, "k_tree": a["k_tree"][:, :1]}, "k_tree has 1 kv heads, k_ctx has 2"),
    (lambda a: {**a, "v_ctx": a["v_ctx"][:, :1]}, "v_ctx has 1 kv heads, k_ctx has 2"),
    (lambda a: {**a, "v_ctx": a["v_ctx"][:5]}, "k_ctx has 8 tokens, v_ctx 5"),
    (lambda a: {**a, "k_ctx": a["k_ctx"][..., :32]}, r"k_ctx must be \[tokens, num_kv_heads, "
                                                     r"64\]"),
    (lambda a: {**a, "v_tree": a["v_tree"][0]}, r"v_tree must be \[tokens, num_kv_heads, "
                                                r"64\]"),
    (lambda a: {**a, "v_tree": a["v_tree"].half()}, "all inputs must share q's dtype"),
    (lambda a: {k: v.double() if v.is_floating_point() else v for k, v in a.items()},
     "q dtype must be one of"),
    (lambda a: {**a, "k_ctx": a["k_ctx"].to("meta")}, "k_ctx is on meta but q is on cpu"),
])
@pytest.mark.parametrize("function", [tree_attention_reference, tree_attention_triton,
                                      tree_attention])
def test_bad_inputs_are_refused(function, change, message):
    with pytest.raises(ValueError, match=message):
        function(**change(_valid_args()), scale=0.125)


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "mask": a["mask"][:3]}, r"mask must be bool or int8 \[n, n\] = \[4, 4\], "
                                             r"got torch.bool \(3, 4\)"),
    (lambda a: {**a, "mask": a["mask"].float()}, "mask must be bool or int8"),
    (lambda a: {**a, "mask": a["mask"].to("meta")}, "mask is on meta but q is on cpu"),
    (lambda a: {**a, "v_tree": a["v_tree"][:3]}, r"one row per node \(4\)"),
    (lambda a: {**a, "k_ctx": a["k_ctx"].half()}, "all inputs must share q's dtype"),
    (lambda a: {**a, "q": a["q"][0]}, r"q must be \[n, num_heads, head_dim\]"),
])
def test_bad_inputs_are_refused_with_a_mask(change, message):
    args = _valid_args()
    args["mask"] = tree_ancestor_mask(args.pop("parents"))
    with pytest.raises(ValueError, match=message):
        tree_attention_masked_triton(**change(args), scale=0.125)


@pytest.mark.parametrize("parents, message", BAD_PARENTS)
@pytest.mark.parametrize("function", [tree_ancestor_mask, tree_mask_triton, tree_mask])
def test_bad_parents_are_refused_by_the_masks(function, parents, message):
    with pytest.raises(ValueError, match=message):
        function(parents)


if __name__ == "__main__":
    _run_interpreted(sys.argv[1])
