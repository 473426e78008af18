"""Offline replay of recorded plain greedy outputs: tokens per target forward in seconds.

For greedy decoding the accepted length of a draft is exactly its common prefix with the true
continuation, so walking a recorded plain output and drafting at every position the engine would
reach gives the engine's tokens per forward without running the model. Use it to tune drafting
rules; confirm winners with ``vllm-rsd bench``.

    python -m benchmarks.replay benchmarks/results/RUN.plain.jsonl \
        --configs '[{"method": "pld"}, {"method": "rest", "datastore": "ds/stdlib"}]'

``--grid '{"context_weight": [1, 2], "min_prefix_prob": [0.2, 0.3]}'`` replays every config
with each combination; results are printed per task, one JSON line each. ``--oracle`` replays
the ceiling of hybrid's sources instead, and ``--oracle-gap`` says why a hybrid config falls
short of it (a wrong choice among the candidates, a draft cut short, no draft).
``--choice-ceilings`` replays a hybrid config beside ceilings of choosing better among its own
candidates and of stopping its drafts where they go wrong (``CHOICE_CEILINGS``): what perfect
choosing could add without new sources.
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

from vllm_retrieval_spec.tree_verification import is_chain

DraftFn = Callable[[np.ndarray, int], np.ndarray]
#: Makes the drafting function for one recorded request (PLD+ needs that request's states).
DraftFactory = Callable[[dict[str, list[int]]], DraftFn]


def replay(records: list[dict[str, list[int]]], make_draft: DraftFactory, k: int, *,
           draft_token_cost: float, adaptive: bool = False,
           min_draft_len: int = 1, step_costs: list[float] | None = None,
           pad_drafts: bool = False) -> dict[str, float]:
    """Walk every recorded output as the engine would with ``draft``; summarise.

    ``modeled_speedup`` = tokens per forward / (1 + ``draft_token_cost`` x mean draft length):
    a forward verifying more tokens takes longer, so long weak drafts lose time. A tree draft
    (``TreeDraft``) counts all its nodes and accepts its longest root path that the output
    follows, as ``tree_verification`` does in vLLM. ``adaptive``
    caps each draft by the record's acceptance so far, as the proposers do in vLLM; drafts
    shorter than ``min_draft_len`` are dropped, as there.

    ``step_costs[d]``, a measured step time for d draft tokens (``measured_step_costs``),
    replaces the linear model where verification is not linear in d: the modelled speedup is
    then output tokens over every forward's cost in units of a draft-less step. With
    ``pad_drafts`` too, short chains are padded as the proposers pad them once their
    ``StepCostModel`` has learned these costs (``drafting.step_cost``).
    """
    from vllm_retrieval_spec.drafting.adaptive import AcceptanceTracker, too_short
    from vllm_retrieval_spec.drafting.step_cost import (
        cheapest_at_least, pad_to, padding_lengths)
    from vllm_retrieval_spec.drafting.tree import TreeDraft

    output_tokens = forwards = drafted = 0
    cost = 0.0  # forwards, each in units of a step without a draft (step_costs only)
    draft_ns: list[int] = []
    tracker = AcceptanceTracker(k, draft_token_cost, min_draft_len)
    pad_costs = {n: step_costs[n] for n in padding_lengths(min_draft_len, k)} \
        if pad_drafts and step_costs is not None else None
    # A method that learns from served requests (``ServedReplay``) is told when each finishes.
    finished = getattr(make_draft, "finished", None)
    for n, record in enumerate(records):
        prompt, output = record["prompt"], record["output"]
        sequence = np.asarray(prompt + output, dtype=np.int32)
        draft = make_draft(record)
        position = 1  # the prefill forward produced output[0]
        forwards += 1
        cost += 1.0
        while position < len(output):
            start = time.perf_counter_ns()
            max_len = tracker.cap(str(n)) if adaptive else k
            proposal = draft(sequence[: len(prompt) + position], max_len)
            if isinstance(proposal, TreeDraft) and is_chain(proposal.parents):
                proposal = proposal.tokens
            size = len(proposal.tokens if isinstance(proposal, TreeDraft) else proposal)
            if too_short(size, max_len, min_draft_len):
                proposal, size = proposal[:0], 0
            drafted_size = size
            if pad_costs is not None and not isinstance(proposal, TreeDraft):
                proposal = pad_to(sequence[: len(prompt) + position],
                                  np.asarray(proposal, dtype=np.int32),
                                  min(cheapest_at_least(size, pad_costs), k))
                size = len(proposal)
            draft_ns.append(time.perf_counter_ns() - start)
            accepted = accepted_length(proposal, output[position:position + size])
            # Padding's tokens are not evidence (as in the proposers).
            tracker.update(str(n), drafted_size, min(accepted, drafted_size))
            drafted += size
            forwards += 1
            if step_costs is not None:
                cost += step_costs[min(size, len(step_costs) - 1)] / step_costs[0]
            position += accepted + 1
        output_tokens += len(output)
        if finished is not None:
            finished(record)
    steps = max(forwards - len(records), 1)
    tokens_per_forward = output_tokens / forwards
    mean_draft_len = drafted / steps
    modeled = (output_tokens / cost if step_costs is not None
               else tokens_per_forward / (1 + draft_token_cost * mean_draft_len))
    return {
        "modeled_speedup": round(modeled, 3),
        "tokens_per_forward": round(tokens_per_forward, 3),
        "mean_draft_len": round(mean_draft_len, 2),
        "draft_us_p50": round(float(np.percentile(draft_ns, 50)) / 1e3, 1) if draft_ns else 0.0,
        "draft_us_p99": round(float(np.percentile(draft_ns, 99)) / 1e3, 1) if draft_ns else 0.0,
    }


def measured_step_costs(path: str, k: int) -> list[float]:
    """Step time for 0..k draft tokens from a ``verify_cost`` results file: its shortest
    context's medians, linear between the measured lengths and along the last two beyond."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    shortest = min(row["context_tokens"] for row in rows)
    points = sorted((row["draft_len"], row["ms_per_step_median"]) for row in rows
                    if row["context_tokens"] == shortest)
    if len(points) < 2 or points[0][0] != 0:
        raise ValueError(f"{path}: needs the step time with no draft and at least one other "
                         f"length, got draft lengths {[d for d, _ in points]}")
    lengths, times = zip(*points)
    slope = (times[-1] - times[-2]) / (lengths[-1] - lengths[-2])
    return [float(np.interp(d, lengths, times)) if d <= lengths[-1]
            else times[-1] + slope * (d - lengths[-1]) for d in range(k + 1)]


