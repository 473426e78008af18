"""Precompute-then-narrow (``drafting.overlap``): a step drafted from drafts made before its
sampled tokens were known must be exactly the step drafted after them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import VOCAB, batch, vllm_config
from vllm_retrieval_spec.contract import Capabilities, MethodDrafter
from vllm_retrieval_spec.datastore import build_datastore_from_token_ids
from vllm_retrieval_spec.datastore.suffix_array import build_suffix_array, suffix_followers
from vllm_retrieval_spec.drafting.overlap import (
    NextDrafts,
    greedy_sampled,
    precompute_plan,
    rank_followers,
    row_argmax,
    sampled_before_sampling,
)
from vllm_retrieval_spec.proposers.base import RetrievalProposer
from vllm_retrieval_spec.sources.context import context_followers

WIDTH = 96
# Repeats with variations, so that tokens have several followers and drafts several lengths.
CONTEXT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8, 1, 2, 9, 4, 5, 6, 10, 2, 3, 4, 5, 11, 1, 2, 3]
DOCUMENTS = [[1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 12, 13], [2, 3, 9, 9, 4], [5, 6, 10, 2, 3, 4, 5]]


def test_context_followers_lists_what_followed_each_earlier_occurrence():
    context = np.array([4, 1, 2, 4, 3, 4, 4], dtype=np.int32)
    # Most recent first; the 4 before the last one is followed by it.
    assert context_followers(context).tolist() == [4, 3, 1]
    assert context_followers(np.array([7], dtype=np.int32)).tolist() == []


def test_rank_followers_orders_by_votes_then_by_source():
    ranked = rank_followers(np.array([5, 3, 3, 7], dtype=np.int32),
                            np.array([9, 9, 9, 5, 1], dtype=np.int32))
    # The context's own (3 twice, then 5 and 7 by id) before the other source's new ones.
    assert ranked.tolist() == [3, 5, 7, 9, 1]
    # Token 0 is a token; -1 (a document's end) follows nothing.
    assert rank_followers(np.array([-1, 0, 3, 0, -1], dtype=np.int32)).tolist() == [0, 3]


def test_precompute_plan_takes_every_acceptance_in_turn_within_budget():
    followers = [np.array([1, 2]), np.array([3]), np.array([4, 5, 6])]
    assert precompute_plan(followers, 5) == [(2, 4), (1, 3), (0, 1), (2, 5), (0, 2)]
    assert len(precompute_plan(followers, 100)) == 6
    assert precompute_plan([np.empty(0)], 10) == []
    # The budget can end a round.
    assert precompute_plan(followers, 2) == [(2, 4), (1, 3)]


def test_suffix_followers_match_a_scan_of_the_stream():
    tokens = np.array([1, 2, 1, 3, -1, 1, 2, 4, 1, -1, 1], dtype=np.int32)
    sa = build_suffix_array(tokens)
    found, every = suffix_followers(tokens, sa, 1, 100)
    expected = [int(tokens[i + 1]) for i in range(len(tokens) - 1)
                if tokens[i] == 1 and tokens[i + 1] >= 0]
    assert sorted(found.tolist()) == sorted(expected) and every
    sampled, every = suffix_followers(tokens, sa, 1, 2)
    assert len(sampled) <= 2 and not every
    assert suffix_followers(tokens, sa, 42, 100)[0].tolist() == []


def test_next_drafts_refuse_what_they_were_not_made_for():
    ahead = NextDrafts(base_len=3, draft=[7, 8], sources="s", max_lens=[4, 4, 4],
                       drafts={(1, 9): ([1, 2], None)}, complete=[True, False, False])
    assert ahead.take([7, 9], 5, "s", "none") == ([1, 2], None)
    assert ahead.take([7, 9], 6, "s", "none") is None  # not the tokens it was made for
    assert ahead.take([7, 9], 5, "other", "none") is None  # the sources changed
    # The drafted token came back as the bonus: vLLM verified a shortened draft.
    assert ahead.take([7, 8], 5, "s", "none") is None
    # Not what was drafted before the bonus token (a tree's path off its chain).
    assert ahead.take([6, 9], 5, "s", "none") is None
    assert ahead.take([7, 8, 1, 2], 7, "s", "none") is None  # more than the draft
    # a = 0 is complete: any token without a precomputed draft drafts nothing.
    assert ahead.take([5], 4, "s", "none") == "none"
    assert ahead.take([7, 5], 5, "s", "none") is None
    # Nor for a shortened draft where every follower was drafted for.
    ahead.complete = [True, True, True]
    assert ahead.take([7, 8], 5, "s", "none") is None
    assert ahead.take([7, 5], 5, "s", "none") == "none"


@pytest.fixture(scope="module")
def datastore(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("overlap") / "ds"
    build_datastore_from_token_ids(DOCUMENTS, path, tokenizer_name="test",
                                   tokenizer_fingerprint="f" * 64, vocab_size=VOCAB,
                                   progress=False)
    return str(path)


def _proposer(kind: str, datastore: str, precompute: bool, **overrides):
    # No time budget: a draft dropped for being slow on a busy machine is no mismatch.
    options = {"num_speculative_tokens": 6, "precompute_drafts": precompute,
               "min_prefix_prob": 0.0, "min_draft_len": 1, "draft_budget_ms": 0, **overrides}
    if kind == "pld":
        return RetrievalProposer(vllm_config({"method": "pld", **options}, WIDTH))
    if kind == "rest":
        return RetrievalProposer(vllm_config({"method": "rest", "datastore": datastore, **options},
                                        WIDTH))
    extra = {"tree": "on", "tree_min_prob": 0.05} if kind == "hybrid/tree" else {}
    proposer = RetrievalProposer(vllm_config({"method": "hybrid", "datastore": datastore,
                                           **extra, **options}, WIDTH))
    for i, document in enumerate(DOCUMENTS):
        proposer.method.learning.shared.add(f"served-{i}", np.asarray(document[::-1], dtype=np.int32))
    assert proposer.method.learning.shared.wait_indexed()
    return proposer


def _two_steps(proposer, first: list[int], second: list[int], sampled: list[int]):
    """Draft after ``first`` (the step that precomputes), then after ``second``."""
    proposer.observe_batch(["r"], [True])
    tokens, lengths = batch(first, width=WIDTH)
    drafted = proposer.propose([[first[-1]]], lengths, tokens)[0]
    proposer.after_handover()
    proposer.observe_batch(["r"], [True])
    tokens, lengths = batch(second, width=WIDTH)
    return drafted, proposer.propose([sampled], lengths, tokens)[0]


@pytest.mark.parametrize("kind", ["pld", "rest", "hybrid", "hybrid/tree"])
def test_precomputed_drafts_equal_drafting_after_sampling(kind, datastore):
    """For every accepted length and every bonus token, the second step's draft with
    precomputed drafts equals a proposer's that drafts after sampling only (brute force). A
    tree is accepted along a prefix of its nodes here, its chain and past it."""
    # A tree needs room for branches beside a chain the evidence rule ends.
    options = {"num_speculative_tokens": 16, "min_prefix_prob": 0.3} \
        if kind == "hybrid/tree" else {}
    reference = _proposer(kind, datastore, precompute=False, **options)
    reference.observe_batch(["r"], [True])
    draft = list(reference.propose([[CONTEXT[-1]]], *reversed(batch(CONTEXT, width=WIDTH)))[0])
    assert draft, "the context must draft something for this test to mean anything"
    assert ("r" in reference.trees) == (kind == "hybrid/tree")
    used = missed = 0
    for a in range(len(draft) + 1):
        for b in range(VOCAB):
            if a < len(draft) and b == draft[a]:
                continue  # vLLM never returns a rejected draft token as the bonus token
            second = CONTEXT + draft[:a] + [b]
            reference = _proposer(kind, datastore, precompute=False, **options)
            proposer = _proposer(kind, datastore, precompute=True, **options)
            expected = _two_steps(reference, CONTEXT, second, draft[:a] + [b])
            got = _two_steps(proposer, CONTEXT, second, draft[:a] + [b])
            for done in (reference, proposer):
                getattr(done, "close", lambda: None)()
            assert got == expected, (a, b)
            assert proposer.trees.keys() == reference.trees.keys()
            for req_id, tree in proposer.trees.items():
                assert tree.parents.tolist() == reference.trees[req_id].parents.tolist()
            used += proposer.ahead.precomputed["used"]
            missed += proposer.ahead.precomputed["missed"]
    assert used + missed == (len(draft) + 1) * VOCAB - len(draft)
    if kind == "pld":
        # The context is the only source, and every follower fits the budget: nothing missed.
        assert missed == 0
    elif kind.startswith("hybrid"):
        # One-token matches (and a tree's one-token branches) can follow any token seen before:
        # only the precomputed ones are served.
        assert 0 < used < VOCAB
    else:
        assert used > missed


def test_a_trees_drafts_made_ahead_follow_its_chain(datastore):
    """A tree is accepted along one root path; the drafts made ahead assume its chain (the
    first ``chain_len`` nodes), the path ``take`` can serve. Its nodes past the chain are no
    path: drafts made for them as if they were (before: the budget went to those first, the
    deepest acceptance) are never used."""
    # Room for branches beside a chain the evidence rule ends.
    proposer = _proposer("hybrid/tree", datastore, precompute=True, num_speculative_tokens=16,
                         min_prefix_prob=0.3)
    proposer.ahead.max_drafts = 1000
    proposer.observe_batch(["r"], [True])
    tokens, lengths = batch(CONTEXT, width=WIDTH)
    proposer.propose([[CONTEXT[-1]]], lengths, tokens)
    tree = proposer.trees["r"]
    assert 0 < tree.chain_len < len(tree.tokens), "the test needs a tree that branches"
    made = []
    made_ahead = proposer.ahead.checked
    proposer.ahead.checked = lambda row, context, *rest: made.append(context.tolist()) \
        or made_ahead(row, context, *rest)
    proposer.after_handover()
    chain = tree.chain().tolist()
    accepted = {len(context) - len(CONTEXT) - 1 for context in made}
    # Every acceptance along the chain that has a follower besides its draft token.
    assert tree.chain_len in accepted and accepted <= set(range(tree.chain_len + 1))
    assert all(context[len(CONTEXT):-1] == chain[:len(context) - len(CONTEXT) - 1]
               for context in made)
    proposer.close()


TRUTH = CONTEXT + [4, 5, 6, 1, 2, 3, 7, 8, 1, 2, 9, 4, 5, 6, 10, 2, 3, 4, 5, 11, 1, 2, 3,
                   4, 5, 12, 13, 1, 2, 3, 4, 5, 6, 7, 1, 2, 9, 9, 4, 5, 6]


def _drafts_step_by_step(proposer, forward_done=lambda: False):
    """Drafts for TRUTH step after step (acceptance caps carried from one to the next), as
    vLLM drives it, and the acceptance rates at the end."""
    drafts = []
    position = len(CONTEXT)
    sampled = [TRUTH[position - 1]]
    while position < len(TRUTH):
        proposer.observe_batch(["r"], [False])
        tokens, lengths = batch(TRUTH[:position], width=WIDTH)
        draft = proposer.propose([sampled], lengths, tokens)[0]
        proposer.after_handover(forward_done)
        drafts.append(draft)
        accepted = 0
        while accepted < len(draft) and position + accepted < len(TRUTH) \
                and draft[accepted] == TRUTH[position + accepted]:
            accepted += 1
        sampled = TRUTH[position:position + accepted + 1]
        position += accepted + 1
    rates = dict(proposer.lengths.acceptance.rates) if proposer.lengths.acceptance else None
    getattr(proposer, "close", lambda: None)()
    return drafts, rates


@pytest.mark.parametrize("kind", ["pld", "rest", "hybrid"])
def test_a_request_drafts_alike_with_and_without_precomputed_drafts(kind, datastore):
    expected = _drafts_step_by_step(_proposer(kind, datastore, precompute=False))
    proposer = _proposer(kind, datastore, precompute=True)
    assert _drafts_step_by_step(proposer) == expected
    assert proposer.ahead.precomputed["used"] > len(expected[0]) // 2


@pytest.mark.parametrize("kind", ["pld", "rest", "hybrid"])
@pytest.mark.parametrize("drafts_before_done", [0, 1, 3])
def test_drafts_made_ahead_stop_when_the_forward_is_done(kind, drafts_before_done, datastore):
    """On a GPU the drafts made ahead stop once the forward running beside them is done
    (before: all of them, each then delaying the step): those not made are drafted by
    ``propose``, alike."""
    expected = _drafts_step_by_step(_proposer(kind, datastore, precompute=False))
    proposer = _proposer(kind, datastore, precompute=True)
    made_in_step = []
    made_ahead = proposer.ahead.checked
    proposer.ahead.checked = lambda *args: made_in_step.append(args) or made_ahead(*args)
    after_handover = proposer.after_handover

    def after_handover_of_step(forward_done):
        made_in_step.clear()
        after_handover(forward_done)
        assert len(made_in_step) <= drafts_before_done

    proposer.after_handover = after_handover_of_step
    drafts = _drafts_step_by_step(proposer, lambda: len(made_in_step) >= drafts_before_done)
    assert drafts == expected
    used = proposer.ahead.precomputed["used"]
    assert used > 0 if drafts_before_done else used == 0


def test_greedy_sampled_is_the_accepted_draft_and_the_bonus_token():
    def logits(*argmax: int) -> np.ndarray:
        rows = np.zeros((len(argmax), 10), dtype=np.float32)
        rows[np.arange(len(argmax)), argmax] = 1.0
        return rows

    def sampled(draft, rows):
        return greedy_sampled(draft, row_argmax(torch.from_numpy(rows)))

    assert sampled([5, 6, 7], logits(5, 6, 9, 1)) == [5, 6, 9]
    assert sampled([5, 6, 7], logits(5, 6, 7, 1)) == [5, 6, 7, 1]  # all accepted
    assert sampled([5, 6, 7], logits(4, 6, 7, 1)) == [4]
    assert sampled([], logits(8)) == [8]  # no draft: the plain step's token
    # Ties go to the first maximum, as torch's argmax (vLLM's greedy sampler) does.
    assert sampled([3], np.ones((2, 10), dtype=np.float32)) == [0]
    assert sampled([3], np.ones((2, 10), dtype=np.float16)) == [0]

    def first_row_only(row):
        assert row == 0, "rows after the first rejection must not be read"
        return 4

    assert greedy_sampled([5, 6], first_row_only) == [4]


def test_a_gpus_logits_stay_there_but_for_their_argmax():
    """Before: every row of the step's logits was copied to the host (a Llama 3 row is 0.5 MB)."""
    argmax = torch.tensor([7, 2, 9])

    class DeviceLogits:
        device = torch.device("meta")  # not the host: an accelerator's, as far as this goes

        def argmax(self, dim):
            assert dim == -1
            return argmax

    argmax_at = row_argmax(DeviceLogits())  # DeviceLogits has no cpu() or numpy(): not copied
    assert [argmax_at(r) for r in range(3)] == [7, 2, 9]


