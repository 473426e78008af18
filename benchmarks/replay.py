"""Offline replay of recorded plain greedy outputs: tokens per target forward in seconds.

For greedy decoding the accepted length of a draft is exactly its common prefix with the true
continuation, so walking a recorded plain output and drafting at every position the engine would
reach gives the engine's tokens per forward without running the model. Use it to tune drafting
rules; confirm winners with ``vllm-rsd bench``.

    python -m vllm_retrieval_spec.benchmarks.replay benchmarks/results/RUN.plain.jsonl \
        --datastore ds/stdlib --rest-options '[{}, {"min_prefix_prob": 0.1}]'
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

DraftFn = Callable[[np.ndarray, int], np.ndarray]


def replay(records: list[dict[str, list[int]]], draft: DraftFn, k: int) -> dict[str, float]:
    """Walk every recorded output as the engine would with ``draft``; summarise."""
    output_tokens = forwards = drafted = 0
    draft_ns: list[int] = []
    for record in records:
        prompt, output = record["prompt"], record["output"]
        sequence = np.asarray(prompt + output, dtype=np.int32)
        position = 1  # the prefill forward produced output[0]
        forwards += 1
        while position < len(output):
            start = time.perf_counter_ns()
            proposal = draft(sequence[: len(prompt) + position], k)
            draft_ns.append(time.perf_counter_ns() - start)
            truth = output[position:position + len(proposal)]
            accepted = 0
            while accepted < len(truth) and proposal[accepted] == truth[accepted]:
                accepted += 1
            drafted += len(proposal)
            forwards += 1
            position += accepted + 1
        output_tokens += len(output)
    steps = max(forwards - len(records), 1)
    return {
        "tokens_per_forward": round(output_tokens / forwards, 3),
        "mean_draft_len": round(drafted / steps, 2),
        "draft_us_p50": round(float(np.percentile(draft_ns, 50)) / 1e3, 1) if draft_ns else 0.0,
        "draft_us_p99": round(float(np.percentile(draft_ns, 99)) / 1e3, 1) if draft_ns else 0.0,
    }


def load_records(path: str) -> list[dict[str, list[int]]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> None:
    from vllm_retrieval_spec.config import parse_speculative_config
    from vllm_retrieval_spec.datastore.suffix_array import SuffixArrayDatastore
    from vllm_retrieval_spec.proposers.rest import rest_draft

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outputs", help="<run>.plain.jsonl written by vllm-rsd bench")
    parser.add_argument("--datastore", required=True)
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--rest-options", default="[{}]",
                        help="JSON list of REST option dicts to compare")
    args = parser.parse_args(argv)
    records = load_records(args.outputs)
    datastore = SuffixArrayDatastore.from_path(args.datastore, verify_checksums=False)
    for options in json.loads(args.rest_options):
        config: Any = parse_speculative_config({"method": "rest", "num_speculative_tokens": args.k,
                                                "datastore": args.datastore, **options})
        result = replay(records, lambda c, n: rest_draft(datastore, c, n, config), args.k)
        print(json.dumps({"options": options, **result}))


if __name__ == "__main__":
    main()
