"""Modelled GPU speedups: acceptance replayed from recorded greedy outputs, step times measured
on a GPU (``benchmarks/gpu_check.py``'s chain and tree step-cost curves), every method beside
vLLM's ``ngram`` and ``suffix`` in one run.

    python -m benchmarks.modelled_gpu benchmarks/results/padded-drafts-30-prompts.plain.jsonl \
        --chain-cost CHAIN.json --tree-cost TREE.json --run-name modelled-gpu-h100 \
        [--datastore DIR ...]

``CHAIN.json`` and ``TREE.json`` are in ``replay --verify-cost``'s format (rows of
``context_tokens``, ``draft_len``, ``ms_per_step_median``); the curve of the shortest context is
used. Steps cost what vLLM 0.32's CUDA graphs make them (``replay.CudaGraphs``): for ``suffix``
and ``ngram`` a full graph (the chain curve) only for a draft of num_speculative_tokens, other
steps PIECEWISE (attention eager: the chain's piecewise times where measured, else the chain
curve plus what the mode adds at no draft, read off the tree curve), ``suffix``'s at
num_speculative_tokens + 1 tokens whatever the draft (Model Runner V1 rounds its capture sizes
to that); our methods run PIECEWISE throughout (the plugin's mode), their tree steps at the tree
curve, our kernel only on tree rows. The chain curve is calibrated as ``vllm-rsd calibrate``
calibrates a machine (``calibrated_options``, over the lengths chains verify): those are the
accelerator defaults the curve implies, and our methods are replayed with its
``draft_token_cost`` and ``min_draft_len`` (replay has no time budget), so their drafting rules
see the measured cost. Every row is modelled, not measured in an engine: tokens per forward from
replay, time from the curves; ``modeled_speedup_with_drafting`` adds the drafting each step
waits for, timed by replay on the machine running it (``draft_us_critical_mean``), and
``ahead_used`` is the share of steps whose draft was made ahead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from benchmarks.replay import load_records, replay_config, shortest_context_rows
from vllm_retrieval_spec.bench.report import (
    markdown_table, module_command, results_document, write_report)
from vllm_retrieval_spec.bench.verify_cost import calibrated_options
from vllm_retrieval_spec.config import ACCELERATOR_DEFAULTS

#: The longest draft the calibration reads: what chains of our methods verify.
CHAIN_LENGTHS = 16


def chain_calibration(path: str) -> dict[str, float | int]:
    """``calibrated_options`` of the chain curve's shortest context (the one replay reads),
    over draft lengths up to ``CHAIN_LENGTHS``."""
    return calibrated_options(shortest_context_rows(path), max_draft_len=CHAIN_LENGTHS)


def method_configs(k: int, tree_k: int, datastores: list[str]) -> dict[str, dict]:
    """The rows' names and speculative configs: vLLM's two, and ``suffix`` with PIECEWISE
    graphs set by hand (``suffix/piecewise``: its default pads each step to 25 tokens), then
    ours; per datastore also ``rest`` on it and ``hybrid`` with it among its sources
    (``rest:NAME``, ``hybrid:NAME``, as ``vllm-rsd bench`` names the rows)."""
    configs = {"ngram": {"method": "ngram", "num_speculative_tokens": k},
               "suffix": {"method": "suffix"},
               "suffix/piecewise": {"method": "suffix", "cudagraph_mode": "PIECEWISE"},
               "pld": {"method": "pld", "num_speculative_tokens": k}}
    for datastore in datastores:
        configs[f"rest:{Path(datastore).name}"] = {"method": "rest", "num_speculative_tokens": k,
                                                   "datastore": datastore}
    hybrids = {"hybrid": {}, **{f"hybrid:{Path(d).name}": {"datastore": d} for d in datastores}}
    for name, sources in hybrids.items():
        configs[name] = {"method": "hybrid", "num_speculative_tokens": k, **sources}
        configs[f"{name}/tree"] = {"method": "hybrid", "num_speculative_tokens": tree_k,
                                   "tree": "on", **sources}
    return configs


def ahead_used(stats: dict[str, int]) -> float | None:
    """The share of drafting steps served by a draft made ahead (``precompute_drafts``); None
    for a drafter that makes none."""
    made = stats.get("precomputed_used", 0) + stats.get("precomputed_missed", 0)
    return round(stats.get("precomputed_used", 0) / made, 3) if made else None


def modelled_rows(records: list[dict[str, Any]], configs: dict[str, dict], chain_cost: str,
                  tree_cost: str) -> tuple[list[dict[str, Any]], dict[str, float | int]]:
    """One row per task and method, and the options the chain curve implies."""
    calibrated = chain_calibration(chain_cost)
    platform = dataclasses.replace(ACCELERATOR_DEFAULTS,
                                   draft_token_cost=calibrated["draft_token_cost"],
                                   min_draft_len=calibrated["min_draft_len"])
    rows = []
    for task in sorted({r.get("task", "code-gen") for r in records}):
        ours = [r for r in records if r.get("task", "code-gen") == task]
        for name, options in configs.items():
            result = replay_config(options, ours, platform, verify_cost=chain_cost,
                                   tree_verify_cost=tree_cost)
            rows.append({"task": task, "method": name, "config": options, "prompts": len(ours),
                         **{key: result[key] for key in (
                             "modeled_speedup", "modeled_speedup_with_drafting",
                             "tokens_per_forward", "mean_draft_len", "draft_us_p50",
                             "draft_us_critical_mean")},
                         "ahead_used": ahead_used(result.get("stats", {}))})
        suffix = next(r for r in rows if r["task"] == task and r["method"] == "suffix")
        for row in rows:
            if row["task"] == task:
                row["vs_suffix"] = round(row["modeled_speedup"] / suffix["modeled_speedup"], 3)
    return rows, calibrated


def by_method(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows pivoted as README's results table: one per method, a column per task with its
    modelled speedup and, in brackets, that over suffix's."""
    pivoted: dict[str, dict[str, Any]] = {}
    for row in rows:
        pivoted.setdefault(row["method"], {"method": row["method"]})[row["task"]] = (
            f"{row['modeled_speedup']:.2f}x ({row['vs_suffix']:.2f})")
    return list(pivoted.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outputs", nargs="+", help="<run>.plain.jsonl written by vllm-rsd bench")
    parser.add_argument("--chain-cost", required=True, help="step times verifying chains")
    parser.add_argument("--tree-cost", required=True, help="step times verifying trees")
    parser.add_argument("--run-name", required=True)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--datastore", action="append", default=[],
                        help="a build-datastore directory: a rest row on it, and hybrid's rows "
                             "again with it (repeatable)")
    parser.add_argument("-k", type=int, default=32, help="num_speculative_tokens of chains")
    parser.add_argument("--tree-k", type=int, default=64, help="nodes of hybrid's trees at most")
    args = parser.parse_args(argv)
    records = [r for path in args.outputs for r in load_records(path)]
    rows, calibrated = modelled_rows(
        records, method_configs(args.k, args.tree_k, args.datastore), args.chain_cost,
        args.tree_cost)
    results = results_document(args.run_name, module_command("benchmarks.modelled_gpu", argv),
                               rows, model="SmolLM2-135M-Instruct (recorded outputs)",
                               modelled=True, chain_cost=args.chain_cost,
                               tree_cost=args.tree_cost,
                               calibrated_options=calibrated)
    tasks = sorted({row["task"] for row in rows})
    body = [f"Modelled, not measured in an engine: tokens per forward replayed from recorded "
            f"outputs, step times from `{args.chain_cost}` and `{args.tree_cost}`; our methods "
            f"at the accelerator's defaults with draft_token_cost "
            f"{calibrated['draft_token_cost']} and min_draft_len {calibrated['min_draft_len']}. "
            f"Steps cost what vLLM 0.32's CUDA graphs make them: for suffix and ngram a full "
            f"graph (the chain curve) only for a draft of num_speculative_tokens, else "
            f"PIECEWISE (the chain's piecewise times where measured, else the chain curve "
            f"plus what the mode adds at no draft), suffix's at "
            f"num_speculative_tokens + 1 tokens whatever the draft (Model Runner V1 rounds its "
            f"capture sizes to that), ngram's (Model Runner V2) at the next capture size; ours "
            f"run PIECEWISE throughout (the plugin's mode), tree steps at the tree curve. "
            f"Drafting is left out of the modelled speedup; `with "
            f"drafting` adds to every step the part of drafting it waits for (`critical "
            f"drafting`: everything but the drafts made ahead, which overlap the next forward), "
            f"timed by replay on the machine this page names, not a GPU host. `ahead used`: "
            f"the share of steps whose draft was made ahead (`precompute_drafts`, the "
            f"accelerator's default).",
            "", f"What the chain curve implies (`vllm-rsd calibrate`'s rules, draft lengths up "
            f"to {CHAIN_LENGTHS}): `{json.dumps(calibrated)}`.",
            "", *markdown_table([("task", "task"), ("method", "method"),
                                 ("modelled speedup", "modeled_speedup"),
                                 ("vs suffix", "vs_suffix"),
                                 ("with drafting", "modeled_speedup_with_drafting"),
                                 ("tokens/forward", "tokens_per_forward"),
                                 ("mean draft", "mean_draft_len"),
                                 ("critical drafting (us/step, mean)", "draft_us_critical_mean"),
                                 ("ahead used", "ahead_used")], rows),
            "", "As README's table (modelled speedup over plain decoding, over suffix's in "
            "brackets):", "",
            *markdown_table([("method", "method"), *((task, task) for task in tasks)],
                            by_method(rows))]
    json_path, md_path = write_report(results, args.out_dir, body)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
