"""Continuation candidates -> weighted trie -> the best-supported draft chain.

REST and DReSD both retrieve many continuations and keep the prefixes that most of them share.
The trie is materialised in flat arrays (node -> parent, token, weight, first child, next
sibling) so it can be built and walked in compiled code every decoding step, and so a later
tree-verification path can take the top nodes instead of one chain.

vLLM 0.32 verifies one chain per request, so the draft is the greedy walk from the root that
always follows the heaviest child. Its length adapts to the evidence: a token is drafted only
while the estimated probability that the whole prefix is right,
``weight(node) / (weight(root) + prior_weight)``, stays at or above ``min_prefix_prob``. The prior
weight is a pseudo-count for "none of the candidates is right": with one retrieved continuation
and ``prior_weight=1`` the estimate is 0.5, not 1.
"""

from __future__ import annotations

import numba
import numpy as np

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
    denominator = weight[0] + prior_weight
    if denominator <= 0:
        # Nothing has a vote (e.g. a source weighted 0 and no prior): no evidence, no draft.
        return np.empty(0, dtype=np.int32)
    chain = np.empty(max_len, dtype=np.int32)
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
        chain[n] = token[best]
        n += 1
        node = best
    return chain[:n]
