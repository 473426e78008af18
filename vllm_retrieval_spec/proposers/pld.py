"""PLD and PLD+ (arXiv 2412.01447): drafting from the request's own context.

PLD:
The longest context suffix (``max_match_len`` down to ``min_match_len`` tokens) that occurred
earlier in the same request is found by a compiled backwards scan; the continuations of its
most recent occurrences are voted in the weighted trie, like REST's, and the best chain is
drafted with an adaptive length. vLLM's ``ngram`` instead drafts k tokens after one occurrence.

PLD+: every earlier occurrence of the last token is a candidate; they are ranked by the cosine
similarity of an early layer's hidden states (the paper's PLD+(h)) and the best one's
continuation is drafted. The paper's attention-based ranking, PLD+(a), needs attention weights,
which vLLM's fused attention kernels never materialise, so it is not offered.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from vllm_retrieval_spec.config import PldConfig, PldPlusConfig
from vllm_retrieval_spec.drafting.overlap import context_followers, rank_followers
from vllm_retrieval_spec.drafting.tree import TreeDraft, select_draft
from vllm_retrieval_spec.proposers.base import RetrievalProposer
from vllm_retrieval_spec.proposers.hidden_states import HiddenStateCache, unit_rows


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


def pld_draft(context: np.ndarray, max_len: int, config: PldConfig) -> np.ndarray | TreeDraft:
    """Continuations of the longest earlier match in the context, voted; the best chain."""
    candidates, lengths, _ = find_context_matches(
        context, config.min_match_len, config.max_match_len, config.max_occurrences, max_len)
    return select_draft(candidates, lengths, np.ones(len(candidates)), max_len, config)


class PldProposer(RetrievalProposer):
    config: PldConfig

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        # Compile now rather than inside the first decoding step.
        self.draft(np.zeros(2 * self.config.max_match_len, dtype=np.int32), self.k)

    def draft(self, context: np.ndarray, max_len: int) -> np.ndarray | TreeDraft:
        return pld_draft(context, max_len, self.config)

    def followers(self, row: int, context: np.ndarray) -> tuple[np.ndarray, bool]:
        # A match of 2 or more tokens ending in b means (context[-1], b) occurred earlier.
        return rank_followers(context_followers(context)), self.config.min_match_len >= 2


def rank_occurrences(context: np.ndarray, unit_states: np.ndarray, min_similarity: float,
                     max_candidates: int) -> int:
    """PLD+(h): the earlier occurrence ``j`` of the last token whose preceding state is most
    similar to the state before the last token, or -1.

    ``unit_states[p]`` is the unit-normalised early-layer state of context position ``p``; the
    last token's own state is not computed yet, so ``cos(H[j - 1], H[n - 2])`` compares the
    states that led to each occurrence with the one that led to the last token.
    """
    n = len(context)
    if n < 3 or len(unit_states) < n - 1:
        return -1
    occurrences = np.flatnonzero(context[1:n - 1] == context[n - 1]) + 1
    if not len(occurrences):
        return -1
    occurrences = occurrences[-max_candidates:]
    similarity = unit_states[occurrences - 1] @ unit_states[n - 2]
    best = int(np.argmax(similarity))
    return int(occurrences[best]) if similarity[best] >= min_similarity else -1


def pld_plus_draft(context: np.ndarray, unit_states: np.ndarray, max_len: int,
                   config: PldPlusConfig) -> np.ndarray:
    """The continuation of the best-ranked occurrence of the last token."""
    j = rank_occurrences(context, unit_states, config.min_similarity, config.max_candidates)
    if j < 0:
        return np.empty(0, dtype=np.int32)
    return np.asarray(context[j + 1:j + 1 + max_len], dtype=np.int32)


class PldPlusProposer(RetrievalProposer):
    """Keeps every request's early-layer states (``record_hidden_states``, called by the plugin
    each step before ``propose``) and drafts with ``pld_plus_draft``."""

    config: PldPlusConfig

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        self.aux_hidden_state_layers = (self.config.layer,)
        self.hidden_size = vllm_config.model_config.get_hidden_size()
        self.caches: dict[str, HiddenStateCache] = {}

    def record_hidden_states(self, req_ids: list[str], aux_hidden_states: list[Any],
                             segments: list[tuple[int, int, int]]) -> None:
        """Store this step's accepted states; forget requests that left the batch.

        A failure here must not reach the engine: the caches are dropped instead, so requests
        get no draft until their states are complete again (a recompute from position 0).
        """
        try:
            states = aux_hidden_states[0]
            for req_id in self.caches.keys() - set(req_ids):
                del self.caches[req_id]
            for req_id, (position, offset, count) in zip(req_ids, segments):
                cache = self.caches.get(req_id)
                if cache is None:
                    cache = self.caches[req_id] = HiddenStateCache(self.hidden_size,
                                                                   self.max_model_len)
                rows = states[offset:offset + count].float().cpu().numpy()
                cache.write(position, unit_rows(rows))
        except Exception:
            self._fail("exception", "could not record hidden states", exc_info=True)
            self.caches.clear()

    def draft_row(self, row: int, context: np.ndarray, max_len: int) -> np.ndarray:
        cache = self.caches.get(self.row_req_ids[row]) if row < len(self.row_req_ids) else None
        states = cache.view() if cache is not None else None
        if states is None:
            # States for part of the context were never seen: no draft rather than a guess.
            return np.empty(0, dtype=np.int32)
        return pld_plus_draft(context, states, max_len, self.config)
