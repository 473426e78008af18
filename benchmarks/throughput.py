"""Throughput benchmark: plain decoding, vLLM's ``ngram`` and our methods, side by side.

Every method runs in this one process on the same prompts (one at a time, greedy), each with its
own engine built and torn down in turn, so the ratios in one results file are fair. Results
follow ``shared/notes/bench-results-schema.md``.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class MethodRun:
    """One row of the comparison: a method name and its vLLM speculative_config (None = plain)."""

    method: str
    speculative_config: dict[str, Any] | None = None
    datastore: str | None = None


@dataclass
class BenchSettings:
    tasks: tuple[str, ...] = ("code-gen",)
    prompts: int = 20
    prompt_offset: int = 0
    max_tokens: int = 128
    num_speculative_tokens: int = 8
    #: Requests submitted together (a batch of this many, then the next).
    concurrency: int = 1
    max_model_len: int = 2048
    # float32: in bfloat16 (vLLM's default on CPU) verifying k+1 tokens at once rounds
    # differently from decoding one, and even vLLM's own ngram stops matching plain decoding.
    dtype: str = "float32"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def method_runs(specs: list[str], k: int, datastores: dict[str, str],
                method_options: dict[str, dict[str, Any]] | None = None) -> list[MethodRun]:
    """Rows for ``specs`` such as ``ngram``, ``pld`` or ``rest:stdlib`` (a method on the named
    datastore; the name may be left out when there is one datastore). Plain always comes first:
    the others are compared with it."""
    runs = [MethodRun("plain")]
    for spec in specs:
        name, _, store = spec.partition(":")
        options = dict((method_options or {}).get(name, {}))
        if name == "plain":
            continue
        if name == "ngram":
            # n from 4 down to 2, as measured in shared/notes; vLLM's default (5..5) drafts less.
            runs.append(MethodRun("ngram", {"method": "ngram", "num_speculative_tokens": k,
                                            "prompt_lookup_min": 2, "prompt_lookup_max": 4}))
            continue
        from vllm_retrieval_spec.config import METHODS

        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; choose from plain, ngram, "
                             + ", ".join(sorted(METHODS)))
        config = {"method": name, "num_speculative_tokens": k, **options}
        label = None
        if "datastore" in {f.name for f in dataclasses.fields(METHODS[name])}:
            if not store and len(datastores) == 1:
                store = next(iter(datastores))
            if store not in datastores:
                raise ValueError(f"{spec!r} needs a datastore: name one of {sorted(datastores)} "
                                 f"as {name}:NAME (--datastore NAME=DIR)")
            config["datastore"] = datastores[store]
            label = store
        runs.append(MethodRun(name, config, datastore=label))
    return runs


def run_benchmark(model: str, runs: list[MethodRun], settings: BenchSettings,
                  run_name: str, command: str) -> dict[str, Any]:
    """Run every method on every task's prompts; return the results document."""
    from transformers import AutoTokenizer

    from vllm_retrieval_spec.benchmarks.tasks import task_prompts

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = {task: task_prompts(task, tokenizer, settings.prompts, settings.prompt_offset)
               for task in settings.tasks}
    rows: list[dict[str, Any]] = []
    plain: dict[str, tuple[list[list[int]], float]] = {}
    for run in runs:
        for task, (row, outputs) in _run_method(model, run, prompts, settings).items():
            if run.method == "plain":
                plain[task] = (outputs, row["tokens_per_s"])
            plain_outputs, plain_tps = plain[task]
            row["speedup"] = round(row["tokens_per_s"] / plain_tps, 3)
            row["outputs_equal_plain"] = outputs == plain_outputs
            rows.append(row)
        print(format_table(rows), file=sys.stderr)
    import vllm

    return {
        "run": run_name,
        "date": datetime.date.today().isoformat(),
        "machine": _machine(),
        "model": MODEL_NAME if Path(model).name == MODEL_NAME else model,
        "vllm": vllm.__version__,
        "command": command,
        "rows": rows,
        "plain_outputs": [{"task": task, "prompt": p, "output": o}
                          for task, (outputs, _) in plain.items()
                          for p, o in zip(prompts[task], outputs)],
    }


