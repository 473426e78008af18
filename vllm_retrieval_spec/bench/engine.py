"""One method's engine in a throughput run, and what it measures on each task."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_retrieval_spec.bench.results import task_row

if TYPE_CHECKING:
    from vllm_retrieval_spec.bench.throughput import BenchSettings, MethodRun


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


def timed_engine_args(is_cpu: bool, piecewise: bool = False) -> dict[str, Any]:
    """How an engine whose steps are timed runs the model: eagerly on vLLM-CPU, whose compiled
    mode takes 55-80 s to start, again at every start (docs/platform-notes.md); on a GPU with
    CUDA graphs, as vLLM serves, since an eager forward is launch-bound there and no server
    runs one. ``piecewise``: in PIECEWISE mode, the one this plugin's methods run in
    (``patches.engine_args.piecewise_cuda_graphs``); vLLM's default mode replays a full graph
    only for steps that verify num_speculative_tokens, and computes as many for the others."""
    if is_cpu:
        return {"enforce_eager": True}
    return {"compilation_config": {"cudagraph_mode": "PIECEWISE"}} if piecewise else {}


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
        from vllm import LLM
        from vllm.platforms import current_platform

        progress.set_postfix_str(f"starting {run.label}")
        self.run = run
        self.settings = settings
        self.progress = progress
        self.speculative = run.speculative_config is not None
        is_cpu = current_platform.is_cpu()
        engine_kwargs = {**timed_engine_args(is_cpu), **settings.engine_kwargs}
        if is_cpu:
            engine_kwargs.setdefault("kv_cache_memory_bytes", cpu_kv_cache_bytes(model, settings))
        # vLLM-CPU takes VLLM_CPU_KVCACHE_SPACE over the size given here while it is set.
        with _environment_without("VLLM_CPU_KVCACHE_SPACE"):
            self.llm = LLM(model=model, speculative_config=run.speculative_config,
                           max_model_len=settings.max_model_len, dtype=settings.dtype, seed=0,
                           # Per request, not the process-wide Prometheus counters, which every
                           # engine of an interleaved run adds to.
                           per_request_spec_decode_metrics="summary" if self.speculative
                           else "none", **engine_kwargs)
        try:
            speculative = self.llm.llm_engine.vllm_config.speculative_config
            #: Drafts of at most this many tokens (vLLM fills it in for ``suffix``).
            self.num_speculative_tokens = (speculative.num_speculative_tokens if speculative
                                           else None)
            self.forwards = ForwardCounter(self.llm)
            # Warm up (numba, allocator, first-step paths) outside the timed region, sampled as
            # the timed requests are: greedy and sampled requests take different paths (vLLM's
            # sampler, drafting before sampling), and vLLM samples at temperature 1 unless told.
            self.llm.generate([{"prompt_token_ids": warmup_prompt}],
                              self.sampling_params(seed=0, max_tokens=8), use_tqdm=False)
        except BaseException:
            # The engine started: its processes would outlive a run that goes on without it.
            self.close()
            raise

    def sampling_params(self, seed: int, max_tokens: int | None = None) -> Any:
        from vllm import SamplingParams

        s = self.settings
        max_tokens = max_tokens or s.max_tokens
        if s.temperature == 0:
            return SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              seed=seed, max_tokens=max_tokens)

    def start_task(self, task: str) -> None:
        self.task = task
        self.outputs: list[list[int]] = []
        #: (prompts, output tokens, seconds, forwards) of each batch, in order.
        self.batches: list[tuple[int, int, float, int]] = []
        self.accepted = self.drafts = self.drafted = 0
        self.forwards.count = 0
        if self.speculative:
            self.llm.collective_rpc("rsd_drafting_stats", kwargs={"reset": True})

    def generate(self, batch: list[list[int]], first: int) -> None:
        """``batch``: the task's prompts from index ``first`` on (a sampled one's seed)."""
        self.progress.set_postfix_str(f"{self.run.label} on {self.task}")
        params = [self.sampling_params(first + j) for j in range(len(batch))]
        forwards = self.forwards.count
        start = time.perf_counter()
        result = self.llm.generate([{"prompt_token_ids": p} for p in batch], params,
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
        row = task_row(self.run, self.num_speculative_tokens, self.task, self.settings,
                   self.outputs, self.batches, self.accepted, self.drafts, self.drafted,
                   drafting)
        return row, self.outputs

    def close(self) -> None:
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        del self.llm
        gc.collect()