def _decode_drafting_before_sampling(proposer, truth: list[int], start: int, wrong_every: int,
                                     req_id: str = "r"):
    """Decode ``truth`` greedily as vLLM would, handing the proposer each step's sampled tokens
    before sampling (``draft_before_sampling``, as the plugin does from the logits) when
    ``wrong_every`` is nonzero, with a wrong bonus token every ``wrong_every``-th step; returns
    every draft."""
    drafts = []
    position = start
    draft: list[int] = []
    sampled = [truth[position - 1]]
    step = 0
    while position < len(truth) - 8:
        proposer.observe_batch([req_id])
        if wrong_every:
            step += 1
            told = sampled if step % wrong_every else sampled[:-1] + [sampled[-1] + 1]
            before, _ = batch(truth[:position - len(sampled)], width=WIDTH)
            proposer.draft_before_sampling([told], [draft], np.array([position - len(sampled)]),
                                           before)
        tokens, lengths = batch(truth[:position], width=WIDTH)
        draft = proposer.propose([sampled], lengths, tokens)[0]
        proposer.after_handover()  # as the plugin does once the drafts are handed over
        drafts.append(draft)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == truth[position + accepted]:
            accepted += 1
        sampled = truth[position:position + accepted + 1]
        position += accepted + 1
    return drafts


