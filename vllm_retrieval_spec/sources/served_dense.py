"""The served store's dense half as a source (hybrid, ``datastore.served_dense``): DReSD
neighbours among the states of what this engine generated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_retrieval_spec.datastore.served_dense import ServedDenseStore
from vllm_retrieval_spec.sources.base import Ballot


class ServedDenseSource:
    """``top_n`` neighbours of ``query(row)`` (the row's projected last state, or None) that
    pass the emitted-token filter, sharing ``weight`` x similarity / ``top_n``. Unlike the
    static index's, these keep the match-length cap: without it drafts doubled in length and
    modelled speedup fell on every task (replay)."""

    name = "served_dense"
    stateful = False
    precomputable = False

    def __init__(self, store: ServedDenseStore, query: Callable[[int], np.ndarray | None],
                 weight: float, top_n: int) -> None:
        self.store = store
        self.query = query
        self.weight = weight
        self.top_n = top_n

    def vote(self, ballot: Ballot) -> None:
        candidates, lengths, similarity = self.store.candidates(
            self.query(ballot.row), int(ballot.context[-1]), self.top_n, ballot.max_len)
        ballot.add(candidates, lengths, self.weight * similarity / self.top_n)

    def followers(self, row: int, context: np.ndarray) -> tuple[None, bool]:
        # Not precomputable: the candidates come from the state the forward computes next.
        return None, False

    def snapshot(self, row: int) -> Any:
        return None