def accepted_length(proposal: Any, truth: list[int] | np.ndarray) -> int:
    """Draft tokens greedy verification accepts when the target produces ``truth``: a chain's
    common prefix with it, a tree's longest root path along it."""
    from vllm_retrieval_spec.drafting.tree import TreeDraft
    from vllm_retrieval_spec.tree_verification import greedy_tree_walk, tree_depths

    if isinstance(proposal, TreeDraft):
        # The target's token after a node on the followed path is the truth at its depth.
        after = np.asarray([*truth, -1])
        depths = np.minimum(tree_depths(proposal.parents), len(truth))
        target = np.concatenate([after[:1], after[depths]])
        return len(greedy_tree_walk(proposal.parents, proposal.tokens, target)[0])
    accepted = 0
    while accepted < len(truth) and proposal[accepted] == truth[accepted]:
        accepted += 1
    return accepted


def load_records(path: str) -> list[dict[str, list[int]]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def draft_factory(config: Any, model: str | None = None, gap: OracleGap | None = None,
                  ceiling: str | None = None) -> DraftFactory:
    """The same pure drafting function the method's proposer calls in vLLM, per request;
    with ``gap`` (hybrid only), each of its drafts is also measured against the oracle; with
    ``ceiling`` (one of ``CHOICE_CEILINGS``; hybrid chains only), its candidates are chosen from
    knowing the recorded continuation (``ceiling_select``)."""
    from vllm_retrieval_spec.config import (
        DresdConfig, HybridConfig, PldConfig, PldPlusConfig, RestConfig)
    from vllm_retrieval_spec.drafting.tree import select_draft
    from vllm_retrieval_spec.proposers.hybrid import hybrid_draft
    from vllm_retrieval_spec.proposers.pld import pld_draft, pld_plus_draft
    from vllm_retrieval_spec.proposers.rest import rest_draft

    if gap is not None and not isinstance(config, HybridConfig):
        raise ValueError("--oracle-gap takes hybrid configs: their sources are the oracle's "
                         "candidates")
    if ceiling is not None and (not isinstance(config, HybridConfig) or config.tree == "on"):
        raise ValueError("--choice-ceilings takes hybrid configs with tree off: a ceiling "
                         "chooses one chain among their candidates")
    if isinstance(config, RestConfig):  # hybrid too: it extends REST
        datastore = _datastore(config)
        if not isinstance(config, HybridConfig):
            return lambda record: lambda context, n: rest_draft(datastore, context, n, config)
        dense = DenseQueries.if_in_use(config, model)
        served = ServedReplay(config, model, dense) if config.served_store != "off" else None
        store = served.store if served is not None else None

        def make_hybrid(record: dict[str, list[int]]) -> DraftFn:
            served_dense_of = served.dense_candidates(record) if served is not None else None
            truth = None if ceiling is None else \
                np.asarray(record["prompt"] + record["output"], dtype=np.int32)

            def draft(context: np.ndarray, n: int) -> np.ndarray:
                select = select_draft if ceiling is None else ceiling_select(
                    ceiling, truth[len(context):len(context) + n])
                return hybrid_draft(
                    datastore, context, n, config, dense.index if dense else None,
                    query_of(context) if dense else None, store,
                    served_dense_of(context) if served_dense_of else None, select)

            query_of = dense.for_record(record) if dense is not None else None
            if gap is None:
                return draft
            return gap.observe(draft, source_candidates(
                config, datastore, store, dense.index if dense else None, query_of,
                served_dense_of), record)

        return make_hybrid if served is None else served.wrap(make_hybrid)
    if isinstance(config, PldConfig):
        return lambda record: lambda context, n: pld_draft(context, n, config)
    if isinstance(config, PldPlusConfig):
        states = _transformers_states(_require_model(model, config))
        return lambda record: _with_states(states(record, config.layer), config, pld_plus_draft)
    if isinstance(config, DresdConfig):
        return _dresd_factory(config, DenseQueries(config, _require_model(model, config)))
    raise ValueError(f"no replay for method {config.method!r}")


class ServedReplay:
    """A draft factory whose method learns from served requests: the records are served in
    order, and each one's tokens enter the store once it is finished, as in the engine."""

    def __init__(self, config: Any, model: str | None = None,
                 dense: DenseQueries | None = None) -> None:
        from vllm_retrieval_spec.datastore.served import ServedStore

        self.config = config
        self.store = ServedStore(config.served_max_tokens, background=False)
        self.make_draft: DraftFactory | None = None
        #: With ``served_dense``: the served tokens' final states, as the engine indexes them.
        self.dense = None
        if getattr(config, "served_dense", False):
            from vllm_retrieval_spec.proposers.hybrid import served_dense_store

            self.states = _transformers_states(_require_model(model, config))
            self.dense = served_dense_store(config, dense.index if dense else None,
                                            self.states.model.config.hidden_size, False)

    def dense_candidates(self, record: dict[str, list[int]]) -> Callable | None:
        """context -> ``hybrid_draft``'s ``served_dense`` for it (None without a dense half)."""
        if self.dense is None:
            return None
        import torch

        final = self.final_states(record)
        top_n = self.config.top_n

        def for_context(context: np.ndarray) -> Callable:
            def candidates(emitted: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
                # Position p's state produced token p + 1, the last of a context of p + 2.
                query = self.dense.project(torch.from_numpy(final[len(context) - 2][None]))
                return self.dense.candidates(None if query is None else query[0], emitted,
                                             top_n, n)

            return candidates

        return for_context

    def final_states(self, record: dict[str, list[int]]) -> np.ndarray:
        return self.states(record, len(self.states.hidden_layers) - 1, unit=False)

    def wrap(self, make_draft: DraftFactory) -> ServedReplay:
        """``make_draft`` (which drafts from ``self.store``), told when records finish."""
        self.make_draft = make_draft
        return self

    def __call__(self, record: dict[str, list[int]]) -> DraftFn:
        return self.make_draft(record)

    def finished(self, record: dict[str, list[int]]) -> None:
        tokens = record["prompt"] + record["output"] if self.config.served_prompts \
            else record["output"]
        if self.dense is None:
            self.store.add(str(self.store.version), tokens)
            return
        from vllm_retrieval_spec.datastore.served import store_served

        # As in the engine: the states that predicted each output token (the prompt's other
        # states never reach the drafter).
        prompt_len = len(record["prompt"])
        positions = np.arange(prompt_len - 1, prompt_len + len(record["output"]) - 1)
        store_served(self.store, self.dense, str(self.store.version), tokens,
                     0 if self.config.served_prompts else prompt_len,
                     self.final_states(record)[positions], positions)


class SuffixDecodingReplay:
    """vLLM's ``suffix`` method offline: arctic_inference's ``SuffixDecodingCache`` driven as
    vLLM's ``SuffixDecodingProposer`` drives it (start a request with its prompt, add what each
    step sampled, speculate on the last ``max_tree_depth`` tokens, stop it when it finishes),
    at vLLM 0.32's defaults, so the peer can be replayed beside our methods."""

    #: vLLM 0.32's SpeculativeConfig defaults for suffix decoding.
    DEFAULTS = {"max_tree_depth": 24, "max_cached_requests": 10000, "max_spec_factor": 1.0,
                "min_token_prob": 0.1}

    def __init__(self, **options: Any) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.options = {**self.DEFAULTS, **options}
        self.cache = SuffixDecodingCache(
            max_tree_depth=self.options["max_tree_depth"],
            max_cached_requests=self.options["max_cached_requests"])
        self.requests = 0
        self.seen = 0

    @property
    def num_speculative_tokens(self) -> int:
        # vLLM sets it to the tree depth for suffix.
        return self.options["max_tree_depth"]

    def __call__(self, record: dict[str, list[int]]) -> DraftFn:
        req_id = str(self.requests)
        self.requests += 1
        prompt = np.asarray(record["prompt"], dtype=np.int32)
        self.cache.start_request(req_id, prompt)
        self.seen = len(prompt)

        def draft(context: np.ndarray, n: int) -> np.ndarray:
            self._add_sampled(req_id, context)
            pattern = context[-self.options["max_tree_depth"]:]
            result = self.cache.speculate(req_id, pattern, max_spec_tokens=n,
                                          max_spec_factor=self.options["max_spec_factor"],
                                          min_token_prob=self.options["min_token_prob"])
            return np.asarray(result.token_ids, dtype=np.int32)

        return draft

    def finished(self, record: dict[str, list[int]]) -> None:
        req_id = str(self.requests - 1)
        self._add_sampled(req_id, np.asarray(record["prompt"] + record["output"], np.int32))
        self.cache.stop_request(req_id)

    def _add_sampled(self, req_id: str, context: np.ndarray) -> None:
        if len(context) > self.seen:
            self.cache.add_active_response(req_id, context[self.seen:].tolist())
            self.seen = len(context)


def oracle_factory(config: Any, model: str | None = None) -> DraftFactory:
    """A ceiling for any merge rule over hybrid's sources: at each step, of every candidate the
    sources offer (``source_candidates``), the one the target model accepts furthest. Every
    chain a trie over the candidates can draft is a prefix of one of them, so no weighting can
    draft better."""
    from vllm_retrieval_spec.config import HybridConfig

    if not isinstance(config, HybridConfig):
        raise ValueError("--oracle takes hybrid configs: their sources are the candidates")
    datastore = _datastore(config)
    dense = DenseQueries.if_in_use(config, model)
    served = ServedReplay(config, model, dense) if config.served_store != "off" else None

    def make_oracle(record: dict[str, list[int]]) -> DraftFn:
        truth = np.asarray(record["prompt"] + record["output"], dtype=np.int32)
        candidates_of = source_candidates(
            config, datastore, served.store if served else None,
            dense.index if dense else None,
            dense.for_record(record) if dense is not None else None,
            served.dense_candidates(record) if served is not None else None)

        def draft(context: np.ndarray, n: int) -> np.ndarray:
            return longest_accepted(*candidates_of(context, n),
                                    truth[len(context):len(context) + n])

        return draft

    return make_oracle if served is None else served.wrap(make_oracle)


def source_candidates(config: Any, datastore: Any, store: Any, dense: Any,
                      query_of: Callable[[np.ndarray], np.ndarray] | None,
                      served_dense_of: Callable | None
                      ) -> Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]:
    """(context, n) -> every candidate hybrid's sources offer and its length: the context, the
    suffix array and the served store at every match length, the dense neighbours (static and
    served) that continue with the context's last token."""
    from vllm_retrieval_spec.proposers.dresd import matching_continuations
    from vllm_retrieval_spec.proposers.pld import find_context_matches

    def candidates(context: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        found = []
        for match_len in range(config.context_min_match_len, config.context_max_match_len + 1):
            found.append(find_context_matches(context, match_len, match_len,
                                              config.max_occurrences, n)[:2])
        for suffix_store in (s for s in (datastore, store) if s is not None):
            for match_len in range(config.min_match_len, config.max_match_len + 1):
                found.append(suffix_store.lookup(context, min_len=match_len, max_len=match_len,
                                                 max_occurrences=config.max_occurrences,
                                                 continuation_len=n)[:2])
        if query_of is not None:
            neighbours, scores = dense.search(query_of(context)[None], config.top_n)
            found.append(matching_continuations(dense.tokens, dense.positions, neighbours[0],
                                                scores[0], int(context[-1]), n)[:2])
        if served_dense_of is not None:
            found.append(served_dense_of(context)(int(context[-1]), n)[:2])
        return (np.concatenate([c for c, _ in found]),
                np.concatenate([length for _, length in found]))

    return candidates


class OracleGap:
    """Where a hybrid config's own drafts fall short of the oracle over its sources
    (``--oracle-gap``). At every step of the config's walk, the tokens the best candidate would
    have had accepted and the draft did not are put down to one cause: the draft went wrong
    where a candidate went on (``wrong_choice``: the merge chose), it was accepted whole but
    stopped before a candidate did (``too_short``: the length rules), or there was no draft
    (``no_draft``). The draft is taken before any padding; a tree counts as cut short when its
    accepted path is as deep as the tree."""

    CAUSES = ("wrong_choice", "too_short", "no_draft")

    def __init__(self) -> None:
        self.steps = self.accepted = self.oracle_accepted = 0
        self.missed = dict.fromkeys(self.CAUSES, 0)
        self.missed_steps = dict.fromkeys(self.CAUSES, 0)

    def observe(self, draft: DraftFn,
                candidates_of: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]],
                record: dict[str, list[int]]) -> DraftFn:
        """``draft``, unchanged, measuring each of its drafts for ``record``."""
        from vllm_retrieval_spec.drafting.tree import TreeDraft
        from vllm_retrieval_spec.tree_verification import tree_depths

        truth = np.asarray(record["prompt"] + record["output"], dtype=np.int32)

        def observed(context: np.ndarray, n: int) -> np.ndarray:
            proposal = draft(context, n)
            ahead = truth[len(context):len(context) + n]
            is_tree = isinstance(proposal, TreeDraft)
            size = len(proposal.tokens if is_tree else proposal)
            accepted = accepted_length(proposal, ahead[:size].tolist())
            best = len(longest_accepted(*candidates_of(context, n), ahead))
            deepest = int(tree_depths(proposal.parents).max(initial=0)) if is_tree else size
            self.steps += 1
            self.accepted += accepted
            self.oracle_accepted += max(best, accepted)
            if best > accepted:
                cause = ("no_draft" if deepest == 0 else
                         "too_short" if accepted == deepest else "wrong_choice")
                self.missed[cause] += best - accepted
                self.missed_steps[cause] += 1
            return proposal

        return observed

    def summary(self) -> dict[str, float]:
        """Per drafting step: tokens accepted, the oracle's, and the missed ones by cause; and
        the share of steps each cause missed tokens in."""
        steps = max(self.steps, 1)
        return {"accepted_per_step": round(self.accepted / steps, 3),
                "oracle_accepted_per_step": round(self.oracle_accepted / steps, 3),
                **{f"missed_{cause}_per_step": round(self.missed[cause] / steps, 3)
                   for cause in self.CAUSES},
                **{f"{cause}_step_share": round(self.missed_steps[cause] / steps, 3)
                   for cause in self.CAUSES}}


