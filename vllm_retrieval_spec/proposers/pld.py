"""PLD: prompt lookup, drafting from the request's own context (baseline of arXiv 2412.01447).

The longest context suffix (``max_match_len`` down to ``min_match_len`` tokens) that occurred
earlier in the same request is found by a compiled backwards scan; the continuations of its
most recent occurrences are voted in the weighted trie, like REST's, and the best chain is
drafted with an adaptive length. vLLM's ``ngram`` instead drafts k tokens after one occurrence.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from vllm_retrieval_spec.config import PldConfig
from vllm_retrieval_spec.drafting.tree import best_chain
from vllm_retrieval_spec.proposers.base import RetrievalProposer


@numba.njit(cache=True)
def find_context_matches(
    context: np.ndarray, min_len: int, max_len: int, max_occurrences: int,
    continuation_len: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Continuations of the earlier occurrences of the longest suffix of ``context``.

    An occurrence is an end position ``j < len(context) - 1`` whose preceding tokens equal the
    context's last ``n`` tokens, ``min_len <= n <= max_len``; only those of the longest ``n``
    found are kept, most recent first, at most ``max_occurrences``. Returns
    (candidates int32 [m, continuation_len] padded with -1, lengths int32 [m], n).
    """
    size = context.shape[0]
    ends = np.empty(max_occurrences, dtype=np.int64)
    count = 0
    best = 0
    for j in range(size - 2, -1, -1):
        n = 0
        while n < max_len and n <= j and context[j - n] == context[size - 1 - n]:
            n += 1
        if n < min_len or n < best:
            continue
        if n > best:
            best = n
            count = 0
        if count < max_occurrences:
            ends[count] = j
            count += 1
    candidates = np.full((count, continuation_len), -1, dtype=np.int32)
    lengths = np.zeros(count, dtype=np.int32)
    for i in range(count):
        length = min(continuation_len, size - 1 - ends[i])
        candidates[i, :length] = context[ends[i] + 1:ends[i] + 1 + length]
        lengths[i] = length
    return candidates, lengths, best


def pld_draft(context: np.ndarray, max_len: int, config: PldConfig) -> np.ndarray:
    """Continuations of the longest earlier match in the context, voted; the best chain."""
    candidates, lengths, _ = find_context_matches(
        context, config.min_match_len, config.max_match_len, config.max_occurrences, max_len)
    return best_chain(candidates, lengths, np.ones(len(candidates)), max_len,
                      config.min_prefix_prob, config.prior_weight)


class PldProposer(RetrievalProposer):
    config: PldConfig

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        # Compile now rather than inside the first decoding step.
        self.draft(np.zeros(2 * self.config.max_match_len, dtype=np.int32), self.k)

    def draft(self, context: np.ndarray, max_len: int) -> np.ndarray:
        return pld_draft(context, max_len, self.config)
