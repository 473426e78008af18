"""Hybrid drafting: the request's own context (PLD), what the engine has served (finished
requests, ``datastore.served``), a REST suffix array and a DReSD dense index in one weighted
trie. Only the context and the served store need nothing built beforehand.

No source alone is the best drafter: the context knows the request's names and the text it is
rewriting, the suffix array knows the corpus's exact phrasing, the dense index finds corpus
positions where the model was in a similar state even when the last tokens differ. Candidates
from every source are merged in one trie with comparable weights and the best-supported chain
is drafted. A long context match is trusted alone: the datastore is then not searched at all
(the served store always is: a lookup costs microseconds).
"""

from __future__ import annotations

import atexit
import multiprocessing.util
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_retrieval_spec.config import ConfigError, HybridConfig
from vllm_retrieval_spec.contract import Capabilities, MethodDrafter
from vllm_retrieval_spec.datastore.dense import DenseIndex, dense_index_in_use
from vllm_retrieval_spec.datastore.served import KeyedServedStores, ServedStore
from vllm_retrieval_spec.datastore.served_requests import ServedRequests
from vllm_retrieval_spec.datastore.served_saver import ServedDirectory, tokenizer_facts
from vllm_retrieval_spec.datastore.served_dense import ServedDenseStore, accepted_state_rows
from vllm_retrieval_spec.datastore.suffix_array import SuffixArrayDatastore
from vllm_retrieval_spec.drafting.tree import TreeDraft, TrieSelection
from vllm_retrieval_spec.drafting.trie import TrieDrafter
from vllm_retrieval_spec.metrics import counts_metrics, served_store_tokens_gauge
from vllm_retrieval_spec.sources.base import Gated, Vote
from vllm_retrieval_spec.sources.context import ContextSource, LastTokenBranches
from vllm_retrieval_spec.sources.dense import (
    DenseSource, matching_continuations, project_last_states, searched, warm_up_projection)
from vllm_retrieval_spec.sources.served_dense import ServedDenseSource
from vllm_retrieval_spec.sources.suffix_array import SuffixArraySource

#: DReSD's projection width (the paper's 64), for a served dense store without a dense index.
SERVED_DENSE_DIMS = 64


class StepQueries:
    """The step's last hidden states (``record``) and each row's query, projected for the whole
    batch at the first row that needs one: on vLLM-CPU the projection took ~0.2 ms per step, a
    third of hybrid's drafting time, and a long context match needs none."""

    def __init__(self, projection: Callable[[], Any], report: Callable[..., None]) -> None:
        #: The projection to use (the dense index's, else the served dense store's once fitted).
        self.projection = projection
        self.report = report
        #: This step's (states, rows) until the first row that needs a query projects them.
        self.pending: tuple[Any, list[int]] | None = None
        #: This step's (states, rows), kept for the served dense store after the queries.
        self.step_states: tuple[Any, list[int]] | None = None
        self.queries = np.empty((0, 0), dtype=np.float32)
        #: Batch row -> its query's index in ``queries`` (this step's rows that sampled).
        self.row_query: dict[int, int] = {}

    def record(self, states: Any, rows: list[int]) -> None:
        self.pending = self.step_states = (states, rows)
        self.row_query = {}

    def query(self, row: int) -> np.ndarray | None:
        if self.pending is not None:
            states, rows = self.pending
            self.pending = None
            projection = self.projection()
            try:
                if projection is not None:  # the served dense store's, before it is fitted
                    self.queries, valid = project_last_states(projection, states, rows)
                    self.row_query = {r: q for q, r in enumerate(valid)}
            except Exception:
                # No query, no dense candidates: the other sources still draft.
                self.report("exception", "could not project hidden states", exc_info=True)
        q = self.row_query.get(row)
        return None if q is None else self.queries[q]


