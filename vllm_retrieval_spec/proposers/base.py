"""What every retrieval proposer shares: vLLM's ``custom_class`` contract and its safety rules.

vLLM builds the proposer with ``Class(vllm_config)`` in the worker, calls ``load_model(model)``
once, then ``propose(...)`` once per decoding step for the whole batch (see
``GPUModelRunner.propose_draft_token_ids``). A draft longer than ``num_speculative_tokens``
kills the engine, and so does an exception, so each request's draft is checked here and any
failure costs that request one step's draft, never the engine.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import Counter
from typing import Any

import numpy as np

from vllm_retrieval_spec.config import (
    PLUGIN_KEY,
    TREE_COST_FACTOR,
    MethodConfig,
    config_from_dict,
)
from vllm_retrieval_spec.drafting.adaptive import AcceptanceTracker, too_short
from vllm_retrieval_spec.drafting.overlap import (
    NextDrafts, ReadyDraft, last_state_rows, precompute_plan)
from vllm_retrieval_spec.drafting.step_cost import StepCostModel, pad_to
from vllm_retrieval_spec.drafting.tree import TreeDraft
from vllm_retrieval_spec.tree_verification import is_chain, valid_tree
from vllm_retrieval_spec.metrics import MethodMetrics

logger = logging.getLogger(__name__)


class RetrievalProposer:
    """Adapts vLLM's per-batch ``propose`` call to a per-request ``draft(context, max_len)``."""

    def __init__(self, vllm_config: Any) -> None:
        self.config: MethodConfig = config_from_dict(vllm_config.additional_config[PLUGIN_KEY])
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.budget_ns = int(self.config.draft_budget_ms * 1e6)
        #: Request id of each batch row this step (``observe_batch``; empty outside vLLM).
        self.row_req_ids: list[str] = []
        #: Whether each batch row may get a tree this step (``observe_batch``).
        self.tree_rows: list[bool] = []
        #: Request id -> its draft, for this step's drafts that are trees (not chains);
        #: ``tree_verification`` reads it when vLLM schedules those drafts.
        self.trees: dict[str, TreeDraft] = {}
        self.acceptance = (AcceptanceTracker(self.k, self.config.draft_token_cost,
                                             self.config.min_draft_len)
                           if self.config.adaptive_draft_len else None)
        #: Request id -> length of its last draft as drafted (before ``pad_drafts``' padding).
        self.last_draft_len: dict[str, int] = {}
        # Every tensor-parallel rank must draft alike, and each would time its steps apart.
        parallel = getattr(vllm_config, "parallel_config", None)
        self.step_costs = StepCostModel(self.config.min_draft_len, self.k) \
            if self.config.pad_drafts and getattr(parallel, "world_size", 1) == 1 else None
        #: (request id, tokens handed to vLLM, whether a tree, when) of the last step in which
        #: that request decoded alone: the next ``propose`` times its verification
        #: (``step_costs``).
        self._alone: tuple[str, int, bool, int] | None = None
        #: Clock of those timings, in ns.
        self.clock = time.perf_counter_ns
        #: Drafts padded (``step_costs``) since the stats were last reset.
        self.padded = 0
        self.metrics = MethodMetrics(self.config.method)
        # Seeded: every tensor-parallel rank must draft the same.
        self._fault_rng = random.Random(0)
        self._fault_kinds = itertools.cycle(("raise", "too_long", "out_of_vocabulary", "slow"))
        #: Steps on which a request got no draft because drafting failed, returned garbage or
        #: overran its time budget, by kind (see ``_fail``).
        self.failures: Counter[str] = Counter()
        self.precompute = self.config.precompute_drafts and not self.config.inject_faults
        #: Whether drafts can be made before the step they are for has run: not where they need
        #: its hidden states (``followers`` is None; hybrid with a dense source).
        self.drafts_without_states = type(self).followers is not RetrievalProposer.followers
        #: The hidden states of the rows vLLM samples this step (``search_ahead``, called by
        #: the plugin right after the forward), until ``draft_before_sampling`` uses them.
        self.forward_states: Any = None
        #: This step's (row, request id, context, draft) for ``precompute_next``.
        self.handed: list[tuple[int, str, np.ndarray, list[int]]] = []
        #: Request id -> its drafts for the next step (``precompute_next``).
        self.next_drafts: dict[str, NextDrafts] = {}
        #: This step's ``next_drafts`` by batch row (``observe_batch``), or the row's draft made
        #: before sampling (``draft_before_sampling``).
        self.row_ahead: list[NextDrafts | ReadyDraft | None] = []
        #: Drafting steps served from drafts made in advance ("used") or not ("missed").
        self.precomputed: Counter[str] = Counter()
        #: (request id, drafted, accepted) whose acceptance update waits for
        #: ``_apply_deferred``.
        self._deferred: list[tuple[str, int, int]] = []
        #: Drafts made before sampling and handed out, whose bookkeeping waits for
        #: ``_apply_deferred``.
        self._ready_used: list[ReadyDraft] = []
        #: (draft tokens, ns, whether a tree): the last step's time, for ``step_costs`` in
        #: ``_apply_deferred``.
        self._step_time: tuple[int, int, bool] | None = None
        #: Whether ``_apply_deferred`` may have work (set by every ``propose``).
        self._pending = False
        #: Counts for ``self.metrics`` not yet published.
        self._counts = dict.fromkeys(
            ("target_forwards", "output_tokens", "lookups", "empty_lookups"), 0)

    @property
    def drafts_ahead(self) -> bool:
        """Whether this step's contexts are kept for ``precompute_next``."""
        return self.precompute and self.drafts_without_states

    @property
    def drafts_from_logits(self) -> bool:
        """Whether the plugin calls ``draft_before_sampling`` (``draft_before_sampling``):
        drafts that need the step's hidden states get them from ``search_ahead``."""
        return self.config.draft_before_sampling and not self.config.inject_faults and (
            self.drafts_without_states or hasattr(self, "search_ahead"))

    def load_model(self, model: Any) -> None:
        """The CPU runner hands over the target model; retrieval needs none by default."""

    def draft(self, context: np.ndarray, max_len: int) -> np.ndarray | TreeDraft:
        """Draft at most ``max_len`` tokens to follow ``context`` (int32, the request's tokens)."""
        raise NotImplementedError

    def draft_row(self, row: int, context: np.ndarray, max_len: int) -> np.ndarray | TreeDraft:
        """``draft`` for batch row ``row``; methods with per-request state override this."""
        return self.draft(context, max_len)

    def followers(self, row: int, context: np.ndarray) -> tuple[np.ndarray, bool] | None:
        """The tokens ``b`` for which drafting after ``context + [b]`` (batch row ``row``'s
        context) can find anything, most likely first, and whether that list is complete (every
        other ``b`` drafts nothing); None where drafts cannot be made in advance (they need the
        step's hidden states)."""
        return None

    def sources_state(self, row: int) -> Any:
        """What batch row ``row``'s precomputed drafts depend on besides the context
        (``NextDrafts.sources``)."""
        return None

    def observe_batch(self, req_ids: list[str], tree_rows: list[bool] | None = None) -> None:
        """The plugin calls this each step before ``propose``: which request is in which row,
        and which rows may get a tree (greedy requests, where vLLM can verify trees). State of
        requests that left the batch is dropped."""
        self.row_req_ids = req_ids
        self.tree_rows = tree_rows or []
        self._apply_deferred()
        # Each row's precomputed drafts, found before sampling (the lookup after it is then
        # all that is left); those of requests that left the batch are dropped.
        if self.next_drafts:
            self.row_ahead = [self.next_drafts.get(r) for r in req_ids]
            self.next_drafts = {}
        if len(self.last_draft_len) > len(req_ids):
            present = set(req_ids)
            self.last_draft_len = {r: n for r, n in self.last_draft_len.items() if r in present}
            if self.acceptance is not None:
                self.acceptance.forget_except(present)

    def draft_before_sampling(self, sampled: list[list[int] | None], verified: list[list[int]],
                              num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray) -> None:
        """This step's drafts, made before vLLM samples: batch row i will sample ``sampled[i]``
        (a greedy request's argmax along its draft, ``drafting.overlap.greedy_sampled``; None
        where not known) after verifying ``verified[i]``, and has ``num_tokens_no_spec[i]``
        tokens before them. Each draft is kept, padded as ``propose`` would pad it, as that
        row's ``ReadyDraft``: ``propose`` hands it out if the row sampled exactly those tokens
        and drafts as before otherwise. Rows with trees or with precomputed drafts already are
        left alone."""
        rows = len(sampled)
        states, self.forward_states = self.forward_states, None
        if self.drafting_off(sum(1 for tokens in sampled if tokens)):
            return
        if not self.drafts_without_states:
            if states is None:
                return
            # The state that predicted each row's last sampled token: the logits' rows are the
            # states' rows (the root's, then one per draft token, request after request). Only
            # drafters with ``search_ahead`` get here, and they record states.
            self.record_last_hidden_states(  # type: ignore[attr-defined]
                states, last_state_rows(sampled, [len(draft) for draft in verified]))
        # propose pads the drafts of a request decoding alone.
        pad = self.step_costs is not None and rows == 1
        if len(self.row_ahead) < rows:
            self.row_ahead = self.row_ahead + [None] * (rows - len(self.row_ahead))
        for i, tokens in enumerate(sampled):
            if not tokens or i >= len(self.row_req_ids) or self.row_ahead[i] is not None:
                continue
            req_id = self.row_req_ids[i]
            if req_id in self.trees:
                # The tree verifier picks the accepted path; it need not follow the chain.
                continue
            base = int(num_tokens_no_spec[i])
            context = np.concatenate([token_ids_cpu[i, :base],
                                      np.asarray(tokens, dtype=token_ids_cpu.dtype)])
            a = len(tokens) - 1
            # As propose's update: acceptance of the last draft as drafted.
            last_drafted = self.last_draft_len.get(req_id, 0)
            cap = None if self.acceptance is None else \
                self.acceptance.cap_after(req_id, last_drafted, min(a, last_drafted))
            max_len = self._max_len(len(context), cap)
            draft, tree = self._checked_draft(i, context, max_len) if max_len > 0 \
                else ([], None)
            self.row_ahead[i] = ReadyDraft(
                req_id, i, list(tokens), context, self.sources_state(i),
                self._padded(context, draft) if pad and tree is None else draft, tree,
                len(draft), last_drafted)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        # Everything here is on the critical path, right after a forward that left the caches
        # cold (drafting.overlap): counters, acceptance updates and step times wait for
        # precompute_next, called once the drafts are handed over.
        now = self.clock()
        self._apply_deferred()
        self._pending = True
        self.trees = {}
        self.handed = []
        running = sum(1 for sampled in sampled_token_ids if sampled)
        alone, self._alone = self._alone, None
        pad = self.step_costs is not None and running == 1 and len(sampled_token_ids) == 1
        if pad and alone is not None and self.row_req_ids == [alone[0]]:
            # The step since the last propose verified that request's draft and nothing else.
            self._step_time = (alone[1], now - alone[3], alone[2])
        self._counts["target_forwards"] += running
        self._counts["output_tokens"] += sum(map(len, sampled_token_ids))
        if self.drafting_off(running):
            # Verifying drafts for a batch this large costs more than they save.
            self.last_draft_len.clear()
            self.row_ahead = []
            return [[] for _ in sampled_token_ids]
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                # Partial prefill: nothing was sampled, so there is nothing to continue.
                drafts.append([])
                continue
            num_tokens = int(num_tokens_no_spec[i])
            req_id = self.row_req_ids[i] if i < len(self.row_req_ids) else None
            ahead = self.row_ahead[i] if i < len(self.row_ahead) else None
            if isinstance(ahead, ReadyDraft):
                if ahead.made_for(sampled, num_tokens, self.sources_state(i)):
                    # Made before sampling: its bookkeeping waits for the handover.
                    self._ready_used.append(ahead)
                    if ahead.tree is not None:
                        self.trees[req_id] = ahead.tree
                    if pad:
                        self._alone = (req_id, len(ahead.draft), ahead.tree is not None, 0)
                    if self.drafts_ahead:
                        self.handed.append((i, req_id, ahead.context, ahead.draft))
                    drafts.append(ahead.draft)
                    continue
                self.precomputed["missed"] += 1
                ahead = None
            made = None if ahead is None else ahead.take(sampled, num_tokens,
                                                         self.sources_state(i), ([], None))
            if made is not None:
                self.precomputed["used"] += 1
                drafted = self.last_draft_len.get(req_id, 0)
                self._deferred.append((req_id, drafted, min(len(sampled) - 1, drafted)))
                draft, tree = made
                self._counts["lookups"] += 1
                self._counts["empty_lookups"] += not draft
            else:
                if ahead is not None:
                    self.precomputed["missed"] += 1
                cap = None
                if req_id is not None and self.acceptance is not None:
                    # The tokens sampled this step are the accepted part of last step's draft
                    # plus one the target model chose itself (padding's tokens not counted).
                    drafted = self.last_draft_len.get(req_id, 0)
                    self.acceptance.update(req_id, drafted, min(len(sampled) - 1, drafted))
                    cap = self.acceptance.cap(req_id)
                max_len = self._max_len(num_tokens, cap)
                draft, tree = self._safe_draft(i, token_ids_cpu[i, :num_tokens], max_len) \
                    if max_len > 0 else ([], None)
            if req_id is not None:
                self.last_draft_len[req_id] = len(draft)
                if tree is not None:
                    self.trees[req_id] = tree
                elif pad:
                    padded = self._padded(token_ids_cpu[i, :num_tokens], draft)
                    self.padded += len(padded) > len(draft)
                    draft = padded
                if pad:
                    self._alone = (req_id, len(draft), tree is not None, 0)
                if self.drafts_ahead:
                    # A copy: vLLM may move rows of its buffer before precompute_next runs.
                    self.handed.append((i, req_id, token_ids_cpu[i, :num_tokens].copy(),
                                        draft))
            drafts.append(draft)
        self.row_ahead = []
        if self._alone is not None:
            self._alone = (*self._alone[:3], self.clock())
        return drafts

    def _padded(self, context: np.ndarray, draft: list[int]) -> list[int]:
        """``draft`` padded to the length whose steps ``step_costs`` found cheapest among
        those not shorter, or to a length still to be measured (``StepCostModel.explore``)
        when the draft is not longer than that."""
        explore = self.step_costs.explore(len(draft))
        target = explore if explore is not None else self.step_costs.target(len(draft))
        target = min(target, self.k, self.max_model_len - len(context) - 1)
        if target <= len(draft):
            return draft
        return pad_to(context, np.asarray(draft, dtype=np.int32), target).tolist()

    def _max_len(self, num_tokens: int, cap: int | None) -> int:
        # Leave room for the bonus token: a draft may not push past max_model_len.
        max_len = min(self.k, self.max_model_len - num_tokens - 1)
        return max_len if cap is None else min(max_len, cap)

    @property
    def work_after_handover(self) -> bool:
        """Whether ``precompute_next`` has work once the drafts are handed to vLLM."""
        return self._pending or bool(self.handed)

    def _apply_deferred(self) -> None:
        """The bookkeeping of the drafts handed out from drafts made in advance (their caps
        were already known: acceptance updates, counters), the last step's time
        (``step_costs``), and the counters, published to Prometheus."""
        if not self._pending:
            return
        self._pending = False
        if self._step_time is not None:
            self.step_costs.observe(*self._step_time)
            self._step_time = None
        for ready in self._ready_used:
            self.precomputed["used"] += 1
            self._deferred.append((ready.req_id, ready.last_drafted,
                                   min(len(ready.sampled) - 1, ready.last_drafted)))
            self.last_draft_len[ready.req_id] = ready.drafted
            self._counts["lookups"] += 1
            self._counts["empty_lookups"] += not ready.drafted
            self.padded += len(ready.draft) > ready.drafted
        self._ready_used = []
        if self.acceptance is not None:
            for req_id, drafted, accepted in self._deferred:
                self.acceptance.update(req_id, drafted, accepted)
        self._deferred.clear()
        for name, count in self._counts.items():
            if count:
                getattr(self.metrics, name).inc(count)
        self._counts = dict.fromkeys(self._counts, 0)

    def precompute_next(self) -> None:
        """The bookkeeping ``propose`` left for later, then the next step's possible drafts for
        the requests drafted for this step (``drafting.overlap``); the plugin calls this once
        the drafts are handed to vLLM (``work_after_handover``), before the next ``propose``."""
        self._apply_deferred()
        handed, self.handed = self.handed, []
        for row, req_id, context, draft in handed:
            try:
                ahead = self._precompute(row, req_id, context, draft)
            except Exception:
                self._fail("exception", "raised while precomputing drafts", exc_info=True)
                continue
            if ahead is not None:
                self.next_drafts[req_id] = ahead

    def _precompute(self, row: int, req_id: str, context: np.ndarray,
                    drafted: list[int]) -> NextDrafts | None:
        sources = self.sources_state(row)
        draft = np.asarray(drafted, dtype=np.int32)
        contexts = []
        followers = []
        complete = []
        for a in range(len(draft) + 1):
            extended = np.concatenate([context, draft[:a]])
            found = self.followers(row, extended)
            if found is None:
                return None
            contexts.append(extended)
            tokens, all_found = found
            if a < len(draft):
                # vLLM's bonus token after a rejected draft token is never that token.
                tokens = tokens[tokens != draft[a]]
            followers.append(tokens)
            complete.append(all_found)
        # Acceptance counts the draft as drafted: padding's tokens are not evidence.
        drafted_len = self.last_draft_len.get(req_id, len(draft))
        caps = [None] * len(contexts) if self.acceptance is None else [
            self.acceptance.cap_after(req_id, drafted_len, min(a, drafted_len))
            for a in range(len(contexts))]
        ahead = NextDrafts(len(context), drafted, sources,
                           [self._max_len(len(context) + a + 1, caps[a])
                            for a in range(len(contexts))])
        plan = precompute_plan(followers, self.config.precompute_max_drafts)
        for a, b in plan:
            max_len = ahead.max_lens[a]
            ahead.drafts[a, b] = self._checked_draft(row, np.append(contexts[a], b), max_len) \
                if max_len > 0 else ([], None)
        planned = Counter(a for a, _ in plan)
        ahead.complete = [complete[a] and planned[a] == len(followers[a])
                          for a in range(len(contexts))]
        # A source that changed meanwhile (a new served-store snapshot) may have drafted some
        # of these differently from the others.
        return ahead if self.sources_state(row) is sources else None

    def drafting_off(self, running: int) -> bool:
        """No drafts this step: ``running`` requests sampled a token, as many as
        ``disable_by_batch_size`` or more."""
        limit = self.config.disable_by_batch_size
        return bool(limit) and running >= limit

    def stats(self, reset: bool = False) -> dict[str, int]:
        """Counters the ``rsd_drafting_stats`` worker RPC reports; ``reset`` restarts those that
        describe a stretch of steps (failures count since start)."""
        self._apply_deferred()
        stats = {**{f"failed_{kind}": n for kind, n in self.failures.items()},
                 **{f"precomputed_{kind}": n for kind, n in self.precomputed.items()}}
        if self.step_costs is not None:
            stats.update(self.step_costs.summary())
        if self.padded:
            stats["padded_drafts"] = self.padded
        if reset:
            self.precomputed.clear()
            self.padded = 0
        return stats

    @property
    def num_failed_drafts(self) -> int:
        return sum(self.failures.values())

    def _safe_draft(self, row: int, context: np.ndarray,
                    max_len: int) -> tuple[list[int], TreeDraft | None]:
        """The row's draft tokens, and the tree when they form one (not a chain)."""
        self._counts["lookups"] += 1
        draft, tree = self._checked_draft(row, context, max_len)
        self._counts["empty_lookups"] += not draft
        return draft, tree

    def _checked_draft(self, row: int, context: np.ndarray,
                       max_len: int) -> tuple[list[int], TreeDraft | None]:
        start = time.perf_counter_ns()
        draft_row = self.draft_row
        if self.config.inject_faults and self._fault_rng.random() < self.config.inject_faults:
            draft_row = self._injected_fault
        try:
            draft = draft_row(row, context, max_len)
        except TimeoutError:
            self._fail("over_budget", f"waited past its {self.config.draft_budget_ms} ms budget")
            return [], None
        except Exception:
            self._fail("exception", "raised", exc_info=True)
            return [], None
        elapsed = time.perf_counter_ns() - start
        if self.budget_ns and elapsed > self.budget_ns:
            # The time is spent, but a draft this late would make the step later still
            # (its verification costs more too); a slow lookup must not become the norm.
            self._fail("over_budget", f"took {elapsed / 1e6:.2f} ms, over its "
                                      f"{self.config.draft_budget_ms} ms budget")
            return [], None
        tree = None
        if isinstance(draft, TreeDraft):
            # Only greedy requests are verified as trees: the others get the tree's chain.
            if row < len(self.tree_rows) and self.tree_rows[row] and self.branches_pay(draft):
                tree, draft = draft, draft.tokens
            else:
                draft = draft.chain()
        if len(draft) > max_len:
            self._fail("too_long", f"returned {len(draft)} tokens, more than the allowed {max_len}")
            return [], None
        if len(draft) and (draft.min() < 0 or draft.max() >= self.vocab_size):
            self._fail("out_of_vocabulary",
                       f"returned token ids outside [0, {self.vocab_size}): {draft.tolist()}")
            return [], None
        if tree is not None and (len(tree.parents) != len(draft)
                                 or not valid_tree(tree.parents)):
            self._fail("bad_tree", f"returned a tree whose parents {tree.parents.tolist()} are "
                                   "not in topological order")
            return [], None
        if too_short(len(draft), max_len, self.config.min_draft_len):
            return [], None
        return draft.tolist(), None if tree is None or is_chain(tree.parents) else tree

    def branches_pay(self, tree: TreeDraft) -> bool:
        """Whether the nodes beside the tree's chain are expected to add more tokens than they
        cost: their verification (``tree_min_prob`` each, as ``best_tree`` adds them) and a
        tree step's fixed cost as measured (``StepCostModel.tree_extra``), both scaled, as
        ``tree_min_prob`` is, by how much the trie overstates a branch's chances. Yes while
        that cost is not measured: only tree steps measure it."""
        extra = None if self.step_costs is None else self.step_costs.tree_extra()
        if extra is None:
            return True
        branches = len(tree.tokens) - tree.chain_len
        return tree.branch_prob - branches * self.config.tree_min_prob >= TREE_COST_FACTOR * extra

    def _injected_fault(self, row: int, context: np.ndarray, max_len: int) -> np.ndarray:
        kind = next(self._fault_kinds)
        if kind == "raise":
            raise RuntimeError("injected fault (inject_faults)")
        if kind == "too_long":
            return np.ones(max_len + 1, dtype=np.int32)
        if kind == "out_of_vocabulary":
            return np.asarray([self.vocab_size], dtype=np.int32)
        time.sleep(2 * self.config.draft_budget_ms / 1e3)
        return self.draft_row(row, context, max_len)

    def _fail(self, kind: str, what: str, exc_info: bool = False) -> None:
        self.failures[kind] += 1
        self.metrics.failed_draft(kind)
        if self.failures[kind] == 1:
            logger.error(
                "%s drafting %s; that request gets no draft this step (the first %r event is "
                "logged, later ones only counted: see failures)", type(self).__name__, what,
                kind, exc_info=exc_info)
