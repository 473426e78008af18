"""Draft padding from learned step times: the cost model, the filler, and propose with a clock
the test drives."""

from __future__ import annotations

import numpy as np
import pytest

import helpers
from helpers import batch, vllm_config
from vllm_retrieval_spec.contract import MethodDrafter
from vllm_retrieval_spec.drafting.step_cost import (
    EXPIRE_EVERY,
    MAX_SAMPLE_AGE,
    MIN_SAMPLES,
    REFRESH_STEPS,
    WARMUP_STEPS,
    StepCostModel,
    cheapest_at_least,
    padded_draft,
)

MS = 1_000_000
#: Shaped like benchmarks/results/verify-cost-slow-epyc.md: 3-4 draft tokens beat none.
DIPPED = {0: 50.6, 3: 45.0, 4: 43.8, 5: 46.0, 6: 49.0, 7: 52.0, 8: 55.4}
#: Shaped like verify-cost-avx512.md: every draft token costs more.
LINEAR = {n: 23.7 + 1.1 * n for n in DIPPED}


def test_a_draft_is_padded_to_the_cheapest_length_not_shorter_than_it():
    assert [cheapest_at_least(d, DIPPED) for d in (0, 3, 4, 5, 8)] == [4, 4, 4, 5, 8]
    assert [cheapest_at_least(d, LINEAR) for d in (0, 3, 4, 8)] == [0, 3, 4, 8]
    # Within the margin a median's noise could explain: not padded.
    assert cheapest_at_least(0, {0: 50.0, 4: 49.8}) == 0
    # No cost of its own (not measured yet): not padded.
    assert cheapest_at_least(2, DIPPED) == 2


def test_the_model_explores_unmeasured_lengths_after_warm_up_then_pads():
    model = StepCostModel(min_len=3, k=24)
    assert model.lengths == [0, 3, 4, 5, 6, 7, 8]
    for _ in range(WARMUP_STEPS - 1):
        model.observe(0, int(DIPPED[0] * MS))
        assert model.explore(0) is None
    model.observe(0, int(DIPPED[0] * MS))
    explored = []
    while (n := model.explore(0)) is not None:
        explored.append(n)
        model.observe(n, int(DIPPED[n] * MS))
    assert explored == [n for n in model.lengths[1:] for _ in range(MIN_SAMPLES)]
    assert model.target(0) == 4 and model.target(3) == 4 and model.target(6) == 6
    assert model.target(20) == 20
    assert model.summary()["step_ms_draft_4"] == 43.8


def test_a_drafts_own_length_or_a_longer_one_is_explored_never_a_shorter_one():
    model = StepCostModel(min_len=3, k=24)
    for _ in range(WARMUP_STEPS):
        model.observe(0, int(DIPPED[0] * MS))
    # Length 0 is measured; a 5-token draft cannot be cut to 3 or 4 to measure them.
    assert model.explore(5) == 5
    assert model.explore(3) == 3
    assert model.explore(9) is None


def test_old_step_times_expire_and_their_length_is_measured_again():
    model = StepCostModel(min_len=3, k=8)
    for n in [0] * WARMUP_STEPS + [n for n in model.lengths[1:] for _ in range(MIN_SAMPLES)]:
        model.observe(n, int(DIPPED[n] * MS))
    assert model.target(0) == 4
    # The machine slows down; only 4 is verified (every short draft is padded to it), and
    # stays the cheapest while the other lengths keep their old times.
    steps = model.steps
    while model.steps < steps + MAX_SAMPLE_AGE - EXPIRE_EVERY:
        model.observe(4, int(1.5 * DIPPED[4] * MS))
    assert 5 in model.medians and model.explore(0) is None
    # Then every length not measured since expires (none is a padding target any more) ...
    while model.steps % EXPIRE_EVERY or model.steps < steps + MAX_SAMPLE_AGE:
        model.observe(4, int(1.5 * DIPPED[4] * MS))
    assert sorted(model.medians) == [4] and model.target(0) == 0 and model.target(3) == 3
    # ... and is measured again, shortest first from the draft's own length.
    assert model.explore(0) == 0 and model.explore(4) == 5
    for n in (0, 3, 5, 6, 7, 8):
        for _ in range(MIN_SAMPLES):
            assert model.explore(n) == n
            model.observe(n, int(1.5 * DIPPED[n] * MS))
    assert model.explore(0) is None
    assert model.target(0) == 4 and model.summary()["step_ms_draft_0"] == 1.5 * DIPPED[0]


