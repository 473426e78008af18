"""Drafts made before the step they are for (``drafting.overlap``), so that ``propose``, on
vLLM's critical path, only looks one up:

- after the handover (``precompute_next``, with ``precompute_drafts``): every draft the next
  step may need, one per accepted length and following token that can draft anything;
- before sampling (``before_sampling``, with ``draft_before_sampling``): the one draft a greedy
  request needs, from what it will sample (the argmax of the step's logits along its draft).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container
from typing import Any

import numpy as np

from vllm_retrieval_spec.contract import UNKNOWN_TOKEN, MethodDrafter
from vllm_retrieval_spec.drafting.lengths import DraftLengths
from vllm_retrieval_spec.drafting.overlap import (
    NextDrafts, ReadyDraft, precompute_plan, same_snapshot)
from vllm_retrieval_spec.drafting.tree import TreeDraft

#: A checked draft of batch row ``row`` for ``context``: (tokens, tree or None).
CheckedDraft = Callable[[int, np.ndarray, int], tuple[list[int], Any]]


class DraftAhead:
    def __init__(self, method: MethodDrafter, lengths: DraftLengths, checked: CheckedDraft, *,
                 precompute: bool, max_drafts: int) -> None:
        self.method = method
        self.lengths = lengths
        self.checked = checked
        #: Whether this step's drafts are kept for ``precompute_next``.
        self.precompute = precompute
        self.max_drafts = max_drafts
        #: This step's (row, request id, context, draft) for ``precompute_next``.
        self.handed: list[tuple[int, str, np.ndarray, list[int]]] = []
        #: Request id -> its drafts for the next step (``precompute_next``).
        self.next_drafts: dict[str, NextDrafts] = {}
        #: This step's ``next_drafts`` by batch row (``begin_batch``), or the row's draft made
        #: before sampling (``before_sampling``).
        self.row_ahead: list[NextDrafts | ReadyDraft | None] = []
        #: Drafts made before sampling and handed out this step, whose bookkeeping waits for
        #: the proposer's ``settle``.
        self.ready_used: list[ReadyDraft] = []
        #: Drafting steps served from drafts made in advance ("used") or not ("missed").
        self.precomputed: Counter[str] = Counter()

    def begin_batch(self, req_ids: list[str]) -> None:
        """Each row's precomputed drafts, found before sampling (the lookup after it is then
        all that is left); those of requests that left the batch are dropped. Every step: one
        vLLM called no ``propose`` for (a step without attention metadata; near max_model_len
        too, before ``patches.drafter.drafting_near_the_length_limit``) still drafted before
        sampling, and those drafts, for its rows, must not pass for this step's."""
        self.row_ahead = [self.next_drafts.get(r) for r in req_ids] if self.next_drafts else []
        self.next_drafts = {}

    def for_row(self, row: int) -> NextDrafts | ReadyDraft | None:
        return self.row_ahead[row] if row < len(self.row_ahead) else None

    def hand(self, row: int, req_id: str, context: np.ndarray, draft: list[int],
             tree: TreeDraft | None, copy: bool) -> None:
        """Row ``row``'s draft (``tree``'s nodes, where it is one) went to vLLM; with
        ``precompute`` its next drafts are made after the handover, from a copy of ``context``
        where it is a view of vLLM's buffer (``copy``): vLLM may move its rows meanwhile. A
        tree's are made along its chain, the one path of it ``NextDrafts.take`` serves: its
        other nodes follow no single path."""
        if self.precompute:
            self.handed.append((row, req_id, context.copy() if copy else context,
                                draft if tree is None else draft[:tree.chain_len]))

    def before_sampling(self, sampled: list[list[int] | None], num_tokens_no_spec: np.ndarray,
                        token_ids_cpu: np.ndarray, row_req_ids: list[str],
                        last_trees: Container[str], tree_of_row: Callable[[int], bool],
                        pad: bool, known_from: Callable[[int], int] = lambda row: 0) -> None:
        """Row i will sample ``sampled[i]`` (None where not known) and has
        ``num_tokens_no_spec[i]`` tokens before them, their ids known from position
        ``known_from(i)`` (``Drafter.observe_batch``): its next draft, made now, padded as
        ``propose`` would pad it, becomes that row's ``ReadyDraft``. Rows whose last draft was a
        tree (in ``last_trees``: the verifier picks the accepted path, which need not follow the
        chain) and rows with precomputed drafts already are left alone."""
        rows = len(sampled)
        if len(self.row_ahead) < rows:
            self.row_ahead = self.row_ahead + [None] * (rows - len(self.row_ahead))
        for i, tokens in enumerate(sampled):
            if not tokens or i >= len(row_req_ids) or self.row_ahead[i] is not None:
                continue
            req_id = row_req_ids[i]
            if req_id in last_trees:
                continue
            base = int(num_tokens_no_spec[i])
            context = np.concatenate([token_ids_cpu[i, :base],
                                      np.asarray(tokens, dtype=token_ids_cpu.dtype)])
            context[:known_from(i)] = UNKNOWN_TOKEN
            # As propose's update: acceptance of the last draft as drafted.
            last_drafted = self.lengths.last_drafted.get(req_id, 0)
            max_len = self.lengths.max_len(
                req_id, len(context),
                self.lengths.cap_after(req_id, len(tokens) - 1, last_drafted))
            # Before drafting: a served store's index replaced meanwhile must not pass for
            # the one the draft came from.
            snapshot = self.method.snapshot(i)
            draft, tree = self.checked(i, context, max_len, tree_of_row(i)) if max_len > 0 \
                else ([], None)
            self.row_ahead[i] = ReadyDraft(
                req_id, i, list(tokens), context, snapshot,
                self.lengths.padded_draft(req_id, context, draft) if pad and tree is None
                else draft,
                tree, len(draft), last_drafted, max_len)

    def precompute_next(self, tree_of_row: Callable[[int], bool], report: Callable[..., None],
                        forward_done: Callable[[], bool] = lambda: False) -> None:
        """The next step's possible drafts for the requests drafted for this step, until
        ``forward_done``: past it each draft made here would delay the step, where ``propose``
        makes the one a request needs (requests and drafts not reached are drafted then)."""
        handed, self.handed = self.handed, []
        for row, req_id, context, draft in handed:
            if forward_done():
                return
            try:
                ahead = self._precompute(row, req_id, context, draft, tree_of_row(row),
                                         forward_done)
            except Exception:
                report("exception", "raised while precomputing drafts", exc_info=True)
                continue
            if ahead is not None:
                self.next_drafts[req_id] = ahead

    def _precompute(self, row: int, req_id: str, context: np.ndarray, drafted: list[int],
                    tree_row: bool, forward_done: Callable[[], bool]) -> NextDrafts | None:
        snapshot = self.method.snapshot(row)
        draft = np.asarray(drafted, dtype=np.int32)
        contexts = []
        followers = []
        complete = []
        for a in range(len(draft) + 1):
            extended = np.concatenate([context, draft[:a]])
            found = self.method.followers(row, extended)
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
        drafted_len = self.lengths.last_drafted.get(req_id, len(draft))
        ahead = NextDrafts(len(context), drafted, snapshot, [
            self.lengths.max_len(req_id, len(context) + a + 1,
                                 self.lengths.cap_after(req_id, a, drafted_len))
            for a in range(len(contexts))])
        for a, b in precompute_plan(followers, self.max_drafts):
            if forward_done():
                break
            max_len = ahead.max_lens[a]
            ahead.drafts[a, b] = self.checked(row, np.append(contexts[a], b), max_len, tree_row) \
                if max_len > 0 else ([], None)
        made = Counter(a for a, _ in ahead.drafts)
        ahead.complete = [complete[a] and made[a] == len(followers[a])
                          for a in range(len(contexts))]
        # A source that changed meanwhile (a new served-store snapshot) may have drafted some
        # of these differently from the others.
        return ahead if same_snapshot(self.method.snapshot(row), snapshot) else None
