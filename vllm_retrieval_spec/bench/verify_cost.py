"""What a decoding step costs when it verifies a draft of d tokens, on this machine.

One engine whose proposer drafts ``d`` copies of token 0 (``<|endoftext|>``, which the model next
to never predicts mid-text) at every step, so nothing is accepted and every step emits one token:
the time per step is the cost of verifying d draft tokens. ``d`` is read from a file at every
step, so all lengths share one engine and are measured in turns (repeats interleave, which
spreads this machine's drifts over all lengths). Every context is generated once before the timed
runs, so each of them finds its prompt in vLLM's prefix cache: the time per step is that of the
decoding steps plus the prefill of the prompt's last, partial block divided by ``--max-tokens``,
the same for every d and repeat of one context length.

    python -m vllm_retrieval_spec.bench.verify_cost --run-name verify-cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

#: The file the engine's proposer reads the draft length from (inherited by vLLM's processes).
LENGTH_FILE_ENV = "VLLM_RSD_VERIFY_COST_LENGTH_FILE"


class RejectedDraftProposer:
    """vLLM's ``custom_class`` contract: drafts the current length of token 0 for every row."""

    def __init__(self, vllm_config: Any) -> None:
        self.path = Path(os.environ[LENGTH_FILE_ENV])

    def load_model(self, model: Any) -> None:
        pass

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any,
                token_ids_cpu: Any, slot_mappings: Any = None) -> list[list[int]]:
        length = int(self.path.read_text())
        return [[0] * length if sampled else [] for sampled in sampled_token_ids]


def measure(model: str, text: list[int], contexts: list[int], lengths: list[int], repeats: int,
            max_tokens: int, progress_file: Any = None,
            dtype: str | None = None) -> list[dict[str, Any]]:
    """Median ms per step for every (context length, draft length), each context the start of
    ``text`` (``calibration_text``, which the caller has checked the plan against); a progress
    bar on ``progress_file`` (default stderr). The engine runs as ours serve
    (``engine.timed_engine_args``: on a GPU, PIECEWISE CUDA graphs), in ``dtype`` (default:
    float32 on vLLM-CPU, as this project's benchmarks; the model's own elsewhere)."""
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    from vllm_retrieval_spec.bench.engine import timed_engine_args
    from vllm_retrieval_spec.bench.tasks import MAX_MODEL_LEN

    is_cpu = current_platform.is_cpu()
    length_file = Path(tempfile.mkdtemp()) / "draft-length"
    length_file.write_text("0")
    os.environ[LENGTH_FILE_ENV] = str(length_file)
    llm = LLM(model=model, dtype=dtype or ("float32" if is_cpu else "auto"),
              max_model_len=MAX_MODEL_LEN, seed=0,
              speculative_config={"method": "custom_class",
                                  "model": f"{__name__}.RejectedDraftProposer",
                                  "num_speculative_tokens": max(lengths)},
              **timed_engine_args(is_cpu, piecewise=True))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    times: dict[tuple[int, int], list[float]] = {}
    runs = [(context, length) for _ in range(repeats) for context in contexts
            for length in lengths]
    try:
        # Warm-up, and every context into the prefix cache: were only the first run of a
        # context to pay its whole prefill, that run would be an outlier of its length.
        for context in contexts:
            llm.generate([{"prompt_token_ids": text[:context]}], params, use_tqdm=False)
        for context, length in tqdm(runs, desc="verify cost", unit="run", file=progress_file):
            length_file.write_text(str(length))
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": text[:context]}], params, use_tqdm=False)
            elapsed_ms = (time.perf_counter() - start) * 1e3 / max_tokens
            times.setdefault((context, length), []).append(round(elapsed_ms, 1))
    finally:
        llm.llm_engine.engine_core.shutdown()
    return [{"context_tokens": c, "draft_len": d, "ms_per_step_median": statistics.median(v),
             "ms_per_step": v} for (c, d), v in sorted(times.items())]


def calibration_text(tokenizer: Any) -> list[int]:
    """What ``measure`` cuts its contexts from: news articles, concatenated (ordinary text;
    about 1,100 tokens, which bounds the contexts)."""
    from vllm_retrieval_spec.bench.tasks import task_prompts

    return [t for p in task_prompts("summarize", tokenizer, 4) for t in p]


def checked_calibration_text(model: str, contexts: list[int], lengths: list[int],
                             max_tokens: int) -> list[int]:
    """``model``'s calibration text, once the plan has been checked against it (``check_plan``):
    what ``vllm-rsd calibrate`` and ``main`` do before the engine starts. A bad plan, or a
    model without a tokenizer, is a one-line SystemExit."""
    from vllm_retrieval_spec.cli import load_tokenizer

    text = calibration_text(load_tokenizer(model))
    try:
        check_plan(contexts, lengths, max_tokens, len(text))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return text


