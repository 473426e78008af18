"""PLD+: the per-request hidden-state cache and the similarity ranking, with synthetic states."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_retrieval_spec.config import PLUGIN_KEY, VLLM_CPU_DEFAULTS, parse_speculative_config
from vllm_retrieval_spec.proposers.hidden_states import HiddenStateCache, unit_rows
from vllm_retrieval_spec.proposers.base import RetrievalProposer
from vllm_retrieval_spec.proposers.pld_plus import pld_plus_draft, rank_occurrences

H = 4


def test_cache_keeps_accepted_states_and_drops_rejected_ones():
    cache = HiddenStateCache(H, max_len=64, capacity=2)
    cache.write(0, np.ones((3, H)))            # prefill of 3 tokens, grows past capacity 2
    cache.write(3, np.full((5, H), 2.0))       # last token + 4 drafts, all kept...
    cache.write(5, np.full((2, H), 3.0))       # ...but the next step restarts at position 5
    assert cache.length == 7
    np.testing.assert_array_equal(cache.view()[:, 0], [1, 1, 1, 2, 2, 3, 3])


def test_cache_with_a_gap_is_incomplete_until_recomputed():
    cache = HiddenStateCache(H, max_len=64)
    cache.write(0, np.ones((2, H)))
    cache.write(5, np.ones((1, H)))            # positions 2..4 were never seen
    assert cache.view() is None
    cache.write(0, np.ones((6, H)))            # recomputed from the start (preemption)
    assert cache.view() is not None and cache.length == 6


def brute_force_rank(context, states, min_similarity, max_candidates):
    n = len(context)
    candidates = [j for j in range(1, n - 1) if context[j] == context[-1]][-max_candidates:]
    scored = [(float(states[j - 1] @ states[n - 2]), -i, j) for i, j in enumerate(candidates)]
    if not scored:
        return -1
    best = max(scored)
    return best[2] if best[0] >= min_similarity else -1


@pytest.mark.parametrize("seed", range(25))
def test_ranking_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    context = rng.integers(0, 4, n).astype(np.int32)
    states = unit_rows(rng.normal(size=(max(n - 1, 0), H)).astype(np.float32))
    for min_similarity, max_candidates in [(-1.0, 100), (0.0, 100), (0.0, 2), (0.5, 5)]:
        assert rank_occurrences(context, states, min_similarity, max_candidates) == \
            brute_force_rank(context, states, min_similarity, max_candidates)


def test_cached_states_take_two_bytes_a_component_and_rank_as_float32_does():
    rng = np.random.default_rng(0)
    hidden, n = 64, 400
    context = rng.integers(0, 8, n).astype(np.int32)
    exact = unit_rows(rng.normal(size=(n - 1, hidden)).astype(np.float32))
    cache = HiddenStateCache(hidden, max_len=1024)
    cache.write(0, exact)
    assert cache.view().nbytes == (n - 1) * hidden * 2
    ranked = 0
    for end in range(3, n + 1):
        j = rank_occurrences(context[:end], exact, -1.0, 256)
        similarities = sorted(exact[k - 1] @ exact[end - 2] for k in range(1, end - 1)
                              if context[k] == context[end - 1])
        if len(similarities) > 1 and similarities[-1] - similarities[-2] > 1e-2:
            assert rank_occurrences(context[:end], cache.view(), -1.0, 256) == j
            ranked += 1
    assert ranked > 300


def config(**options):
    return parse_speculative_config({"method": "pld_plus", "num_speculative_tokens": 3,
                                     **options}, VLLM_CPU_DEFAULTS)


def test_draft_follows_the_most_similar_occurrence():
    # Token 7 occurs at 2 and 5; the state before the last 7 (position 7) resembles position 4's.
    context = np.array([0, 1, 7, 8, 9, 7, 5, 6, 7], dtype=np.int32)
    states = np.zeros((8, H), dtype=np.float32)
    states[:, 0] = 1
    states[4] = states[7] = [0, 1, 0, 0]
    assert pld_plus_draft(context, states, 3, config()).tolist() == [5, 6, 7]
    states[1] = states[7] = [0, 0, 1, 0]
    states[4] = [1, 0, 0, 0]
    assert pld_plus_draft(context, states, 3, config()).tolist() == [8, 9, 7]
    states[7] = [0, 0, 0, 1]  # orthogonal to every earlier state: similarity 0 < 0.1
    assert pld_plus_draft(context, states, 3, config(min_similarity=0.1)).tolist() == []


def make_proposer():
    # No padding: it follows this machine's step times.
    cfg = config(layer=2, min_similarity=0.0, pad_drafts=False)
    vllm_config = SimpleNamespace(
        additional_config={PLUGIN_KEY: cfg.to_dict()},
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
        model_config=SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 100,
                                     get_hidden_size=lambda: H),
    )
    return RetrievalProposer(vllm_config)


def one_hot(rows):
    states = torch.zeros((len(rows), H))
    for i, r in enumerate(rows):
        states[i, r] = 1.0
    return states



def record(proposer, req_ids, states, segments):
    """What the plugin does each step before propose()."""
    proposer.observe_batch(req_ids)
    proposer.record_hidden_states(req_ids, states, segments)

def test_states_follow_requests_across_reordering_and_leaving():
    proposer = make_proposer()
    assert proposer.capabilities.aux_hidden_state_layers == (2,)
    # Step 1: request a prefills 3 tokens, b prefills 2 (rows a, b).
    record(proposer, ["a", "b"], [one_hot([0, 1, 2, 3, 3])],
                                  [(0, 0, 3), (0, 3, 2)])
    # Step 2: rows swapped; b computes 1 token, a computes 1 token + 2 drafts of which 1 is
    # rejected (2 states kept).
    record(proposer, ["b", "a"], [one_hot([1, 0, 0, 3])],
                                  [(2, 0, 1), (3, 1, 2)])
    np.testing.assert_array_equal(proposer.method.caches["a"].view().argmax(1), [0, 1, 2, 0, 0])
    np.testing.assert_array_equal(proposer.method.caches["b"].view().argmax(1), [3, 3, 1])
    # Drafting for row 1 (= request a) uses a's states: context "4 7 4 5 9 4"...
    tokens = np.zeros((2, 64), dtype=np.int32)
    tokens[1, :6] = [4, 7, 4, 5, 9, 4]
    drafts = proposer.propose([[1], [9]], np.array([3, 6], np.int32), tokens)
    assert drafts[1] == [5, 9, 4]
    # Step 3: a has finished, so its states are freed.
    proposer.observe_finished({"a"})
    record(proposer, ["b"], [one_hot([2])], [(3, 0, 1)])
    assert set(proposer.method.caches) == {"b"}


def test_states_survive_a_step_the_request_was_not_scheduled_in():
    # vLLM drops a running request from the batch for a step it does not schedule (the
    # token budget went to others): its states are still needed when it comes back.
    proposer = make_proposer()
    record(proposer, ["a", "b"], [one_hot([0, 1, 2, 3, 3])], [(0, 0, 3), (0, 3, 2)])
    record(proposer, ["b"], [one_hot([1])], [(2, 0, 1)])
    record(proposer, ["a", "b"], [one_hot([0, 0, 2])], [(3, 0, 2), (3, 2, 1)])
    tokens = np.zeros((2, 64), dtype=np.int32)
    tokens[0, :6] = [4, 7, 4, 5, 9, 4]
    drafts = proposer.propose([[9], [1]], np.array([6, 4], np.int32), tokens)
    assert drafts[0] == [5, 9, 4]
    # Finishing frees them.
    proposer.observe_finished({"a"})
    assert set(proposer.method.caches) == {"b"}


def test_no_draft_without_complete_states():
    proposer = make_proposer()
    record(proposer, ["a"], [one_hot([0])], [(4, 0, 1)])  # positions 0..3 unseen
    tokens = np.zeros((1, 64), dtype=np.int32)
    tokens[0, :6] = [4, 7, 4, 5, 9, 4]
    assert proposer.propose([[4]], np.array([6], np.int32), tokens) == [[]]


def test_a_recording_failure_costs_drafts_not_the_engine():
    proposer = make_proposer()
    record(proposer, ["a"], [one_hot([0, 1])], [(0, 0, 2)])
    record(proposer, ["a"], ["not a tensor"], [(2, 0, 1)])
    assert proposer.num_failed_drafts == 1 and proposer.method.caches == {}
    tokens = np.zeros((1, 64), dtype=np.int32)
    tokens[0, :4] = [4, 7, 4, 4]
    assert proposer.propose([[4]], np.array([4], np.int32), tokens) == [[]]
