"""The weighted trie and the best-chain walk against hand-made examples and a dict oracle."""

import numpy as np
import pytest

from vllm_retrieval_spec.drafting.tree import best_chain, build_trie


def _pack(rows):
    width = max((len(r) for r in rows), default=1)
    cands = np.full((len(rows), width), -1, dtype=np.int32)
    for i, r in enumerate(rows):
        cands[i, : len(r)] = r
    return cands, np.array([len(r) for r in rows], dtype=np.int32)


def test_trie_counts_shared_prefixes():
    cands, lengths = _pack([[5, 6, 7], [5, 6, 8], [9]])
    parent, token, weight, _, _, n = build_trie(cands, lengths, np.ones(3))
    nodes = {}
    for i in range(1, n):
        path, j = [], i
        while j != 0:
            path.append(int(token[j]))
            j = parent[j]
        nodes[tuple(reversed(path))] = weight[i]
    assert nodes == {(5,): 2, (5, 6): 2, (5, 6, 7): 1, (5, 6, 8): 1, (9,): 1}
    assert weight[0] == 3


def test_best_chain_follows_majority_and_stops_on_weak_evidence():
    cands, lengths = _pack([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 7, 7], [8, 8, 8, 8]])
    w = np.ones(4)
    # Prefix probabilities with prior 0: 1 -> 3/4, 1 2 -> 3/4, 1 2 3 -> 2/4, 1 2 3 x -> 1/4.
    assert best_chain(cands, lengths, w, 8, 0.0, 0.0).tolist() == [1, 2, 3, 4]
    assert best_chain(cands, lengths, w, 8, 0.5, 0.0).tolist() == [1, 2, 3]
    assert best_chain(cands, lengths, w, 8, 0.6, 0.0).tolist() == [1, 2]
    assert best_chain(cands, lengths, w, 2, 0.0, 0.0).tolist() == [1, 2]
    # A prior of 4 pseudo-votes halves every estimate.
    assert best_chain(cands, lengths, w, 8, 0.3, 4.0).tolist() == [1, 2]
    # min_len: a chain the evidence cuts short is extended along the heaviest path (8 8 8 8
    # has 1/4 of the vote, below 0.5, but follows once the chain has started), never started.
    assert best_chain(cands, lengths, w, 8, 0.8, 0.0, 3).size == 0
    assert best_chain(cands, lengths, w, 8, 0.6, 0.0, 3).tolist() == [1, 2, 3]
    assert best_chain(cands, lengths, w, 8, 0.6, 0.0, 6).tolist() == [1, 2, 3, 4]  # trie ends
    assert best_chain(cands, lengths, w, 2, 0.6, 0.0, 6).tolist() == [1, 2]  # max_len rules
    # Candidates without any vote and no prior: no evidence, no draft (not a division by 0).
    assert best_chain(cands, lengths, np.zeros(4), 8, 0.0, 0.0).size == 0


def test_weights_override_counts():
    cands, lengths = _pack([[1, 1], [2, 2], [2, 3]])
    assert best_chain(cands, lengths, np.array([5.0, 1.0, 1.0]), 4, 0.0, 0.0).tolist() == [1, 1]


def test_ties_go_to_the_first_candidate_and_empty_inputs_give_no_draft():
    cands, lengths = _pack([[4, 1], [3, 1]])
    assert best_chain(cands, lengths, np.ones(2), 4, 0.0, 0.0).tolist() == [4, 1]
    empty = np.zeros((0, 4), dtype=np.int32)
    assert best_chain(empty, np.zeros(0, np.int32), np.ones(0), 4, 0.0, 1.0).tolist() == []
    assert best_chain(cands, lengths, np.ones(2), 0, 0.0, 0.0).tolist() == []


def _oracle_chain(rows, weights, max_len, min_prob, prior):
    """Dict-of-prefixes greedy walk, first-seen wins ties."""
    total = float(sum(weights))
    counts, order = {}, {}
    for r, w in zip(rows, weights):
        for d in range(1, len(r) + 1):
            counts[tuple(r[:d])] = counts.get(tuple(r[:d]), 0.0) + w
            order.setdefault(tuple(r[:d]), len(order))
    chain = ()
    while len(chain) < max_len:
        kids = [p for p in counts if len(p) == len(chain) + 1 and p[:-1] == chain]
        if not kids:
            break
        best = max(kids, key=lambda p: (counts[p], -order[p]))
        if counts[best] / (total + prior) < min_prob:
            break
        chain = best
    return list(chain)