def _run_method(model: str, run: MethodRun, prompts: dict[str, list[list[int]]],
                settings: BenchSettings) -> dict[str, tuple[dict[str, Any], list[list[int]]]]:
    """One engine for the method; every task's prompts one at a time, greedy."""
    from vllm import LLM, SamplingParams

    print(f"[bench] {run.method}: starting engine", file=sys.stderr)
    llm = LLM(model=model, speculative_config=run.speculative_config, enforce_eager=True,
              max_model_len=settings.max_model_len, dtype=settings.dtype,
              disable_log_stats=False, seed=0,
              **settings.engine_kwargs)
    speculative = run.speculative_config is not None
    greedy = SamplingParams(temperature=0.0, max_tokens=settings.max_tokens)
    results = {}
    try:
        # Warm up (numba, allocator, first-step paths) outside the timed region.
        first = next(iter(prompts.values()))[0]
        llm.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=8), use_tqdm=False)
        for task, task_prompts in prompts.items():
            before = _spec_counters(llm)
            if speculative:
                llm.collective_rpc("rsd_drafting_stats", kwargs={"reset": True})
            outputs: list[list[int]] = []
            elapsed = 0.0
            for i in range(0, len(task_prompts), settings.concurrency):
                batch = task_prompts[i:i + settings.concurrency]
                start = time.perf_counter()
                result = llm.generate([{"prompt_token_ids": p} for p in batch], greedy,
                                      use_tqdm=False)
                elapsed += time.perf_counter() - start
                outputs += [list(r.outputs[0].token_ids) for r in result]
                print(f"[bench] {run.method} {task}: prompt {len(outputs)}/{len(task_prompts)}, "
                      f"{sum(map(len, outputs))} tokens in {elapsed:.1f} s", file=sys.stderr)
            after = _spec_counters(llm)
            drafting = (llm.collective_rpc("rsd_drafting_stats")[0] if speculative
                        else {"p50_ms": None, "p99_ms": None})
            results[task] = (_row(run, task, settings, outputs, elapsed,
                                  after["accepted"] - before["accepted"],
                                  after["drafts"] - before["drafts"], drafting), outputs)
    finally:
        _shutdown(llm)
    return results


def _row(run: MethodRun, task: str, settings: BenchSettings, outputs: list[list[int]],
         elapsed: float, accepted: float, drafts: float,
         drafting: dict[str, Any]) -> dict[str, Any]:
    output_tokens = sum(map(len, outputs))
    config = dict(run.speculative_config or {})
    config.pop("method", None)
    config["dtype"] = settings.dtype
    row = {
        "task": task,
        "method": run.method,
        "config": config,
        "datastore": run.datastore,
        "prompts": len(outputs),
        "max_tokens": settings.max_tokens,
        "temperature": 0.0,
        "concurrency": settings.concurrency,
        "output_tokens": output_tokens,
        "tokens_per_s": round(output_tokens / elapsed, 3),
        # Each target forward yields one token plus the accepted draft tokens.
        "tokens_per_forward": round(output_tokens / (output_tokens - accepted), 3),
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "draft_ms_p50": _round(drafting["p50_ms"]),
        "draft_ms_p99": _round(drafting["p99_ms"]),
        "elapsed_s": round(elapsed, 2),
    }
    if drafting.get("search_ns"):
        # DReSD: share of the ANN search time that drafting did not wait for (thread pool).
        row["search_hidden"] = round(1 - drafting["search_wait_ns"] / drafting["search_ns"], 3)
    return row


def _spec_counters(llm: Any) -> dict[str, float]:
    values = {"accepted": 0.0, "drafts": 0.0}
    names = {"vllm:spec_decode_num_accepted_tokens": "accepted",
             "vllm:spec_decode_num_drafts": "drafts"}
    for metric in llm.get_metrics():
        if metric.name in names:
            values[names[metric.name]] += metric.value
    return values


def _shutdown(llm: Any) -> None:
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()
    del llm
    gc.collect()


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _machine() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import os

    return f"cpu-{os.cpu_count()}core"


COLUMNS = ("task", "method", "datastore", "tokens_per_s", "speedup", "tokens_per_forward",
           "mean_acceptance_length", "draft_ms_p50", "draft_ms_p99", "outputs_equal_plain")


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the rows' headline columns."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join("" if row.get(c) is None else str(row.get(c))
                                       for c in COLUMNS) + " |")
    return "\n".join(lines)


def write_results(results: dict[str, Any], output_dir: str | Path) -> tuple[Path, Path]:
    """``<run>.json``, ``<run>.md`` and the plain outputs for replay, ``<run>.plain.jsonl``."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / f"{results['run']}.json"
    md_path = output_dir / f"{results['run']}.md"
    results = dict(results)
    plain_outputs = results.pop("plain_outputs")
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    with open(output_dir / f"{results['run']}.plain.jsonl", "w") as f:
        for record in plain_outputs:
            f.write(json.dumps(record) + "\n")
    md_path.write_text(
        f"# {results['run']}\n\n{results['date']}, {results['machine']}, {results['model']}, "
        f"vLLM {results['vllm']}, {platform.python_version()}\n\n`{results['command']}`\n\n"
        f"{format_table(results['rows'])}\n")
    return json_path, md_path
