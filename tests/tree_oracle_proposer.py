"""A test drafter that knows plain decoding's outputs and drafts trees whose first branch is
always wrong: the right continuation is reached only through later siblings, at node indices
that differ from their depth, so every step exercises the tree walk, the depth positions, the
ancestor-only attention and the KV moves (each of them, disabled, breaks equality with plain
decoding). Loaded by vLLM as a ``custom_class`` proposer; ``TREE_ORACLE_SEQUENCES`` names a
JSON list of the expected token sequences (prompt + plain output)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from vllm_retrieval_spec.contract import Capabilities, Drafter
from vllm_retrieval_spec.drafting.tree import TreeDraft

SEQUENCES_ENV = "TREE_ORACLE_SEQUENCES"

#: Nodes as (parent, which): ``("t", d)`` is the true continuation's d-th token, ``("w", d)`` a
#: wrong one in its place. The accepted path is nodes 1, 3, 4, 6.
TREE = [(-1, ("w", 0)), (-1, ("t", 0)), (1, ("w", 1)), (1, ("t", 1)), (3, ("t", 2)),
        (0, ("w", 1)), (4, ("t", 3))]


class TreeOracleProposer(Drafter):
    """Implements ``contract.Drafter`` itself: trees, and none of the other hooks."""

    capabilities = Capabilities(trees=True)

    def __init__(self, vllm_config: Any) -> None:
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        with open(os.environ[SEQUENCES_ENV]) as f:
            self.sequences = [np.asarray(s) for s in json.load(f)]
        self.req_ids: list[str] = []
        self.tree_rows: list[bool] | None = None
        self.trees: dict[str, TreeDraft] = {}

    def load_model(self, model: Any) -> None:
        pass

    def observe_batch(self, req_ids: list[str], tree_rows: list[bool] | None,
                      served_keys: list[str | None] | None,
                      token_limits: list[int | None] | None,
                      known_from: list[int] | None = None) -> None:
        self.req_ids = req_ids
        self.tree_rows = tree_rows

    def observe_finished(self, req_ids: set[str], tokens: Any = None) -> None:
        pass

    def continuation(self, context: np.ndarray) -> np.ndarray:
        for sequence in self.sequences:
            if len(sequence) > len(context) and np.array_equal(sequence[:len(context)], context):
                return sequence[len(context):len(context) + 4]
        return sequence[:0]

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        self.trees = {}
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            truth = self.continuation(token_ids_cpu[i, :num_tokens_no_spec[i]]) \
                if sampled else []
            if len(truth) < 4 or not (self.tree_rows and self.tree_rows[i]):
                drafts.append([int(t) for t in truth])
                continue
            tokens = [int(truth[d]) if kind == "t" else int(truth[d] + 1) % self.vocab_size
                      for _, (kind, d) in TREE]
            drafts.append(tokens)
            self.trees[self.req_ids[i]] = TreeDraft(np.array(tokens),
                                                    np.array([p for p, _ in TREE]), 0, 1.0)
        return drafts

    # The hooks of capabilities this drafter does not declare: never called.
    def draft_before_sampling(self, sampled, verified, num_tokens_no_spec, token_ids_cpu):
        raise AssertionError("not declared")

    def search_ahead(self, states):
        raise AssertionError("not declared")

    def record_hidden_states(self, req_ids, aux_hidden_states, segments):
        raise AssertionError("not declared")

    def record_last_hidden_states(self, states, rows):
        raise AssertionError("not declared")

    has_work_after_handover = False

    def after_handover(self, forward_done=lambda: False):
        raise AssertionError("no work after the handover")

    def report_failure(self, kind, what, exc_info=False):
        raise AssertionError(f"{kind}: {what}")

    def observe_drafting_time(self, critical_s, total_s):
        pass

    def stats(self, reset=False):
        return {}

    def close(self):
        pass