def longest_accepted(candidates: np.ndarray, lengths: np.ndarray,
                     truth: np.ndarray) -> np.ndarray:
    """The longest prefix of ``truth`` that some candidate starts with."""
    best = 0
    for candidate, length in zip(candidates, lengths):
        best = max(best, accepted_length(candidate[:length], truth[:length]))
    return truth[:best]


#: ``--choice-ceilings``, each knowing the recorded continuation at every step:
#: - ``first_token``: the config's chain, except where the trie holds the true next token among
#:   its first tokens and the chain starts with another: then the chain its rule draws below the
#:   true one (the same votes and prior; kept as it was where the rule draws none there);
#: - ``choice``: of the trie's candidates, the one accepted furthest, drafted as long as it is
#:   up to the config's length cap (``max_spec_factor`` x the longest match), where it beats
#:   the chain;
#: - ``choice_and_length``: the same up to ``num_speculative_tokens``;
#: - ``length``: the config's chain, cut right after the tokens it has right (not below
#:   ``min_draft_len``: a shorter draft would be dropped), what a perfect stopping rule drafts;
#: - ``length_heaviest``: the same for the trie's heaviest path without the probability stop
#:   (up to the step's cap), where that path is right further than the chain.
CHOICE_CEILINGS = ("first_token", "choice", "choice_and_length", "length", "length_heaviest")


