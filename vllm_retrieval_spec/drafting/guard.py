"""The drafter never kills the engine: every draft is checked before vLLM sees it.

A draft longer than ``num_speculative_tokens`` kills vLLM's engine, and so does an exception;
an id outside the vocabulary or a late draft makes the step wrong or slow. Each such event
costs that request one step's draft, is counted by kind, and is logged the first time.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_retrieval_spec.drafting.adaptive import too_short
from vllm_retrieval_spec.drafting.tree import TreeDraft
from vllm_retrieval_spec.metrics import MethodMetrics
from vllm_retrieval_spec.verification.core import is_chain, valid_tree

logger = logging.getLogger(__name__)


class DraftFailures:
    """Steps on which a request got no draft because drafting failed, returned garbage or
    overran its time budget, by kind; the first event of each kind is logged."""

    def __init__(self, method: str, metrics: MethodMetrics) -> None:
        self.method = method
        self.metrics = metrics
        self.counts: Counter[str] = Counter()

    def record(self, kind: str, what: str, exc_info: bool = False) -> None:
        self.counts[kind] += 1
        self.metrics.failed_draft(kind)
        if self.counts[kind] == 1:
            logger.error(
                "%s drafting %s; that request gets no draft this step (the first %r event is "
                "logged, later ones only counted: see failures)", self.method, what, kind,
                exc_info=exc_info)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


#: A draft of batch row ``row`` for ``context``, at most ``max_len`` tokens.
DraftFunction = Callable[[int, np.ndarray, int], Any]


class DraftGuard:
    """Runs a method's ``draft`` and checks what comes back (``checked``).

    ``inject_faults`` (a testing aid) makes that fraction of attempts fail on purpose, in turn
    raising, drafting k + 1 tokens, drafting an id outside the vocabulary and overrunning the
    time budget."""

    def __init__(self, draft: DraftFunction, failures: DraftFailures, *, vocab_size: int,
                 budget_ms: float, min_draft_len: int, inject_faults: float = 0.0,
                 branches_pay: Callable[[TreeDraft], bool] = lambda tree: True) -> None:
        self.draft = draft
        self.failures = failures
        self.vocab_size = vocab_size
        self.budget_ms = budget_ms
        self.budget_ns = int(budget_ms * 1e6)
        self.min_draft_len = min_draft_len
        self.inject_faults = inject_faults
        self.branches_pay = branches_pay
        # Seeded: every tensor-parallel rank must draft the same.
        self._fault_rng = random.Random(0)
        self._fault_kinds = itertools.cycle(("raise", "too_long", "out_of_vocabulary", "slow"))

    def checked(self, row: int, context: np.ndarray, max_len: int,
                tree_row: bool) -> tuple[list[int], TreeDraft | None]:
        """Row ``row``'s draft tokens, and the tree when they form one (not a chain): only a
        ``tree_row`` (``verification.core.tree_eligible``) gets a tree, the others its chain."""
        start = time.perf_counter_ns()
        draft_row = self.draft
        if self.inject_faults and self._fault_rng.random() < self.inject_faults:
            draft_row = self._injected_fault
        try:
            draft = draft_row(row, context, max_len)
        except TimeoutError:
            self.failures.record("over_budget", f"waited past its {self.budget_ms} ms budget")
            return [], None
        except Exception:
            self.failures.record("exception", "raised", exc_info=True)
            return [], None
        elapsed = time.perf_counter_ns() - start
        if self.budget_ns and elapsed > self.budget_ns:
            # The time is spent, but a draft this late would make the step later still
            # (its verification costs more too); a slow lookup must not become the norm.
            self.failures.record("over_budget", f"took {elapsed / 1e6:.2f} ms, over its "
                                                f"{self.budget_ms} ms budget")
            return [], None
        tree = None
        if isinstance(draft, TreeDraft):
            if tree_row and self.branches_pay(draft):
                tree, draft = draft, draft.tokens
            else:
                draft = draft.chain()
        if len(draft) > max_len:
            self.failures.record("too_long", f"returned {len(draft)} tokens, more than the "
                                             f"allowed {max_len}")
            return [], None
        if len(draft) and (draft.min() < 0 or draft.max() >= self.vocab_size):
            self.failures.record("out_of_vocabulary", "returned token ids outside "
                                                      f"[0, {self.vocab_size}): {draft.tolist()}")
            return [], None
        if tree is not None and (len(tree.parents) != len(draft)
                                 or not valid_tree(tree.parents)):
            self.failures.record("bad_tree", f"returned a tree whose parents "
                                             f"{tree.parents.tolist()} are not in topological "
                                             "order")
            return [], None
        if too_short(len(draft), max_len, self.min_draft_len):
            return [], None
        return draft.tolist(), None if tree is None or is_chain(tree.parents) else tree

    def _injected_fault(self, row: int, context: np.ndarray, max_len: int) -> np.ndarray:
        kind = next(self._fault_kinds)
        if kind == "raise":
            raise RuntimeError("injected fault (inject_faults)")
        if kind == "too_long":
            return np.ones(max_len + 1, dtype=np.int32)
        if kind == "out_of_vocabulary":
            return np.asarray([self.vocab_size], dtype=np.int32)
        time.sleep(2 * self.budget_ms / 1e3)
        return self.draft(row, context, max_len)
