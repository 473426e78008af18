"""The tree-attention and tree-mask kernels, run by Triton's interpreter on CPU, against the
torch references; the references against independent formulations.

As in test_kernels.py, the kernels run in one fresh process started with TRITON_INTERPRET=1
(this file run as a script), which saves every case's output for the tests here to compare.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from conftest import run_interpreted
from vllm_retrieval_spec.kernels import tree_attention as kernels
from vllm_retrieval_spec.kernels.tree_attention import (
    tree_ancestor_mask,
    tree_attention,
    tree_attention_reference,
    tree_attention_torch,
    tree_attention_triton,
    tree_mask_triton,
)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def chain(n: int) -> torch.Tensor:
    return torch.arange(n) - 1


def star(n: int) -> torch.Tensor:
    return torch.full((n,), -1)


def random_tree(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([int(torch.randint(-1, i, (), generator=g)) if i else -1
                         for i in range(n)])


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
         "rest-64": rest_like(), "single": chain(1)}


def _inputs(parents: torch.Tensor, context: int, heads: int, kv_heads: int, head_dim: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(len(parents) * 131 + context)
    n = len(parents)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return (rand(n, heads, head_dim), rand(context, kv_heads, head_dim),
            rand(context, kv_heads, head_dim), rand(n, kv_heads, head_dim),
            rand(n, kv_heads, head_dim), parents)


# (tree, context length, heads, kv heads, head dim, dtype): interpreted, so kept small.
CASES = {
    f"{tree}-L{context}-h{heads}/{kv}-d{dim}-{str(dtype)[6:]}": (tree, context, heads, kv, dim,
                                                                  dtype)
    for tree, context, heads, kv, dim, dtype in [
        ("chain-7", 40, 4, 2, 64, torch.float32),
        ("star-5", 33, 3, 3, 64, torch.float32),
        ("random-20", 70, 2, 1, 128, torch.float32),
        ("rest-64", 20, 2, 2, 64, torch.float32),
        ("single", 5, 2, 1, 64, torch.float32),
        ("random-20", 0, 2, 1, 64, torch.float32),       # no context at all
        ("random-20", 31, 4, 2, 64, torch.float16),
        ("chain-7", 31, 4, 2, 64, torch.bfloat16),
        ("star-5", 9, 2, 2, 48, torch.float32),          # a head dim padded to 64
    ]}


def case_inputs(name: str) -> tuple[torch.Tensor, ...]:
    tree, context, heads, kv, dim, dtype = CASES[name]
    return _inputs(TREES[tree], context, heads, kv, dim, dtype)


SCALE = 0.125


def _run_interpreted(path: str) -> None:
    """The script's work, in a process started with TRITON_INTERPRET=1."""
    from triton.runtime.interpreter import InterpretedFunction

    torch.save({
        "interpreted": [isinstance(k, InterpretedFunction) for k in kernels._kernels()],
        "attention": {name: tree_attention_triton(*case_inputs(name), SCALE) for name in CASES},
        "masks": {name: tree_mask_triton(parents) for name, parents in TREES.items()},
    }, path)


@pytest.fixture(scope="module")
def triton_outputs(tmp_path_factory) -> dict:
    return run_interpreted(__file__, tmp_path_factory.mktemp("tree-kernels"))