def ceiling_select(ceiling: str, ahead: np.ndarray) -> Callable[..., np.ndarray]:
    """A ``select_draft`` for ``hybrid_draft`` that chooses as ``ceiling`` says
    (``CHOICE_CEILINGS``); ``ahead``: the recorded tokens after the context."""
    from vllm_retrieval_spec.drafting.tree import best_chain, select_draft

    if ceiling not in CHOICE_CEILINGS:
        raise ValueError(f"ceiling must be one of {CHOICE_CEILINGS}, got {ceiling!r}")

    def select(candidates: np.ndarray, lengths: np.ndarray, weights: np.ndarray, max_len: int,
               config: Any, max_depth: int | None = None) -> np.ndarray:
        chain = select_draft(candidates, lengths, weights, max_len, config, max_depth)
        depth = max_len if max_depth is None else min(max_depth, max_len)
        if ceiling == "first_token":
            if len(chain) == 0 or len(ahead) == 0 or chain[0] == ahead[0]:
                return chain
            # The other first tokens' candidates keep their votes at the root (length 0).
            below = np.where((candidates[:, 0] == ahead[0]) & (lengths > 0), lengths, 0)
            redrawn = best_chain(candidates, below.astype(np.int32), weights, depth,
                                 config.min_prefix_prob, config.prior_weight,
                                 config.min_draft_len)
            return redrawn if len(redrawn) else chain
        best, best_accepted = chain, accepted_length(chain, ahead[:len(chain)])
        if ceiling.startswith("length"):
            if ceiling == "length_heaviest":
                heaviest = best_chain(candidates, lengths, weights, max_len, 0.0,
                                      config.prior_weight, 1)
                accepted = accepted_length(heaviest, ahead[:len(heaviest)])
                if accepted > best_accepted:
                    best, best_accepted = heaviest, accepted
            return best[:max(best_accepted, min(len(best), config.min_draft_len))]
        cap = depth if ceiling == "choice" else max_len
        for candidate, length in zip(candidates, np.minimum(lengths, cap)):
            accepted = accepted_length(candidate[:length], ahead[:length])
            if accepted > best_accepted:
                best, best_accepted = candidate[:length], accepted
        return best

    return select


