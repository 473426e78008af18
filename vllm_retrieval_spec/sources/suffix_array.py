"""Suffix matches in a token store as a source: a datastore's suffix array (REST,
arXiv 2311.08252; hybrid) or what this engine has served (hybrid, ``datastore.served``): the
continuations of the longest context suffix found in the store."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_retrieval_spec.drafting.overlap import FOLLOWER_SAMPLES
from vllm_retrieval_spec.sources.base import Ballot, Vote


class SuffixArraySource:
    """Occurrences in ``store(row)`` (batch row ``row``'s store this step; None: it has none)
    of the context's longest suffix of ``min_len`` to ``max_len`` tokens. A store has
    ``lookup`` and ``followers`` (``SuffixArrayDatastore``, ``ServedStore``); a ``stateful``
    one (the served store) replaces its ``index`` as it learns."""

    precomputable = True

    def __init__(self, store: Callable[[int], Any], min_len: int, max_len: int,
                 max_occurrences: int, vote: Vote, *, name: str = "suffix_array",
                 stateful: bool = False) -> None:
        self.store = store
        self.min_len = min_len
        self.max_len = max_len
        self.max_occurrences = max_occurrences
        self.vote_rule = vote
        self.name = name
        self.stateful = stateful

    def vote(self, ballot: Ballot) -> None:
        store = self.store(ballot.row)
        if store is None:
            return
        # lookup() reads only the context's last max_len tokens.
        candidates, lengths, n = store.lookup(
            ballot.context, min_len=self.min_len, max_len=self.max_len,
            max_occurrences=self.max_occurrences, continuation_len=ballot.max_len)
        ballot.add(candidates, lengths, self.vote_rule.weights(len(candidates), n))
        ballot.longest_match = max(ballot.longest_match, n)
        ballot.matches[self.name] = (candidates, lengths, n)

    def followers(self, row: int, context: np.ndarray) -> tuple[np.ndarray | None, bool]:
        store = self.store(row)
        if store is None:
            return None, True
        # A match of 2 or more tokens ending in b means (context[-1], b) is in the store.
        tokens, every = store.followers(int(context[-1]), FOLLOWER_SAMPLES)
        return tokens, every and self.min_len >= 2

    def snapshot(self, row: int) -> Any:
        # A new index may draft differently.
        store = self.store(row) if self.stateful else None
        return None if store is None else store.index