def test_old_step_times_expire_on_tree_steps_too():
    """Steps are counted alike, chain or tree: the check for old samples every
    ``EXPIRE_EVERY`` steps must run on a tree step too (before: it was skipped, and a request
    verifying trees kept the chain times of another speed for good)."""
    model = StepCostModel(min_len=3, k=8)
    for n in model.lengths:
        for _ in range(MIN_SAMPLES):
            model.observe(n, int(DIPPED[n] * MS))
    learned = model.steps
    while model.steps < learned + MAX_SAMPLE_AGE + EXPIRE_EVERY:
        model.observe(12, int(60 * MS), tree=True)
    assert model.medians == {} and model.chain_cost(8) is None

def test_the_model_never_pads_where_draft_tokens_cost_time():
    model = StepCostModel(min_len=1, k=8)
    assert model.lengths == list(range(9))
    for n in [0] * WARMUP_STEPS + [n for n in range(1, 9) for _ in range(MIN_SAMPLES)]:
        model.observe(n, int(23.7 * MS + 1.1 * MS * n))
    assert model.explore(0) is None
    assert [model.target(d) for d in range(9)] == list(range(9))


def test_padding_follows_the_last_tokens_earlier_occurrences():
    context = np.asarray([5, 6, 7, 5, 6], dtype=np.int32)
    empty = np.empty(0, dtype=np.int32)
    # 6 was followed by 7, 7 by 5, and 5 (latest at index 3) by 6.
    assert padded_draft(context, empty, 3).tolist() == [7, 5, 6]
    assert padded_draft(context, np.asarray([7], dtype=np.int32), 3).tolist() == [7, 5, 6]
    # A token never seen before is repeated.
    assert padded_draft(context, np.asarray([9], dtype=np.int32), 3).tolist() == [9, 9, 9]
    assert padded_draft(context, np.asarray([1, 2], dtype=np.int32), 1).tolist() == [1, 2]


class NoDrafts(MethodDrafter):
    """Drafts nothing: every token it sends out is padding."""

    def draft(self, row, context, max_len):
        return np.empty(0, dtype=np.int32)


class StepClock:
    """Advances by the step time of the draft length last handed out."""

    def __init__(self, curve):
        self.curve = curve
        self.now = 0

    def __call__(self):
        return self.now

    def step(self, draft_len):
        self.now += int(self.curve[draft_len] * MS)


def drive(curve, steps, **options):
    proposer = helpers.proposer({"method": "pld", "num_speculative_tokens": 8,
                                 "pad_drafts": True, **options}, 256, NoDrafts())
    proposer.lengths.clock = clock = StepClock(curve)
    context = [1, 2, 3, 1, 2, 3, 1, 2]
    drafts = []
    for _ in range(steps):
        proposer.observe_batch(["r"])
        tokens, lengths = batch(context, width=256)
        draft = proposer.propose([[context[-1]]], lengths, tokens)[0]
        proposer.after_handover()  # as the plugin does once the drafts are handed over
        drafts.append(draft)
        clock.step(len(draft))
    return proposer, drafts


def test_propose_pads_empty_drafts_where_the_engine_verifies_four_tokens_fastest():
    proposer, drafts = drive(DIPPED, 80)
    # Warm-up, measuring each length, then every step at the cheapest length, 4.
    assert drafts[:WARMUP_STEPS] == [[]] * WARMUP_STEPS
    assert all(len(d) == 4 for d in drafts[-20:])
    # The padding continues the context: after 2 came 3, then 1, 2, 3.
    assert drafts[-1] == [3, 1, 2, 3]
    stats = proposer.stats()
    assert stats["step_ms_draft_4"] == 43.8 and stats["padded_drafts"] > 40
    # Padding is not evidence: the acceptance estimate never saw a drafted token.
    assert proposer.lengths.acceptance.rates == {}


def test_propose_stops_padding_where_draft_tokens_cost_time():
    proposer, drafts = drive(LINEAR, 80)
    assert drafts[-20:] == [[]] * 20
    # Each length is explored once more than it needs: a step's time is known when the next
    # propose starts, and learned after that propose has chosen its padding (off the
    # critical path).
    assert proposer.stats()["padded_drafts"] == (len(LINEAR) - 1) * (MIN_SAMPLES + 1)


@pytest.mark.parametrize("pad, rows", [(False, 1), (True, 2)])
def test_no_padding_when_off_or_with_several_requests(pad, rows):
    proposer = helpers.proposer({"method": "pld", "num_speculative_tokens": 8,
                                 "pad_drafts": pad}, 256, NoDrafts())
    proposer.lengths.clock = clock = StepClock(DIPPED)
    contexts = [[1, 2, 3, 1, 2]] * rows
    for _ in range(80):
        proposer.observe_batch([f"r{i}" for i in range(rows)])
        tokens, lengths = batch(*contexts, width=256)
        drafts = proposer.propose([[2]] * rows, lengths, tokens)
        assert drafts == [[]] * rows
        clock.step(0)
    assert "padded_drafts" not in proposer.stats()


