"""vLLM's ``custom_class`` proposer for every retrieval method: the ``contract.Drafter`` the
plugin drives, over one method's ``contract.MethodDrafter`` (``proposers/<method>.py``).

vLLM builds it with ``RetrievalProposer(vllm_config)`` in the worker, calls ``load_model``
once, then ``propose`` once per decoding step for the whole batch. What every method shares is
here, each part an object of its own: how long drafts may be and what they cost
(``DraftLengths``), checking every draft (``DraftGuard``: a draft longer than
``num_speculative_tokens`` or an exception would kill the engine, so any failure costs that
request one step's draft instead), drafts made ahead of their step (``DraftAhead``), and the
counters behind the metrics.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.config import PLUGIN_KEY, MethodConfig, config_from_dict
from vllm_retrieval_spec.contract import UNKNOWN_TOKEN, Drafter, MethodDrafter
from vllm_retrieval_spec.drafting.adaptive import drafting_off
from vllm_retrieval_spec.drafting.ahead import DraftAhead
from vllm_retrieval_spec.drafting.guard import DraftFailures, DraftGuard
from vllm_retrieval_spec.drafting.lengths import DraftLengths
from vllm_retrieval_spec.drafting.overlap import (
    NextDrafts, ReadyDraft, last_state_rows, rank_followers)
from vllm_retrieval_spec.drafting.step_cost import pad_to
from vllm_retrieval_spec.drafting.tree import TreeDraft
from vllm_retrieval_spec.metrics import MethodMetrics, counts_metrics


@dataclass
class SampledStep:
    """What one ``propose`` was handed, for ``MethodDrafter.observe_sampled``."""

    #: Request id of each batch row.
    req_ids: list[str]
    sampled: list[list[int]]
    num_tokens: np.ndarray
    token_ids: np.ndarray
    #: Drafts made before sampling that this step handed out (each holds a copy of its
    #: request's tokens).
    ready: list[ReadyDraft]
    #: Request id -> tree, for the drafts this step verified that were trees (handed out by the
    #: last ``propose``): their accepted tokens' states are not contiguous.
    trees: dict[str, TreeDraft]
    #: Each row's first position with a known token id (``Drafter.observe_batch``; empty: 0).
    known_from: list[int] = dataclasses.field(default_factory=list)


def model_placement(model: Any) -> tuple[Any, Any]:
    """The device and dtype of the model's weights, which its hidden states share; the CPU and
    float32 without a model (replay) or weights."""
    import torch

    weights = next(model.parameters(), None) if model is not None else None
    return ("cpu", torch.float32) if weights is None else (weights.device, weights.dtype)


class RetrievalProposer(Drafter):
    def __init__(self, vllm_config: Any, method: MethodDrafter | None = None) -> None:
        """vLLM passes ``vllm_config`` alone; the method's drafter is then made from the
        config (``make_drafter`` of the method's module). Tests and lab tools may pass one."""
        self.config: MethodConfig = config_from_dict(vllm_config.additional_config[PLUGIN_KEY])
        parallel = getattr(vllm_config, "parallel_config", None)
        if getattr(parallel, "world_size", 1) > 1:
            # Every rank drafts, and each verifies the tree its own drafter made: a time budget
            # (the guard's, DReSD's search wait) would drop a draft on a rank slow by chance
            # only, which would then verify as a chain what the others verify as a tree.
            self.config = dataclasses.replace(self.config, drafting=dataclasses.replace(
                self.config.drafting, draft_budget_ms=0.0))
        drafting = self.config.drafting
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.metrics = MethodMetrics(self.config.method, counts_metrics(parallel))
        self.failures = DraftFailures(self.config.method, self.metrics)
        self.method = method or importlib.import_module(self.config.module).make_drafter(
            self.config, vllm_config, self.failures.record)
        # Tensor-parallel ranks would time their steps apart, and all must draft alike.
        self.lengths = DraftLengths(drafting, self.k, self.max_model_len,
                                    timed=getattr(parallel, "world_size", 1) == 1)
        trie = getattr(self.config, "trie", None)
        self.guard = DraftGuard(
            self.method.draft, self.failures, vocab_size=vllm_config.model_config.get_vocab_size(),
            budget_ms=drafting.draft_budget_ms, min_draft_len=drafting.min_draft_len,
            inject_faults=drafting.inject_faults,
            branches_pay=lambda tree: self.lengths.branches_pay(tree, trie.tree_min_prob))
        faults = bool(drafting.inject_faults)
        found = self.method.capabilities
        self.ahead = DraftAhead(
            self.method, self.lengths, self.guard.checked,
            precompute=drafting.precompute_drafts and not faults and found.precomputable,
            max_drafts=drafting.precompute_max_drafts)
        # Drafts that need the step's hidden states get them from ``search_ahead``.
        self.capabilities = dataclasses.replace(
            found, drafts_before_sampling=drafting.draft_before_sampling and not faults and (
                found.precomputable or found.last_hidden_states))
        #: Request id of each batch row this step (``observe_batch``; empty outside vLLM).
        self.row_req_ids: list[str] = []
        #: Whether each batch row may get a tree this step (``observe_batch``).
        self.tree_rows: list[bool] = []
        #: Each batch row's first position with a known token id (``observe_batch``; empty:
        #: 0 for every row).
        self.known_from: list[int] = []
        self.trees: dict[str, TreeDraft] = {}
        #: The hidden states of the rows vLLM samples this step (``search_ahead``), until
        #: ``draft_before_sampling`` uses them.
        self.forward_states: Any = None
        #: Whether ``settle`` may have work (set by every ``propose``).
        self._pending = False
        #: Counts for ``self.metrics`` not yet published.
        self._counts = dict.fromkeys(
            ("target_forwards", "output_tokens", "lookups", "empty_lookups"), 0)

    def load_model(self, model: Any) -> None:
        """Retrieval needs no model of its own: this is where what the first step would
        compile or load is done instead (``MethodDrafter.warm_up``)."""
        self.method.warm_up(self.k, *model_placement(model))
        context = np.arange(4, dtype=np.int32) % 2
        if self.capabilities.precomputable:
            self.method.followers(0, context)
        rank_followers(context, context)
        pad_to(context, context[:1], 3)

    def drafting_off(self, running: int) -> bool:
        return drafting_off(running, self.config.drafting.disable_by_batch_size)

    def _tree_row(self, row: int) -> bool:
        # Only ``tree_eligible`` requests are verified as trees: the others get its chain.
        return row < len(self.tree_rows) and self.tree_rows[row]

    def observe_batch(self, req_ids: list[str], tree_rows: list[bool] | None = None,
                      served_keys: list[str | None] | None = None,
                      token_limits: list[int | None] | None = None,
                      known_from: list[int] | None = None) -> None:
        self.row_req_ids = req_ids
        self.tree_rows = tree_rows or []
        self.known_from = known_from or []
        self.settle()
        self.ahead.begin_batch(req_ids)
        self.lengths.forget_except(req_ids)
        self.lengths.limit_tokens(req_ids, token_limits)
        self.method.begin_step(req_ids, served_keys)

    def observe_finished(self, req_ids: set[str],
                         tokens: dict[str, np.ndarray] | None = None) -> None:
        # The last step's bookkeeping first: it may hold a finished request's last tokens.
        self.settle()
        self.method.finished(req_ids, tokens)

    def search_ahead(self, states: Any) -> None:
        self.forward_states = states
        self.method.search_ahead(states)

    def record_hidden_states(self, req_ids: list[str], aux_hidden_states: list[Any],
                             segments: list[tuple[int, int, int]]) -> None:
        self.method.record_hidden_states(req_ids, aux_hidden_states, segments)

    def record_last_hidden_states(self, states: Any, rows: list[int]) -> None:
        self.method.record_last_hidden_states(states, rows)

    def draft_before_sampling(self, sampled: list[list[int] | None], verified: list[list[int]],
                              num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray) -> None:
        """This step's drafts, made before vLLM samples (``DraftAhead.before_sampling``):
        ``propose`` hands each out if its row sampled exactly the tokens it was made for and
        drafts as before otherwise."""
        states, self.forward_states = self.forward_states, None
        # The rows propose counts: every one that samples, its tokens known yet (greedy) or not.
        if self.drafting_off(sum(tokens != [] for tokens in sampled)):
            return
        if not self.method.capabilities.precomputable:
            if states is None:
                return
            # The state that predicted each row's last sampled token: the logits' rows are the
            # states' rows (the root's, then one per draft token, request after request).
            self.method.record_last_hidden_states(
                states, last_state_rows(sampled, [len(draft) for draft in verified]))
        # propose pads the drafts of a request decoding alone.
        pad = self.lengths.step_costs is not None and len(sampled) == 1
        self.ahead.before_sampling(sampled, num_tokens_no_spec, token_ids_cpu, self.row_req_ids,
                                   self.trees, self._tree_row, pad, self._known_from)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        try:
            return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception:
            # Each draft is guarded on its own (DraftGuard); this is the step's bookkeeping
            # around them, which must cost the step's drafts at most, never the engine.
            self.failures.record("exception", "raised while proposing", exc_info=True)
            self._drop_drafts()
            return [[] for _ in sampled_token_ids]

    def _drop_drafts(self) -> None:
        """The step failed and vLLM gets no draft: what it had made must be neither counted
        as drafted (the next step would count it as rejected) nor drafted ahead from."""
        self.trees = {}
        self.ahead.handed = []
        self.ahead.row_ahead = []
        # The acceptance updates of the drafts this step verified stand: those of the rows
        # handed drafts made before sampling are left for settle, as they would have been.
        for ready in self.ahead.ready_used:
            self.lengths.defer_update(ready.req_id, len(ready.sampled), ready.last_drafted)
        self.ahead.ready_used = []
        self.lengths.no_drafts()

    def _propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                 token_ids_cpu: np.ndarray) -> list[list[int]]:
        # Everything here is on the critical path, right after a forward that left the caches
        # cold (drafting.overlap): counters, acceptance updates and step times wait for
        # after_handover, called once the drafts are handed over.
        now = self.lengths.clock()
        self.settle()
        self._pending = True
        verified_trees, self.trees = self.trees, {}
        self.ahead.handed = []
        running = sum(1 for sampled in sampled_token_ids if sampled)
        pad = self.lengths.begin_step(now, running, len(sampled_token_ids), self.row_req_ids)
        self._counts["target_forwards"] += running
        self._counts["output_tokens"] += sum(map(len, sampled_token_ids))
        if self.drafting_off(running):
            self.lengths.last_drafted.clear()
            drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        else:
            # Partial prefills sampled nothing, so there is nothing to continue.
            drafts = [self._propose_row(i, sampled, int(num_tokens_no_spec[i]), token_ids_cpu,
                                        pad) if sampled else []
                      for i, sampled in enumerate(sampled_token_ids)]
            self.lengths.end_step()
        self.ahead.row_ahead = []
        self.method.observe_sampled(SampledStep(
            self.row_req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
            self.ahead.ready_used, verified_trees, self.known_from))
        return drafts

    def _propose_row(self, i: int, sampled: list[int], num_tokens: int,
                     token_ids_cpu: np.ndarray, pad: bool) -> list[int]:
        req_id = self.row_req_ids[i] if i < len(self.row_req_ids) else None
        ahead = self.ahead.for_row(i)
        if isinstance(ahead, ReadyDraft):
            if ahead.made_for(sampled, num_tokens, self.method.snapshot(i)):
                return self._hand_ready(i, req_id, ahead, pad)
            self.ahead.precomputed["missed"] += 1
            ahead = None
        made = None if ahead is None else ahead.take(sampled, num_tokens, self.method.snapshot(i),
                                                     ([], None))
        context = self._context(i, token_ids_cpu, num_tokens)
        if made is not None:
            draft, tree = self._take_precomputed(req_id, sampled,
                                                 ahead.max_lens[len(sampled) - 1], made)
        else:
            if ahead is not None:
                self.ahead.precomputed["missed"] += 1
            draft, tree = self._draft_now(i, req_id, sampled, context)
        if req_id is None:
            return draft
        return self._hand_out(i, req_id, draft, tree, context, pad)

    def _known_from(self, row: int) -> int:
        return self.known_from[row] if row < len(self.known_from) else 0

    def _context(self, row: int, token_ids_cpu: np.ndarray, num_tokens: int) -> np.ndarray:
        """Row ``row``'s tokens: a view of vLLM's buffer, or a copy with ``UNKNOWN_TOKEN``
        where its prompt came as embeddings (``observe_batch``)."""
        context = token_ids_cpu[row, :num_tokens]
        known_from = self._known_from(row)
        if known_from:
            context = context.copy()
            context[:known_from] = UNKNOWN_TOKEN
        return context

    def _hand_ready(self, i: int, req_id: str, ready: ReadyDraft, pad: bool) -> list[int]:
        """A draft made before sampling, for exactly what the row sampled: its bookkeeping
        waits for ``settle``."""
        self.ahead.ready_used.append(ready)
        if ready.tree is not None:
            self.trees[req_id] = ready.tree
        if pad:
            self.lengths.handed(req_id, len(ready.draft), ready.tree is not None)
        self.ahead.hand(i, req_id, ready.context, ready.draft, ready.tree, copy=False)
        return ready.draft

    def _take_precomputed(self, req_id: str, sampled: list[int], max_len: int,
                          made: tuple[list[int], TreeDraft | None]
                          ) -> tuple[list[int], TreeDraft | None]:
        """A draft precomputed after the last handover (``NextDrafts``), with ``max_len``: its
        cap was known."""
        self.ahead.precomputed["used"] += 1
        self.lengths.defer_update(req_id, len(sampled), self.lengths.last_drafted.get(req_id, 0))
        self._count_lookup(max_len, len(made[0]))
        return made

    def _draft_now(self, i: int, req_id: str | None, sampled: list[int],
                   context: np.ndarray) -> tuple[list[int], TreeDraft | None]:
        max_len = self.lengths.max_len(req_id, len(context),
                                       self.lengths.cap_now(req_id, len(sampled)))
        if max_len <= 0:
            return [], None
        draft, tree = self.guard.checked(i, context, max_len, self._tree_row(i))
        self._count_lookup(max_len, len(draft))
        return draft, tree

    def _count_lookup(self, max_len: int, drafted: int) -> None:
        """A draft attempt of at most ``max_len`` tokens gave ``drafted``. A request with no
        room to draft (``max_len`` <= 0: at max_model_len or max_tokens) made none, however its
        draft was made: the metrics count attempts, and empty ones where the sources found
        nothing."""
        if max_len > 0:
            self._counts["lookups"] += 1
            self._counts["empty_lookups"] += not drafted

    def _hand_out(self, i: int, req_id: str, draft: list[int], tree: TreeDraft | None,
                  context: np.ndarray, pad: bool) -> list[int]:
        self.lengths.last_drafted[req_id] = len(draft)
        if tree is not None:
            self.trees[req_id] = tree
        elif pad:
            padded = self.lengths.padded_draft(req_id, context, draft)
            self.lengths.padded += len(padded) > len(draft)
            draft = padded
        if pad:
            self.lengths.handed(req_id, len(draft), tree is not None)
        self.ahead.hand(i, req_id, context, draft, tree, copy=True)
        return draft

    @property
    def has_work_after_handover(self) -> bool:
        return self._pending or bool(self.ahead.handed)

    def after_handover(self, forward_done: Callable[[], bool] = lambda: False) -> None:
        """The bookkeeping ``propose`` left for later, then the next step's possible drafts for
        the requests drafted for this step (``drafting.overlap``), until ``forward_done``."""
        self.settle()
        self.ahead.precompute_next(self._tree_row, self.failures.record, forward_done)

    def settle(self) -> None:
        """The bookkeeping of the last ``propose``, off the critical path: the method's own,
        the drafts handed out from drafts made before sampling (their caps were already
        known: acceptance updates, counters), the last step's time, and the counters,
        published to Prometheus."""
        self.method.settle()
        if not self._pending:
            return
        self._pending = False
        for ready in self.ahead.ready_used:
            self.ahead.precomputed["used"] += 1
            self.lengths.defer_update(ready.req_id, len(ready.sampled), ready.last_drafted)
            self.lengths.last_drafted[ready.req_id] = ready.drafted
            self._count_lookup(ready.max_len, ready.drafted)
            self.lengths.padded += len(ready.draft) > ready.drafted
        self.ahead.ready_used = []
        self.lengths.settle()
        self.metrics.publish(self._counts)

    def report_failure(self, kind: str, what: str, exc_info: bool = False) -> None:
        self.failures.record(kind, what, exc_info=exc_info)

    def observe_drafting_time(self, critical_s: float | None, total_s: float | None) -> None:
        if critical_s is not None:
            self.metrics.drafting_critical_seconds.observe(critical_s)
        if total_s is not None:
            self.metrics.drafting_seconds.observe(total_s)

    def stats(self, reset: bool = False) -> dict[str, int]:
        """Failures count since start; ``reset`` restarts the counters that describe a stretch
        of steps."""
        self.settle()
        stats = {**{f"failed_{kind}": n for kind, n in self.failures.counts.items()},
                 **{f"precomputed_{kind}": n for kind, n in self.ahead.precomputed.items()},
                 **self.lengths.stats(reset)}
        if reset:
            self.ahead.precomputed.clear()
        return {**stats, **self.method.stats(reset)}

    @property
    def num_failed_drafts(self) -> int:
        return self.failures.total

    def close(self) -> None:
        self.settle()
        self.method.close()


#: What the plugin hands vLLM as the ``custom_class`` of every method.
PROPOSER_CLASS = f"{RetrievalProposer.__module__}.{RetrievalProposer.__qualname__}"

__all__ = ["PROPOSER_CLASS", "NextDrafts", "RetrievalProposer", "SampledStep"]