@pytest.mark.parametrize("seed", range(20))
def test_best_chain_matches_oracle(seed):
    rng = np.random.default_rng(seed)
    rows = [list(rng.integers(0, 3, rng.integers(0, 7))) for _ in range(rng.integers(1, 30))]
    weights = rng.integers(1, 4, len(rows)).astype(np.float64)
    cands, lengths = _pack(rows)
    for min_prob, prior in [(0.0, 0.0), (0.2, 1.0), (0.5, 0.0)]:
        got = best_chain(cands, lengths, weights, 5, min_prob, prior).tolist()
        assert got == _oracle_chain(rows, weights, 5, min_prob, prior)


def _tree(rows, weights, max_nodes, min_prefix_prob, branch_min_prob, prior=0.0, min_len=1):
    from vllm_retrieval_spec.drafting.tree import best_tree

    cands, lengths = _pack(rows)
    tokens, parents, _, _ = best_tree(cands, lengths, np.asarray(weights, dtype=np.float64),
                                      max_nodes, min_prefix_prob, prior, min_len, branch_min_prob,
                                      max_nodes)
    return tokens.tolist(), parents.tolist()


def test_best_tree_starts_with_the_best_chain_then_adds_branches_best_first():
    rows = [[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 7, 7], [8, 8, 8, 8]]
    # The chain at 0.5 is 1 2 3 (each >= 2/4); then 3->4, 3->9, 2->7 and 8, all at 1/4: ties
    # go to the node inserted first (the earlier candidate's), so 8 is left out.
    tokens, parents = _tree(rows, np.ones(4), 6, 0.5, 0.25)
    assert tokens == [1, 2, 3, 4, 9, 7] and parents == [-1, 0, 1, 2, 2, 1]


def test_best_tree_sums_the_estimated_probabilities_of_the_nodes_beside_its_chain():
    from vllm_retrieval_spec.drafting.tree import best_tree

    rows = [[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 7, 7], [8, 8, 8, 8]]
    cands, lengths = _pack(rows)
    weights = np.array([3.0, 1.0, 2.0, 2.0])
    # A prior of 2: denominator 10. Chain at 0.5: 1 2 (0.6 each); then 2->3 (0.4) and 3->4
    # (0.3); the 7s and 8s (0.2) and 3->9 (0.1) are under 0.25.
    tokens, parents, chain_len, branch_prob = best_tree(cands, lengths, weights, 10, 0.5, 2.0,
                                                        1, 0.25, 10)
    assert tokens.tolist() == [1, 2, 3, 4] and chain_len == 2
    assert branch_prob == pytest.approx(0.4 + 0.3)
    assert best_tree(cands, lengths, weights, 10, 0.5, 2.0, 1, 0.2, 10)[3] == pytest.approx(1.9)
    assert best_tree(cands, lengths, weights, 2, 0.5, 2.0, 1, 0.25, 10)[3] == 0.0
    # Every parent precedes its children, so any prefix of the nodes is a tree.
    assert all(-1 <= p < i for i, p in enumerate(parents))


def test_best_tree_stops_at_the_cost_threshold_and_the_node_budget():
    rows = [[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 7, 7], [8, 8, 8, 8]]
    # Branches of 1/4 fall below 0.3: the tree is the chain.
    assert _tree(rows, np.ones(4), 8, 0.5, 0.3) == ([1, 2, 3], [-1, 0, 1])
    assert _tree(rows, np.ones(4), 4, 0.5, 0.0)[0][:3] == [1, 2, 3]
    assert len(_tree(rows, np.ones(4), 4, 0.5, 0.0)[0]) == 4
    # Weighted: the 8-branch (4/7) is the chain, the 1-branch (3/7) comes next.
    assert _tree(rows, [1, 1, 1, 4], 5, 0.5, 0.0) == ([8, 8, 8, 8, 1], [-1, 0, 1, 2, -1])


