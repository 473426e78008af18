"""How long each request's next draft may be, and what verifying each length costs here.

- Room: at most k tokens, and a draft may not push a request past ``max_model_len``, nor past
  its ``max_tokens`` (the bonus token included): vLLM's scheduler verifies whatever is drafted
  and drops the tokens past ``max_tokens`` afterwards.
- ``adaptive_draft_len``: a cap from the request's recent acceptance (``drafting.adaptive``),
  counting its last draft as drafted (padding's tokens are not evidence).
- ``pad_drafts``: while one request decodes alone, each step's time by the draft length it
  verified (``drafting.step_cost``), and a chain padded to a length that verifies faster.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from vllm_retrieval_spec.config.options import TREE_COST_FACTOR, DraftingOptions
from vllm_retrieval_spec.drafting.adaptive import AcceptanceTracker
from vllm_retrieval_spec.drafting.step_cost import StepCostModel, pad_to
from vllm_retrieval_spec.drafting.tree import TreeDraft


class DraftLengths:
    def __init__(self, drafting: DraftingOptions, k: int, max_model_len: int, timed: bool,
                 clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.k = k
        self.max_model_len = max_model_len
        #: Request id -> the most tokens it may reach, its prompt included, where its
        #: ``max_tokens`` ends it before ``max_model_len`` (``limit_tokens``).
        self.token_limits: dict[str, int] = {}
        self.acceptance = (AcceptanceTracker(k, drafting.draft_token_cost, drafting.min_draft_len)
                           if drafting.adaptive_draft_len else None)
        #: Request id -> length of its last draft as drafted (before padding).
        self.last_drafted: dict[str, int] = {}
        #: (request id, drafted, accepted) whose acceptance update waits for ``settle``.
        self._deferred: list[tuple[str, int, int]] = []
        # Every tensor-parallel rank must draft alike, and each would time its steps apart.
        self.step_costs = StepCostModel(drafting.min_draft_len, k) \
            if drafting.pad_drafts and timed else None
        #: Clock of the step timings, in ns.
        self.clock = clock
        #: (request id, tokens handed to vLLM, whether a tree, when) of the last step in which
        #: that request decoded alone: the next ``begin_step`` times its verification.
        self._alone: tuple[str, int, bool, int] | None = None
        #: (draft tokens, ns, whether a tree): the last step's time, observed at ``settle``.
        self._step_time: tuple[int, int, bool] | None = None
        #: Drafts padded since the stats were last reset.
        self.padded = 0

    def limit_tokens(self, req_ids: list[str], limits: list[int | None] | None) -> None:
        """This step's requests may reach ``limits[i]`` tokens, their prompts included (None:
        ``max_model_len``)."""
        self.token_limits = {} if limits is None else {
            req_id: limit for req_id, limit in zip(req_ids, limits)
            if limit is not None and limit < self.max_model_len}

    def max_len(self, req_id: str | None, num_tokens: int, cap: int | None = None) -> int:
        """The longest draft request ``req_id`` may get at ``num_tokens`` tokens."""
        # Leave room for the bonus token: verifying a draft gives one token more than it holds.
        limit = self.token_limits.get(req_id, self.max_model_len)
        max_len = min(self.k, limit - num_tokens - 1)
        return max_len if cap is None else min(max_len, cap)

    def cap_now(self, req_id: str | None, sampled: int) -> int | None:
        """The request's acceptance cap after this step, which sampled ``sampled`` tokens: the
        accepted part of its last draft plus one the target model chose itself."""
        if req_id is None or self.acceptance is None:
            return None
        drafted = self.last_drafted.get(req_id, 0)
        self.acceptance.update(req_id, drafted, min(sampled - 1, drafted))
        return self.acceptance.cap(req_id)

    def cap_after(self, req_id: str, accepted: int, last_drafted: int) -> int | None:
        """The cap ``cap_now`` will give once the request accepted ``accepted`` tokens of a
        last draft of ``last_drafted`` tokens, without updating anything."""
        if self.acceptance is None:
            return None
        return self.acceptance.cap_after(req_id, last_drafted, min(accepted, last_drafted))

    def defer_update(self, req_id: str, sampled: int, last_drafted: int) -> None:
        """The acceptance update ``cap_now`` makes, left for ``settle``: the step's draft was
        made ahead, with its cap already known."""
        self._deferred.append((req_id, last_drafted, min(sampled - 1, last_drafted)))

    def forget_except(self, req_ids: list[str]) -> None:
        """Drop the state of requests that left the batch."""
        # By id, not by count: a request that left as another joined (preempted, to resume
        # with a prefill) would keep its last draft, which vLLM dropped unverified, and have
        # it counted as rejected when it is back.
        present = set(req_ids)
        for req_id in self.last_drafted.keys() - present:
            del self.last_drafted[req_id]
        if self.acceptance is not None:
            self.acceptance.forget_except(present)

    def begin_step(self, now: int, running: int, rows: int, row_req_ids: list[str]) -> bool:
        """At ``now``, as ``propose`` starts: times the step since the last ``propose`` if it
        verified one lone request's draft; returns whether this step's drafts are padded (one
        request decodes alone)."""
        alone, self._alone = self._alone, None
        pad = self.step_costs is not None and running == 1 and rows == 1
        if pad and alone is not None and row_req_ids == [alone[0]]:
            # The step since the last propose verified that request's draft and nothing else.
            self._step_time = (alone[1], now - alone[3], alone[2])
        return pad

    def handed(self, req_id: str, tokens: int, tree: bool) -> None:
        """A lone request's draft of ``tokens`` went out: its verification is timed."""
        self._alone = (req_id, tokens, tree, 0)

    def no_drafts(self) -> None:
        """This step's drafts did not go out (the step failed): none counts as drafted, and
        the next step verifies none of a lone request's."""
        self.last_drafted.clear()
        self._alone = None

    def end_step(self) -> None:
        if self._alone is not None:
            self._alone = (*self._alone[:3], self.clock())

    def padded_draft(self, req_id: str, context: np.ndarray, draft: list[int]) -> list[int]:
        """``draft`` padded to the length whose steps ``step_costs`` found cheapest among
        those not shorter, or to a length still to be measured (``StepCostModel.explore``)
        when the draft is not longer than that."""
        explore = self.step_costs.explore(len(draft))
        target = explore if explore is not None else self.step_costs.target(len(draft))
        target = min(target, self.max_len(req_id, len(context)))
        if target <= len(draft):
            return draft
        return pad_to(context, np.asarray(draft, dtype=np.int32), target).tolist()

    def branches_pay(self, tree: TreeDraft, tree_min_prob: float) -> bool:
        """Whether the nodes beside the tree's chain are expected to add more tokens than they
        cost: their verification (``tree_min_prob`` each, as ``best_tree`` adds them) and a
        tree step's fixed cost as measured (``StepCostModel.tree_extra``), both scaled, as
        ``tree_min_prob`` is, by how much the trie overstates a branch's chances. Yes while
        that cost is not measured: only tree steps measure it."""
        extra = None if self.step_costs is None else self.step_costs.tree_extra()
        if extra is None:
            return True
        branches = len(tree.tokens) - tree.chain_len
        return tree.branch_prob - branches * tree_min_prob >= TREE_COST_FACTOR * extra

    def settle(self) -> None:
        """The last step's time and the acceptance updates left for later."""
        if self._step_time is not None:
            self.step_costs.observe(*self._step_time)
            self._step_time = None
        if self.acceptance is not None:
            for req_id, drafted, accepted in self._deferred:
                self.acceptance.update(req_id, drafted, accepted)
        self._deferred.clear()

    def stats(self, reset: bool) -> dict[str, float]:
        stats: dict[str, float] = {}
        if self.step_costs is not None:
            stats.update(self.step_costs.summary())
        if self.padded:
            stats["padded_drafts"] = self.padded
        if reset:
            self.padded = 0
        return stats