@pytest.mark.parametrize("kind", ["pld", "rest", "hybrid"])
def test_drafts_made_before_sampling_equal_drafting_after_it(kind, datastore):
    """Step after step, drafts made from the tokens a greedy request will sample (before vLLM
    samples) are exactly the drafts made after sampling, acceptance caps included; a step
    whose sampled tokens differ from those drafted for is drafted after sampling."""
    truth = (CONTEXT * 3)[:WIDTH - 4]
    truth[40:44] = [12, 13, 9, 9]
    runs = {}
    for wrong_every in (0, 1000, 3):
        proposer = _proposer(kind, datastore, precompute=False)
        assert proposer.capabilities.drafts_before_sampling
        drafts = _decode_drafting_before_sampling(proposer, truth, 4, wrong_every)
        proposer.stats()  # applies the last step's deferred acceptance update
        rates = proposer.lengths.acceptance and dict(proposer.lengths.acceptance.rates)
        runs[wrong_every] = (drafts, rates, dict(proposer.ahead.precomputed))
        getattr(proposer, "close", lambda: None)()
    drafts, rates, counts = runs[0]
    assert sum(map(len, drafts)) > 10, "the text must draft for this test to mean anything"
    assert counts == {}
    for wrong_every in (1000, 3):
        assert runs[wrong_every][:2] == (drafts, rates), wrong_every
    steps = len(drafts)  # the first one too: the prefill's logits give its sampled token
    assert runs[1000][2] == {"used": steps}
    assert runs[3][2]["missed"] == steps // 3 and runs[3][2]["used"] == steps - steps // 3


