"""Throughput benchmark: plain decoding, vLLM's ``ngram`` and ``suffix`` and our methods, side
by side.

Every method runs in this one process on the same prompts (greedy), all engines alive and taking
turns prompt by prompt (or, with ``interleave=False``, one engine after another), so the ratios in
one results file are fair. Results follow ``docs/results-schema.md``; a PNG plot of speedup and
tokens per forward goes beside them.

This module says what a run compares (``method_runs``, ``BenchSettings``) and runs it
(``run_benchmark``); ``engine`` holds one method's engine and what it measures, ``results`` the
rows, tables and plot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.bench.engine import MethodEngine, cpu_kv_cache_bytes, turns
from vllm_retrieval_spec.bench.report import results_document
from vllm_retrieval_spec.bench.results import compared_with_plain, failed_row, method_label
from vllm_retrieval_spec.bench.tasks import MAX_MODEL_LEN
from vllm_retrieval_spec.config import METHODS, parse_speculative_config, platform_defaults

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
    #: A row of its own beside the same method's, set apart only by its ``--method-options``
    #: entry (``METHOD@NAME``, e.g. ``hybrid@restarted`` on a served store kept from earlier).
    name: str = ""

    @property
    def label(self) -> str:
        return method_label(self.method, self.datastore) + (f"/{self.variant}"
                                                            if self.variant else "") \
            + (f"@{self.name}" if self.name else "")


#: vLLM's own drafters, compared with ours at the settings below.
BUILTIN_METHODS = ("ngram", "suffix")
#: vLLM's ngram as every benchmark runs it (the lab tools' peers too): n from 4 down to 2,
#: shorter matches than vLLM's default (5..5), which drafts less.
NGRAM_OPTIONS = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
#: Ours that can draft token trees: those that vote in a trie (``tree`` is a trie option).
TREE_METHODS = tuple(name for name, cls in METHODS.items() if "tree" in cls.option_types())
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
    #: Sampling of every request: greedy at 0, else seeded by the prompt's index in its task,
    #: alike for every method (their outputs still differ once drafts are verified).
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0


def method_runs(specs: list[str], k: int, datastores: dict[str, str],
                method_options: dict[str, dict[str, Any]] | None = None) -> list[MethodRun]:
    """Rows for ``specs`` such as ``ngram``, ``pld`` or ``rest:stdlib`` (a method on the named
    datastore; the name may be left out when there is one datastore), ``/tree`` after one of
    ours for its tree drafts, ``@NAME`` last for a row set apart by ``method_options``'
    entry spelled so. Plain always comes first: the others are compared with it."""
    from vllm.platforms import current_platform

    # The defaults the engine's own check reads (patches/engine_args.py).
    platform = platform_defaults(current_platform.is_cpu())
    runs = [MethodRun("plain")]
    for spelled in specs:
        unnamed, _, row_name = spelled.partition("@")
        spec, _, variant = unnamed.partition("/")
        if variant and variant not in VARIANTS:
            raise ValueError(f"{spelled!r}: the variants are '/tree' (token-tree drafts), "
                             "'/after-sampling' (drafts only after sampling), '/served-dense' "
                             "(hybrid's served store with its dense half) and '/unpadded' (no "
                             "draft padded to a cheaper length)")
        name, _, store = spec.partition(":")
        if variant == "tree" and name not in TREE_METHODS:
            raise ValueError(f"{spelled!r}: '/tree' is for " + ", ".join(TREE_METHODS))
        if variant and name in ("plain", *BUILTIN_METHODS):
            raise ValueError(f"{spelled!r}: variants are for our methods, "
                             + ", ".join(METHODS))
        if variant == "served-dense" and name != "hybrid":
            raise ValueError(f"{spelled!r}: '/served-dense' is for hybrid")
        # Options for the method, then for this row alone (keyed as spelled, e.g. "hybrid:a").
        options = {**(method_options or {}).get(name, {}),
                   **((method_options or {}).get(spec, {}) if store else {})}
        if row_name and name in ("plain", *BUILTIN_METHODS):
            raise ValueError(f"{spelled!r}: '@NAME' rows are for our methods, which take "
                             "--method-options")
        options.update((method_options or {}).get(spelled, {}) if row_name else {})
        if name == "plain":
            continue
        if name == "ngram":
            runs.append(MethodRun("ngram", {"method": "ngram", "num_speculative_tokens": k,
                                            **NGRAM_OPTIONS}))
            continue
        if name == "suffix":
            # vLLM's SuffixDecoding at its own defaults (it drafts up to 24 tokens, as long as
            # its match supports); it learns from every response the engine has served.
            if importlib.util.find_spec("arctic_inference") is None:
                raise ValueError("method 'suffix' (vLLM's SuffixDecoding) needs the "
                                 "arctic-inference package, which ./setup.sh installs")
            runs.append(MethodRun("suffix", {"method": "suffix"}))
            continue
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; choose from plain, "
                             + ", ".join([*BUILTIN_METHODS, *sorted(METHODS)]))
        config = {"method": name, "num_speculative_tokens": k, **options,
                  **VARIANTS.get(variant, {})}
        label = None
        # hybrid alone drafts from what it serves (and the context); hybrid:NAME adds NAME.
        optional = name == "hybrid" and not store
        if "datastore" in METHODS[name].option_types() and not optional:
            if not store and len(datastores) == 1:
                store = next(iter(datastores))
            if store not in datastores:
                raise ValueError(f"{spec!r} needs a datastore: name one of {sorted(datastores)} "
                                 f"as {name}:NAME (--datastore NAME=DIR)")
            config["datastore"] = datastores[store]
            label = store
        # A bad option fails here, not in this row's engine once the engines before it ran.
        parse_speculative_config(config, platform)
        runs.append(MethodRun(name, config, datastore=label, variant=variant, name=row_name))
    # Rows of one label cannot be told apart in the table or the JSON, and the plot draws one
    # bar per label (the last row's). "rest" and "rest:NAME" are one label with one datastore.
    labels = [run.label for run in runs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"{', '.join(repeated)} asked for more than once; a second row of one "
                         "of our methods needs its own @NAME and --method-options entry")
    return runs


def run_benchmark(model: str, runs: list[MethodRun], prompts: dict[str, list[list[int]]],
                  warmup_prompt: list[int], settings: BenchSettings, run_name: str, command: str,
                  progress_file: Any = None) -> dict[str, Any]:
    """Run every method on every task's prompts (task -> prompt token ids); return the results
    document. Every engine is warmed up on ``warmup_prompt`` first, untimed. One progress bar
    (on ``progress_file``, default stderr) counts methods x prompts."""
    import torch
    from tqdm import tqdm

    if settings.interleave:
        check_memory_for_interleaving(len(runs), model, settings)
    total = len(runs) * sum(map(len, prompts.values()))
    # All engines alive at once (see _run_engines), or one after another.
    groups = [list(range(len(runs)))] if settings.interleave else [[e] for e in range(len(runs))]
    if settings.interleave and torch.cuda.is_available():
        # vLLM gives one engine 90% of the GPU by default; all of them share it here.
        settings = dataclasses.replace(settings, engine_kwargs={
            "gpu_memory_utilization": round(0.85 / len(runs), 3), **settings.engine_kwargs})
    with tqdm(total=total, desc="bench", unit="prompt", dynamic_ncols=True,
              file=progress_file) as progress:
        results = _run_engines(model, runs, prompts, warmup_prompt, settings, progress, groups)
    import vllm

    return {**results_document(run_name, command, compared_with_plain(results),
                               model=reported_model(model),
                               vllm=vllm.__version__),
            "plain_outputs": [{"task": task, "prompt": p, "output": o,
                               "max_tokens": settings.max_tokens}
                              for task, (_, outputs) in results[0].items()
                              for p, o in zip(prompts[task], outputs)]}


def reported_model(model: str) -> str:
    """``model`` as results name it: the cached SmolLM2's folder by the model's name, any other
    model as given (docs/results-schema.md)."""
    return MODEL_NAME if Path(model).name == MODEL_NAME else model


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


def _run_engines(model: str, runs: list[MethodRun], prompts: dict[str, list[list[int]]],
                 warmup_prompt: list[int], settings: BenchSettings, progress: Any,
                 groups: list[list[int]],
                 ) -> list[dict[str, tuple[dict[str, Any], list[list[int]] | None]]]:
    """Each group of runs (indices into ``runs``) with its engines alive at once; each batch of
    prompts goes to every engine of the group in turn, the order rotating from batch to batch.
    On a shared 2-core machine the speed drifts by up to 20% over minutes; run one after
    another, methods would be timed in different minutes.

    An engine that fails (to start, or at any call) is closed and its rows from then on say why
    (``error``), while the others run on: one method's crash does not lose the whole run. Plain
    decoding's failure ends it, since every row is compared with plain."""
    results: list[dict[str, tuple[dict[str, Any], list[list[int]] | None]]] = [
        {} for _ in runs]
    failures: dict[int, str] = {}
    engines: dict[int, MethodEngine] = {}

    def attempt(e: int, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as error:
            if e == 0:
                raise
            failures[e] = f"{type(error).__name__}: {error}"
            engine = engines.pop(e, None)
            if engine is not None:
                # A crashed engine may fail to shut down too; its failure is recorded already.
                with contextlib.suppress(Exception):
                    engine.close()
            return None

    for group in groups:
        try:
            for e in group:
                engine = attempt(e, functools.partial(MethodEngine, model, runs[e], settings,
                                                      warmup_prompt, progress))
                if engine is not None:
                    engines[e] = engine
            for task, task_prompts in prompts.items():
                for e in list(engines):
                    attempt(e, functools.partial(engines[e].start_task, task))
                for start, j in turns(len(task_prompts), settings.concurrency, len(group)):
                    if group[j] in engines:
                        attempt(group[j], functools.partial(
                            engines[group[j]].generate,
                            task_prompts[start:start + settings.concurrency], start))
                for e in group:
                    done = attempt(e, engines[e].finish_task) if e in engines else None
                    results[e][task] = done or (failed_row(runs[e], task, failures[e]), None)
        finally:
            for engine in engines.values():
                engine.close()
            engines.clear()
    return results
