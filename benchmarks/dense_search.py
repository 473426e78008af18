"""DReSD's dense search on real hidden states: ScaNN's recall against exact search, and latency.

Queries are the model's final hidden states along recorded outputs (``<run>.plain.jsonl`` from
``vllm-rsd bench``), i.e. the queries DReSD makes while decoding them, projected as the proposer
projects them.

    python -m benchmarks.dense_search ds/own \
        --outputs benchmarks/results/RUN.plain.jsonl --model MODEL_DIR --run-name NAME
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from vllm_retrieval_spec.bench.report import (
    markdown_table, module_command, results_document, write_report)
from vllm_retrieval_spec.bench.throughput import reported_model
from vllm_retrieval_spec.cli import int_at_least
from vllm_retrieval_spec.datastore.format import DatastoreError

COLUMNS = ("datastore", "num_keys", "explained_variance", "queries", "top_n", "self_mrr_exact",
           "self_mrr_scann", "scann_recall",
           "exact_us_p50", "exact_us_p99", "scann_us_p50", "scann_us_p99")


def open_indexes(datastore: str) -> tuple[Any, Any]:
    """``datastore``'s dense index searched exactly and by ScaNN."""
    from vllm_retrieval_spec.datastore.dense import DenseIndex

    return (DenseIndex.from_path(datastore, search="exact", verify_checksums=False),
            DenseIndex.from_path(datastore, search="scann", verify_checksums=False))


def measure(datastore: str, exact: Any, scann: Any, records: list[dict], states: Any,
            top_n: int) -> dict:
    import torch

    queries = np.concatenate([
        exact.projection(torch.from_numpy(
            states(r)[len(r["prompt"]) - 1:]))
        for r in records])
    result = {"datastore": Path(datastore).name, "num_keys": exact.manifest.num_keys,
              "dims": exact.manifest.dims,
              "explained_variance": round(exact.manifest.explained_variance, 4),
              "queries": len(queries), "top_n": top_n, "scann_settings": exact.manifest.scann}
    found = {}
    for name, index in (("exact", exact), ("scann", scann)):
        latencies = []
        hits = []
        for query in queries:
            start = time.perf_counter_ns()
            neighbours, _ = index.search(query[None], top_n)
            latencies.append(time.perf_counter_ns() - start)
            hits.append(neighbours[0])
        found[name] = hits
        result[f"{name}_us_p50"] = round(float(np.percentile(latencies, 50)) / 1e3, 1)
        result[f"{name}_us_p99"] = round(float(np.percentile(latencies, 99)) / 1e3, 1)
    # Self-retrieval: stored keys as queries must find themselves first.
    rows = np.random.default_rng(0).choice(exact.manifest.num_keys,
                                           min(1000, exact.manifest.num_keys), replace=False)
    keys = np.asarray(exact.keys[np.sort(rows)], dtype=np.float32)
    for name, index in (("exact", exact), ("scann", scann)):
        neighbours, _ = index.search(keys / np.linalg.norm(keys, axis=1, keepdims=True), top_n)
        ranks = [list(n).index(r) + 1 if r in n else np.inf
                 for n, r in zip(neighbours, np.sort(rows))]
        result[f"self_mrr_{name}"] = round(float(np.mean(1 / np.asarray(ranks))), 4)
    result["scann_recall"] = round(float(np.mean(
        [len(set(e) & set(s)) / len(e) for e, s in zip(found["exact"], found["scann"])])), 4)
    return result


def main(argv: list[str] | None = None) -> None:
    from benchmarks.replay import load_records

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("datastores", nargs="+", help="datastores with a dense index")
    parser.add_argument("--outputs", required=True, help="<run>.plain.jsonl")
    parser.add_argument("--model", required=True, help="model folder")
    parser.add_argument("--task", help="only this task's records")
    parser.add_argument("--top-n", type=int_at_least(1), default=32)
    parser.add_argument("--run-name", default="dense-search")
    parser.add_argument("--output-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    # Everything that can be wrong with the inputs is found before the model is loaded.
    try:
        indexes = {d: open_indexes(d) for d in args.datastores}
    except DatastoreError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        records = [r for r in load_records(args.outputs)
                   if args.task is None or r.get("task", "code-gen") == args.task]
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot read {args.outputs} ({e}); give the "
                         "<run>.plain.jsonl that vllm-rsd bench wrote") from None
    if not records:
        raise SystemExit(f"error: {args.outputs} has no records"
                         + (f" of task {args.task!r}" if args.task else ""))
    from benchmarks.hidden_states import TransformersStates

    states = TransformersStates(args.model)
    rows = [measure(d, exact, scann, records, states, args.top_n)
            for d, (exact, scann) in indexes.items()]
    table = markdown_table([(c, c) for c in COLUMNS], rows)
    print("\n".join(table))
    if args.output_dir:
        results = results_document(args.run_name, module_command("benchmarks.dense_search", argv),
                                   rows, model=reported_model(args.model))
        for path in write_report(results, args.output_dir, table):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