def test_served_store_learns_alike_when_drafting_before_sampling(datastore):
    """A request drafted before sampling is recorded for the served store after the handover,
    from its tokens copied before sampling: the store holds what drafting after sampling
    stores, and the next request drafts alike from it."""
    truth = (CONTEXT * 3)[:WIDTH - 4]
    truth[40:44] = [12, 13, 9, 9]
    runs = {}
    for wrong_every in (0, 1000):
        proposer = RetrievalProposer(vllm_config(
            {"method": "hybrid", "num_speculative_tokens": 6, "min_prefix_prob": 0.0,
             "min_draft_len": 1, "draft_budget_ms": 0}, WIDTH))
        first = _decode_drafting_before_sampling(proposer, truth, 4, wrong_every, "r1")
        proposer.observe_finished({"r1"})
        assert proposer.method.learning.shared.wait_indexed()
        stored = [d.tolist() for d in proposer.method.learning.shared.documents()]
        second = _decode_drafting_before_sampling(proposer, truth, 4, wrong_every, "r2")
        proposer.stats()
        runs[wrong_every] = (first, stored, second, dict(proposer.ahead.precomputed))
        proposer.close()
    assert runs[1000][:3] == runs[0][:3]
    # r1's prompt and every token it had when it last drafted, as the store keeps them.
    position = 4
    for draft in runs[0][0][:-1]:
        accepted = 0
        while accepted < len(draft) and draft[accepted] == truth[position + accepted]:
            accepted += 1
        position += accepted + 1
    assert runs[0][1] == [truth[:position]]
    assert runs[1000][3] == {"used": len(runs[0][0]) + len(runs[0][2])}


def test_a_draft_made_before_sampling_is_tied_to_the_state_it_was_drafted_from():
    """A served store's index may be replaced while a draft is made (its rebuild runs in a
    thread): the draft made before sampling is not handed out under the new index."""
    from vllm_retrieval_spec.contract import Capabilities, MethodDrafter

    class Rebuilt(MethodDrafter):
        """Drafts its index's number; the index is replaced during every draft."""

        capabilities = Capabilities(precomputable=True)

        def __init__(self):
            self.index = (1,)

        def draft(self, row, context, max_len):
            drafted_from = self.index
            self.index = (drafted_from[0] + 1,)
            return np.full(3, drafted_from[0], dtype=np.int32)

        def followers(self, row, context):
            return np.empty(0, dtype=np.int32), False

        def snapshot(self, row):
            return self.index

    proposer = RetrievalProposer(vllm_config({"method": "pld", "num_speculative_tokens": 3,
                                              "draft_before_sampling": True}), Rebuilt())
    assert proposer.capabilities.drafts_before_sampling
    proposer.observe_batch(["r"])
    before, _ = batch([1, 2], width=WIDTH)
    proposer.draft_before_sampling([[3]], [[]], np.array([2]), before)
    tokens, lengths = batch([1, 2, 3], width=WIDTH)
    # Made from index 1, which index 2 replaced: drafted again, from index 2.
    assert proposer.propose([[3]], lengths, tokens) == [[2, 2, 2]]
    assert dict(proposer.ahead.precomputed) == {"missed": 1}


class Sevens(MethodDrafter):
    """Drafts ``max_len`` sevens: a draft's length shows the cap it was made with."""

    capabilities = Capabilities(precomputable=True)

    def draft(self, row, context, max_len):
        return np.full(max_len, 7, dtype=np.int32)

    def followers(self, row, context):
        return np.empty(0, dtype=np.int32), False


def test_a_draft_made_before_sampling_lasts_only_its_step():
    """vLLM calls no ``propose`` while a request of the batch is within k tokens of
    max_model_len, but samples (and so drafts before sampling): that step's draft must not be
    handed out at a later step to the request then in its row (before: it was, with the other
    request's acceptance cap, and its bookkeeping went to the other request)."""
    proposer = RetrievalProposer(vllm_config({"method": "pld", "num_speculative_tokens": 3,
                                              "min_draft_len": 1}, WIDTH), Sevens())
    assert proposer.capabilities.drafts_before_sampling
    before, _ = batch([1, 2], width=WIDTH)
    proposer.observe_batch(["a"])
    proposer.draft_before_sampling([[3]], [[]], np.array([2]), before)
    # No propose this step; "a" finishes and "c", with the same tokens and a poor acceptance
    # record (cap 1), takes its row.
    proposer.lengths.acceptance.rates["c"] = 0.05
    proposer.observe_batch(["c"])
    proposer.draft_before_sampling([[3]], [[]], np.array([2]), before)
    tokens, lengths = batch([1, 2, 3], width=WIDTH)
    assert proposer.propose([[3]], lengths, tokens) == [[7]]
    proposer.after_handover()
    assert proposer.lengths.last_drafted == {"c": 1}
    assert dict(proposer.ahead.precomputed) == {"used": 1}


