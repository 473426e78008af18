"""DReSD (arXiv 2502.15572): drafts from a dense datastore searched with the last hidden state.

A key is the projected final hidden state at some corpus position p; that state predicted
token p + 1. The query is the state that predicted the token just emitted, so a neighbour
agrees with the request only if its stored next token is that token (DReSD's filter); the tokens
after it are the neighbour's draft. The kept neighbours' continuations are voted in a trie,
weighted by similarity, and the best-supported chain is drafted with an adaptive length.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numba
import numpy as np

from vllm_retrieval_spec.config import DresdConfig, HybridConfig
from vllm_retrieval_spec.datastore.dense import DenseIndex, Projection
from vllm_retrieval_spec.datastore.format import SEPARATOR
from vllm_retrieval_spec.datastore.suffix_array import copy_continuation
from vllm_retrieval_spec.drafting.tree import TreeDraft, select_draft
from vllm_retrieval_spec.proposers.base import RetrievalProposer


@numba.njit(cache=True)
def matching_continuations(tokens: np.ndarray, positions: np.ndarray, neighbours: np.ndarray,
                           scores: np.ndarray, emitted: int,
                           continuation_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Continuations of the neighbours whose stored next token is ``emitted``.

    ``neighbours`` index ``positions`` (-1 = no hit); a continuation starts two tokens after the
    key's position and stops at SEPARATOR. Returns (cands int32 [m, continuation_len] padded
    with -1, lengths int32 [m], weights float64 [m]: similarity, floored at 0).
    """
    m = neighbours.shape[0]
    cands = np.full((m, continuation_len), SEPARATOR, dtype=np.int32)
    lengths = np.zeros(m, dtype=np.int32)
    weights = np.zeros(m, dtype=np.float64)
    size = tokens.shape[0]
    kept = 0
    for i in range(m):
        if neighbours[i] < 0:
            continue
        pos = positions[neighbours[i]] + 1
        if pos >= size or tokens[pos] != emitted:
            continue
        lengths[kept] = copy_continuation(tokens, pos + 1, cands[kept])
        weights[kept] = max(scores[i], 0.0)
        kept += 1
    return cands[:kept], lengths[:kept], weights[:kept]


def load_dense_index(config: DresdConfig | HybridConfig, model_config: Any) -> DenseIndex:
    """The datastore's dense index, opened in the worker by the proposers that search it. The
    front-end already checked the model, dtype, checksums and tokenizer
    (``plugin.validate_against_model``)."""
    return DenseIndex.from_path(config.datastore, hidden_size=model_config.get_hidden_size(),
                                search=config.search, verify_checksums=False)


def dresd_draft(index: DenseIndex, neighbours: np.ndarray, scores: np.ndarray, emitted: int,
                max_len: int, config: DresdConfig) -> np.ndarray | TreeDraft:
    """The best chain of the neighbours' continuations after the ``emitted`` filter."""
    cands, lengths, weights = matching_continuations(
        index.tokens, index.positions, neighbours, scores, emitted, max_len)
    return select_draft(cands, lengths, weights, max_len, config)


def project_last_states(projection: Projection, states: Any,
                        rows: list[int]) -> tuple[np.ndarray, list[int]]:
    """Queries for the batch rows that sampled a token: ``states[rows[i]]`` produced row i's
    last token (row -1: nothing sampled). Returns (unit queries float32 [m, d], the m batch
    rows they belong to)."""
    valid = [i for i, row in enumerate(rows) if row >= 0]
    if not valid:
        return np.empty((0, projection.components.shape[1]), dtype=np.float32), valid
    return projection(states[[rows[i] for i in valid]]), valid