def _datastore(config: Any) -> Any:
    from vllm_retrieval_spec.datastore.suffix_array import SuffixArrayDatastore

    if not config.datastore:
        return None  # hybrid drafting from the context and the served store alone
    return SuffixArrayDatastore.from_path(config.datastore, verify_checksums=False)


def _require_model(model: str | None, config: Any) -> str:
    if model is None:
        raise ValueError(f"replaying {config.method} needs --model for the hidden states")
    return model


def _with_states(states: np.ndarray, config: Any, draft: Callable) -> DraftFn:
    # A causal model's states for a prefix do not depend on what follows, so the states of the
    # whole recorded sequence serve every prefix.
    return lambda context, n: draft(context, states[: len(context) - 1], n, config)


def _dresd_factory(config: Any, dense: DenseQueries) -> DraftFactory:
    from vllm_retrieval_spec.proposers.dresd import dresd_draft

    def make_draft(record: dict[str, list[int]]) -> DraftFn:
        query_of = dense.for_record(record)

        def draft(context: np.ndarray, n: int) -> np.ndarray:
            neighbours, scores = dense.index.search(query_of(context)[None], config.top_n)
            return dresd_draft(dense.index, neighbours[0], scores[0], int(context[-1]), n,
                               config)

        return draft

    return make_draft