@pytest.mark.parametrize("name", CASES)
def test_triton_attention_matches_reference(triton_outputs, name):
    inputs = case_inputs(name)
    expected = tree_attention_reference(*inputs, SCALE)
    out = triton_outputs["attention"][name]
    assert out.dtype == expected.dtype and out.shape == expected.shape
    tolerance = TOLERANCE[expected.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("name", TREES)
def test_triton_mask_matches_reference(triton_outputs, name):
    assert torch.equal(triton_outputs["masks"][name], tree_ancestor_mask(TREES[name]))


@pytest.mark.parametrize("name", CASES)
def test_cpu_path_matches_reference(name):
    q, k_ctx, v_ctx, k_tree, v_tree, parents = case_inputs(name)
    expected = tree_attention_reference(q, k_ctx, v_ctx, k_tree, v_tree, parents, SCALE)
    # The context head-major, as vLLM-CPU's paged cache is read (tree_verification.PagedKV).
    out = tree_attention_torch(q, k_ctx.permute(1, 2, 0), v_ctx.transpose(0, 1), k_tree,
                               v_tree, tree_ancestor_mask(parents), SCALE)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    tolerance = TOLERANCE[expected.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_ancestor_mask_of_a_small_tree():
    #   root -> 0 -> 2, root -> 1 -> 3 -> 4
    mask = tree_ancestor_mask(torch.tensor([-1, -1, 0, 1, 3]))
    assert mask.int().tolist() == [[1, 0, 0, 0, 0],
                                   [0, 1, 0, 0, 0],
                                   [1, 0, 1, 0, 0],
                                   [0, 1, 0, 1, 0],
                                   [0, 1, 0, 1, 1]]
    assert torch.equal(tree_ancestor_mask(chain(6)), torch.ones(6, 6, dtype=torch.bool).tril())


@pytest.mark.parametrize("kv_heads", [1, 3])
def test_a_chain_is_causal_attention_over_context_and_chain(kv_heads):
    # Independent of the reference: scaled_dot_product_attention with a causal mask over the
    # whole sequence, whose last rows are the chain's.
    q, k_ctx, v_ctx, k_tree, v_tree, parents = _inputs(chain(9), 30, 6, kv_heads, 64,
                                                      torch.float32)
    keys = torch.cat([k_ctx, k_tree]).repeat_interleave(6 // kv_heads, dim=1).transpose(0, 1)
    values = torch.cat([v_ctx, v_tree]).repeat_interleave(6 // kv_heads, dim=1).transpose(0, 1)
    visible = torch.ones(9, 39, dtype=torch.bool).tril(diagonal=30)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=visible, scale=SCALE).transpose(0, 1)
    out = tree_attention(q, k_ctx, v_ctx, k_tree, v_tree, parents, SCALE)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_a_node_ignores_its_siblings_subtrees():
    # Changing keys and values outside a node's ancestry leaves that node's output unchanged;
    # changing an ancestor's does not.
    parents = torch.tensor([-1, -1, 0, 1, 3])
    q, k_ctx, v_ctx, k_tree, v_tree, _ = _inputs(parents, 12, 2, 1, 64, torch.float32)
    before = tree_attention(q, k_ctx, v_ctx, k_tree, v_tree, parents, SCALE)
    k_other, v_other = k_tree.clone(), v_tree.clone()
    k_other[[0, 2]] += 5
    v_other[[0, 2]] -= 3
    after = tree_attention(q, k_ctx, v_ctx, k_other, v_other, parents, SCALE)
    torch.testing.assert_close(after[[1, 3, 4]], before[[1, 3, 4]], atol=0, rtol=0)
    assert not torch.allclose(after[[0, 2]], before[[0, 2]])


def _valid_args() -> dict:
    names = ("q", "k_ctx", "v_ctx", "k_tree", "v_tree", "parents")
    return dict(zip(names, _inputs(chain(4), 8, 4, 2, 64, torch.float32)))


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "parents": torch.tensor([-1, 1, 0, 2])}, r"parents\[1\]=1: a parent must "
                                                              "precede its child"),
    (lambda a: {**a, "parents": torch.tensor([-1, -2, 0, 2])}, r"parents\[1\]=-2"),
    (lambda a: {**a, "parents": torch.tensor([[-1, 0, 1, 2]])}, r"parents must be \[n\]"),
    (lambda a: {**a, "parents": torch.tensor([-1.0, 0, 1, 2])}, "integer indices"),
    (lambda a: {**a, "q": a["q"][:3]}, r"one row per node \(4\)"),
    (lambda a: {**a, "q": a["q"][:, :3]}, "3 query heads do not divide into 2 kv heads"),
    (lambda a: {**a, "k_tree": a["k_tree"][:, :1]}, "k_tree has 1 kv heads, k_ctx has 2"),
    (lambda a: {**a, "v_ctx": a["v_ctx"][:5]}, "k_ctx has 8 tokens, v_ctx 5"),
    (lambda a: {**a, "k_ctx": a["k_ctx"][..., :32]}, r"k_ctx must be \[tokens, num_kv_heads, "
                                                     r"64\]"),
    (lambda a: {**a, "v_tree": a["v_tree"].half()}, "all inputs must share q's dtype"),
])
@pytest.mark.parametrize("function", [tree_attention_reference, tree_attention_triton])
def test_bad_inputs_are_refused(function, change, message):
    with pytest.raises(ValueError, match=message):
        function(**change(_valid_args()), scale=SCALE)


if __name__ == "__main__":
    _run_interpreted(sys.argv[1])