class ServedLearning:
    """What hybrid learns from: every request vLLM finishes is stored (its prompt and output)
    in the served store every request drafts from, or in the store its key names; with
    ``served_dense`` its final hidden states too. With ``served_datastore`` every stored request
    is journaled there as well, and the stores start from it and learn from the other replicas
    sharing it (``datastore.served_saver``)."""

    def __init__(self, config: HybridConfig, model_config: Any, dense: DenseIndex | None,
                 background: bool, counted: bool = True) -> None:
        options = config.served
        self.keyed = KeyedServedStores(options.served_max_tokens, options.served_max_keys,
                                       background=background) \
            if options.served_store == "per_request" else None
        self.shared = None if self.keyed is not None else \
            ServedStore(options.served_max_tokens, background=background)
        self.dense = None
        if config.served_dense.served_dense:
            # With a dense index, its projection (one query searches both), else one fitted on
            # the first served states.
            self.dense = ServedDenseStore(
                config.served_dense.served_dense_max_keys,
                dense.manifest.dims if dense is not None
                else min(SERVED_DENSE_DIMS, model_config.get_hidden_size()),
                projection=dense.projection if dense is not None else None,
                fit_states=config.served_dense.served_dense_fit_states, background=background)
        self.directory = None
        if options.served_datastore:
            from vllm_retrieval_spec.datastore.served_dense import ModelFacts

            self.directory = ServedDirectory(
                options.served_datastore, self.keyed or self.shared,
                tokenizer_facts(model_config), flush_s=options.served_flush_ms / 1000,
                compact_s=60 * options.served_save_minutes,
                max_age_s=3600 * options.served_max_age_hours, dense=self.dense,
                model=ModelFacts.of(model_config) if self.dense is not None else None,
                background=background)
        self.requests: ServedRequests | None = ServedRequests(
            self.keyed or self.shared, options.served_prompts, self.dense,
            self.directory.record if self.directory is not None else None)
        self.tokens_gauge = served_store_tokens_gauge(config.method, counted)
        #: Each batch row's key and store this step (``per_request``).
        self.row_keys: list[str | None] = []
        self.row_stores: list[ServedStore | None] = []
        #: This step's drafts made before sampling, when recording its tokens waits for the
        #: handover (``settle``).
        self.deferred: list[Any] | None = None
        # vLLM has no shutdown call for drafters; the worker process's exit is the last
        # chance to store and journal the requests that never left a batch. A worker started
        # by multiprocessing may leave through os._exit, which skips atexit but still runs
        # multiprocessing's finalizers; close() runs once, whichever comes first.
        atexit.register(self.close)
        multiprocessing.util.Finalize(self, self.close, exitpriority=10)

    def store(self, row: int) -> ServedStore | None:
        """The served store batch row ``row`` is drafted from this step."""
        if self.keyed is None:
            return self.shared
        return self.row_stores[row] if row < len(self.row_stores) else None

    def begin_step(self, req_ids: list[str], keys: list[str | None] | None) -> None:
        if self.keyed is not None:
            keys = keys or [None] * len(req_ids)
            # On disk and in memory a key is its salted digest (``ServedDirectory.key_of``).
            self.row_keys = keys if self.directory is None else \
                [self.directory.key_of(key) for key in keys]
            self.row_stores = [self.keyed.get(key) for key in self.row_keys]

    def finish(self, req_ids: set[str], tokens: dict[str, np.ndarray] | None = None) -> None:
        """Store (and journal) the requests vLLM says are finished, now: after a burst's last
        request no step may come for a long time, and a crash must not lose it meanwhile.
        The last step's handover is settled first (``Drafter.observe_finished``)."""
        self.requests.finish(req_ids, tokens)

    def settle(self) -> None:
        self.tokens_gauge.set((self.keyed or self.shared).num_tokens)
        ready, self.deferred = self.deferred, None
        if ready:
            self.requests.observe(
                [r.req_id for r in ready], [r.sampled for r in ready],
                [len(r.context) for r in ready], [r.context for r in ready],
                [self.row_keys[r.row] for r in ready] if self.keyed is not None else None)

    def stats(self) -> dict[str, int]:
        store = self.keyed or self.shared
        stats = {"served_store_tokens": store.num_tokens,
                 "served_store_requests": store.num_documents}
        if self.keyed is not None:
            stats["served_store_keys"] = self.keyed.num_stores
        if self.dense is not None:
            stats.update(served_dense_keys=self.dense.num_keys, served_dense_busy=self.dense.busy,
                         served_dense_hits=self.dense.hits)
        return stats

    def close(self) -> None:
        """Store (and journal) the requests still tracked, flush the journal, stop the
        threads. Idempotent."""
        if self.requests is None:
            return
        self.settle()
        self.requests.finish_all()
        self.requests = None
        if self.directory is not None:
            self.directory.close()
        (self.keyed or self.shared).close()
        if self.dense is not None:
            self.dense.close()


