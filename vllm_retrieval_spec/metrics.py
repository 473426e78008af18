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


#: Prefix of our Prometheus metrics. Not "vllm:": vLLM unregisters every "vllm:" collector of
#: the default registry when it sets up its own.
PROMETHEUS_PREFIX = "vllm_rsd:"
_DRAFTING_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


class MethodMetrics:
    """Our Prometheus series for one drafting method, created in the worker that drafts.

    With ``PROMETHEUS_MULTIPROC_DIR`` set (``vllm-rsd serve`` sets it), prometheus_client
    writes them to files that vLLM's ``/metrics`` endpoint collects from every process; without
    it they stay in this process's default registry. Tokens per target forward is
    ``output_tokens_total / target_forwards_total``.
    """

    def __init__(self, method: str) -> None:
        metrics = _prometheus_metrics()
        self.drafting_seconds = metrics["drafting_seconds"].labels(method)
        self.lookups = metrics["lookups"].labels(method)
        self.empty_lookups = metrics["empty_lookups"].labels(method)
        self.output_tokens = metrics["output_tokens"].labels(method)
        self.target_forwards = metrics["target_forwards"].labels(method)
        self._failed_drafts = metrics["failed_drafts"]
        self._method = method

    def failed_draft(self, kind: str) -> None:
        self._failed_drafts.labels(self._method, kind).inc()


_metrics: dict[str, object] = {}


def _prometheus_metrics() -> dict[str, object]:
    """Create the metric families once per process (prometheus_client refuses duplicates)."""
    if not _metrics:
        from prometheus_client import Counter, Histogram

        p = PROMETHEUS_PREFIX
        _metrics.update(
            drafting_seconds=Histogram(
                p + "drafting_seconds", "Drafting time per engine step, whole batch",
                ["method"], buckets=_DRAFTING_BUCKETS),
            lookups=Counter(p + "lookups", "Draft attempts (one per request per step)",
                            ["method"]),
            empty_lookups=Counter(p + "empty_lookups", "Draft attempts that found nothing",
                                  ["method"]),
            failed_drafts=Counter(
                p + "failed_drafts", "Drafts dropped: exception, too_long, out_of_vocabulary "
                "or over_budget", ["method", "kind"]),
            output_tokens=Counter(p + "output_tokens",
                                  "Tokens sampled (accepted drafts + one per forward), "
                                  "including any past max_tokens or EOS in a request's last "
                                  "step",
                                  ["method"]),
            target_forwards=Counter(p + "target_forwards",
                                    "Target-model forwards, counted per request", ["method"]),
        )
    return _metrics