@pytest.mark.parametrize("ahead", ["after sampling", "precomputed", "before sampling"])
def test_drafts_leave_room_for_the_bonus_token_within_max_tokens(ahead):
    """Request "a" may reach 6 tokens (its max_tokens), "b" max_model_len: at 3 tokens, "a" is
    drafted 2 (verified, they give at most 3 tokens), "b" k; one accepted and a bonus token
    later, "a" (at 5) none, however its draft is made."""

    class SevensAfterNines(Sevens):
        def followers(self, row, context):
            return np.array([9], dtype=np.int32), True

    options = {"after sampling": {"precompute_drafts": False, "draft_before_sampling": False},
               "precomputed": {"precompute_drafts": True, "draft_before_sampling": False},
               "before sampling": {"precompute_drafts": False, "draft_before_sampling": True}}
    proposer = RetrievalProposer(vllm_config({"method": "pld", "num_speculative_tokens": 3,
                                              "min_draft_len": 1, "adaptive_draft_len": False,
                                              **options[ahead]}, WIDTH), SevensAfterNines())
    contexts = [[1, 2], [1, 2]]
    sampled = [[3], [3]]
    verified = [[], []]
    expected = [[[7, 7], [7, 7, 7]], [[], [7, 7, 7]]]
    for drafts in expected:
        proposer.observe_batch(["a", "b"], None, None, [6, None])
        if ahead == "before sampling":
            tokens, lengths = batch(*contexts, width=WIDTH)
            proposer.draft_before_sampling(sampled, verified, lengths, tokens)
        contexts = [c + s for c, s in zip(contexts, sampled)]
        tokens, lengths = batch(*contexts, width=WIDTH)
        assert proposer.propose(sampled, lengths, tokens) == drafts
        proposer.after_handover()
        verified = drafts
        sampled = [[7, 9], [7, 9]]  # one draft token accepted, then a bonus token
    # Every draft but the first step's precomputed ones was made ahead.
    made_ahead = {"after sampling": 0, "precomputed": 2, "before sampling": 4}[ahead]
    assert proposer.ahead.precomputed["used"] == made_ahead


@pytest.mark.parametrize("precompute", [False, True])
def test_a_failed_step_leaves_no_draft_behind(precompute):
    """A step whose bookkeeping raised handed vLLM no drafts: the next step must not count the
    drafts it had made as rejected, nor draft ahead from them (before: both, so the request's
    cap shrank from 8 to 6)."""

    class FailingOnce(Sevens):
        failed = False

        def followers(self, row, context):
            return np.array([9], dtype=np.int32), True

        def observe_sampled(self, step):
            if not self.failed:
                self.failed = True
                raise RuntimeError("bookkeeping")

    proposer = RetrievalProposer(vllm_config({"method": "pld", "num_speculative_tokens": 8,
                                              "min_draft_len": 1, "draft_before_sampling": False,
                                              "precompute_drafts": precompute}, WIDTH),
                                 FailingOnce())
    proposer.observe_batch(["r"])
    tokens, lengths = batch([1, 2, 3], width=WIDTH)
    assert proposer.propose([[3]], lengths, tokens) == [[]]
    proposer.after_handover()
    proposer.observe_batch(["r"])
    tokens, lengths = batch([1, 2, 3, 9], width=WIDTH)
    assert proposer.propose([[9]], lengths, tokens) == [[7] * 8]
    proposer.after_handover()
    assert proposer.stats()["failed_exception"] == 1
    assert "r" not in proposer.lengths.acceptance.rates


def test_sampled_before_sampling_knows_greedy_tokens_and_rows_that_sample_nothing():
    """Per row: a greedy row's tokens, None for a row that samples tokens not known yet, and
    nothing for a row whose sampled token vLLM discards (a partial prefill), greedy or not."""
    logits = np.zeros((5, 10), dtype=np.float32)
    logits[[0, 1, 2, 3, 4], [5, 6, 8, 2, 3]] = 1.0
    # Rows: greedy with draft [5, 7] (logits 0-2), sampled (3), greedy partial prefill (4).
    sampled, verified = sampled_before_sampling(row_argmax(torch.from_numpy(logits)), [2, 0, 0],
                                                [5, 7], [True, False, True],
                                                [False, False, True])
    assert sampled == [[5, 6], None, []] and verified == [[5, 7], [], []]


def _sum_draft(context, max_len: int) -> list[int]:
    """``Summing``'s draft: any other context drafts other tokens."""
    start = int(np.sum(context)) % 50
    return list(range(start, start + max_len))


class Summing(MethodDrafter):
    """Drafts from its context's sum (so a draft shows the context and cap it was made with);
    6, 7 and 9 are the followers of every token. Logs each context it drafts for."""

    capabilities = Capabilities(precomputable=True)

    def __init__(self):
        self.drafted: list[list[int]] = []

    def draft(self, row, context, max_len):
        self.drafted.append(context.tolist())
        return np.asarray(_sum_draft(context, max_len), dtype=np.int32)

    def followers(self, row, context):
        return np.array([6, 7, 9], dtype=np.int32), True