class DenseQueries:
    """A datastore's dense index and, per record, the query for each context: the projected
    final state that produced the context's last token, as the proposers query in vLLM."""

    def __init__(self, config: Any, model: str) -> None:
        from vllm_retrieval_spec.datastore.dense import DenseIndex

        self.index = DenseIndex.from_path(config.datastore, search=config.search,
                                          verify_checksums=False)
        self.states = _transformers_states(model)

    @classmethod
    def if_in_use(cls, config: Any, model: str | None) -> DenseQueries | None:
        """For hybrid: the dense source when its datastore has an index and it is not off."""
        from vllm_retrieval_spec.datastore.dense import dense_index_in_use

        if not dense_index_in_use(config.datastore, config.dense):
            return None
        return cls(config, _require_model(model, config))

    def for_record(self, record: dict[str, list[int]]) -> Callable[[np.ndarray], np.ndarray]:
        """context (a prefix of the record's sequence) -> its query."""
        import torch

        final = self.states(record, len(self.states.hidden_layers) - 1, unit=False)
        queries = self.index.projection(torch.from_numpy(final))
        # Position p's state produced token p + 1, the last of a context of p + 2 tokens.
        return lambda context: queries[len(context) - 2]


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
    from vllm_retrieval_spec.config import (
        ACCELERATOR_DEFAULTS, VLLM_CPU_DEFAULTS, parse_speculative_config)

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
    parser.add_argument("--platform", choices=("vllm-cpu", "accelerator"), default="vllm-cpu",
                        help="whose option defaults (draft_token_cost, min_draft_len, ...) the "
                             "configs get, and so whose verification cost is modelled")
    parser.add_argument("--verify-cost",
                        help="a verify_cost results JSON: model each step's cost by its "
                             "measured time for that many draft tokens instead of linearly")
    parser.add_argument("--oracle", action="store_true",
                        help="replay hybrid configs' ceiling: at every step the candidate of "
                             "any source that is accepted furthest (k tokens at most)")
    parser.add_argument("--oracle-gap", action="store_true",
                        help="replay hybrid configs as they are and add, per step, what the "
                             "oracle would have had accepted and what they missed by cause "
                             "(a wrong choice among candidates, a draft cut short, no draft)")
    parser.add_argument("--choice-ceilings", action="store_true",
                        help="replay hybrid configs (tree off) and, beside each, the ceilings "
                             "of choosing better among its own candidates: the true first "
                             "token, the best candidate at its length cap, the best up to k, "
                             "the chain or the heaviest path cut where it goes wrong")
    args = parser.parse_args(argv)
    if sum((args.oracle, args.oracle_gap, args.choice_ceilings)) > 1:
        parser.error("--oracle, --oracle-gap and --choice-ceilings: choose one")
    records = [r for path in args.outputs for r in load_records(path)
               if args.task is None or r.get("task", "code-gen") == args.task]
    tasks = sorted({r.get("task", "code-gen") for r in records})
    grid = json.loads(args.grid)
    platforms = {p.name: p for p in (VLLM_CPU_DEFAULTS, ACCELERATOR_DEFAULTS)}

    def curve(k: int) -> list[float] | None:
        return None if args.verify_cost is None else measured_step_costs(args.verify_cost, k)
    for options in (o for base in json.loads(args.configs) for o in expand_grid(base, grid)):
        if options.get("method") == "suffix":
            # vLLM's own method, at its defaults (or the options given), beside ours.
            peer_options = {key: value for key, value in options.items() if key != "method"}
            cost = platforms[args.platform].draft_token_cost
            for task in tasks:
                peer = SuffixDecodingReplay(**peer_options)
                k = peer.num_speculative_tokens
                result = replay([r for r in records if r.get("task", "code-gen") == task],
                                peer, k, draft_token_cost=cost, step_costs=curve(k))
                print(json.dumps({"task": task, "config": options, **result}), flush=True)
            continue
        config = parse_speculative_config({"num_speculative_tokens": args.k, **options},
                                          platforms[args.platform])
        if args.oracle:
            # A ceiling: no adaptive cap, no minimum length, drafts cost nothing extra.
            factory = oracle_factory
            rules = {"draft_token_cost": 0.0, "adaptive": False, "min_draft_len": 1}
        else:
            factory = draft_factory
            rules = {"draft_token_cost": config.draft_token_cost,
                     "adaptive": config.adaptive_draft_len,
                     "min_draft_len": config.min_draft_len,
                     "step_costs": curve(config.num_speculative_tokens),
                     "pad_drafts": config.pad_drafts}
        ceilings = (None, *CHOICE_CEILINGS) if args.choice_ceilings else (None,)
        for task, ceiling in itertools.product(tasks, ceilings):
            # A fresh factory per task: a method that learns starts each task knowing none.
            gap = OracleGap() if args.oracle_gap else None
            make_draft = (factory(config, args.model) if gap is None and ceiling is None
                          else draft_factory(config, args.model, gap, ceiling))
            result = replay([r for r in records if r.get("task", "code-gen") == task],
                            make_draft, config.num_speculative_tokens, **rules)
            if gap is not None:
                result.update(gap.summary())
            tag = {} if ceiling is None else {"ceiling": ceiling}
            print(json.dumps({"task": task, "config": options, **tag, **result}), flush=True)


if __name__ == "__main__":
    main()
