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
    """Unit-normalised states of positions ``[0, length)`` of one request, grown by doubling."""

    def __init__(self, hidden_size: int, max_len: int, capacity: int = 256) -> None:
        self.max_len = max_len
        self.states = np.zeros((min(capacity, max_len), hidden_size), dtype=np.float32)
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
                              self.states.shape[1]), dtype=np.float32)
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
