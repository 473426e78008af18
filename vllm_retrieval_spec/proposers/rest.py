"""REST (arXiv 2311.08252): drafts from the longest context suffix found in a token datastore."""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_retrieval_spec.config import RestConfig
from vllm_retrieval_spec.datastore.suffix_array import SuffixArrayDatastore
from vllm_retrieval_spec.drafting.overlap import FOLLOWER_SAMPLES, rank_followers
from vllm_retrieval_spec.drafting.tree import TreeDraft, select_draft
from vllm_retrieval_spec.proposers.base import RetrievalProposer


def rest_draft(
    datastore: SuffixArrayDatastore, context: np.ndarray, max_len: int, config: RestConfig
) -> np.ndarray | TreeDraft:
    """Continuations of the longest matching suffix, voted in a trie; the best chain."""
    candidates, lengths, _ = datastore.lookup(
        context,
        min_len=config.min_match_len,
        max_len=config.max_match_len,
        max_occurrences=config.max_occurrences,
        continuation_len=max_len,
    )
    # Every occurrence of the same suffix is equally good evidence: one vote each.
    return select_draft(candidates, lengths, np.ones(len(candidates)), max_len, config)


class RestProposer(RetrievalProposer):
    config: RestConfig

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        # The front-end already checked checksums and the tokenizer; here only sizes. (Only
        # hybrid may have none: it can draft from what it serves alone.)
        self.datastore = SuffixArrayDatastore.from_path(
            self.config.datastore, verify_checksums=False) if self.config.datastore else None
        # Compile the numba functions now rather than inside the first decoding step.
        self.draft(np.zeros(2 * self.config.max_match_len, dtype=np.int32), self.k)

    def draft(self, context: np.ndarray, max_len: int) -> np.ndarray | TreeDraft:
        # lookup() itself reads only the last max_match_len tokens.
        return rest_draft(self.datastore, context, max_len, self.config)

    def followers(self, row: int, context: np.ndarray) -> tuple[np.ndarray, bool]:
        # A match of 2 or more tokens ending in b means (context[-1], b) is in the datastore.
        tokens, every = self.datastore.followers(int(context[-1]), FOLLOWER_SAMPLES)
        return rank_followers(tokens), every and self.config.min_match_len >= 2
