"""The served store at size: lookup latency, rebuild time and memory at N stored tokens.

The store is filled with real SmolLM2 token documents, cut to request size (300 tokens): half
of the recorded benchmark requests (``benchmarks/results/*.plain.jsonl``, prompt and output),
then documents of a REST datastore (``--datastore``, e.g. the stdlib one the demo builds) until
N tokens. Each lookup's context is one of the other recorded requests' prompt plus a prefix of
its output, as in a decoding step.

    python -m benchmarks.served_store \
        --datastore ~/.cache/vllm-retrieval-spec/datastores/stdlib --output-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from vllm_retrieval_spec.bench.report import (
    markdown_table, module_command, results_document, write_report)
from vllm_retrieval_spec.cli import int_at_least, ints_at_least
from vllm_retrieval_spec.datastore.format import SEPARATOR, DatastoreError, load_datastore
from vllm_retrieval_spec.datastore.served import ServedStore

RESULTS = Path(__file__).parent / "results"
REQUEST_TOKENS = 300


def recorded_requests() -> list[dict[str, list[int]]]:
    records = []
    for path in sorted(RESULTS.glob("**/*.plain.jsonl")):
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


def documents(records: list[dict[str, list[int]]], tokens: np.ndarray) -> Iterator[np.ndarray]:
    """The records, then the documents of a datastore's ``tokens``, cut to request size."""
    for record in records:
        yield np.asarray(record["prompt"] + record["output"], dtype=np.int32)
    start = 0
    for end in np.flatnonzero(tokens == SEPARATOR):
        for piece in range(start, end, REQUEST_TOKENS):
            yield tokens[piece:min(piece + REQUEST_TOKENS, end)]
        start = end + 1


def measure(store_tokens: int, datastore_tokens: np.ndarray, lookups: int, seed: int = 0) -> dict:
    # Requests are stored (every second record) or looked up (the others), never both.
    records = recorded_requests()
    stored, held_out = records[::2], records[1::2]
    # Compile the index builder outside the timed rebuild.
    ServedStore(16, background=False).add("warm-up", np.arange(8, dtype=np.int32))
    store = ServedStore(store_tokens, background=False)
    # Filled without indexing each add (that is the background thread's job in the engine).
    store.refresh = lambda: None  # type: ignore[method-assign]
    for i, document in enumerate(documents(stored, datastore_tokens)):
        store.add(str(i), document)
        if store.num_tokens >= store_tokens:
            break
    del store.refresh
    start = time.perf_counter()
    store.refresh()
    rebuild_s = time.perf_counter() - start
    # Again, traced (numpy's and divsufsort's buffers are numpy arrays): the rebuild's peak.
    tracemalloc.start()
    store.refresh()
    rebuild_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rng = np.random.default_rng(seed)
    contexts = []
    for _ in range(lookups):
        record = held_out[int(rng.integers(len(held_out)))]
        cut = int(rng.integers(1, len(record["output"]) + 1))
        contexts.append(np.asarray(record["prompt"] + record["output"][:cut], dtype=np.int32))
    options = {"min_len": 2, "max_len": 16, "max_occurrences": 64, "continuation_len": 24}
    for context in contexts[:100]:  # compiled, caches warm
        store.lookup(context, **options)
    times, matched = [], []
    for context in contexts:
        start = time.perf_counter_ns()
        _, _, n = store.lookup(context, **options)
        times.append(time.perf_counter_ns() - start)
        matched.append(n)
    return {"store_tokens": store.num_tokens, "store_requests": store.num_documents,
            "lookups": lookups, "lookup_us_p50": round(np.percentile(times, 50) / 1e3, 2),
            "lookup_us_p99": round(np.percentile(times, 99) / 1e3, 2),
            "mean_match_len": round(float(np.mean(matched)), 2),
            "rebuild_s": round(rebuild_s, 3),
            "index_bytes": int(store.index.tokens.nbytes + store.index.suffix_array.nbytes),
            "documents_bytes": int(sum(d.nbytes for d in store.documents())),
            "rebuild_peak_bytes": rebuild_peak}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datastore", required=True,
                        help="a REST datastore whose documents fill the store past the records")
    parser.add_argument("--tokens", type=ints_at_least(1), default="100000,1000000",
                        help="store sizes to measure")
    parser.add_argument("--lookups", type=int_at_least(1), default=10_000)
    parser.add_argument("--output-dir", help="write served-store.json and .md there")
    args = parser.parse_args(argv)
    # Opened before any store is filled: a wrong path is a one-line error, not a traceback
    # after the records were stored.
    try:
        tokens = np.asarray(load_datastore(args.datastore, verify_checksums=False).tokens)
    except DatastoreError as e:
        raise SystemExit(f"error: {e}") from None
    rows = [measure(n, tokens, args.lookups) for n in args.tokens]
    columns = [(key, key) for key in rows[0]]
    print("\n".join(markdown_table(columns, rows)))
    if args.output_dir:
        results = results_document("served-store", module_command(
            "benchmarks.served_store", argv), rows)
        for path in write_report(results, args.output_dir, markdown_table(columns, rows)):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
