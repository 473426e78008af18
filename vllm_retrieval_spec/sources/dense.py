"""A dense index as a source (DReSD, arXiv 2502.15572; hybrid): corpus positions where the
model was in a state like the request's.

A key is the projected final hidden state at some corpus position p; that state predicted
token p + 1. The query is the state that predicted the token just emitted, so a neighbour agrees
with the request only if its stored next token is that token (DReSD's filter); the tokens after
it are the neighbour's candidate, weighted by similarity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from vllm_retrieval_spec.datastore.dense import DenseIndex
from vllm_retrieval_spec.datastore.projection import Projection
from vllm_retrieval_spec.datastore.format import SEPARATOR
from vllm_retrieval_spec.datastore.suffix_array import copy_continuation
from vllm_retrieval_spec.sources.base import Ballot

#: A row's neighbours in the index and their similarities, or None where it has no query.
Neighbours = Callable[[int], tuple[np.ndarray, np.ndarray] | None]


@numba.njit(cache=True)
def matching_continuations(tokens: np.ndarray, positions: np.ndarray, neighbours: np.ndarray,
                           scores: np.ndarray, emitted: int,
                           continuation_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Continuations of the neighbours whose stored next token is ``emitted``.

    ``neighbours`` index ``positions`` (-1 = no hit); a continuation starts two tokens after the
    key's position and stops at SEPARATOR. Returns (cands int32 [m, continuation_len] padded
    with -1, lengths int32 [m], weights float64 [m]: similarity, floored at 0, NaN too).
    """
    m = neighbours.shape[0]
    cands = np.full((m, continuation_len), SEPARATOR, dtype=np.int32)
    lengths = np.zeros(m, dtype=np.int32)
    weights = np.zeros(m, dtype=np.float64)
    size = tokens.shape[0]
    kept = 0
    for i in range(m):
        if neighbours[i] < 0:
            continue
        pos = positions[neighbours[i]] + 1
        if pos >= size or tokens[pos] != emitted:
            continue
        lengths[kept] = copy_continuation(tokens, pos + 1, cands[kept])
        # Floored at 0, NaN (a NaN hidden state's) too: max() would keep it, and one NaN vote
        # outweighs every other candidate in the trie.
        weights[kept] = scores[i] if scores[i] > 0.0 else 0.0
        kept += 1
    return cands[:kept], lengths[:kept], weights[:kept]


def project_last_states(projection: Projection, states: Any,
                        rows: list[int]) -> tuple[np.ndarray, list[int]]:
    """Queries for the batch rows that sampled a token: ``states[rows[i]]`` produced row i's
    last token (row -1: nothing sampled). Returns (unit queries float32 [m, d], the m batch
    rows they belong to)."""
    valid = [i for i, row in enumerate(rows) if row >= 0]
    if not valid:
        return np.empty((0, projection.components.shape[1]), dtype=np.float32), valid
    return projection(states[[rows[i] for i in valid]]), valid


def warm_up_projection(index: DenseIndex, device: Any, dtype: Any) -> np.ndarray:
    """Projects zero states as the steps will, on the model's device in its dtype: two rows, then
    one (Triton compiles a kernel apiece for a single row and for more), so that a GPU's kernels
    are compiled at start-up. Returns the one row's query, float32 [1, d]."""
    import torch

    for rows in (2, 1):
        queries, _ = project_last_states(index.projection, torch.zeros(
            rows, index.manifest.hidden_size, device=device, dtype=dtype), list(range(rows)))
    return queries


def searched(index: DenseIndex, query: np.ndarray | None,
             top_n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The ``top_n`` neighbours of one ``query`` (a projected state) and their similarities,
    or None without a query."""
    if query is None:
        return None
    neighbours, scores = index.search(query[None], top_n)
    return neighbours[0], scores[0]


class DenseSource:
    """The continuations of ``neighbours(row)`` in ``index`` that pass the emitted-token filter,
    each weighing ``weight`` x similarity / ``divisor``. Dividing by the neighbours asked for,
    not the survivors: the share that passes the filter is itself evidence that the state is a
    familiar one."""

    name = "dense"
    stateful = False
    precomputable = False

    def __init__(self, index: DenseIndex, neighbours: Neighbours, weight: float = 1.0,
                 divisor: int = 1) -> None:
        self.index = index
        self.neighbours = neighbours
        self.weight = weight
        self.divisor = divisor

    def vote(self, ballot: Ballot) -> None:
        found = self.neighbours(ballot.row)
        if found is None:
            return
        candidates, lengths, similarity = matching_continuations(
            self.index.tokens, self.index.positions, found[0], found[1],
            int(ballot.context[-1]), ballot.max_len)
        ballot.add(candidates, lengths, self.weight * similarity / self.divisor)
        # Neighbours have no match length to cap the draft by.
        ballot.uncapped = True

    def followers(self, row: int, context: np.ndarray) -> tuple[None, bool]:
        # Not precomputable: the candidates come from the state the forward computes for the
        # next token.
        return None, False

    def snapshot(self, row: int) -> Any:
        return None
