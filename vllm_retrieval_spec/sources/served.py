"""What this engine has served as a source (hybrid, ``datastore.served``): suffix matches in
the tokens of finished requests, from the one store every request shares or from the store
each request's key names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_retrieval_spec.datastore.served import ServedStore
from vllm_retrieval_spec.drafting.overlap import FOLLOWER_SAMPLES
from vllm_retrieval_spec.sources.base import Ballot, Vote


#: ``SamplingParams.extra_args`` key naming a request's served store (``served_store:
#: "per_request"``); the OpenAI server fills extra_args from a request's ``vllm_xargs``.
SERVED_STORE_KEY = "served_store_key"


def served_store_key(sampling_params: Any) -> str | None:
    """The request's served-store key (its ``str``), or None when it names none."""
    key = (getattr(sampling_params, "extra_args", None) or {}).get(SERVED_STORE_KEY)
    return None if key is None else str(key)


class ServedSource:
    """``store(row)`` is the served store batch row ``row`` drafts from this step (None: it
    has none)."""

    name = "served"
    stateful = True
    precomputable = True

    def __init__(self, store: Callable[[int], ServedStore | None], min_len: int, max_len: int,
                 max_occurrences: int, vote: Vote) -> None:
        self.store = store
        self.min_len = min_len
        self.max_len = max_len
        self.max_occurrences = max_occurrences
        self.vote_rule = vote

    def vote(self, ballot: Ballot) -> None:
        # Searched whatever the context match: a few microseconds, and the model's own earlier
        # answers often continue further than the request's own text does.
        store = self.store(ballot.row)
        if store is None:
            return
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
        tokens, every = store.followers(int(context[-1]), FOLLOWER_SAMPLES)
        return tokens, every and self.min_len >= 2

    def snapshot(self, row: int) -> Any:
        # A new index may draft differently.
        store = self.store(row)
        return None if store is None else store.index
