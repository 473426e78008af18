"""What every candidate source shares: the ballot the sources of one draft fill, how a
source's candidates weigh, and the gate on a long context match."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass
class Ballot:
    """Every source's weighted continuations for one draft of batch row ``row``."""

    row: int
    #: The request's tokens (int32).
    context: np.ndarray
    #: Candidates are at most this long.
    max_len: int
    candidates: list[np.ndarray] = field(default_factory=list)
    lengths: list[np.ndarray] = field(default_factory=list)
    weights: list[np.ndarray] = field(default_factory=list)
    #: Length of the longest earlier match of the request's own context (``Gated``).
    context_match: int = 0
    #: The longest exact match behind any candidate (hybrid's ``max_spec_factor``).
    longest_match: int = 0
    #: Candidates without a match length voted (dense neighbours): no match-length cap.
    uncapped: bool = False
    #: Source name -> (candidates, lengths, match length) it found, for sources that reuse
    #: them (tree branches).
    matches: dict[str, tuple[np.ndarray, np.ndarray, int]] = field(default_factory=dict)

    def add(self, candidates: np.ndarray, lengths: np.ndarray, weights: np.ndarray) -> None:
        self.candidates.append(candidates)
        self.lengths.append(lengths)
        self.weights.append(weights)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(candidates int32 [m, max_len] padded with -1, lengths [m], weights float64 [m]),
        sources in the order they voted."""
        if not self.candidates:
            # No source voted (a dense source without a query): no candidates, no draft.
            return (np.empty((0, max(self.max_len, 0)), dtype=np.int32),
                    np.empty(0, dtype=np.int32), np.empty(0, dtype=np.float64))
        return (np.concatenate(self.candidates), np.concatenate(self.lengths),
                np.concatenate(self.weights))


@dataclass(frozen=True)
class Vote:
    """How much each of a source's candidates weighs: ``weight``, times the match length behind
    it when ``per_token``, split among the candidates when ``shared`` (the source's total vote
    is fixed) or given to each otherwise (each occurrence is evidence of its own)."""

    weight: float = 1.0
    per_token: bool = False
    shared: bool = False

    def weights(self, count: int, match_len: int) -> np.ndarray:
        vote = self.weight * (match_len if self.per_token else 1)
        if self.shared and count:
            vote /= count
        return np.full(count, vote, dtype=np.float64)


class CandidateSource(Protocol):
    """One source of candidate continuations."""

    #: Whether ``snapshot`` can change between steps (a store that learns).
    stateful: bool
    #: Whether its candidates can be found before the step that drafts runs (``followers``);
    #: not where they need that step's hidden states.
    precomputable: bool

    def vote(self, ballot: Ballot) -> None:
        """Add this source's candidates for ``ballot``'s request."""

    def followers(self, row: int, context: np.ndarray) -> tuple[np.ndarray | None, bool]:
        """(``precomputable``) The tokens (repeats are votes) that followed earlier occurrences
        of ``context[-1]`` in this source, and whether a draft after any other token finds
        nothing here."""

    def snapshot(self, row: int) -> Any:
        """The state row ``row``'s candidates come from (``stateful`` sources)."""


class Gated:
    """``source`` votes only while the context's own match is shorter than ``skip_match_len``:
    a long context match is trusted alone (hybrid's datastore and dense sources)."""

    def __init__(self, source: CandidateSource, skip_match_len: int) -> None:
        self.source = source
        self.skip_match_len = skip_match_len
        self.stateful = source.stateful
        self.precomputable = source.precomputable

    def vote(self, ballot: Ballot) -> None:
        if ballot.context_match < self.skip_match_len:
            self.source.vote(ballot)

    def followers(self, row: int, context: np.ndarray) -> tuple[np.ndarray | None, bool]:
        return self.source.followers(row, context)

    def snapshot(self, row: int) -> Any:
        return self.source.snapshot(row)