def test_no_padding_beside_a_partial_prefill():
    """Padding learned while a request decodes alone stops at a step beside another request's
    partial prefill (which samples nothing): that step is not the lone request's."""
    proposer, drafts = drive(DIPPED, 80)
    assert len(drafts[-1]) == 4
    proposer.observe_batch(["r", "p"])
    tokens, lengths = batch([1, 2, 3, 1, 2, 3, 1, 2], [5, 6], width=256)
    assert proposer.propose([[2], []], lengths, tokens) == [[], []]


def test_padding_leaves_room_for_the_bonus_token():
    """Near max_model_len (256) a draft is padded no further than a draft may be: 253 tokens
    leave room for 2 draft tokens and the bonus token."""
    proposer, drafts = drive(DIPPED, 80)
    assert len(drafts[-1]) == 4
    proposer.observe_batch(["r"])
    context = [1, 2, 3] * 84 + [1]
    tokens, lengths = batch(context, width=256)
    assert proposer.propose([[1]], lengths, tokens) == [[2, 3]]


def test_a_step_is_timed_only_for_the_lone_request_whose_draft_it_verified():
    """A request decoding alone after another one did (which left the batch): the step
    between their proposes verified the other's draft, and its time is no sample of this
    one's, which is timed at the next step."""
    observed = []
    proposer = helpers.proposer({"method": "pld", "num_speculative_tokens": 8,
                                 "pad_drafts": True}, 256, NoDrafts())
    proposer.lengths.clock = clock = StepClock(DIPPED)
    proposer.lengths.step_costs.observe = lambda *step: observed.append(step)
    for req_id in ("a", "b", "b"):
        proposer.observe_batch([req_id])
        tokens, lengths = batch([1, 2, 3], width=256)
        assert proposer.propose([[3]], lengths, tokens) == [[]]
        proposer.after_handover()
        clock.step(0)
    assert observed == [(0, int(DIPPED[0] * MS), False)]


def test_padded_drafts_are_the_same_with_and_without_drafting_ahead(monkeypatch):
    """Step after step with the clock of a dipped curve: the padded drafts are the same when
    drafted after sampling, precomputed (the padded draft vLLM verified is what the next
    step's precomputed drafts are keyed by) or made before sampling (padded then too: propose
    pads nothing)."""
    from vllm_retrieval_spec.drafting import step_cost
    from vllm_retrieval_spec.proposers.base import RetrievalProposer

    padded_after_sampling = []
    in_propose = [False]
    made = step_cost.padded_draft
    monkeypatch.setattr(step_cost, "padded_draft", lambda *args: (
        in_propose[0] and padded_after_sampling.append(1)) or made(*args))
    # Random text with a few exact repeats: many steps have no draft of their own.
    rng = np.random.default_rng(0)
    truth = rng.integers(10, 90, 200).tolist()
    truth[120:150] = truth[20:50]
    runs = {}
    for ahead in ("after", "precompute", "before"):
        padded_after_sampling.clear()
        proposer = RetrievalProposer(vllm_config(
            {"method": "pld", "num_speculative_tokens": 8, "pad_drafts": True,
             "precompute_drafts": ahead == "precompute",
             "draft_before_sampling": ahead == "before", "draft_budget_ms": 0},
            max_model_len=320))
        proposer.lengths.clock = clock = StepClock(DIPPED)
        drafts = []
        position = 6
        draft: list[int] = []
        sampled = [truth[position - 1]]
        while position < len(truth) - 8:
            proposer.observe_batch(["r"])
            if ahead == "before":
                before, _ = batch(truth[:position - len(sampled)], width=320)
                proposer.draft_before_sampling([sampled], [draft],
                                               np.array([position - len(sampled)]), before)
            tokens, lengths = batch(truth[:position], width=320)
            in_propose[0] = True
            draft = proposer.propose([sampled], lengths, tokens)[0]
            in_propose[0] = False
            proposer.after_handover()
            drafts.append(draft)
            clock.step(len(draft))
            accepted = 0
            while accepted < len(draft) and draft[accepted] == truth[position + accepted]:
                accepted += 1
            sampled = truth[position:position + accepted + 1]
            position += accepted + 1
        proposer.stats()  # applies the last step's deferred acceptance update
        runs[ahead] = (drafts, dict(proposer.lengths.acceptance.rates))
        assert proposer.lengths.padded > 20
        if ahead != "after":
            assert proposer.ahead.precomputed["used"] > 0
        if ahead == "before":
            assert proposer.ahead.precomputed == {"used": len(drafts)}
            assert padded_after_sampling == []
        else:
            assert len(padded_after_sampling) == proposer.lengths.padded
    assert runs["after"] == runs["precompute"] == runs["before"]


