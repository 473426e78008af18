"""Continuation candidates -> weighted trie -> the best-supported draft chain, or tree.

REST and DReSD both retrieve many continuations and keep the prefixes that most of them share.
The trie is materialised in flat arrays (node -> parent, token, weight, first child, next
sibling) so it can be built and walked in compiled code every decoding step.

The chain is the greedy walk from the root that always follows the heaviest child. Its length
adapts to the evidence: a token is drafted only while the estimated probability that the whole
prefix is right, ``weight(node) / (weight(root) + prior_weight)``, stays at or above
``min_prefix_prob``. The prior weight is a pseudo-count for "none of the candidates is right":
with one retrieved continuation and ``prior_weight=1`` the estimate is 0.5, not 1. A tree
(``best_tree``, verified by ``verification``) is that chain plus the trie's next best
nodes, while each is likely enough to be accepted to pay for its verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np

from vllm_retrieval_spec.config import TrieOptions

NO_NODE = -1


@numba.njit(cache=True)
def build_trie(
    candidates: np.ndarray, lengths: np.ndarray, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Insert every candidate prefix into a weighted trie.

    Args:
        candidates: int32 ``[m, L]``; row ``i`` is valid up to ``lengths[i]``.
        lengths: int32 ``[m]``.
        weights: float64 ``[m]``; a node's weight is the sum over candidates passing through it.

    Returns:
        ``(parent, token, weight, first_child, next_sibling, num_nodes)``; node 0 is the root
        (token -1, weight = total weight of all candidates).
    """
    m = candidates.shape[0]
    capacity = 1
    for i in range(m):
        capacity += lengths[i]
    parent = np.full(capacity, NO_NODE, dtype=np.int32)
    token = np.full(capacity, -1, dtype=np.int32)
    weight = np.zeros(capacity, dtype=np.float64)
    first_child = np.full(capacity, NO_NODE, dtype=np.int32)
    next_sibling = np.full(capacity, NO_NODE, dtype=np.int32)
    num_nodes = 1
    for i in range(m):
        w = weights[i]
        node = 0
        weight[0] += w
        for d in range(lengths[i]):
            t = candidates[i, d]
            child = first_child[node]
            while child != NO_NODE and token[child] != t:
                child = next_sibling[child]
            if child == NO_NODE:
                child = num_nodes
                num_nodes += 1
                parent[child] = node
                token[child] = t
                next_sibling[child] = first_child[node]
                first_child[node] = child
            weight[child] += w
            node = child
    return parent, token, weight, first_child, next_sibling, num_nodes


@numba.njit(cache=True)
def best_chain(
    candidates: np.ndarray,
    lengths: np.ndarray,
    weights: np.ndarray,
    max_len: int,
    min_prefix_prob: float,
    prior_weight: float,
    min_len: int = 1,
) -> np.ndarray:
    """The heaviest root-to-leaf walk of the candidates' trie, cut by the evidence rule.

    A chain the rule cuts shorter than ``min_len`` (but not empty) is extended along the
    heaviest children to ``min_len`` tokens, or to where the trie ends: on vLLM-CPU verifying a
    1-token draft costs more than an 8-token one, and 2-5 tokens cost no more than none (see
    ``MethodConfig.min_draft_len``), so the extra tokens are free chances.

    Ties between siblings go to the token seen first in ``candidates`` (row order), which keeps
    the result deterministic across runs and tensor-parallel ranks.
    """
    if candidates.shape[0] == 0 or max_len <= 0:
        return np.empty(0, dtype=np.int32)
    _, token, weight, first_child, next_sibling, _ = build_trie(candidates, lengths, weights)
    nodes = _chain_nodes(weight, first_child, next_sibling, max_len,
                         weight[0] + prior_weight, min_prefix_prob, min_len)
    return token[nodes]


@numba.njit(cache=True)
def _chain_nodes(weight: np.ndarray, first_child: np.ndarray, next_sibling: np.ndarray,
                 max_len: int, denominator: float, min_prefix_prob: float,
                 min_len: int) -> np.ndarray:
    """Trie nodes of ``best_chain``'s walk, root excluded."""
    chain = np.empty(max(max_len, 0), dtype=np.int64)
    if denominator <= 0:
        # Nothing has a vote (e.g. a source weighted 0 and no prior): no evidence, no draft.
        return chain[:0]
    n = 0
    node = 0
    while n < max_len:
        best = NO_NODE
        child = first_child[node]
        while child != NO_NODE:
            # Children are prepended, so among equal weights the later-visited (earlier
            # inserted) sibling wins with >=.
            if best == NO_NODE or weight[child] >= weight[best]:
                best = child
            child = next_sibling[child]
        if best == NO_NODE or (weight[best] / denominator < min_prefix_prob
                               and (n == 0 or n >= min_len)):
            break
        chain[n] = best
        n += 1
        node = best
    return chain[:n]