class DresdProposer(RetrievalProposer):
    """Projects the batch's last hidden states (``record_last_hidden_states``, called by the
    plugin each step before ``propose``), searches them, and drafts per request.

    With more than one request the searches run in a thread pool while earlier rows are voted;
    ``search_ns`` (time spent searching) against ``search_wait_ns`` (time drafting waited for a
    search) says how much of the search time was hidden.

    With ``precompute_drafts`` the search starts before sampling (``search_ahead``, called by
    the plugin right after the forward): every state the forward computed that could be a
    request's last one (the root's and each draft token's: which one depends on how many draft
    tokens are accepted) is projected and searched in the pool while vLLM computes the logits,
    samples and does its bookkeeping; once the sampled tokens are known each request keeps the
    search of its own state. With ``draft_before_sampling`` a greedy request's last state is
    known from the logits: it is searched (or its search ahead taken) and the draft made
    before vLLM samples (``RetrievalProposer.draft_before_sampling``).
    """

    config: DresdConfig

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        self.index = load_dense_index(self.config, vllm_config.model_config)
        self.pool = ThreadPoolExecutor(self.config.search_threads,
                                       thread_name_prefix="dresd-search")
        #: This step's searches (futures until first consumed) and each batch row's
        #: (chunk, row within chunk).
        self.chunks: list[Future | tuple[np.ndarray, np.ndarray, int]] = []
        self.row_chunk: list[tuple[int, int] | None] = []
        self.search_ns = 0
        self.search_wait_ns = 0
        #: This step's search of every candidate state (``search_ahead``) and their number.
        self.ahead: Future | None = None
        self.ahead_rows = 0
        #: Steps whose searches ran in the pool from right after the forward ("ahead") or
        #: started once the rows' last states were known ("after").
        self.searched: Counter[str] = Counter()
        #: The rows this step's searches are for (``record_last_hidden_states``).
        self.searched_rows: list[int] | None = None
        # Compile the numba functions now rather than inside the first decoding step.
        dresd_draft(self.index, np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.float32), 0,
                    self.k, self.config)

    def search_ahead(self, candidates: Any) -> None:
        """Start projecting and searching ``candidates`` (the rows of the step's sampled hidden
        states, [m, H]) in the pool, before the sampled tokens are known (with
        ``precompute_drafts``); they are kept for ``draft_before_sampling``."""
        self.forward_states = candidates
        self.searched_rows = None
        if not self.precompute:
            return
        self.ahead = self.pool.submit(self._project_and_search, candidates)
        self.ahead_rows = int(candidates.shape[0])

    def _project_and_search(self, candidates: Any) -> tuple[np.ndarray, np.ndarray, int]:
        return self._search(project_last_states(self.index.projection, candidates,
                                                list(range(candidates.shape[0])))[0])

    def record_last_hidden_states(self, states: Any, rows: list[int]) -> None:
        """``states[rows[i]]`` is the final hidden state that produced batch row i's last
        sampled token (row -1: nothing was sampled). Takes their searches from ``search_ahead``
        when it searched these states; else projects them and starts the searches: one batched
        search inline for a single request, else a few chunks in the thread pool, so that rows
        whose chunk is done are voted while the rest is still searched."""
        if rows == self.searched_rows:
            # Searched before sampling (``draft_before_sampling``), for the same rows.
            return
        self.searched_rows = rows
        self.row_chunk = [None] * len(rows)
        self.chunks = []
        ahead, self.ahead = self.ahead, None
        if ahead is not None and self.ahead_rows == states.shape[0]:
            # Row r of the step's states is row r of the search ahead.
            self.chunks = [ahead]
            self.row_chunk = [(0, row) if row >= 0 else None for row in rows]
            self.searched["ahead"] += 1
            return
        if self.drafting_off(sum(row >= 0 for row in rows)):
            # propose() will draft nothing: neither project nor search.
            return
        try:
            queries, valid = project_last_states(self.index.projection, states, rows)
        except Exception:
            # No query, no draft: the engine goes on.
            self._fail("exception", "could not project hidden states", exc_info=True)
            return
        if not valid:
            return
        self.searched["after"] += 1
        num_chunks = 1 if len(valid) == 1 else min(len(valid), 2 * self.config.search_threads)
        bounds = np.linspace(0, len(valid), num_chunks + 1).astype(int)
        for c, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            chunk = queries[lo:hi]
            self.chunks.append(self._search(chunk) if num_chunks == 1
                               else self.pool.submit(self._search, chunk))
            for j, i in enumerate(valid[lo:hi]):
                self.row_chunk[i] = (c, j)

    def observe_batch(self, req_ids: list[str], tree_rows: list[bool] | None = None) -> None:
        super().observe_batch(req_ids, tree_rows)
        # A new step (also where nothing was searched ahead): its states are searched anew.
        self.searched_rows = None

    def _search(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        start = time.perf_counter_ns()
        neighbours, scores = self.index.search(queries, self.config.top_n)
        return neighbours, scores, time.perf_counter_ns() - start

    def draft_row(self, row: int, context: np.ndarray, max_len: int) -> np.ndarray | TreeDraft:
        where = self.row_chunk[row] if row < len(self.row_chunk) else None
        if where is None:
            return np.empty(0, dtype=np.int32)
        c, j = where
        result = self.chunks[c]
        if isinstance(result, Future):
            start = time.perf_counter_ns()
            # A search still running past the budget costs this request its draft (TimeoutError,
            # counted by the caller), not the step its time.
            result = result.result(timeout=self.budget_ns / 1e9 or None)
            self.search_wait_ns += time.perf_counter_ns() - start
            self.search_ns += result[2]
            self.chunks[c] = result
        elif j == 0:
            # Searched inline (or counted already): an inline search was all waited for.
            self.search_ns += result[2]
            self.search_wait_ns += result[2]
        neighbours, scores, _ = result
        return dresd_draft(self.index, neighbours[j], scores[j], int(context[-1]), max_len,
                           self.config)

    def stats(self, reset: bool = False) -> dict[str, int]:
        return {**super().stats(reset), "search_ns": self.search_ns,
                "search_wait_ns": self.search_wait_ns,
                "searched_ahead": self.searched["ahead"],
                "searched_after": self.searched["after"]}
