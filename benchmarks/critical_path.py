"""Why drafting is several times slower inside vLLM than offline, measured, and what is left of
it on the critical path when the next drafts are precomputed (``drafting.overlap``).

The same proposer replays recorded greedy outputs step by step as replay drives it
(``benchmarks.replay``: every hook in the order of vLLM's step, drafts made before sampling and
``after_handover``, which precomputes the next drafts when that is on, included). What is timed
is what vLLM on a GPU waits for: every hook from the forward's end to the drafts handed over
(replay's ``critical_ns``; ``after_handover`` overlaps the next forward there, where vLLM-CPU
waits for it too). Between two steps runs what happens between two decoding steps in the
engine, or nothing:

- ``nothing``: the steps back to back, as in offline replay;
- ``forward``: a forward of the target model on the last 64 tokens (transformers, float32: the
  weights vLLM-CPU reads every step);
- ``read``: a read of as many bytes as the model's weights, with no computation.

    python -m benchmarks.critical_path --output-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.replay import Replay, StepCosts, build_proposer, load_records
from vllm_retrieval_spec.bench.report import (
    markdown_table, module_command, results_document, write_report)
from vllm_retrieval_spec.bench.throughput import reported_model
from vllm_retrieval_spec.cli import int_at_least
from vllm_retrieval_spec.config import VLLM_CPU_DEFAULTS, parse_speculative_config

RESULTS = Path(__file__).parent / "results"
DEFAULT_RECORDS = RESULTS / "tuning" / "plain-tune-20-39.plain.jsonl"
BETWEEN = ("nothing", "forward", "read")


def offline_proposer(options: dict[str, Any], max_model_len: int = 4096) -> Any:
    """Our proposer for ``options`` (a speculative_config), built as vLLM's worker builds it
    (its served store indexes each finished request before the next one starts)."""
    return build_proposer(options, VLLM_CPU_DEFAULTS, max_model_len=max_model_len)


def between_steps(kind: str, model: Any) -> Callable[[np.ndarray], None]:
    """What runs between two steps (see the module's docstring)."""
    if kind == "nothing":
        return lambda context: None
    if kind == "read":
        weights = np.ones(sum(p.numel() for p in model.parameters()), dtype=np.float32)
        return lambda context: float(weights.sum())
    import torch

    def forward(context: np.ndarray) -> None:
        with torch.no_grad():
            model(torch.from_numpy(context[-64:].astype(np.int64))[None])

    return forward


def replay_steps(proposer: Any, records: list[dict[str, list[int]]], between: Callable,
                 max_steps: int) -> np.ndarray:
    """Nanoseconds of each step's drafting that the step waits for (replay's ``critical_ns``:
    every hook from the forward's end to the drafts handed over), over the records' greedy
    steps as replay drives the proposer, ``between`` run where the forward runs (a request at a
    time; each is finished as vLLM finishes it, so a served store learns from them)."""
    steps = Replay(proposer, StepCosts(proposer.config.drafting.draft_token_cost),
                   between=between)
    steps.serve(list(enumerate(records)))
    while len(steps.critical_ns) < max_steps and steps.advance():
        pass
    times = steps.critical_ns[:max_steps]
    return np.asarray(times[len(times) // 10:])  # the first steps compile and warm up


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", default=str(DEFAULT_RECORDS),
                        help="<run>.plain.jsonl written by vllm-rsd bench")
    parser.add_argument("--task", default="code-edit")
    parser.add_argument("--methods", default='[{"method": "pld", "num_speculative_tokens": 8}, '
                        '{"method": "hybrid", "num_speculative_tokens": 24}]',
                        help="JSON list of speculative_config dicts")
    parser.add_argument("--between", default=",".join(BETWEEN))
    parser.add_argument("--steps", type=int_at_least(1), default=300, help="timed steps per row")
    parser.add_argument("--model", help="model folder (default: the cached SmolLM2)")
    parser.add_argument("--output-dir", help="write critical-path.json and .md there")
    args = parser.parse_args(argv)
    between = args.between.split(",")
    for kind in between:
        if kind not in BETWEEN:
            parser.error(f"--between: {kind!r} is not one of {', '.join(BETWEEN)}")
    try:
        records = load_records(args.records)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot read {args.records} ({e}); give the "
                         "<run>.plain.jsonl that vllm-rsd bench wrote") from None
    try:
        methods = json.loads(args.methods)
        for options in methods:
            parse_speculative_config({**options, "draft_budget_ms": 0}, VLLM_CPU_DEFAULTS)
    except ValueError as e:  # not JSON, or a ConfigError
        raise SystemExit(f"error: --methods: {e}") from None
    tasks = sorted({r["task"] for r in records})
    records = [r for r in records if r["task"] == args.task]
    if not records:
        raise SystemExit(f"error: no records of task {args.task!r} in {args.records} "
                         f"(it has {', '.join(tasks)})")

    import torch
    from transformers import AutoModelForCausalLM

    from vllm_retrieval_spec.assets import model_path

    torch.set_num_threads(1)
    model_dir = args.model or str(model_path())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = []
    for options in methods:
        for kind in between:
            for precompute in (False, True):
                proposer = offline_proposer({**options, "precompute_drafts": precompute,
                                             "draft_budget_ms": 0})
                us = replay_steps(proposer, records, between_steps(kind, model), args.steps) / 1e3
                stats = proposer.stats()
                proposer.close()
                rows.append({"method": options["method"], "between_steps": kind,
                             "precompute_drafts": precompute, "steps": len(us),
                             "critical_us_p50": round(float(np.percentile(us, 50)), 1),
                             "critical_us_p90": round(float(np.percentile(us, 90)), 1),
                             "precomputed_used": stats.get("precomputed_used", 0),
                             "precomputed_missed": stats.get("precomputed_missed", 0)})
                print(rows[-1], flush=True)
    columns = [(key, key) for key in rows[0]]
    print("\n".join(markdown_table(columns, rows)))
    if args.output_dir:
        results = results_document("critical-path", module_command(
            "benchmarks.critical_path", argv), rows,
            model=reported_model(model_dir), torch_threads=1)
        for path in write_report(results, args.output_dir, markdown_table(columns, rows)):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
