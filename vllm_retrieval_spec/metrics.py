"""Drafting-latency counters kept inside the worker and read back by benchmarks."""

from __future__ import annotations

import numpy as np


class DraftingTimer:
    """Wall time of every drafting step (one call for the whole batch), in nanoseconds.

    Appending to a preallocated array keeps the cost per step at a few hundred nanoseconds;
    when it is full, the buffer doubles.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._ns = np.zeros(capacity, dtype=np.int64)
        self._count = 0

    def record(self, elapsed_ns: int) -> None:
        if self._count == len(self._ns):
            self._ns = np.concatenate([self._ns, np.zeros_like(self._ns)])
        self._ns[self._count] = elapsed_ns
        self._count += 1

    def summary(self, reset: bool = False) -> dict[str, float | int]:
        """Steps timed and p50/p99/mean in milliseconds (NaN when nothing was timed)."""
        ms = self._ns[: self._count] / 1e6
        if len(ms):
            p50, p99 = np.percentile(ms, [50, 99])
            mean = ms.mean()
        else:
            p50 = p99 = mean = float("nan")
        summary = {"steps": int(len(ms)), "p50_ms": float(p50), "p99_ms": float(p99),
                   "mean_ms": float(mean)}
        if reset:
            self._count = 0
        return summary