@numba.njit(cache=True)
def best_tree(
    candidates: np.ndarray,
    lengths: np.ndarray,
    weights: np.ndarray,
    max_nodes: int,
    min_prefix_prob: float,
    prior_weight: float,
    min_len: int,
    branch_min_prob: float,
    max_depth: int,
) -> tuple[np.ndarray, np.ndarray, int, float]:
    """``best_chain``'s chain, then the trie's other nodes best-first while their estimated
    probability of being accepted, ``weight(node) / (weight(root) + prior_weight)``, stays at or
    above ``branch_min_prob``, up to ``max_nodes`` in all and ``max_depth`` deep.

    A node is worth verifying when that probability (the tokens it adds, on average) exceeds
    what verifying one more token costs; ``branch_min_prob`` is that cost plus the trie's
    overconfidence (tuned by replay). Starting from the chain makes the tree accept at least
    what the chain would.

    Returns ``(tokens, parents, chain_len, branch_prob)``: nodes in the order added, so every
    parent precedes its children (``parents[i]`` in [-1, i), -1 for a child of the root) and any
    prefix of the nodes is itself a tree; the first ``chain_len`` nodes are ``best_chain``'s
    draft; ``branch_prob`` is the sum of the other nodes' estimated probabilities.
    """
    tokens = np.empty(max(max_nodes, 0), dtype=np.int32)
    parents = np.empty(max(max_nodes, 0), dtype=np.int32)
    if candidates.shape[0] == 0 or max_nodes <= 0:
        return tokens[:0], parents[:0], 0, 0.0
    trie_parent, token, weight, first_child, next_sibling, num_nodes = build_trie(
        candidates, lengths, weights)
    denominator = weight[0] + prior_weight
    chain = _chain_nodes(weight, first_child, next_sibling, min(max_nodes, max_depth),
                         denominator, min_prefix_prob, min_len)
    depth = np.zeros(num_nodes, dtype=np.int64)
    #: Output index of each trie node added so far (-1: not added; the root maps to -1 too).
    index = np.full(num_nodes, -1, dtype=np.int64)
    frontier = np.empty(num_nodes, dtype=np.int64)
    size = 0
    n = 0
    for node in chain:
        tokens[n] = token[node]
        parents[n] = n - 1
        index[node] = n
        n += 1
        depth[node] = n
    # Every child of the root or of an added node that is not added itself is a candidate.
    for i in range(-1, min(n, max_depth - 1)):
        child = first_child[0] if i < 0 else first_child[chain[i]]
        while child != NO_NODE:
            if index[child] < 0:
                frontier[size] = child
                size += 1
            child = next_sibling[child]
    branch_prob = 0.0
    while n < max_nodes and size > 0 and denominator > 0:
        best = 0
        for f in range(1, size):
            # Ties go to the node inserted first (lower id): deterministic on every rank.
            if weight[frontier[f]] > weight[frontier[best]] or (
                    weight[frontier[f]] == weight[frontier[best]]
                    and frontier[f] < frontier[best]):
                best = f
        node = frontier[best]
        if weight[node] / denominator < branch_min_prob:
            break
        branch_prob += weight[node] / denominator
        size -= 1
        frontier[best] = frontier[size]
        tokens[n] = token[node]
        parents[n] = index[trie_parent[node]] if trie_parent[node] != 0 else -1
        index[node] = n
        n += 1
        depth[node] = depth[trie_parent[node]] + 1
        if depth[node] >= max_depth:
            continue
        child = first_child[node]
        while child != NO_NODE:
            frontier[size] = child
            size += 1
            child = next_sibling[child]
    return tokens[:n], parents[:n], len(chain), branch_prob


class TreeDraft(NamedTuple):
    """A drafted token tree: ``tokens[i]``'s parent is node ``parents[i]`` (-1: the root)."""

    tokens: np.ndarray
    parents: np.ndarray
    #: The first ``chain_len`` nodes are the chain the method drafts with ``tree: "off"``.
    chain_len: int
    #: Sum of the estimated probabilities of the other nodes (``best_tree``): the tokens the
    #: branches are expected to add, as the trie sees it.
    branch_prob: float

    def chain(self) -> np.ndarray:
        return self.tokens[:self.chain_len]


@dataclass(frozen=True)
class TrieSelection:
    """How a trie-voting method turns its candidates into a draft: the best chain, or with
    ``tree: "on"`` the best tree (``TrieOptions``); chains extended to ``min_draft_len``."""

    trie: TrieOptions
    min_draft_len: int

    def select(self, candidates: np.ndarray, lengths: np.ndarray, weights: np.ndarray,
               max_len: int, max_depth: int | None = None) -> np.ndarray | TreeDraft:
        """The best chain of at most ``max_depth`` tokens, or a tree of at most ``max_len``
        nodes and ``max_depth`` deep (``max_depth`` defaults to ``max_len``)."""
        depth = max_len if max_depth is None else min(max_depth, max_len)
        trie = self.trie
        if trie.tree == "on":
            return TreeDraft(*best_tree(candidates, lengths, weights, max_len,
                                        trie.min_prefix_prob, trie.prior_weight,
                                        self.min_draft_len, trie.tree_min_prob, depth))
        return best_chain(candidates, lengths, weights, depth, trie.min_prefix_prob,
                          trie.prior_weight, self.min_draft_len)