def check_plan(contexts: list[int], lengths: list[int], max_tokens: int,
               text_tokens: int) -> None:
    """Refuse, before an engine starts, what would otherwise fail or be mislabelled only
    after every measurement: lengths ``calibrated_options`` cannot fit, a context longer than
    the text (it would be cut short, yet reported at its asked length) or leaving no room for
    ``max_tokens`` steps (vLLM would stop the run early, skewing ms per step)."""
    from vllm_retrieval_spec.bench.tasks import MAX_MODEL_LEN

    check_lengths(lengths)
    for context in contexts:
        if context > text_tokens:
            raise ValueError(f"context {context} is longer than the calibration text "
                             f"({text_tokens} tokens); give --contexts of at most that")
        if context + max_tokens > MAX_MODEL_LEN:
            raise ValueError(f"context {context} + --max-tokens {max_tokens} is over the "
                             f"engine's {MAX_MODEL_LEN} tokens; lower one of them")


def check_lengths(lengths: list[int]) -> None:
    if 0 not in lengths or len({d for d in lengths if d >= 2}) < 2:
        raise ValueError("calibration needs draft length 0 and at least two lengths of 2 or "
                         f"more; got {sorted(set(lengths))}")


#: A draft length whose step is this much slower than the trend of longer drafts is avoided.
ANOMALY_TOLERANCE = 0.10
#: The drafting time budget, as a share of a step without draft.
BUDGET_SHARE = 0.07


def calibrated_options(rows: list[dict[str, Any]], max_draft_len: int | None = None,
                       ) -> dict[str, float | int]:
    """The speculative_config options that ``measure``'s step times imply for this machine.

    - ``draft_token_cost``: the least-squares slope of step time over draft length (lengths 2
      and up, every context), as a share of the step without draft. Lengths past
      ``max_draft_len`` are left out: a GPU's curve is flat for the lengths chains verify and
      bends only beyond them, where a line through both fits neither.
    - ``min_draft_len``: the shortest length from which no measured length is more than
      ``ANOMALY_TOLERANCE`` slower than that line (vLLM-CPU verifies 1 token slower than 8).
    - ``draft_budget_ms``: ``BUDGET_SHARE`` of the step without draft.
    """
    by_length: dict[int, list[float]] = {}
    for row in rows:
        if max_draft_len is not None and row["draft_len"] > max_draft_len:
            continue
        by_length.setdefault(row["draft_len"], []).append(row["ms_per_step_median"])
    check_lengths(list(by_length))
    base = statistics.mean(by_length[0])
    points = [(d, t) for d, times in by_length.items() if d >= 2 for t in times]
    mean_d = statistics.mean(d for d, _ in points)
    mean_t = statistics.mean(t for _, t in points)
    slope = (sum((d - mean_d) * (t - mean_t) for d, t in points)
             / sum((d - mean_d) ** 2 for d, _ in points))
    slope = max(slope, 0.0)

    def trend(d: int) -> float:
        return mean_t + slope * (d - mean_d)

    anomalous = [d for d, times in by_length.items()
                 if d >= 1 and statistics.mean(times) > (1 + ANOMALY_TOLERANCE) * trend(d)]
    return {"draft_token_cost": round(slope / base, 4),
            "min_draft_len": max(anomalous, default=0) + 1,
            "draft_budget_ms": round(BUDGET_SHARE * base, 2)}


def main(argv: list[str] | None = None) -> None:
    from vllm_retrieval_spec.bench.report import (
        markdown_table, module_command, results_document, write_report)
    from vllm_retrieval_spec.bench.throughput import MODEL_NAME, reported_model

    from vllm_retrieval_spec.cli import add_calibration_plan, resolve_model

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL_NAME)
    add_calibration_plan(parser, lengths="0,1,2,3,4,5,6,7,8")
    parser.add_argument("--run-name", default="verify-cost")
    parser.add_argument("--output-dir", default="benchmarks/results")
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = resolve_model(args.model)
    text = checked_calibration_text(model, args.contexts, args.lengths, args.max_tokens)
    rows = measure(model, text, args.contexts, args.lengths, args.repeats, args.max_tokens)
    import vllm

    command = module_command("vllm_retrieval_spec.bench.verify_cost", argv)
    results = results_document(args.run_name, command, rows, model=reported_model(model),
                               vllm=vllm.__version__)
    table = markdown_table([("context tokens", "context_tokens"), ("draft tokens", "draft_len"),
                            ("ms per step (median)", "ms_per_step_median"),
                            ("runs", "ms_per_step")], rows)
    write_report(results, args.output_dir, table)
    print("\n".join(table))


if __name__ == "__main__":
    main()