def _summing_proposer(method=None, **options):
    return RetrievalProposer(vllm_config(
        {"method": "pld", "num_speculative_tokens": 2, "min_draft_len": 1,
         "adaptive_draft_len": False, "precompute_drafts": True, "draft_before_sampling": False,
         **options}, max_model_len=8), method or Summing())


def test_drafts_made_ahead_are_those_for_every_outcome_vllm_can_return():
    """After [1, 2, 3] drafted [6, 7]: a draft for each accepted length a and each follower b
    but draft[a] (vLLM's bonus token after a rejected token is never that token), each with the
    room the context it follows leaves (max_model_len 8: one token after 6 tokens), and no
    other; the next step takes its own and drafts nothing."""
    proposer = _summing_proposer()
    proposer.observe_batch(["r"])
    tokens, lengths = batch([1, 2, 3], width=WIDTH)
    assert proposer.propose([[3]], lengths, tokens) == [[6, 7]]
    proposer.after_handover()
    ahead = proposer.ahead.next_drafts["r"]
    outcomes = [(0, 7), (0, 9), (1, 6), (1, 9), (2, 6), (2, 7), (2, 9)]
    assert ahead.drafts == {
        (a, b): (_sum_draft([1, 2, 3, *[6, 7][:a], b], 2 if a < 2 else 1), None)
        for a, b in outcomes}
    assert ahead.complete == [True, True, True]
    proposer.method.drafted.clear()
    proposer.observe_batch(["r"])
    tokens, lengths = batch([1, 2, 3, 6, 7, 9], width=WIDTH)
    assert proposer.propose([[6, 7, 9]], lengths, tokens) == [_sum_draft([1, 2, 3, 6, 7, 9], 1)]
    assert proposer.method.drafted == []
    assert dict(proposer.ahead.precomputed) == {"used": 1}


def test_drafts_made_ahead_follow_their_request_when_vllm_moves_its_rows():
    """vLLM may write over its token rows while the drafts are made ahead and order the next
    step's batch otherwise: each request gets the drafts made from its own tokens."""
    proposer = _summing_proposer()
    proposer.observe_batch(["a", "b"])
    tokens, lengths = batch([1, 2, 3], [10, 11, 12], width=WIDTH)
    assert proposer.propose([[3], [12]], lengths, tokens) == [[6, 7], [33, 34]]
    tokens[:] = 0  # vLLM's buffer, reused
    proposer.after_handover()
    proposer.method.drafted.clear()
    proposer.observe_batch(["b", "a"])
    tokens, lengths = batch([10, 11, 12, 33, 9], [1, 2, 3, 6, 7, 9], width=WIDTH)
    assert proposer.propose([[33, 9], [6, 7, 9]], lengths, tokens) == [
        _sum_draft([10, 11, 12, 33, 9], 2), _sum_draft([1, 2, 3, 6, 7, 9], 1)]
    assert proposer.method.drafted == []
    assert dict(proposer.ahead.precomputed) == {"used": 2}


def test_drafts_made_ahead_are_dropped_with_the_step_they_were_for():
    """A step vLLM called no ``propose`` for (a request of the batch near max_model_len) drops
    the drafts made for it: the step after it finds none to miss, and a request that left the
    batch leaves none behind."""
    proposer = _summing_proposer()
    proposer.observe_batch(["r"])
    tokens, lengths = batch([1, 2, 3], width=WIDTH)
    proposer.propose([[3]], lengths, tokens)
    proposer.after_handover()
    proposer.observe_batch(["r"])  # no propose
    proposer.observe_batch(["r"])
    tokens, lengths = batch([1, 2, 3, 6, 9], width=WIDTH)
    assert proposer.propose([[9]], lengths, tokens) == [_sum_draft([1, 2, 3, 6, 9], 2)]
    assert dict(proposer.ahead.precomputed) == {}
    proposer.after_handover()
    assert list(proposer.ahead.next_drafts) == ["r"]
    proposer.observe_batch(["s"])
    assert proposer.ahead.next_drafts == {}


def test_drafts_made_ahead_from_a_replaced_index_are_not_used():
    """A served store's index replaced while the drafts were made ahead (its rebuild runs in a
    thread): none of them is handed out, the next step drafts from the new index."""

    class Rebuilt(Summing):
        def __init__(self):
            super().__init__()
            self.index = (1,)

        def draft(self, row, context, max_len):
            self.index = (self.index[0] + 1,)
            return np.full(max_len, self.index[0], dtype=np.int32)

        def snapshot(self, row):
            return self.index

    proposer = _summing_proposer(Rebuilt())
    proposer.observe_batch(["r"])
    tokens, lengths = batch([1, 2, 3], width=WIDTH)
    assert proposer.propose([[3]], lengths, tokens) == [[2, 2]]
    proposer.after_handover()  # 9 drafts, from indexes 3 to 11
    proposer.observe_batch(["r"])
    tokens, lengths = batch([1, 2, 3, 2, 9], width=WIDTH)
    assert proposer.propose([[2, 9]], lengths, tokens) == [[12, 12]]
    assert dict(proposer.ahead.precomputed) == {}


def test_a_failure_drafting_ahead_is_counted_and_the_step_drafts_after_sampling():
    class Failing(Summing):
        def followers(self, row, context):
            raise RuntimeError("followers")

    proposer = _summing_proposer(Failing())
    proposer.observe_batch(["r"])
    tokens, lengths = batch([1, 2, 3], width=WIDTH)
    proposer.propose([[3]], lengths, tokens)
    proposer.after_handover()
    proposer.observe_batch(["r"])
    tokens, lengths = batch([1, 2, 3, 6, 7, 9], width=WIDTH)
    assert proposer.propose([[6, 7, 9]], lengths, tokens) == [_sum_draft([1, 2, 3, 6, 7, 9], 1)]
    stats = proposer.stats()
    assert stats["failed_exception"] == 1 and "precomputed_used" not in stats