def hybrid_trie(config: HybridConfig, datastore: SuffixArrayDatastore | None = None,
                dense: DenseIndex | None = None,
                served: Callable[[int], ServedStore | None] | None = None,
                served_dense: ServedDenseStore | None = None,
                query: Callable[[int], np.ndarray | None] | None = None,
                dense_neighbours: Callable[[int], Any] | None = None,
                served_keys: bool = False) -> TrieDrafter:
    """Hybrid's sources in one trie: the context, the served store ``served(row)`` (and, with
    trees, the last token's other continuations), then, while the context match is short, the
    datastore's suffix array, its ``dense`` index (``dense_neighbours(row)``) and the served
    store's dense half (``query(row)``: the row's projected last state)."""
    match, context = config.match, config.context
    top_n, skip = config.search.top_n, context.skip_datastore_match_len
    own = ContextSource(context.context_min_match_len, context.context_max_match_len,
                        match.max_occurrences,
                        # Every context occurrence is evidence of its own: the request repeats
                        # itself.
                        Vote(context.context_weight, per_token=True))
    sources: list[Any] = [own]
    served_source = None
    if served is not None:
        # Searched whatever the context match: a few microseconds, and the model's own earlier
        # answers often continue further than the request's own text does.
        served_source = SuffixArraySource(
            served, match.min_match_len, match.max_match_len, match.max_occurrences,
            Vote(config.served.served_weight, per_token=True, shared=True), name="served",
            stateful=True)
        sources.append(served_source)
    if config.trie.tree == "on" and config.tree_branch_weight:
        sources.append(LastTokenBranches(own, served_source, config.tree_branch_weight))
    if datastore is not None:
        # Occurrences in a large corpus are many and alike: together they weigh as one.
        sources.append(Gated(SuffixArraySource(
            lambda row: datastore, match.min_match_len, match.max_match_len,
            match.max_occurrences, Vote(1.0, per_token=True, shared=True)), skip))
    if dense is not None:
        sources.append(Gated(DenseSource(dense, dense_neighbours, config.dense.dense_weight,
                                         top_n), skip))
    if served_dense is not None:
        sources.append(Gated(ServedDenseSource(
            served_dense, query, config.served_dense.served_dense_weight, top_n), skip))
    states = dense is not None or served_dense is not None
    return TrieDrafter(
        sources, TrieSelection(config.trie, config.drafting.min_draft_len),
        config.max_spec_factor, Capabilities(
            last_hidden_states=states, precomputable=not states, served_store_keys=served_keys,
            trees=config.trie.tree == "on"))


