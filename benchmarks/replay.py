"""Offline replay of recorded greedy outputs through the proposers' own code.

For greedy decoding a step samples the accepted part of its draft, then the target's own next
token, and both can be read off a recorded plain output: a chain is accepted as far as it
agrees with the output, a tree along its longest root path that does. So replay drives
``RetrievalProposer`` over a stand-in batch with the hooks vLLM's step calls, in their order
(``contract``), and counts the forwards the engine would make without running the model. Use it
to tune drafting rules; confirm winners with ``vllm-rsd bench``.

    python -m benchmarks.replay benchmarks/results/RUN.plain.jsonl \
        --configs '[{"method": "pld"}, {"method": "hybrid"}, {"method": "suffix"}]' \
        --grid '{"min_prefix_prob": [0.2, 0.3]}'

One JSON line per task and config; ``{"method": "suffix"}`` and ``{"method": "ngram"}`` are
vLLM's own methods (``benchmarks.peers``).
Each task's records are served in file order, ``--batch`` at a time, by a fresh drafter; a
request that generated its output is finished (``observe_finished``), so a served store learns
as in the engine.
``--replicas 1,2,4,8`` deals them round-robin to a fleet of that many drafters of each config:
hybrid's replicas share one ``served_datastore`` (each drafts from every replica's finished
requests, through the journals), vLLM's ``suffix`` learns from its own replica's only.
``--run-name`` also writes the lines as results (``docs/results-schema.md``).

Where replay is not the engine:
- Time is simulated: a step takes the time of the draft length it verified, measured
  (``--verify-cost``) or 1 + ``draft_token_cost`` x d steps without a draft. ``pad_drafts``
  learns from that clock as from the engine's, padding drafts to measure lengths first. A GPU
  curve (``benchmarks/gpu_check.py``'s, with ``--tree-verify-cost``) is read as vLLM 0.32
  replays CUDA graphs (``StepCosts``, ``CudaGraphs``): for vLLM's methods a full graph only for
  a draft of num_speculative_tokens, else piecewise, ``suffix``'s at k + 1 tokens whatever the
  draft; ours piecewise throughout (a config's ``cudagraph_mode`` sets another); a tree step
  costs the tree curve, else a tree costs what a chain of as many tokens does. With ``--batch``
  each row costs what it would alone (a batch's graph mode as a lone row's). The simulated clock
  leaves drafting out; with a measured curve, ``modeled_speedup_with_drafting`` adds the part of
  it a step waits for, timed on this machine. Drafts made ahead (``after_handover``) run to the
  end here, where the engine stops them when the next forward is done and drafts the rest in
  ``propose``: where they take longer than a forward, the engine waits for more.
- Hidden states (``--model``) come from one transformers forward over the recorded sequence:
  the true prefix's states, also at rejected draft tokens (vLLM's would be a wrong token's
  there). Only accepted rows are kept (PLD+) or become queries (``last_state_rows``), so the
  drafts are the engine's.
- Served stores index finished requests synchronously, as with several tensor-parallel ranks,
  so that runs repeat; and drafting has no time budget unless a config sets one. Storing them
  (``observe_finished``) is left out of the drafting times, index and all: the engine counts
  the storing, which its next step waits for (microseconds a request), not the indexing.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from benchmarks.hidden_states import TransformersStates
from benchmarks.peers import NgramPeer, SuffixPeer
from vllm_retrieval_spec.bench.report import (
    markdown_table, module_command, results_document, write_report)
from vllm_retrieval_spec.config import (
    ACCELERATOR_DEFAULTS, PLUGIN_KEY, VLLM_CPU_DEFAULTS, MethodConfig, PlatformDefaults,
    parse_speculative_config)
from vllm_retrieval_spec.datastore.journal import TokenizerFacts
from vllm_retrieval_spec.datastore.served_saver import ServedDirectory
from vllm_retrieval_spec.drafting.overlap import last_state_rows
from vllm_retrieval_spec.drafting.tree import TreeDraft
from vllm_retrieval_spec.proposers.base import RetrievalProposer
from vllm_retrieval_spec.proposers.hidden_states import accepted_state_segments
from vllm_retrieval_spec.proposers.hybrid import HybridDrafter
from vllm_retrieval_spec.verification.core import greedy_tree_walk, is_chain, tree_depths

#: The engine's context length unless a record needs more (SmolLM2's).
MAX_MODEL_LEN = 8192
#: Simulated time of a step verifying no draft (only ratios matter).
PLAIN_STEP_NS = 50_000_000


def load_records(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def expand_grid(base: dict[str, Any], grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """``base`` with every combination of the ``grid`` values (the last key varies fastest)."""
    names = list(grid)
    return [{**base, **dict(zip(names, values))}
            for values in itertools.product(*(grid[name] for name in names))]


def shortest_context_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a ``verify_cost`` results file at its shortest context: the curve replay
    models steps with."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    shortest = min(row["context_tokens"] for row in rows)
    return [row for row in rows if row["context_tokens"] == shortest]


def measured_step_costs(path: str, k: int, key: str = "ms_per_step_median") -> list[float]:
    """Step time for 0..k draft tokens from a ``verify_cost`` results file: its shortest
    context's ``key`` (medians), linear between the measured lengths and along the last two
    beyond."""
    points = sorted((row["draft_len"], row[key]) for row in shortest_context_rows(path))
    if len(points) < 2 or points[0][0] != 0:
        raise ValueError(f"{path}: needs the step time with no draft and at least one other "
                         f"length, got draft lengths {[d for d, _ in points]}")
    lengths, times = zip(*points)
    slope = (times[-1] - times[-2]) / (lengths[-1] - lengths[-2])
    return [float(np.interp(d, lengths, times)) if d <= lengths[-1]
            else times[-1] + slope * (d - lengths[-1]) for d in range(k + 1)]


def piecewise_step_costs(path: str, chain: list[float], tree: list[float] | None
                         ) -> list[float] | None:
    """A chain step's time run PIECEWISE (CUDA graphs between the attention layers, attention
    eager), for the draft lengths of ``chain`` (``path``'s full-graph curve): the chain rows'
    ``piecewise_ms_median`` where ``gpu_check`` measured it, else ``chain`` plus what the mode
    adds at no draft (``tree``'s first step, measured PIECEWISE, less the chain's); None
    without either (a CPU curve: no CUDA graphs)."""
    if all("piecewise_ms_median" in row for row in shortest_context_rows(path)):
        return measured_step_costs(path, len(chain) - 1, "piecewise_ms_median")
    if tree is None:
        return None
    mode = max(0.0, tree[0] - chain[0])
    return [ms + mode for ms in chain]


#: vLLM 0.32's CUDA-graph capture sizes up to 255 tokens (``VllmConfig._set_cudagraph_sizes``);
#: a speculative config's also has k + 1.
CAPTURE_SIZES = (1, 2, 4, *range(8, 256, 8))


@dataclass(frozen=True)
class CudaGraphs:
    """How vLLM 0.32 runs a decode step of one request verifying d of at most ``k`` draft
    tokens in CUDA graphs; both flags hold in its default mode, FULL_AND_PIECEWISE, neither in
    PIECEWISE:
    - ``full_at_k``: a k-token draft makes a uniform batch, which replays one full graph; any
      other step runs PIECEWISE (``gpu_model_runner._is_uniform_decode``: every row verifies
      k).
    - ``rounded``: the capture sizes are multiples of k + 1, so a piecewise step computes
      k + 1 tokens whatever its draft (Model Runner V1 with full decode graphs:
      ``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``); else it computes its
      tokens padded to the next capture size. vLLM runs ``suffix`` on Model Runner V1 and
      ``ngram`` on V2, which does not round
      (``VllmConfig._get_v2_model_runner_unsupported_features``). Our methods run PIECEWISE
      only (``patches.engine_args.piecewise_cuda_graphs``)."""

    k: int
    full_at_k: bool = True
    rounded: bool = True

    def piecewise_len(self, draft_len: int) -> int:
        """The draft length whose tokens a piecewise step verifying ``draft_len`` computes."""
        if self.rounded:
            return self.k
        return min(s for s in (*CAPTURE_SIZES, self.k + 1) if s > draft_len) - 1


#: A replay config's key for vLLM's ``-cc.cudagraph_mode`` (not a speculative_config key).
CUDAGRAPH_MODE = "cudagraph_mode"


def cuda_graphs(drafter: Any, mode: str | None = None) -> CudaGraphs:
    """The CUDA graphs vLLM 0.32 runs ``drafter``'s steps in (``CudaGraphs``), in cudagraph
    ``mode`` as given to vLLM; None, its default: FULL_AND_PIECEWISE for vLLM's methods,
    PIECEWISE for ours (the plugin's)."""
    vllms = isinstance(drafter, (SuffixPeer, NgramPeer))
    mode = mode or ("FULL_AND_PIECEWISE" if vllms else "PIECEWISE")
    if mode == "PIECEWISE":
        return CudaGraphs(drafter.k, full_at_k=False, rounded=False)
    if mode != "FULL_AND_PIECEWISE":
        raise ValueError(f"{CUDAGRAPH_MODE} {mode!r} is not modelled: PIECEWISE or "
                         "FULL_AND_PIECEWISE")
    if drafter.capabilities.trees:
        raise ValueError(f"trees run PIECEWISE only (the plugin refuses {mode})")
    return CudaGraphs(drafter.k, rounded=not isinstance(drafter, NgramPeer))


@dataclass(frozen=True)
class StepCosts:
    """A step verifying d draft tokens costs ``curve[d] / curve[0]`` steps without a draft
    where measured, else 1 + ``draft_token_cost`` x d; a step verifying a tree with rows after
    its leading chain costs ``tree_curve[d]`` where measured.

    On a GPU curve (``graphs`` and ``piecewise_curve``, the chain's time run PIECEWISE) a step
    costs what vLLM's CUDA graphs make it (``CudaGraphs``): a full graph's ``curve[d]`` only
    for a k-token draft, else the piecewise time of the tokens the step computes, and a tree
    step the tree curve's excess over a piecewise chain of as many tokens on top (our kernel,
    which runs only on tree rows). Plain decoding, the unit, replays a full graph of one
    token: ``curve[0]``. On the H200 a piecewise step took 0.37 ms more than a full graph's
    7.2 ms, and our kernel 0.75 ms more at 64 tree nodes (benchmarks/results/gpu-check-h200*)."""

    draft_token_cost: float
    curve: list[float] | None = None
    tree_curve: list[float] | None = None
    piecewise_curve: list[float] | None = None
    graphs: CudaGraphs | None = None

    def __post_init__(self) -> None:
        if self.tree_curve is not None and self.curve is None:
            raise ValueError("a tree step-cost curve needs the chain's (--verify-cost) too")
        if (self.graphs is None) != (self.piecewise_curve is None):
            raise ValueError("CUDA graphs are modelled with the chain's piecewise curve")

    def units(self, draft_len: int, tree_rows: bool = False) -> float:
        """A step's cost; ``tree_rows``: it verifies a tree with rows after its leading
        chain."""
        if self.curve is None:
            return 1.0 + self.draft_token_cost * draft_len
        trees = self.tree_curve if tree_rows else None
        if self.graphs is None:
            curve = trees or self.curve
            return curve[min(draft_len, len(curve) - 1)] / self.curve[0]
        assert self.piecewise_curve is not None
        d = min(draft_len, self.graphs.k)
        if self.graphs.full_at_k and d == self.graphs.k and not tree_rows:
            return self.curve[d] / self.curve[0]
        ms = self.piecewise_curve[self.graphs.piecewise_len(d)]
        if trees is not None:
            ms += max(0.0, trees[min(d, len(trees) - 1)] - self.piecewise_curve[d])
        return ms / self.curve[0]

    def drafting_units(self, critical_ns: int) -> float:
        """Drafting a step waits for, in steps without a draft: measured curves only (the
        modelled cost has no time)."""
        assert self.curve is not None
        return critical_ns / (self.curve[0] * 1e6)


def fake_vllm_config(config: MethodConfig, *, world_size: int = 1,
                     max_model_len: int = MAX_MODEL_LEN, vocab_size: int = 2**31 - 1,
                     hidden_size: int | None = None) -> SimpleNamespace:
    """What ``RetrievalProposer`` and the methods' ``make_drafter`` read of vLLM's config."""
    return SimpleNamespace(
        additional_config={PLUGIN_KEY: config.to_dict()},
        speculative_config=SimpleNamespace(
            num_speculative_tokens=config.drafting.num_speculative_tokens),
        model_config=SimpleNamespace(
            max_model_len=max_model_len, get_vocab_size=lambda: vocab_size,
            get_hidden_size=lambda: hidden_size or _needs_model(config.method)),
        parallel_config=SimpleNamespace(world_size=world_size))


def _needs_model(method: str) -> int:
    raise ValueError(f"replaying {method} needs --model for the hidden states")


def build_proposer(options: dict[str, Any], platform: PlatformDefaults, states: Any = None,
                   max_model_len: int = MAX_MODEL_LEN) -> RetrievalProposer:
    """The proposer vLLM's worker builds for ``options`` (a speculative_config); ``states``
    (``TransformersStates``) gives the model's sizes."""
    config = parse_speculative_config({"draft_budget_ms": 0, **options}, platform)
    model = {"max_model_len": max_model_len} if states is None else {
        "max_model_len": max_model_len, "vocab_size": states.vocab_size,
        "hidden_size": states.hidden_size}
    proposer: RetrievalProposer | None = None

    def report(*args: Any, **kwargs: Any) -> None:
        proposer.report_failure(*args, **kwargs)

    # The method as with two tensor-parallel ranks, its stores indexing each finished request
    # before the next step (not in a background thread) so that runs repeat; the proposer as
    # with one, timing its steps for padding.
    method = importlib.import_module(config.module).make_drafter(
        config, fake_vllm_config(config, world_size=2, **model), report)
    proposer = RetrievalProposer(fake_vllm_config(config, **model), method)
    proposer.load_model(None)
    caps = proposer.capabilities
    if states is None and (caps.aux_hidden_state_layers or caps.last_hidden_states):
        _needs_model(config.method)
    return proposer


@dataclass
class Request:
    """A recorded request in the batch."""

    req_id: str
    record: dict[str, Any]
    sequence: np.ndarray
    #: Output tokens sampled so far (0: its prefill is this step).
    done: int = 0
    #: What the last ``propose`` handed to vLLM for it, and the tree where that was one.
    draft: list[int] = field(default_factory=list)
    tree: TreeDraft | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens before this step's sampled ones."""
        return len(self.record["prompt"]) + self.done

    @property
    def token_limit(self) -> int | None:
        """The most tokens it could reach in the engine, prompt included: its prompt and the
        run's max_tokens (None: not recorded before 2026-12-07)."""
        max_tokens = self.record.get("max_tokens")
        return None if max_tokens is None else len(self.record["prompt"]) + max_tokens

    def verify(self) -> tuple[list[int], int | None]:
        """What greedy verification of the last draft samples (within the recorded output),
        and a tree's last accepted node (-1: the root)."""
        truth = self.sequence[self.num_tokens:]
        if self.done == 0:
            return truth[:1].tolist(), None
        last = None
        if self.tree is not None:
            # The target's token after a node on the followed path is the truth at its depth.
            after = np.append(truth, -1)
            depths = np.minimum(tree_depths(self.tree.parents), len(truth))
            path, _ = greedy_tree_walk(self.tree.parents, self.tree.tokens,
                                       np.concatenate([after[:1], after[depths]]))
            accepted = min(len(path), len(truth) - 1)
            last = path[accepted - 1] if accepted else -1
        else:
            accepted = 0
            while accepted < min(len(self.draft), len(truth) - 1) \
                    and self.draft[accepted] == truth[accepted]:
                accepted += 1
        return truth[:accepted + 1].tolist(), last

    def sampled_positions(self) -> np.ndarray:
        """Positions of the rows vLLM samples this step: the last token's (the root), then each
        draft node's, the root's plus its depth."""
        depths = [] if not self.done else np.arange(1, len(self.draft) + 1) \
            if self.tree is None else tree_depths(self.tree.parents)
        return self.num_tokens - 1 + np.concatenate([[0], depths]).astype(np.int64)

    def computed_positions(self) -> np.ndarray:
        """Positions of the tokens this step computes: the prompt, else the last token and the
        draft."""
        if not self.done:
            return np.arange(self.num_tokens)
        return np.arange(self.num_tokens - 1, self.num_tokens + len(self.draft))


class Replay:
    """Recorded requests through a drafter, step by step as vLLM's runner drives it."""

    def __init__(self, drafter: RetrievalProposer | SuffixPeer | NgramPeer, costs: StepCosts,
                 states: Any = None, batch: int = 1, trace: bool = False,
                 between: Callable[[np.ndarray], None] | None = None) -> None:
        self.drafter, self.costs, self.states, self.batch = drafter, costs, states, batch
        #: Run where the forward runs, given the first row's tokens before this step's
        #: (``benchmarks.critical_path``: a real forward, or a read of the context).
        self.between = between
        #: The simulated clock (ns); each forward advances it by its cost.
        self.now = 0
        if isinstance(drafter, RetrievalProposer):
            # Padding times its steps with this clock, as with the engine's.
            drafter.lengths.clock = lambda: self.now
        #: vLLM's token buffer: each batch row's tokens.
        self.tokens = np.zeros((batch, drafter.max_model_len), dtype=np.int32)
        #: Each step's drafts, in batch order (``trace``).
        self.trace: list[list[list[int]]] | None = [] if trace else None
        self.output_tokens = self.forwards = self.decode_steps = self.drafted = 0
        self.cost = 0.0
        self.draft_ns: list[int] = []
        #: The part of each step's drafting the step waits for, the first step's left out:
        #: every hook but ``after_handover``, which overlaps the next forward.
        self.critical_ns: list[int] = []
        #: That part in steps without a draft, every row of a step waiting for all of it
        #: (with a measured curve only).
        self.drafting_cost = 0.0
        self.waiting: deque[tuple[int, dict[str, Any]]] = deque()
        self.running: list[Request] = []

    def run(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Serve ``records`` in order, ``batch`` at a time; a summary of the steps."""
        self.serve(list(enumerate(records)))
        while self.advance():
            pass
        return self.summary()

    def serve(self, numbered: list[tuple[int, dict[str, Any]]]) -> None:
        """Queue (request number, record) pairs; the number is the request's id."""
        self.waiting.extend(numbered)

    def advance(self) -> bool:
        """One step of the queued requests, ``batch`` at a time; False once none is left."""
        while len(self.running) < self.batch and self.waiting:
            n, record = self.waiting.popleft()
            sequence = np.asarray(record["prompt"] + record["output"], dtype=np.int32)
            self.running.append(Request(str(n), record, sequence))
        if not self.running:
            return False
        self.step(self.running)
        running = [r for r in self.running if r.done < len(r.record["output"])]
        if len(running) < len(self.running):
            # As vLLM's next step starts; untimed, since a served store indexes them here.
            self.drafter.observe_finished({r.req_id for r in self.running} -
                                          {r.req_id for r in running})
        self.running = running
        return True

    def step(self, batch: list[Request]) -> None:
        """A forward verifying each request's last draft (or its prefill), then the drafter's
        hooks in the order vLLM's step reaches them (``contract``)."""
        drafter, caps = self.drafter, self.drafter.capabilities
        req_ids = [r.req_id for r in batch]
        verified = [r.verify() for r in batch]
        sampled = [tokens for tokens, _ in verified]
        self.output_tokens += sum(map(len, sampled))
        base = self.forward(batch)
        # The stand-ins for the forward's hidden states are made before the hooks are timed.
        states = self.states_at(batch, [r.sampled_positions() for r in batch]) \
            if caps.last_hidden_states else None
        aux = self.aux_states(batch, sampled) if caps.aux_hidden_state_layers else None
        start = time.perf_counter_ns()
        if states is not None:
            drafter.search_ahead(states)
        # Every request is greedy, so each may get a tree; a task's requests share a store key.
        drafter.observe_batch(req_ids, [True] * len(batch) if caps.trees else None,
                              [r.record.get("task") for r in batch]
                              if caps.served_store_keys else None,
                              [r.token_limit for r in batch])
        if caps.drafts_before_sampling:
            drafter.draft_before_sampling(sampled, [r.draft for r in batch], base, self.tokens)
        if aux is not None:
            drafter.record_hidden_states(req_ids, *aux)
        if states is not None:
            drafter.record_last_hidden_states(states, last_state_rows(
                sampled, [len(r.draft) for r in batch],
                {i: node for i, (_, node) in enumerate(verified) if node is not None}))
        num_tokens = base.copy()
        for i, tokens in enumerate(sampled):
            self.tokens[i, base[i]:base[i] + len(tokens)] = tokens
            num_tokens[i] += len(tokens)
        drafts = drafter.propose(sampled, num_tokens, self.tokens)
        critical = time.perf_counter_ns() - start
        if drafter.has_work_after_handover:
            drafter.after_handover()
        self.draft_ns.append(time.perf_counter_ns() - start)
        # A fresh drafter's first step pays what a server pays once, before it serves
        # (vLLM's ngram compiles its kernels there).
        if len(self.draft_ns) > 1:
            self.critical_ns.append(critical)
            if self.costs.curve is not None:
                self.drafting_cost += len(batch) * self.costs.drafting_units(critical)
        for r, tokens, draft in zip(batch, sampled, drafts):
            r.done += len(tokens)
            r.draft, r.tree = list(draft), drafter.trees.get(r.req_id)
        if self.trace is not None:
            self.trace.append([list(d) for d in drafts])

    def forward(self, batch: list[Request]) -> np.ndarray:
        """Counts this step's forward (a prefill, or the last draft's verification) and its
        cost; fills the token buffer; returns each row's tokens before this step's."""
        base = np.zeros(self.batch, dtype=np.int32)
        for i, r in enumerate(batch):
            drafted = len(r.draft) if r.done else 0
            # A prefill costs what plain decoding's does, in the same CUDA-graph mode.
            units = self.costs.units(drafted, bool(drafted) and r.tree is not None
                                     and not is_chain(r.tree.parents)) if r.done else 1.0
            self.forwards += 1
            self.decode_steps += r.done > 0
            self.drafted += drafted
            self.cost += units
            self.now += round(PLAIN_STEP_NS * units)
            base[i] = r.num_tokens
            self.tokens[i, :base[i]] = r.sequence[:base[i]]
        if self.between is not None:
            self.between(self.tokens[0, :base[0]])
        return base

    def states_at(self, batch: list[Request], positions: list[np.ndarray],
                  layer: int | None = None) -> Any:
        """The states at ``positions`` of each request's sequence, concatenated (a draft may
        run past the recorded output: its last state stands in there)."""
        import torch

        return torch.from_numpy(np.concatenate([
            self.states(r.record, layer)[np.minimum(p, len(r.sequence) - 1)]
            for r, p in zip(batch, positions)]))

    def aux_states(self, batch: list[Request], sampled: list[list[int]]
                   ) -> tuple[list[Any], list[tuple[int, int, int]]]:
        """The aux layer's states of the tokens this step computes, and which of them vLLM's
        runner keeps (``accepted_state_segments``)."""
        computed = [r.computed_positions() for r in batch]
        segments = accepted_state_segments(
            [r.req_id for r in batch], {r.req_id: len(p) for r, p in zip(batch, computed)},
            {r.req_id: r.draft for r in batch if r.done}, np.array([p[0] for p in computed]),
            sampled)
        layer = self.drafter.capabilities.aux_hidden_state_layers[0]
        return [self.states_at(batch, computed, layer)], segments

    def drop_step_times(self) -> None:
        """Forget the drafting times kept per step for ``summary`` (a long run's memory)."""
        self.draft_ns.clear()
        self.critical_ns.clear()

    def summary(self) -> dict[str, Any]:
        return summarize([self], [self.counters()])

    def counters(self) -> dict[str, Any]:
        """The drafter's counters only: its step times are simulated."""
        return {k: v for k, v in self.drafter.stats().items()
                if not (k.startswith("step_ms") or k.endswith("_ns"))}


def summarize(runs: list[Replay], counters: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' steps together (a fleet's replicas: one run each) and their drafters'
    ``counters``, summed. ``modeled_speedup``: output tokens over the forwards' summed cost
    (``StepCosts``) in steps without a draft, as plain decoding takes one per token; the
    prefills' forwards, which verify no draft, count too. With measured curves also
    ``modeled_speedup_with_drafting``: each row's steps also wait for the drafting the step
    waits for, timed here (``draft_us_critical_mean``), in the curve's milliseconds."""
    output_tokens = sum(run.output_tokens for run in runs)
    forwards = sum(run.forwards for run in runs)
    tokens_per_forward = output_tokens / max(forwards, 1)
    mean_draft_len = sum(run.drafted for run in runs) / max(sum(r.decode_steps for r in runs), 1)
    modeled = output_tokens / max(sum(run.cost for run in runs), 1e-9)
    us = np.asarray([ns for run in runs for ns in run.draft_ns] or [0]) / 1e3
    critical_us = np.asarray([ns for run in runs for ns in run.critical_ns] or [0]) / 1e3
    with_drafting = {"modeled_speedup_with_drafting": round(
        output_tokens / max(sum(run.cost + run.drafting_cost for run in runs), 1e-9), 3)} \
        if all(run.costs.curve is not None for run in runs) else {}
    stats: dict[str, Any] = {}
    for counts in counters:
        for name, value in counts.items():
            stats[name] = stats.get(name, 0) + value
    return {"modeled_speedup": round(modeled, 3),
            "tokens_per_forward": round(tokens_per_forward, 3),
            "mean_draft_len": round(mean_draft_len, 2),
            "draft_us_p50": round(float(np.percentile(us, 50)), 1),
            "draft_us_p99": round(float(np.percentile(us, 99)), 1),
            "draft_us_critical_mean": round(float(critical_us.mean()), 1),
            **with_drafting,
            **({"stats": stats} if stats else {})}


def make_drafter(options: dict[str, Any], platform: PlatformDefaults, states: Any,
                 max_model_len: int) -> tuple[Any, float]:
    """The drafter ``options`` name (vLLM's own for ``suffix`` and ``ngram``) and the
    ``draft_token_cost`` its steps are modelled at."""
    peer = {"suffix": SuffixPeer, "ngram": NgramPeer}.get(options.get("method"))
    if peer is not None:
        return peer({k: v for k, v in options.items() if k != "method"}, max_model_len), \
            platform.draft_token_cost
    proposer = build_proposer(options, platform, states, max_model_len)
    return proposer, proposer.config.drafting.draft_token_cost


def replay_config(options: dict[str, Any], records: list[dict[str, Any]],
                  platform: PlatformDefaults, states: TransformersStates | None = None,
                  verify_cost: str | None = None, batch: int = 1,
                  tree_verify_cost: str | None = None, replicas: int = 1) -> dict[str, Any]:
    """One config over ``records`` with fresh drafters, the records dealt round-robin to
    ``replicas`` of them (``replay_fleet``); their summary. ``options`` may also name vLLM's
    ``cudagraph_mode``, which GPU curves are read in (``cuda_graphs``)."""
    options = dict(options)
    mode = options.pop(CUDAGRAPH_MODE, None)
    max_model_len = max([MAX_MODEL_LEN] + [len(r["prompt"]) + len(r["output"]) + 1
                                           for r in records])
    drafters: list[Any] = []
    try:
        for _ in range(replicas):
            drafter, draft_token_cost = make_drafter(options, platform, states, max_model_len)
            drafters.append(drafter)
        costs = step_costs(drafters[0], draft_token_cost, verify_cost, tree_verify_cost, mode)
    except BaseException:
        for drafter in drafters:
            drafter.close()
        raise
    with tempfile.TemporaryDirectory(prefix="replay-fleet-") as shared:
        return replay_fleet([Replay(d, costs, states, batch) for d in drafters], records,
                            Path(shared))


def step_costs(drafter: Any, draft_token_cost: float, verify_cost: str | None,
               tree_verify_cost: str | None, mode: str | None) -> StepCosts:
    """``drafter``'s ``StepCosts``: modelled, else the measured curves, in vLLM's CUDA graphs
    (cudagraph ``mode``) where they are a GPU's."""
    k = drafter.k
    chain = measured_step_costs(verify_cost, k) if verify_cost else None
    tree = measured_step_costs(tree_verify_cost, k) if tree_verify_cost else None
    piecewise = piecewise_step_costs(verify_cost, chain, tree) if chain is not None else None
    if piecewise is None and mode is not None:
        raise ValueError(f"{CUDAGRAPH_MODE} needs a GPU's curves (--verify-cost and "
                         "--tree-verify-cost from benchmarks/gpu_check.py)")
    return StepCosts(draft_token_cost, chain, tree if drafter.capabilities.trees else None,
                     piecewise, cuda_graphs(drafter, mode) if piecewise is not None else None)


#: A fleet's journals in replay hold the records' token ids; no tokenizer to name.
REPLAY_TOKENIZER = TokenizerFacts("replay", "replay", 2**31 - 1)


def join_fleet(drafter: Any, directory: Path, replica: str) -> ServedDirectory | None:
    """The journal a replica keeps in the ``served_datastore`` its fleet shares (``directory``):
    every request its served store keeps is appended to it, and ``sync`` stores the other
    replicas' from theirs. The engine's own code (``ServedDirectory``) without its threads:
    the fleet flushes and reads between steps, so that runs repeat. None for a drafter without
    a served store (vLLM's ``suffix`` learns only from what its own replica serves)."""
    method = getattr(drafter, "method", None)
    learning = method.learning if isinstance(method, HybridDrafter) else None
    if learning is None:
        return None
    # As ServedLearning wires a served_datastore, which replay's stand-in for two ranks (for
    # stores indexed inside the step) would refuse.
    journal = ServedDirectory(directory, learning.keyed or learning.shared, REPLAY_TOKENIZER,
                              flush_s=1.0, compact_s=float("inf"), background=False,
                              replica=replica)
    learning.directory = journal
    learning.requests.persist = journal.record
    return journal


def replay_fleet(runs: list[Replay], records: list[dict[str, Any]],
                 directory: Path) -> dict[str, Any]:
    """``records`` dealt round-robin to ``runs``, a fleet's replicas sharing ``directory`` as
    their ``served_datastore``; their summary together.

    Replicas decode at once: the one whose simulated clock is behind takes the next step. Each
    flushes its journal after a step and reads the others' before one, so a request one
    replica finished is drafted from by the others from their next step on, where the engine
    reads within ``served_flush_ms`` (1 s, a few steps): replay is that much early. A replica
    that has served its share stops, and stores and journals its last request, as a server does
    at shutdown (one that went on serving would at its next step)."""
    journals = [join_fleet(run.drafter, directory, f"replica-{i}") if len(runs) > 1 else None
                for i, run in enumerate(runs)]
    numbered = list(enumerate(records))
    for i, run in enumerate(runs):
        run.serve(numbered[i::len(runs)])
    counters: list[dict[str, Any]] = [{} for _ in runs]
    active = list(range(len(runs)))
    try:
        while active:
            i = min(active, key=lambda i: runs[i].now)
            journal = journals[i]
            if journal is not None:
                journal.sync()
            if runs[i].advance():
                if journal is not None:
                    journal.writer.flush()
                continue
            active.remove(i)
            counters[i] = runs[i].counters()
            runs[i].drafter.close()
    finally:
        for i in active:
            runs[i].drafter.close()
    return summarize(runs, counters)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outputs", nargs="+", help="<run>.plain.jsonl written by vllm-rsd bench")
    parser.add_argument("--configs", required=True,
                        help="JSON list of speculative_config dicts to compare")
    parser.add_argument("--grid", default="{}", help='JSON {"option": [values, ...]}: replay '
                        "each config with every combination of these values")
    parser.add_argument("-k", type=int, default=8, help="num_speculative_tokens if not given")
    parser.add_argument("--model", help="model folder, for methods that need hidden states")
    parser.add_argument("--task", help="replay only this task's records")
    parser.add_argument("--platform", choices=("vllm-cpu", "accelerator"), action="append",
                        help="whose option defaults (draft_token_cost, min_draft_len, ...) the "
                             "configs get, and so whose verification cost is modelled "
                             "(repeatable; default vllm-cpu)")
    parser.add_argument("--verify-cost", help="a verify_cost results JSON: each step costs its "
                        "measured time for that many draft tokens instead of a linear cost")
    parser.add_argument("--tree-verify-cost", help="the same for steps verifying a tree "
                        "(benchmarks/gpu_check.py measures both; with it every config's steps "
                        "are modelled in vLLM's CUDA-graph modes); needs --verify-cost")
    parser.add_argument("--batch", type=int, default=1,
                        help="requests decoding at once (records join as others finish)")
    parser.add_argument("--replicas", default="1",
                        help="comma-separated fleet sizes: each task's records are dealt "
                             "round-robin to that many replicas of each config, a served store "
                             "learning from the whole fleet's (one served_datastore)")
    parser.add_argument("--run-name", help="also write the lines as results, <run-name>.json "
                        "and .md in --output-dir")
    parser.add_argument("--output-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    records = [r for path in args.outputs for r in load_records(path)]
    for r in records:
        r.setdefault("task", "code-gen")
    tasks = sorted({r["task"] for r in records if args.task in (None, r["task"])})
    platforms = {p.name: p for p in (VLLM_CPU_DEFAULTS, ACCELERATOR_DEFAULTS)}
    states = TransformersStates(args.model) if args.model else None
    grid = json.loads(args.grid)
    rows = []
    for name, replicas in itertools.product(args.platform or ["vllm-cpu"],
                                            [int(n) for n in args.replicas.split(",")]):
        for options in (o for base in json.loads(args.configs) for o in expand_grid(base, grid)):
            if options.get("method") not in ("suffix", "ngram"):
                options = {"num_speculative_tokens": args.k, **options}
            for task in tasks:
                result = replay_config(options, [r for r in records if r["task"] == task],
                                       platforms[name], states, args.verify_cost, args.batch,
                                       args.tree_verify_cost, replicas)
                rows.append({"task": task, "config": options, "platform": name,
                             "replicas": replicas, **result})
                print(json.dumps(rows[-1]), flush=True)
    if args.run_name:
        write_replay_results(args.run_name, module_command("benchmarks.replay", argv),
                             compared_with_first_config(rows), args.output_dir)


def compared_with_first_config(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with ``vs_first_config``: their modelled speed over that of the first config's row
    of the same task, platform and fleet size."""
    first: dict[tuple[str, str, int], dict[str, Any]] = {}
    for row in rows:
        first.setdefault((row["task"], row["platform"], row["replicas"]), row)
    return [{**row, "vs_first_config": round(row["modeled_speedup"] / first[
        row["task"], row["platform"], row["replicas"]]["modeled_speedup"], 3)} for row in rows]


#: The results page's columns: (heading, row key).
RESULT_COLUMNS = [("task", "task"), ("config", "config"), ("platform", "platform"),
                  ("replicas", "replicas"), ("tokens per forward", "tokens_per_forward"),
                  ("mean draft length", "mean_draft_len"),
                  ("modelled speedup", "modeled_speedup"),
                  ("vs the first config", "vs_first_config")]


def write_replay_results(run: str, command: str, rows: list[dict[str, Any]],
                         output_dir: str) -> None:
    """``<run>.json`` and ``<run>.md`` (``docs/results-schema.md``)."""
    table = [{**row, "config": json.dumps(row["config"])} for row in rows]
    write_report(results_document(run, command, rows), output_dir, [
        "Replayed from recorded greedy outputs (`benchmarks/replay.py`): tokens per forward "
        "are counted, speed is modelled from each platform's step cost.", "",
        *markdown_table(RESULT_COLUMNS, table)])


if __name__ == "__main__":
    main()