def test_a_row_with_drafts_made_ahead_is_not_drafted_again_before_sampling():
    """With both ways on, a row whose next drafts were made after the handover gets none made
    before sampling (it would be the same draft, made again); one drafted before sampling has
    its next drafts made after the handover, for a step whose tokens are not known early."""
    proposer = _summing_proposer(draft_before_sampling=True)
    assert proposer.capabilities.drafts_before_sampling
    proposer.observe_batch(["r"])
    before, _ = batch([1, 2], width=WIDTH)
    proposer.draft_before_sampling([[3]], [[]], np.array([2]), before)
    tokens, lengths = batch([1, 2, 3], width=WIDTH)
    assert proposer.propose([[3]], lengths, tokens) == [[6, 7]]
    proposer.after_handover()
    assert proposer.method.drafted[0] == [1, 2, 3]
    proposer.method.drafted.clear()
    proposer.observe_batch(["r"])
    before, _ = batch([1, 2, 3], width=WIDTH)
    proposer.draft_before_sampling([None], [[6, 7]], np.array([3]), before)  # not greedy
    tokens, lengths = batch([1, 2, 3, 6, 9], width=WIDTH)
    assert proposer.propose([[6, 9]], lengths, tokens) == [_sum_draft([1, 2, 3, 6, 9], 2)]
    proposer.after_handover()
    proposer.method.drafted.clear()
    proposer.observe_batch(["r"])
    before, _ = batch([1, 2, 3, 6, 9], width=WIDTH)
    proposer.draft_before_sampling([[9]], [_sum_draft([1, 2, 3, 6, 9], 2)], np.array([5]), before)
    assert proposer.method.drafted == []
    tokens, lengths = batch([1, 2, 3, 6, 9, 9], width=WIDTH)
    assert proposer.propose([[9]], lengths, tokens) == [_sum_draft([1, 2, 3, 6, 9, 9], 1)]
    assert proposer.method.drafted == []
    assert proposer.stats()["precomputed_used"] == 3


def test_a_tree_drafted_before_sampling_goes_out_as_one_and_the_next_step_drafts_after():
    """A greedy tree row's draft made before sampling is its tree (vLLM verifies its nodes);
    the next step's is made after sampling: the verifier picks the accepted path, which need
    not follow the chain the tokens known before sampling assume."""
    from vllm_retrieval_spec.drafting.tree import TreeDraft

    class Branching(Summing):
        def draft(self, row, context, max_len):
            self.drafted.append(context.tolist())
            return TreeDraft(np.array([5, 6, 9], dtype=np.int32), np.array([-1, 0, -1]), 2, 0.6)

    proposer = RetrievalProposer(vllm_config(
        {"method": "pld", "num_speculative_tokens": 3, "tree": "on", "min_draft_len": 1,
         "precompute_drafts": False, "draft_before_sampling": True}, WIDTH), Branching())
    proposer.observe_batch(["r"], [True])
    before, _ = batch([1, 2], width=WIDTH)
    proposer.draft_before_sampling([[3]], [[]], np.array([2]), before)
    assert proposer.method.drafted == [[1, 2, 3]]
    tokens, lengths = batch([1, 2, 3], width=WIDTH)
    assert proposer.propose([[3]], lengths, tokens) == [[5, 6, 9]]
    assert proposer.trees["r"].parents.tolist() == [-1, 0, -1]
    proposer.after_handover()
    proposer.observe_batch(["r"], [True])
    before, _ = batch([1, 2, 3], width=WIDTH)
    proposer.draft_before_sampling([[5, 6, 4]], [[5, 6, 9]], np.array([3]), before)
    assert proposer.method.drafted == [[1, 2, 3]]
    tokens, lengths = batch([1, 2, 3, 9, 4], width=WIDTH)
    assert proposer.propose([[9, 4]], lengths, tokens) == [[5, 6, 9]]
    assert proposer.method.drafted == [[1, 2, 3], [1, 2, 3, 9, 4]]
    assert proposer.stats()["precomputed_used"] == 1


def test_a_draft_made_before_sampling_is_not_handed_to_other_tokens_before_the_same_ones():
    """The row sampled the tokens the draft was made for, after other tokens than those it
    was made from: drafted again, from the row's own."""
    proposer = _summing_proposer(precompute_drafts=False, draft_before_sampling=True)
    proposer.observe_batch(["r"])
    before, _ = batch([1, 2], width=WIDTH)
    proposer.draft_before_sampling([[3]], [[]], np.array([2]), before)
    tokens, lengths = batch([1, 2, 9, 3], width=WIDTH)
    assert proposer.propose([[3]], lengths, tokens) == [_sum_draft([1, 2, 9, 3], 2)]
    assert dict(proposer.ahead.precomputed) == {"missed": 1}


def test_sampled_before_sampling_reads_each_rows_own_logits_and_draft():
    """Three greedy rows with drafts of 2, 1 and 0 tokens: logits rows 0-2, 3-4 and 5."""
    logits = np.zeros((6, 10), dtype=np.float32)
    logits[np.arange(6), [5, 6, 1, 8, 4, 3]] = 1.0
    sampled, verified = sampled_before_sampling(row_argmax(torch.from_numpy(logits)), [2, 1, 0],
                                                [5, 7, 8], [True] * 3, [False] * 3)
    assert sampled == [[5, 6], [8, 4], [3]] and verified == [[5, 7], [8], []]