class HybridDrafter(MethodDrafter):
    """Every source hybrid has, in one ``TrieDrafter``: the context, the served store (and,
    with trees, the last token's other continuations), then, while the context match is short,
    the datastore's suffix array, its dense index and the served store's dense half."""

    def __init__(self, config: HybridConfig, datastore: SuffixArrayDatastore | None,
                 dense: DenseIndex | None, learning: ServedLearning | None,
                 report: Callable[..., None]) -> None:
        self.config = config
        self.datastore = datastore
        self.dense = dense
        self.learning = learning
        served_dense = learning.dense if learning is not None else None
        self.queries = StepQueries(lambda: dense.projection if dense is not None
                                   else served_dense.projection, report)
        self.trie = hybrid_trie(
            config, datastore, dense, learning.store if learning is not None else None,
            served_dense, self.queries.query, self._dense_neighbours,
            served_keys=learning is not None and learning.keyed is not None)
        self.capabilities = self.trie.capabilities

    def _dense_neighbours(self, row: int) -> tuple[np.ndarray, np.ndarray] | None:
        return searched(self.dense, self.queries.query(row), self.config.search.top_n)

    def draft(self, row: int, context: np.ndarray, max_len: int) -> np.ndarray | TreeDraft:
        return self.trie.draft(row, context, max_len)

    def followers(self, row: int, context: np.ndarray) -> tuple[np.ndarray, bool] | None:
        return self.trie.followers(row, context)

    def snapshot(self, row: int) -> Any:
        return self.trie.snapshot(row)

    def begin_step(self, req_ids: list[str], served_keys: list[str | None] | None) -> None:
        if self.learning is not None:
            self.learning.begin_step(req_ids, served_keys)

    def finished(self, req_ids: set[str], tokens: dict[str, np.ndarray] | None = None) -> None:
        if self.learning is not None:
            self.learning.finish(req_ids, tokens)

    def record_last_hidden_states(self, states: Any, rows: list[int]) -> None:
        self.queries.record(states, rows)

    def observe_sampled(self, step: Any) -> None:
        # Every step, drafting on or off: learning must not stop with large batches.
        learning = self.learning
        if learning is None:
            return
        if learning.dense is None and len(step.ready) == sum(map(bool, step.sampled)):
            # Every row that sampled got a draft made before sampling, which copied its
            # tokens: they are recorded once the drafts are handed over.
            learning.deferred = step.ready
        else:
            learning.requests.observe(step.req_ids, step.sampled, step.num_tokens,
                                      step.token_ids, learning.row_keys,
                                      self.accepted_states(step), step.known_from)

    def accepted_states(self, step: Any) -> list[tuple[np.ndarray, np.ndarray] | None] | None:
        """For the served dense store: each row's final hidden states of this step's sampled
        tokens (float32 [m, H]) and the context positions they are at (the state at p predicted
        p + 1). A tree's accepted path is not contiguous in the step's states: only its last
        state is kept."""
        if self.learning.dense is None or self.queries.step_states is None:
            return None
        states, rows = self.queries.step_states
        self.queries.step_states = None
        req_ids = step.req_ids
        spans = accepted_state_rows(rows, [len(s) for s in step.sampled], [
            i >= len(req_ids) or req_ids[i] not in step.trees for i in range(len(rows))])
        gather = [r for first, last in spans if first >= 0 for r in range(first, last + 1)]
        if not gather:
            return None
        # One copy of the rows kept: vLLM reuses the states' buffer next step.
        gathered = states[gather].float().cpu().numpy()
        out: list[tuple[np.ndarray, np.ndarray] | None] = []
        offset = 0
        for i, (first, last) in enumerate(spans):
            if first < 0:
                out.append(None)
                continue
            m = last - first + 1
            end = int(step.num_tokens[i]) - 1  # the state at end - 1 predicted the last token
            out.append((gathered[offset:offset + m], np.arange(end - m, end, dtype=np.int64)))
            offset += m
        return out

    def settle(self) -> None:
        if self.learning is not None:
            self.learning.settle()

    def warm_up(self, max_len: int, device: Any, dtype: Any) -> None:
        context = np.zeros(2 * self.config.match.max_match_len, dtype=np.int32)
        self.trie.draft(0, context, max_len)
        if self.learning is not None:
            # The served store's lookup, compiled (or loaded from numba's cache) on a store of
            # its own: the real one may be empty, or keyed.
            ServedStore(1, background=False).lookup(
                context, min_len=1, max_len=2, max_occurrences=1, continuation_len=max_len)
        if self.dense is not None:
            warm_up_projection(self.dense, device, dtype)
            neighbours, scores = self.dense.search(
                np.zeros((1, self.dense.manifest.dims), dtype=np.float32), 1)
            matching_continuations(self.dense.tokens, self.dense.positions, neighbours[0],
                                   scores[0], 0, max_len)

    def stats(self, reset: bool) -> dict[str, int]:
        return {} if self.learning is None else self.learning.stats()

    def close(self) -> None:
        if self.learning is not None:
            self.learning.close()


def make_drafter(config: HybridConfig, vllm_config: Any,
                 report: Callable[..., None]) -> HybridDrafter:
    model = vllm_config.model_config
    path = config.store.datastore
    # The front-end already checked checksums, the tokenizer and the dense index's model.
    datastore = SuffixArrayDatastore.from_path(path, verify_checksums=False) if path else None
    dense = DenseIndex.from_path(path, hidden_size=model.get_hidden_size(),
                                 search=config.search.search, verify_checksums=False) \
        if path and dense_index_in_use(path, config.dense.dense) else None
    learning = None
    if config.served.served_store != "off":
        # Every tensor-parallel rank drafts, and all must draft alike: a background rebuild
        # would publish the new index at a different step on each rank. With several ranks
        # the index is rebuilt inside the step in which a request finishes instead.
        parallel = getattr(vllm_config, "parallel_config", None)
        world_size = getattr(parallel, "world_size", 1)
        if config.served.served_datastore and world_size > 1:
            # Each rank would journal every request under its own name, and read the other
            # replicas' records at a different step from the other ranks.
            raise ConfigError("speculative_config['served_datastore'] is not supported with "
                              f"tensor or pipeline parallelism (world size {world_size})")
        # Tensor-parallel ranks keep the same store: only the one that counts reports it.
        learning = ServedLearning(config, model, dense, background=world_size == 1,
                                  counted=counts_metrics(parallel))
    return HybridDrafter(config, datastore, dense, learning, report)