@pytest.mark.parametrize("seed", range(20))
def test_a_tree_holds_the_chain_and_no_node_twice(seed):
    from vllm_retrieval_spec.drafting.tree import TreeDraft

    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 3, size=rng.integers(1, 7)).tolist() for _ in range(12)]
    weights = rng.random(12)
    cands, lengths = _pack(rows)
    chain = best_chain(cands, lengths, weights, 10, 0.3, 1.0, 2).tolist()
    from vllm_retrieval_spec.drafting.tree import best_tree

    tree = TreeDraft(*best_tree(cands, lengths, weights, 10, 0.3, 1.0, 2, 0.05, 10))
    assert tree.chain().tolist() == chain
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    # No two nodes share a parent and a token: each root path is one trie path.
    assert len(set(zip(parents, tokens))) == len(tokens)
    assert len(tokens) <= 10


def test_selection_obeys_the_tree_option():
    from vllm_retrieval_spec.config import TrieOptions
    from vllm_retrieval_spec.drafting.tree import TreeDraft, TrieSelection

    cands, lengths = _pack([[1, 2, 3], [1, 5, 6], [1, 2, 3]])
    base = dict(prior_weight=0.0, min_prefix_prob=0.5, tree_min_prob=0.3)
    chain = TrieSelection(TrieOptions(**base), 1).select(cands, lengths, np.ones(3), 8)
    assert chain.tolist() == [1, 2, 3]
    tree = TrieSelection(TrieOptions(**base, tree="on"), 1).select(cands, lengths, np.ones(3), 8)
    assert isinstance(tree, TreeDraft)
    assert tree.tokens.tolist() == [1, 2, 3, 5, 6] and tree.parents.tolist() == [-1, 0, 1, 0, 3]
    assert tree.chain().tolist() == [1, 2, 3]


def test_best_tree_keeps_every_path_within_max_depth():
    from vllm_retrieval_spec.drafting.tree import best_tree
    from vllm_retrieval_spec.verification.core import tree_depths

    rows = [[1, 2, 3, 4], [1, 2, 3, 9], [1, 5, 7, 7], [8, 8, 8, 8]]
    cands, lengths = _pack(rows)
    tokens, parents, chain_len, _ = best_tree(cands, lengths, np.ones(4), 12, 0.5, 0.0, 1, 0.0,
                                              2)
    assert tokens[:chain_len].tolist() == [1, 2]
    assert tree_depths(parents).max() == 2
    # Every trie node of depth <= 2 is there: 1, 2, 5, 8 and 8 8.
    assert sorted(tokens.tolist()) == [1, 2, 5, 8, 8]


def test_a_tree_without_evidence_is_empty():
    # A source weighted 0 and no prior: nothing has a vote, so no node is drafted, as no chain.
    from vllm_retrieval_spec.drafting.tree import best_tree

    cands, lengths = _pack([[1, 2], [3]])
    tokens, parents, chain_len, branch_prob = best_tree(cands, lengths, np.zeros(2), 8, 0.0,
                                                        0.0, 1, 0.0, 8)
    assert (tokens.tolist(), parents.tolist(), chain_len, branch_prob) == ([], [], 0, 0.0)


def test_selection_keeps_drafts_within_max_len_and_max_depth():
    from vllm_retrieval_spec.config import TrieOptions
    from vllm_retrieval_spec.drafting.tree import TrieSelection

    cands, lengths = _pack([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 6]])
    base = dict(prior_weight=0.0, min_prefix_prob=0.5, tree_min_prob=0.3)
    chain = TrieSelection(TrieOptions(**base), 1)
    # A depth above max_len is cut to it; a lower one cuts the chain.
    assert chain.select(cands, lengths, np.ones(3), 3, max_depth=4).tolist() == [1, 2, 3]
    assert chain.select(cands, lengths, np.ones(3), 3, max_depth=2).tolist() == [1, 2]
    # A tree of at most 4 nodes, 2 deep: the chain 1 2, then 1's other child 6 (1/3).
    tree = TrieSelection(TrieOptions(**base, tree="on"), 1).select(cands, lengths, np.ones(3),
                                                                   4, max_depth=2)
    assert tree.tokens.tolist() == [1, 2, 6] and tree.parents.tolist() == [-1, 0, 0]
    assert tree.chain_len == 2
