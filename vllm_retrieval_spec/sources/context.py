"""The request's own context as a source (PLD, arXiv 2412.01447's baseline; hybrid): the
continuations of the earlier occurrences of its longest recurring suffix."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from vllm_retrieval_spec.sources.base import Ballot, Vote
from vllm_retrieval_spec.sources.suffix_array import SuffixArraySource


@numba.njit(cache=True)
def find_context_matches(
    context: np.ndarray, min_len: int, max_len: int, max_occurrences: int,
    continuation_len: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Continuations of the earlier occurrences of the longest suffix of ``context``.

    An occurrence is an end position ``j < len(context) - 1`` whose preceding tokens equal the
    context's last ``n`` tokens, ``min_len <= n <= max_len``; only those of the longest ``n``
    found are kept, most recent first, at most ``max_occurrences``. Returns
    (candidates int32 [m, continuation_len] padded with -1, lengths int32 [m], n).
    """
    size = context.shape[0]
    ends = np.empty(max_occurrences, dtype=np.int64)
    count = 0
    best = 0
    for j in range(size - 2, -1, -1):
        n = 0
        while n < max_len and n <= j and context[j - n] == context[size - 1 - n]:
            n += 1
        if n < min_len or n < best:
            continue
        if n > best:
            best = n
            count = 0
        if count < max_occurrences:
            ends[count] = j
            count += 1
        if best == max_len and count == max_occurrences:
            # No earlier occurrence can be longer or still be kept: stop, so that a repetitive
            # context costs O(max_occurrences x max_len), not O(len x max_len), every step.
            break
    candidates = np.full((count, continuation_len), -1, dtype=np.int32)
    lengths = np.zeros(count, dtype=np.int32)
    for i in range(count):
        length = min(continuation_len, size - 1 - ends[i])
        candidates[i, :length] = context[ends[i] + 1:ends[i] + 1 + length]
        lengths[i] = length
    return candidates, lengths, best


@numba.njit(cache=True)
def context_followers(context: np.ndarray) -> np.ndarray:
    """The token after every earlier occurrence of ``context[-1]`` in ``context`` (repeats
    kept, most recent first)."""
    size = context.shape[0]
    out = np.empty(max(size - 1, 0), dtype=np.int32)
    if size == 0:
        return out
    last = context[size - 1]
    k = 0
    for i in range(size - 2, -1, -1):
        if context[i] == last:
            out[k] = context[i + 1]
            k += 1
    return out[:k]


class ContextSource:
    """Earlier occurrences, in the request itself, of its longest recurring suffix of
    ``min_len`` to ``max_len`` tokens."""

    name = "context"
    stateful = False
    precomputable = True

    def __init__(self, min_len: int, max_len: int, max_occurrences: int, vote: Vote) -> None:
        self.min_len = min_len
        self.max_len = max_len
        self.max_occurrences = max_occurrences
        self.vote_rule = vote

    def vote(self, ballot: Ballot) -> None:
        candidates, lengths, n = find_context_matches(
            ballot.context, self.min_len, self.max_len, self.max_occurrences, ballot.max_len)
        ballot.add(candidates, lengths, self.vote_rule.weights(len(candidates), n))
        ballot.context_match = n
        ballot.longest_match = max(ballot.longest_match, n)
        ballot.matches[self.name] = (candidates, lengths, n)

    def followers(self, row: int, context: np.ndarray) -> tuple[np.ndarray, bool]:
        # A match of 2 or more tokens ending in b means (context[-1], b) occurred earlier.
        return context_followers(context), self.min_len >= 2

    def snapshot(self, row: int) -> Any:
        return None


class LastTokenBranches:
    """For trees: the continuations of every earlier occurrence of the last token alone, in the
    context and in the served store, which the longest match leaves out: light branches beside
    the chain. Where a source's longest match was one token, its lookup found exactly these."""

    stateful = False
    precomputable = True

    def __init__(self, context: ContextSource, served: SuffixArraySource | None,
                 weight: float) -> None:
        self.context = context
        self.served = served
        self.vote_rule = Vote(weight, per_token=True, shared=True)

    def vote(self, ballot: Ballot) -> None:
        found = ballot.matches[self.context.name]
        short = [found[:2] if found[2] == 1 else find_context_matches(
            ballot.context, 1, 1, self.context.max_occurrences, ballot.max_len)[:2]]
        served = ballot.matches.get(self.served.name) if self.served is not None else None
        if served is not None:
            short.append(served[:2] if served[2] == 1 else
                         self.served.store(ballot.row).lookup(
                             ballot.context, min_len=1, max_len=1,
                             max_occurrences=self.served.max_occurrences,
                             continuation_len=ballot.max_len)[:2])
        for candidates, lengths in short:
            ballot.add(candidates, lengths, self.vote_rule.weights(len(candidates), 1))

    def followers(self, row: int, context: np.ndarray) -> tuple[None, bool]:
        # Any token seen before drafts a branch, not only the last token's followers.
        return None, False

    def snapshot(self, row: int) -> Any:
        return None
