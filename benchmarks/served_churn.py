"""The drafter's memory under churn, without vLLM: ``hybrid`` with a journaled
``served_datastore``, as the soak test's server runs it, fed the recorded requests
(``benchmarks/results/*.plain.jsonl``, prompt and output) again and again, one at a time, step
by step as replay drives a proposer (every hook in the order of vLLM's step, greedy acceptance of
its drafts), then ``observe_finished``. The store fills
to ``--served-max-tokens`` and evicts, the journal is flushed every ``served_flush_ms`` and
compacted into a snapshot every ``--save-minutes``. Every ``--sample-every`` requests it samples
this process's RSS: whatever the soak's server grows by beyond this is not the served store's.

    python -m benchmarks.served_churn --requests 20000 --output-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.replay import Replay, StepCosts, fake_vllm_config
from benchmarks.served_store import recorded_requests
from vllm_retrieval_spec.assets import model_path
from vllm_retrieval_spec.bench.report import (
    markdown_table, module_command, results_document, write_report)
from vllm_retrieval_spec.cli import int_at_least
from vllm_retrieval_spec.config import VLLM_CPU_DEFAULTS, parse_speculative_config
from vllm_retrieval_spec.proposers.base import RetrievalProposer

K = 8


def journaled_hybrid(directory: Path, max_tokens: int, save_minutes: float) -> RetrievalProposer:
    config = parse_speculative_config(
        {"method": "hybrid", "num_speculative_tokens": K, "draft_budget_ms": 0,
         "served_datastore": str(directory), "served_max_tokens": max_tokens,
         "served_save_minutes": save_minutes}, VLLM_CPU_DEFAULTS)
    vllm_config = fake_vllm_config(config, max_model_len=8192)
    # The journal records the tokenizer it was written with.
    vllm_config.model_config.tokenizer = str(model_path())
    vllm_config.model_config.tokenizer_revision = None
    vllm_config.model_config.trust_remote_code = False
    proposer = RetrievalProposer(vllm_config)
    proposer.load_model(None)
    return proposer


class Churn:
    """Requests served one at a time through replay's steps, each finished before the next."""

    def __init__(self, proposer: RetrievalProposer) -> None:
        self.replay = Replay(proposer, StepCosts(proposer.config.drafting.draft_token_cost))

    def serve(self, n: int, record: dict[str, list[int]]) -> None:
        self.replay.serve([(n, record)])
        while self.replay.advance():
            pass
        # Kept over tens of thousands of requests, the step times would be the growth this
        # tool measures.
        self.replay.drop_step_times()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int_at_least(1), default=20_000)
    parser.add_argument("--served-max-tokens", type=int_at_least(1), default=100_000)
    parser.add_argument("--save-minutes", type=float, default=0.05)
    parser.add_argument("--sample-every", type=int_at_least(1), default=1000)
    parser.add_argument("--run-name", default="served-churn")
    parser.add_argument("--output-dir", help="write <run-name>.json and .md there")
    args = parser.parse_args(argv)
    records = [r for r in recorded_requests() if r.get("output")]
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        served = Path(directory) / "served"
        proposer = journaled_hybrid(served, args.served_max_tokens, args.save_minutes)
        churn = Churn(proposer)
        start = time.perf_counter()
        process = psutil.Process()
        for i in range(args.requests + 1):
            if i % args.sample_every == 0:
                gc.collect()
                rows.append({
                    "requests": i, "seconds": round(time.perf_counter() - start, 1),
                    "rss_mib": round(process.memory_info().rss / 2**20, 1),
                    "store_tokens": proposer.method.learning.shared.num_tokens,
                    # Snapshots are numbered; the older ones are removed.
                    "snapshots": max((int(p.name.split("-")[1])
                                      for p in served.glob("snapshot-*")), default=0)})
                print(rows[-1], flush=True)
            churn.serve(i, records[i % len(records)])
        proposer.close()
    full = [row for row in rows if row["store_tokens"] >= 0.95 * args.served_max_tokens]
    checks = {"records": len(records),
              "rss_growth_mib_once_full": round(full[-1]["rss_mib"] - full[0]["rss_mib"], 1)
              if len(full) > 1 else None,
              "requests_once_full": full[-1]["requests"] - full[0]["requests"] if full else 0}
    print(checks)
    if args.output_dir:
        columns = [(key, key) for key in rows[0]]
        results = results_document(args.run_name, module_command(
            "benchmarks.served_churn", argv), rows)
        results["checks"] = checks
        for path in write_report(results, args.output_dir, markdown_table(columns, rows)):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