def test_a_tree_steps_extra_cost_is_learned_beside_the_chain_curve():
    model = StepCostModel(min_len=3, k=24)
    for n in model.lengths:
        for _ in range(MIN_SAMPLES):
            model.observe(n, int(LINEAR[n] * MS))
    assert model.chain_cost(8) == pytest.approx(LINEAR[8] * MS)
    # Past the lengths learned: the slope from 4 to 8 goes on.
    assert model.chain_cost(12) == pytest.approx((LINEAR[8] + 4 * 1.1) * MS)
    assert model.chain_cost(2) is None
    assert model.tree_extra() is None
    for i in range(MIN_SAMPLES):
        assert model.tree_extra() is None
        model.observe(12, int((LINEAR[8] + 4 * 1.1 + 6.0 + (i % 2)) * MS), tree=True)
    # 6.0, 7.0, 6.0, 7.0, 6.0 ms beyond the chain: median 6, over the cheapest step's 23.7.
    assert model.tree_extra() == pytest.approx(6.0 / 23.7)
    assert model.summary()["step_ms_tree_extra"] == 6.0
    # Tree steps do not count as chain steps of their length.
    assert model.chain_cost(8) == pytest.approx(LINEAR[8] * MS)
    # Long without a tree step, the cost is measured again: trees go out until it is.
    for _ in range(REFRESH_STEPS):
        model.observe(4, int(LINEAR[4] * MS))
    assert model.tree_extra() == pytest.approx(6.0 / 23.7)
    model.observe(4, int(LINEAR[4] * MS))
    assert model.tree_extra() is None
    model.observe(12, int((LINEAR[8] + 4 * 1.1 + 2.0) * MS), tree=True)
    assert model.tree_extra() == pytest.approx(6.0 / 23.7)


class OneTree(MethodDrafter):
    """Drafts the same tree every step: the chain 5 6 7 and a branch 9, at 0.6."""

    def draft(self, row, context, max_len):
        from vllm_retrieval_spec.drafting.tree import TreeDraft

        return TreeDraft(np.array([5, 6, 7, 9], dtype=np.int32), np.array([-1, 0, 1, 0]), 3, 0.6)


@pytest.mark.parametrize("extra_ms, trees_at_the_end", [(6.0, False), (0.5, True)])
def test_a_tree_goes_out_only_while_its_branches_pay_for_the_measured_tree_cost(
        extra_ms, trees_at_the_end):
    proposer = helpers.proposer({"method": "pld", "num_speculative_tokens": 8, "tree": "on",
                                 "pad_drafts": True, "min_draft_len": 3,
                                 "adaptive_draft_len": False}, 256, OneTree())
    for n in proposer.lengths.step_costs.lengths:
        for _ in range(MIN_SAMPLES):
            proposer.lengths.step_costs.observe(n, int(LINEAR[n] * MS))
    proposer.lengths.clock = clock = StepClock(LINEAR)
    context = [1, 2, 3, 4]
    trees = []
    for _ in range(12):
        proposer.observe_batch(["r"], [True])
        tokens, lengths = batch(context, width=256)
        draft = proposer.propose([[context[-1]]], lengths, tokens)[0]
        proposer.after_handover()
        trees.append("r" in proposer.trees)
        assert draft == ([5, 6, 7, 9] if trees[-1] else [5, 6, 7])
        clock.step(len(draft))
        clock.now += int(extra_ms * MS) if trees[-1] else 0
    # Trees until their cost is measured (a step's time is learned after the next propose);
    # then the branch's 0.6, less its verification, against 5.5 x the measured share.
    assert trees[:MIN_SAMPLES + 1] == [True] * (MIN_SAMPLES + 1)
    assert trees[-4:] == [trees_at_the_end] * 4
    assert proposer.stats()["step_ms_tree_extra"] == pytest.approx(extra_ms)


class TwoRoots(MethodDrafter):
    """Drafts two alternatives for the next token: a tree of two nodes, no chain beyond one."""

    def draft(self, row, context, max_len):
        from vllm_retrieval_spec.drafting.tree import TreeDraft

        return TreeDraft(np.array([5, 9], dtype=np.int32), np.array([-1, -1]), 1, 0.6)


def test_a_tree_step_is_timed_where_no_chain_length_is_learned():
    # k 2 below min_draft_len 3: the only length learned is 0, so a tree step has no chain
    # cost to be compared with; timing it must not raise inside the engine's step.
    proposer = helpers.proposer({"method": "pld", "num_speculative_tokens": 2, "tree": "on",
                                 "pad_drafts": True, "min_draft_len": 3}, 64, TwoRoots())
    assert proposer.lengths.step_costs.lengths == [0]
    context = [1, 2, 3, 4]
    for _ in range(3):
        proposer.observe_batch(["r"], [True])
        tokens, lengths = batch(context, width=64)
        assert proposer.propose([[context[-1]]], lengths, tokens)[0] == [5, 9]
        assert "r" in proposer.trees
        proposer.after_handover()
    assert proposer.lengths.step_costs.tree_extra() is None
