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