class PadsToFour:
    """``StepCostModel`` that measured 4-token steps cheapest: every shorter draft is padded."""

    def explore(self, draft_len):
        return None

    def target(self, draft_len):
        return 4

    def observe(self, *step):
        pass

    def tree_extra(self):
        return None

    def summary(self):
        return {}


class CapShown(Summing):
    """Drafts one token: the cap it was asked for (50 follows every token)."""

    def draft(self, row, context, max_len):
        return np.array([max_len], dtype=np.int32)

    def followers(self, row, context):
        return np.array([50], dtype=np.int32), True


def _step(proposer, ahead: str, context: list[int], sampled: list[int], draft: list[int]
          ) -> list[int]:
    """One engine step of request "r" with ``context`` (``sampled`` last) after ``draft`` was
    verified: drafted before sampling where ``ahead`` is "before", then ``propose`` and the
    work after the handover. Returns the step's draft."""
    proposer.observe_batch(["r"])
    if ahead == "before":
        before, _ = batch(context[:-len(sampled)], width=WIDTH)
        proposer.draft_before_sampling([sampled], [draft],
                                       np.array([len(context) - len(sampled)]), before)
    tokens, lengths = batch(context, width=WIDTH)
    draft = proposer.propose([sampled], lengths, tokens)[0]
    proposer.after_handover()
    return draft


@pytest.mark.parametrize("ahead", ["after", "precompute", "before"])
def test_padding_is_no_evidence_of_acceptance_however_a_draft_was_made(ahead):
    """One drafted token padded to 4, of which 3 are accepted twice, counts as 1 of 1 accepted
    each time, drafting after sampling, ahead or before it: the caps (draft_token_cost 0.7)
    go from 3 (a rate of 0.9) to 4 then 7. Counting padding, 3 of 4 would give 2 then 2."""
    proposer = RetrievalProposer(vllm_config(
        {"method": "pld", "num_speculative_tokens": 8, "min_draft_len": 1, "pad_drafts": True,
         "draft_token_cost": 0.7, "precompute_drafts": ahead == "precompute",
         "draft_before_sampling": ahead == "before"}, WIDTH), CapShown())
    proposer.lengths.step_costs = PadsToFour()
    context = [1, 2, 3, 4, 5, 1]
    sampled = [1]
    draft: list[int] = []
    caps = []
    for _ in range(3):
        draft = _step(proposer, ahead, context, sampled, draft)
        assert len(draft) == 4
        caps.append(draft[0])
        sampled = draft[:3] + [50]
        context = context + sampled
    assert caps == [3, 4, 7]
    assert proposer.stats().get("precomputed_used", 0) == {"after": 0, "precompute": 2,
                                                           "before": 3}[ahead]


@pytest.mark.parametrize("ahead", ["after", "precompute", "before"])
def test_lookups_are_counted_alike_however_a_draft_was_made(ahead):
    """Two steps, the second's lookup empty (an odd sum drafts nothing): 2 lookups, 1 empty,
    drafted after sampling, ahead or before it."""
    from prometheus_client import REGISTRY

    class EvenSums(Summing):
        def draft(self, row, context, max_len):
            return super().draft(row, context, max_len if context.sum() % 2 == 0 else 0)

    def value(name):
        return REGISTRY.get_sample_value(f"vllm_rsd:{name}_total", {"method": "pld"}) or 0

    before = {name: value(name) for name in ("lookups", "empty_lookups")}
    proposer = _summing_proposer(EvenSums(), precompute_drafts=ahead == "precompute",
                                 draft_before_sampling=ahead == "before")
    draft: list[int] = []
    for context, sampled in (([1, 2, 3], [3]), ([1, 2, 3, 6, 9], [6, 9])):
        draft = _step(proposer, ahead, context, sampled, draft)
    assert draft == []
    assert proposer.stats().get("precomputed_used", 0) == {"after": 0, "precompute": 1,
                                                           "before": 2}[ahead]
    assert {name: value(name) - before[name] for name in before} == {
        "lookups": 2, "empty_lookups": 1}


def test_a_failed_step_keeps_the_acceptance_of_the_draft_it_verified_when_drafted_before_sampling():
    """The step that verified a draft of 8 (2 accepted) handed out a draft made before
    sampling, then its bookkeeping raised: no draft went out, but the verified draft's
    acceptance stands, as drafting after sampling updates it (0.7 x 0.9 + 0.3 x 2 / 8)."""

    class FailingSecond(Sevens):
        steps = 0

        def observe_sampled(self, step):
            self.steps += 1
            if self.steps == 2:
                raise RuntimeError("bookkeeping")

    rates = {}
    for before_sampling in (False, True):
        proposer = RetrievalProposer(vllm_config(
            {"method": "pld", "num_speculative_tokens": 8, "min_draft_len": 1,
             "precompute_drafts": False, "draft_before_sampling": before_sampling}, WIDTH),
            FailingSecond())
        proposer.observe_batch(["r"])
        tokens, lengths = batch([1, 2, 3], width=WIDTH)
        assert proposer.propose([[3]], lengths, tokens) == [[7] * 8]
        proposer.after_handover()
        proposer.observe_batch(["r"])
        if before_sampling:
            before, _ = batch([1, 2, 3], width=WIDTH)
            proposer.draft_before_sampling([[7, 7, 9]], [[7] * 8], np.array([3]), before)
        tokens, lengths = batch([1, 2, 3, 7, 7, 9], width=WIDTH)
        assert proposer.propose([[7, 7, 9]], lengths, tokens) == [[]]
        proposer.after_handover()
        assert proposer.stats()["failed_exception"] == 1
        rates[before_sampling] = proposer.lengths.acceptance.rates
    assert rates[True] == rates[False] == {"r": pytest.approx(0.7 * 0.9 + 0.3 * 2 / 8)}
