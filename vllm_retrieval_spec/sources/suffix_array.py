"""A token datastore's suffix array as a source (REST, arXiv 2311.08252; hybrid): the
continuations of the longest context suffix found in the corpus."""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_retrieval_spec.datastore.suffix_array import SuffixArrayDatastore
from vllm_retrieval_spec.drafting.overlap import FOLLOWER_SAMPLES
from vllm_retrieval_spec.sources.base import Ballot, Vote


class SuffixArraySource:
    """Occurrences in ``datastore`` of the context's longest suffix of ``min_len`` to
    ``max_len`` tokens (``lookup`` reads only the last ``max_len``)."""

    name = "suffix_array"
    stateful = False
    precomputable = True

    def __init__(self, datastore: SuffixArrayDatastore, min_len: int, max_len: int,
                 max_occurrences: int, vote: Vote) -> None:
        self.datastore = datastore
        self.min_len = min_len
        self.max_len = max_len
        self.max_occurrences = max_occurrences
        self.vote_rule = vote

    def vote(self, ballot: Ballot) -> None:
        candidates, lengths, n = self.datastore.lookup(
            ballot.context, min_len=self.min_len, max_len=self.max_len,
            max_occurrences=self.max_occurrences, continuation_len=ballot.max_len)
        ballot.add(candidates, lengths, self.vote_rule.weights(len(candidates), n))
        ballot.longest_match = max(ballot.longest_match, n)

    def followers(self, row: int, context: np.ndarray) -> tuple[np.ndarray, bool]:
        # A match of 2 or more tokens ending in b means (context[-1], b) is in the datastore.
        tokens, every = self.datastore.followers(int(context[-1]), FOLLOWER_SAMPLES)
        return tokens, every and self.min_len >= 2

    def snapshot(self, row: int) -> Any:
        return None
