"""The soak test's bookkeeping, without a server (``benchmarks/soak.py``)."""

from __future__ import annotations

import http.server
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.soak import (
    PEER_SPECS, Outcome, Sampler, ScrapeFailed, lost_requests, metrics, passed, report,
    rss_checks, rss_growth, stored_documents, summarize_traffic)
from vllm_retrieval_spec.bench.report import results_document
from vllm_retrieval_spec.datastore.journal import TokenizerFacts
from vllm_retrieval_spec.datastore.served import ServedStore
from vllm_retrieval_spec.datastore.served_saver import ServedDirectory


def done(kind, at, prompt=(1, 2), output=(3,), ok=True, duplicate=None, status=200):
    return Outcome(kind, False, ok, status, 1.0, at, list(prompt), list(output), duplicate)


def test_a_request_counts_as_lost_only_if_done_over_a_flush_interval_before_the_kill():
    documents = [np.array([1, 2, 3, 9], dtype=np.int32)]  # 9: accepted past the client's end
    outcomes = [done("greedy", 95.0),                     # stored
                done("greedy", 99.5, output=(4,)),        # within the flush interval
                done("sampled", 90.0, output=(5,)),       # lost
                done("greedy", 10.0, output=(6,)),        # older than a bound keeps
                done("cancelled", 95.0, output=(7,)),     # never complete
                done("greedy", 95.0, output=(8,), ok=False)]
    assert lost_requests(outcomes, documents, 100.0, 1.0, 60.0) == {
        "checked": 2, "missing": 1, "missing_ages_s": [10.0]}


def test_traffic_summary_counts_errors_and_distinct_duplicate_outputs():
    outcomes = [done("duplicate", 1, duplicate=0), done("duplicate", 2, duplicate=0),
                done("duplicate", 3, output=(4,), duplicate=1),
                done("duplicate", 4, output=(5,), duplicate=1),
                done("malformed", 5, ok=True, status=400), done("greedy", 6, ok=False)]
    summary = summarize_traffic(outcomes)
    assert summary["duplicate_outputs"] == {0: 1, 1: 2}
    assert (summary["num_errors"], summary["malformed_400"]) == (1, 1)


class MetricsEndpoint:
    """A ``/metrics`` that answers 500, as vLLM's does while a process creates its file, for
    its first ``errors`` scrapes."""

    BODY = (b'vllm_rsd:served_store_tokens{method="hybrid",pid="7"} 42.0\n'
            b'vllm_rsd:lookups_total{method="hybrid"} 3.0\n')

    def __init__(self, errors):
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                failing = endpoint.errors > 0
                endpoint.errors -= failing
                body = b'{"error":{"message":"unpack_from requires a buffer"}}' if failing \
                    else endpoint.BODY
                self.send_response(500 if failing else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.errors = errors
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint(request):
    served = MetricsEndpoint(request.param)
    yield served
    served.close()


@pytest.mark.parametrize("endpoint", [2], indirect=True)
def test_a_scrape_answered_with_an_error_is_asked_again(endpoint):
    values = metrics(endpoint.port)
    assert values == {"vllm_rsd:served_store_tokens": 42.0, "vllm_rsd:lookups_total": 3.0}


@pytest.mark.parametrize("endpoint", [3], indirect=True)
def test_a_scrape_failing_every_time_says_what_the_server_answered(endpoint):
    with pytest.raises(ScrapeFailed, match="answered 500 3 times: .*unpack_from"):
        metrics(endpoint.port)


@pytest.mark.parametrize("endpoint", [100], indirect=True)
def test_the_memory_sampler_keeps_sampling_when_scrapes_fail(endpoint):
    server = SimpleNamespace(port=endpoint.port, rss_bytes=lambda: (2 ** 20, 3 * 2 ** 20))
    sampler = Sampler(server, SimpleNamespace(outcomes=[]), started=0.0)
    sampler.stop.set()  # one sample, then it returns
    sampler.run()
    assert [(r["rss_mib"], r["served_store_tokens"]) for r in sampler.rows] == [(4.0, None)]


def test_rss_growth_compares_the_ends_of_the_window():
    rows = [{"t_s": 10.0 * i, "rss_mib": 100.0 + (i >= 15) * 5} for i in range(20)]
    assert round(rss_growth(rows, 95.0), 3) == 0.05
    assert rss_growth(rows, 40.0) == 0.0


def test_a_peers_run_is_judged_on_its_traffic_and_memory_alone(tmp_path):
    rows = [{"t_s": 10.0 * i, "rss_mib": 100.0 + i, "rss_server_mib": 40.0,
             "rss_engine_mib": 60.0 + i, "served_store_tokens": None, "requests": i}
            for i in range(40)]
    outcomes = [done("greedy", 1), done("malformed", 2, status=400),
                done("duplicate", 3, duplicate=0), done("duplicate", 4, duplicate=0)]
    checks = {"soaked_s": 400.0, **summarize_traffic(outcomes), "peer": PEER_SPECS["ngram"],
              **rss_checks(rows, 300.0)}
    checks["passed"] = passed(checks)
    assert checks["passed"] == {"no_errors": True, "malformed_refused": True,
                                "duplicates_identical": True, "rss_flat": False}
    assert (checks["rss_engine_mib_first"], checks["rss_engine_mib_last"]) == (60.0, 99.0)
    report(results_document("peer", "python -m benchmarks.soak --peer ngram", rows,
                            checks=checks), str(tmp_path))
    page = (tmp_path / "peer.md").read_text()
    assert "vLLM's own drafter" in page and '"method": "ngram"' in page
    assert "the engine 60.0 and 99.0" in page
    assert "served-store tokens, most sampled" not in page and "restarted server" not in page


def test_stored_documents_are_what_a_replica_loads(tmp_path):
    tokenizer = TokenizerFacts("t", "f" * 64, 1000)
    replica = ServedDirectory(tmp_path, ServedStore(100, background=False), tokenizer,
                              flush_s=1.0, compact_s=600.0, background=False, replica="h-1-a")
    replica.stores.add("a", [1, 2, 3])
    replica.record(None, "a", np.array([1, 2, 3], dtype=np.int32))
    replica.writer.flush()  # and never closed: the process was killed
    assert [d.tolist() for d in stored_documents(tmp_path, 100)] == [[1, 2, 3]]


def test_churn_keeps_the_store_bounded_and_samples_its_memory(tmp_path, model_dir):
    """``benchmarks/served_churn.py``: the journaled drafter fed recorded requests, sampled."""
    import json

    from benchmarks import served_churn

    served_churn.main(["--requests", "60", "--sample-every", "20", "--served-max-tokens",
                       "3000", "--output-dir", str(tmp_path)])
    results = json.loads((tmp_path / "served-churn.json").read_text())
    rows = results["rows"]
    assert [row["requests"] for row in rows] == [0, 20, 40, 60]
    # Full (evicting whole requests) and never past its bound.
    assert rows[0]["store_tokens"] == 0 and rows[-1]["store_tokens"] > 2000
    assert max(row["store_tokens"] for row in rows) <= 3000
    assert all(row["rss_mib"] > 100 for row in rows)
    assert results["checks"]["records"] > 100
