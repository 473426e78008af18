"""What drafting is measured by: the per-step drafting times the worker keeps for the benchmarks
(``DraftingTimer``, read back over RPC) and the ``vllm_rsd:*`` Prometheus series a server's
``/metrics`` shows (``MethodMetrics``, ``served_store_tokens_gauge``)."""

from __future__ import annotations

import numpy as np


class DraftingTimer:
    """Drafting time of every step (one call for the whole batch), in nanoseconds: the critical
    part, what the engine waits for (the work done before sampling, from storing the requests
    the last step finished on, ``add_before``; from vLLM handing over the sampled tokens to the
    drafts going back, ``record``; of the work after the handover, the part that outlasts the
    next forward: all of it on vLLM-CPU, where no forward runs beside it), and the total, which
    adds the rest of the work after the drafts were handed over (``add_after``, precomputing
    the next step's drafts).

    Appending to preallocated arrays keeps the cost per step at a few hundred nanoseconds;
    when they are full, the buffers double.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._critical = np.zeros(capacity, dtype=np.int64)
        self._total = np.zeros(capacity, dtype=np.int64)
        self._count = 0
        self._before = 0

    def add_before(self, elapsed_ns: int) -> None:
        """Drafting work of the coming step done before its sampled tokens are known."""
        self._before += elapsed_ns

    def record(self, handover_ns: int) -> None:
        """The step's drafts went back to vLLM ``handover_ns`` after its sampled tokens came."""
        if self._count == len(self._critical):
            self._critical = np.concatenate([self._critical, np.zeros_like(self._critical)])
            self._total = np.concatenate([self._total, np.zeros_like(self._total)])
        # Sampling waits for the work before it: it is as critical as the call after it.
        self._critical[self._count] = self._total[self._count] = self._before + handover_ns
        self._before = 0
        self._count += 1

    def add_after(self, elapsed_ns: int, waited_ns: int) -> None:
        """Drafting work of the last recorded step done after its drafts were handed over, of
        which the next step waited for ``waited_ns`` (the part that outlasted the forward)."""
        if self._count:
            self._total[self._count - 1] += elapsed_ns
            self._critical[self._count - 1] += waited_ns

    def last_critical_ns(self) -> int:
        return int(self._critical[self._count - 1]) if self._count else 0

    def last_total_ns(self) -> int:
        return int(self._total[self._count - 1]) if self._count else 0

    def summary(self, reset: bool = False) -> dict[str, float | int]:
        """Steps timed and, in milliseconds, p50/p99/mean of the total and p50/p99 of the
        critical part (NaN when nothing was timed)."""
        total = self._total[: self._count] / 1e6
        critical = self._critical[: self._count] / 1e6
        if len(total):
            p50, p99 = np.percentile(total, [50, 99])
            critical_p50, critical_p99 = np.percentile(critical, [50, 99])
            mean = total.mean()
        else:
            p50 = p99 = mean = critical_p50 = critical_p99 = float("nan")
        summary = {"steps": int(len(total)), "p50_ms": float(p50), "p99_ms": float(p99),
                   "mean_ms": float(mean), "critical_p50_ms": float(critical_p50),
                   "critical_p99_ms": float(critical_p99)}
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

    ``counted`` False (``counts_metrics``): a worker whose steps another worker counts, every
    series a no-op.
    """

    def __init__(self, method: str, counted: bool = True) -> None:
        metrics = _prometheus_metrics()

        def series(name: str, *labels: str) -> object:
            return metrics[name].labels(method, *labels) if counted else _UNCOUNTED

        self.drafting_seconds = series("drafting_seconds")
        self.drafting_critical_seconds = series("drafting_critical_seconds")
        self.lookups = series("lookups")
        self.empty_lookups = series("empty_lookups")
        self.output_tokens = series("output_tokens")
        self.target_forwards = series("target_forwards")
        self._series = series

    def failed_draft(self, kind: str) -> None:
        self._series("failed_drafts", kind).inc()

    def publish(self, counts: dict[str, int]) -> None:
        """Add ``counts`` (of ``target_forwards``, ``output_tokens``, ``lookups``,
        ``empty_lookups``) to their series, and zero them."""
        for name, count in counts.items():
            if count:
                getattr(self, name).inc(count)
                counts[name] = 0


def counts_metrics(parallel: object) -> bool:
    """Whether this worker's drafter counts the engine's steps: every tensor-parallel rank
    drafts the same drafts for the same requests, and ``/metrics`` sums the series of every
    process, so only the first rank of the stage that drafts does (vLLM's output rank)."""
    ranks = (getattr(parallel, "tensor_parallel_size", 1)
             * getattr(parallel, "prefill_context_parallel_size", 1))
    return getattr(parallel, "rank", 0) % ranks == 0


class _Uncounted:
    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def set(self, value: float) -> None:
        pass


_UNCOUNTED = _Uncounted()

_metrics: dict[str, object] = {}


def _prometheus_metrics() -> dict[str, object]:
    """Create the metric families once per process (prometheus_client refuses duplicates)."""
    if not _metrics:
        from prometheus_client import Counter, Gauge, Histogram

        p = PROMETHEUS_PREFIX
        _metrics.update(
            drafting_seconds=Histogram(
                p + "drafting_seconds", "Drafting time per engine step, whole batch: before "
                "sampling, after it, and after the drafts were handed over",
                ["method"], buckets=_DRAFTING_BUCKETS),
            drafting_critical_seconds=Histogram(
                p + "drafting_critical_seconds", "Drafting time per engine step, whole batch, "
                "that the step waits for: before sampling, from the sampled tokens being "
                "handed over to the drafts going back, and after that what outlasts the "
                "next forward (all of it on vLLM-CPU)",
                ["method"], buckets=_DRAFTING_BUCKETS),
            lookups=Counter(p + "lookups", "Draft attempts (one per request per step, where "
                            "it has room to draft before max_model_len and max_tokens)",
                            ["method"]),
            empty_lookups=Counter(p + "empty_lookups", "Draft attempts that found nothing",
                                  ["method"]),
            failed_drafts=Counter(
                p + "failed_drafts", "Drafts dropped: exception, too_long, out_of_vocabulary, "
                "bad_tree or over_budget", ["method", "kind"]),
            output_tokens=Counter(p + "output_tokens",
                                  "Tokens sampled (accepted drafts + one per forward), "
                                  "including any past EOS or a stop string in a request's "
                                  "last step",
                                  ["method"]),
            target_forwards=Counter(p + "target_forwards",
                                    "Target-model forwards, counted per request", ["method"]),
            # One series per drafting process ("all" adds its pid): each engine is a replica
            # with a store and bounds of its own.
            served_store_tokens=Gauge(p + "served_store_tokens",
                                      "Tokens in the served store (all keys), at the last step",
                                      ["method"], multiprocess_mode="all"),
        )
    return _metrics


def served_store_tokens_gauge(method: str, counted: bool = True) -> object:
    """The served store's size, set by the method that keeps one (``counted`` False: a no-op,
    in a worker whose store another worker's gauge reports, ``counts_metrics``)."""
    return _prometheus_metrics()["served_store_tokens"].labels(method) if counted \
        else _UNCOUNTED
