"""DReSD (arXiv 2502.15572): drafts from a dense datastore searched with the last hidden state.

The dense index (``sources.dense``) is searched with the state that predicted the token just
emitted; the neighbours whose stored next token is that token vote their continuations in a
trie, weighted by similarity, and the best-supported chain is drafted.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from vllm_retrieval_spec.config import DresdConfig
from vllm_retrieval_spec.contract import Capabilities, MethodDrafter
from vllm_retrieval_spec.datastore.dense import DenseIndex
from vllm_retrieval_spec.drafting.adaptive import drafting_off
from vllm_retrieval_spec.drafting.streams import AheadProjection, Handed
from vllm_retrieval_spec.drafting.tree import TreeDraft, TrieSelection
from vllm_retrieval_spec.drafting.trie import TrieDrafter
from vllm_retrieval_spec.sources.dense import (
    DenseSource, matching_continuations, project_last_states, warm_up_projection)

#: (neighbours [m, top_n], similarities [m, top_n], ns spent searching)
Searched = tuple[np.ndarray, np.ndarray, int]


class DenseSearches:
    """This step's searches of the batch's last states, each row's neighbours for
    ``DenseSource``.

    With more than one request the searches run in a thread pool while earlier rows are voted;
    ``search_ns`` (time spent searching) against ``search_wait_ns`` (time drafting waited for a
    search) says how much of the search time was hidden.

    With ``precompute`` the search starts before sampling (``search_ahead``): every state the
    forward computed that could be a request's last one (the root's and each draft token's:
    which one depends on how many draft tokens are accepted) is projected and searched in the
    pool while vLLM computes the logits, samples and does its bookkeeping; once the sampled
    tokens are known each request keeps the search of its own state. On a GPU the pool thread
    waits for the forward that writes the states on a stream of its own (``AheadProjection``).
    """

    def __init__(self, index: DenseIndex, top_n: int, threads: int, precompute: bool,
                 budget_s: float, disable_by_batch_size: int,
                 report: Callable[..., None]) -> None:
        self.index = index
        self.top_n = top_n
        self.threads = threads
        self.precompute = precompute
        self.budget_s = budget_s
        self.disable_by_batch_size = disable_by_batch_size
        self.report = report
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="dresd-search")
        self.projector = AheadProjection(index.projection.on_device)
        #: This step's searches (futures until first consumed) and each batch row's
        #: (chunk, row within chunk).
        self.chunks: list[Future | Searched] = []
        self.row_chunk: list[tuple[int, int] | None] = []
        self.search_ns = 0
        self.search_wait_ns = 0
        #: This step's search of every candidate state (``search_ahead``) and their number.
        self.ahead: Future | None = None
        self.ahead_rows = 0
        #: Steps whose searches ran in the pool from right after the forward ("ahead") or
        #: started once the rows' last states were known ("after").
        self.searched: Counter[str] = Counter()
        #: The rows this step's searches are for (``record``).
        self.searched_rows: list[int] | None = None

    def new_step(self) -> None:
        # Also where nothing was searched ahead: this step's states are searched anew.
        self.searched_rows = None

    def search_ahead(self, candidates: Any) -> None:
        """Start projecting and searching ``candidates`` (the rows of the step's sampled hidden
        states, [m, H]) in the pool, before the sampled tokens are known."""
        self.searched_rows = None
        if not self.precompute:
            return
        self.ahead = self.pool.submit(self._project_and_search,
                                      self.projector.hand_over(candidates))
        self.ahead_rows = int(candidates.shape[0])

    def _project_and_search(self, handed: Handed) -> Searched:
        with self.projector.queries(handed) as queries:
            return self.search(queries)

    def record(self, states: Any, rows: list[int]) -> None:
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
        if drafting_off(sum(row >= 0 for row in rows), self.disable_by_batch_size):
            # propose() will draft nothing: neither project nor search.
            return
        try:
            queries, valid = project_last_states(self.index.projection, states, rows)
        except Exception:
            # No query, no draft: the engine goes on.
            self.report("exception", "could not project hidden states", exc_info=True)
            return
        if not valid:
            return
        self.searched["after"] += 1
        num_chunks = 1 if len(valid) == 1 else min(len(valid), 2 * self.threads)
        bounds = np.linspace(0, len(valid), num_chunks + 1).astype(int)
        for c, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            chunk = queries[lo:hi]
            self.chunks.append(self.search(chunk) if num_chunks == 1
                               else self.pool.submit(self.search, chunk))
            for j, i in enumerate(valid[lo:hi]):
                self.row_chunk[i] = (c, j)

    def search(self, queries: np.ndarray) -> Searched:
        start = time.perf_counter_ns()
        neighbours, scores = self.index.search(queries, self.top_n)
        return neighbours, scores, time.perf_counter_ns() - start

    def neighbours(self, row: int) -> tuple[np.ndarray, np.ndarray] | None:
        where = self.row_chunk[row] if row < len(self.row_chunk) else None
        if where is None:
            return None
        c, j = where
        result = self.chunks[c]
        if isinstance(result, Future):
            start = time.perf_counter_ns()
            # A search still running past the budget costs this request its draft (TimeoutError,
            # counted by the caller), not the step its time.
            result = result.result(timeout=self.budget_s or None)
            self.search_wait_ns += time.perf_counter_ns() - start
            self.search_ns += result[2]
            self.chunks[c] = result
        elif j == 0:
            # Searched inline (or counted already): an inline search was all waited for.
            self.search_ns += result[2]
            self.search_wait_ns += result[2]
        neighbours, scores, _ = result
        return neighbours[j], scores[j]

    def stats(self) -> dict[str, int]:
        return {"search_ns": self.search_ns, "search_wait_ns": self.search_wait_ns,
                "searched_ahead": self.searched["ahead"],
                "searched_after": self.searched["after"]}


class DresdDrafter(MethodDrafter):
    """Searches the batch's last hidden states (``DenseSearches``) and votes each row's
    neighbours (``DenseSource``)."""

    def __init__(self, config: DresdConfig, index: DenseIndex, report: Callable[..., None]
                 ) -> None:
        drafting = config.drafting
        self.index = index
        self.searches = DenseSearches(
            index, config.search.top_n, config.search_threads,
            drafting.precompute_drafts and not drafting.inject_faults,
            drafting.draft_budget_ms / 1e3, drafting.disable_by_batch_size, report)
        self.trie = TrieDrafter([DenseSource(index, self.searches.neighbours)],
                                TrieSelection(config.trie, drafting.min_draft_len))
        self.capabilities = Capabilities(last_hidden_states=True,
                                         trees=config.trie.tree == "on")

    def draft(self, row: int, context: np.ndarray, max_len: int) -> np.ndarray | TreeDraft:
        return self.trie.draft(row, context, max_len)

    def begin_step(self, req_ids: list[str], served_keys: list[str | None] | None) -> None:
        self.searches.new_step()

    def search_ahead(self, states: Any) -> None:
        self.searches.search_ahead(states)

    def record_last_hidden_states(self, states: Any, rows: list[int]) -> None:
        self.searches.record(states, rows)

    def warm_up(self, max_len: int, device: Any, dtype: Any) -> None:
        # The projection, the searcher (ScaNN loads lazily), the search threads, the filter.
        query = warm_up_projection(self.index, device, dtype)
        self.searches.pool.submit(self.searches.search, query).result()
        candidates, lengths, weights = matching_continuations(
            self.index.tokens, self.index.positions, np.zeros(1, dtype=np.int64),
            np.ones(1, dtype=np.float32), 0, max_len)
        self.trie.selection.select(candidates, lengths, weights, max_len)

    def stats(self, reset: bool) -> dict[str, int]:
        return self.searches.stats()

    def close(self) -> None:
        self.searches.pool.shutdown(wait=False, cancel_futures=True)


def make_drafter(config: DresdConfig, vllm_config: Any,
                 report: Callable[..., None]) -> DresdDrafter:
    # The front-end already checked the model, dtype, checksums and tokenizer
    # (``config.model.validate_against_model``).
    index = DenseIndex.from_path(config.store.datastore,
                                 hidden_size=vllm_config.model_config.get_hidden_size(),
                                 search=config.search.search, verify_checksums=False)
    return DresdDrafter(config, index, report)
