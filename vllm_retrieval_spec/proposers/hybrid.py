"""Hybrid drafting: the request's own context (PLD) and a REST datastore in one weighted trie.

Neither source alone is the best drafter: the context knows the request's names and the text it
is rewriting, the datastore knows the language's common phrasing. Candidates from both are
merged in one trie with comparable weights and the best-supported chain is drafted.
"""

from __future__ import annotations

import numpy as np

from vllm_retrieval_spec.config import HybridConfig
from vllm_retrieval_spec.datastore.suffix_array import SuffixArrayDatastore
from vllm_retrieval_spec.drafting.tree import best_chain
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
                 config: HybridConfig) -> np.ndarray:
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
    return best_chain(np.concatenate(candidates), np.concatenate(lengths),
                      np.concatenate(weights), max_len, config.min_prefix_prob,
                      config.prior_weight)


class HybridProposer(RestProposer):
    """REST's datastore handling; only the drafting rule differs."""

    config: HybridConfig

    def draft(self, context: np.ndarray, max_len: int) -> np.ndarray:
        return hybrid_draft(self.datastore, context, max_len, self.config)
