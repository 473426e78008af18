"""Per-request caches of hidden states for every context position (PLD+ ranks by them).

vLLM computes states only for the tokens scheduled in a step, so a drafter that needs states
for the whole context keeps them itself, keyed by request id (batch rows move between steps).
Each step writes the states of the tokens it computed at their positions; a write that starts
past what is cached means earlier states were never seen (e.g. prefix-cached tokens), and the
cache is then marked incomplete rather than guessed.
"""

from __future__ import annotations

import numpy as np


class HiddenStateCache:
    """Unit-normalised states of positions ``[0, length)`` of one request, grown by doubling.

    Kept in float16: a request holds one row per context token (256 MiB at 32 k tokens of a
    4096-wide model, half float32's). Unit rows' components lie within +-1 and keep three
    significant digits: a near tie may rank the other way, which changes a draft, never an
    output.
    """

    DTYPE = np.float16

    def __init__(self, hidden_size: int, max_len: int, capacity: int = 256) -> None:
        self.max_len = max_len
        self.states = np.zeros((min(capacity, max_len), hidden_size), dtype=self.DTYPE)
        self.length = 0
        self.complete = True

    def write(self, position: int, states: np.ndarray) -> None:
        """States of positions ``position, position + 1, ...``; later positions are dropped
        (they belonged to draft tokens that were rejected, or to a recomputed request)."""
        if position > self.length:
            self.complete = False
            return
        if position == 0:
            self.complete = True
        end = position + len(states)
        if end > len(self.states):
            grown = np.zeros((min(max(end, 2 * len(self.states)), self.max_len),
                              self.states.shape[1]), dtype=self.DTYPE)
            grown[: self.length] = self.states[: self.length]
            self.states = grown
        self.states[position:end] = states
        self.length = end

    def view(self) -> np.ndarray | None:
        """States of every cached position, or None when some earlier position is missing."""
        return self.states[: self.length] if self.complete else None


def unit_rows(states: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (cosine similarity becomes a dot product)."""
    norms = np.linalg.norm(states, axis=1, keepdims=True)
    return states / np.maximum(norms, 1e-12)


def accepted_state_segments(req_ids: list[str], num_scheduled: dict[str, int],
                            scheduled_drafts: dict[str, list[int]], num_computed: np.ndarray,
                            sampled_token_ids: list[list[int]]) -> list[tuple[int, int, int]]:
    """For each batch row: (first position, first row in this step's states, rows to keep).

    A row's scheduled tokens are contiguous in the step's states, in batch order. Their states
    belong to the context only up to the last accepted draft token: rejected drafts' states
    are dropped (a prefill chunk keeps all of its tokens).
    """
    segments = []
    offset = 0
    for i, req_id in enumerate(req_ids):
        scheduled = num_scheduled.get(req_id, 0)
        drafted = len(scheduled_drafts.get(req_id, ()))
        sampled = sampled_token_ids[i] if i < len(sampled_token_ids) else []
        rejected = drafted - (len(sampled) - 1) if drafted and sampled else drafted
        segments.append((int(num_computed[i]), offset, scheduled - rejected))
        offset += scheduled
    return segments
