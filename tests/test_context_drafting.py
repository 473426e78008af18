"""PLD's context matching against brute force, and the hybrid merge of context and datastore."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_retrieval_spec.config import VLLM_CPU_DEFAULTS, parse_speculative_config
from vllm_retrieval_spec.datastore import SuffixArrayDatastore, build_datastore_from_token_ids
from vllm_retrieval_spec.proposers import pld
from vllm_retrieval_spec.proposers.hybrid import hybrid_trie
from vllm_retrieval_spec.sources.base import Vote
from vllm_retrieval_spec.sources.context import find_context_matches


def hybrid_draft(datastore, context, max_len, config, served=None):
    """What hybrid drafts for ``context`` from its context, ``datastore`` and ``served`` store."""
    trie = hybrid_trie(config, datastore, served=None if served is None else lambda row: served)
    return trie.draft(0, context, max_len)


def brute_force_context_matches(context, min_len, max_len, max_occurrences, width):
    context = list(context)
    for n in range(max_len, min_len - 1, -1):
        if n >= len(context):
            continue
        suffix = context[-n:]
        ends = [j for j in range(len(context) - 2, n - 2, -1) if context[j - n + 1:j + 1] == suffix]
        if ends:
            ends = ends[:max_occurrences]
            return n, [context[j + 1:j + 1 + width] for j in ends]
    return 0, []


def test_hand_made_context():
    context = np.array([7, 1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], dtype=np.int32)
    cands, lengths, n = find_context_matches(context, 2, 8, 10, 3)
    # "1 2 3" occurred twice before the end; the most recent comes first; the tail is clipped.
    assert n == 3
    assert [c[:l].tolist() for c, l in zip(cands, lengths)] == [[4, 5, 1], [9, 1, 2]]
    assert find_context_matches(context, 4, 8, 10, 3)[2] == 0  # "9 1 2 3" never recurs


@pytest.mark.parametrize("seed", range(30))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    context = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 120))).astype(np.int32)
    min_len = int(rng.integers(1, 4))
    max_len = int(rng.integers(min_len, 10))
    max_occurrences = int(rng.integers(1, 6))
    cands, lengths, n = find_context_matches(context, min_len, max_len, max_occurrences, 5)
    expected_n, expected = brute_force_context_matches(context, min_len, max_len,
                                                       max_occurrences, 5)
    assert n == expected_n
    assert [c[:l].tolist() for c, l in zip(cands, lengths)] == expected


def test_pld_votes_recurring_continuations():
    config = parse_speculative_config({"method": "pld", "num_speculative_tokens": 4,
                                       "min_prefix_prob": 0.0, "prior_weight": 0.0},
                                           VLLM_CPU_DEFAULTS)
    # "1 2" (the longest recurring suffix) was followed by "3 4" twice and by "8" once; the
    # majority wins, then the tie between "0" and "6" goes to the most recent occurrence.
    context = np.array([5, 1, 2, 3, 4, 6, 1, 2, 8, 7, 1, 2, 3, 4, 0, 1, 2], dtype=np.int32)
    assert pld.make_drafter(config).draft(0, context, 4).tolist() == [3, 4, 0, 1]


def test_votes():
    np.testing.assert_allclose(Vote(2.0, per_token=True).weights(4, 3), [6, 6, 6, 6])
    np.testing.assert_allclose(Vote(1.0, per_token=True, shared=True).weights(4, 3), [0.75] * 4)
    np.testing.assert_allclose(Vote().weights(3, 5), [1, 1, 1])
    assert Vote(shared=True).weights(0, 0).shape == (0,)


@pytest.fixture
def datastore(tmp_path):
    # In the corpus "5 6" is followed by "7 7 7" (three times).
    documents = [[5, 6, 7, 7, 7]] * 3
    path = tmp_path / "ds"
    build_datastore_from_token_ids(documents, path, tokenizer_name="t",
                                   tokenizer_fingerprint="0" * 64, vocab_size=100,
                                   progress=False)
    return str(path), SuffixArrayDatastore.from_path(path)


def hybrid(path, **options):
    return parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 3,
                                     "datastore": path, "min_prefix_prob": 0.0,
                                     "prior_weight": 0.0, **options}, VLLM_CPU_DEFAULTS)


def test_hybrid_merges_context_and_datastore(datastore):
    path, store = datastore
    # The context saw "5 6" followed by "9 9" once; the datastore says "7 7 7" (match 2 each).
    context = np.array([5, 6, 9, 9, 1, 5, 6], dtype=np.int32)
    # With context_weight 1, one context occurrence weighs 2 x 1.0 = 2 and the datastore's three share 2 in all: a tie,
    # which goes to the context's candidate (inserted first). Halving the context's weight flips it.
    assert hybrid_draft(store, context, 3, hybrid(path, context_weight=1.0)).tolist() == [9, 9, 1]
    assert hybrid_draft(store, context, 3, hybrid(path, context_weight=0.5)).tolist() == [7, 7, 7]


def test_long_context_match_skips_the_datastore(datastore):
    path, store = datastore
    context = np.array([4, 5, 6, 9, 9, 4, 5, 6], dtype=np.int32)
    config = hybrid(path, context_weight=0.01, skip_datastore_match_len=3)
    # The context matches "4 5 6" (3 tokens): the datastore is not consulted even though heavier.
    assert hybrid_draft(store, context, 3, config).tolist() == [9, 9, 4]
    config = hybrid(path, context_weight=0.01, skip_datastore_match_len=4)
    assert hybrid_draft(store, context, 3, config).tolist() == [7, 7, 7]


def served_store(*documents):
    from vllm_retrieval_spec.datastore.served import ServedStore

    store = ServedStore(1000, background=False)
    for i, document in enumerate(documents):
        store.add(str(i), document)
    return store


def test_hybrid_drafts_from_the_served_store_without_any_datastore():
    config = parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 3},
                                      VLLM_CPU_DEFAULTS)
    assert config.store.datastore == "" and config.served.served_store == "shared"
    context = np.array([1, 2, 5, 6], dtype=np.int32)
    assert hybrid_draft(None, context, 3, config).tolist() == []
    # An earlier request continued "5 6" with "8 8 8"; the context knows nothing of it.
    assert hybrid_draft(None, context, 3, config, served=served_store([5, 6, 8, 8, 8])
                        ).tolist() == [8, 8, 8]


def test_hybrid_drafts_from_one_token_matches_unless_told_not_to():
    # "3" occurred once before, followed by "7 8 9"; no longer suffix of the context recurs.
    context = np.array([3, 7, 8, 9, 1, 3], dtype=np.int32)
    defaults = parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 3},
                                        VLLM_CPU_DEFAULTS)
    assert (defaults.context.context_min_match_len, defaults.match.min_match_len) == (1, 1)
    assert hybrid_draft(None, context, 3, defaults).tolist() == [7, 8, 9]
    # So does a served request that continued "4" with "5 5 5", for a context that ends in 4.
    served = served_store([4, 5, 5, 5])
    assert hybrid_draft(None, np.array([1, 4], dtype=np.int32), 3, defaults,
                        served=served).tolist() == [5, 5, 5]
    two = parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 3,
                                    "context_min_match_len": 2, "min_match_len": 2},
                                   VLLM_CPU_DEFAULTS)
    assert hybrid_draft(None, context, 3, two).tolist() == []
    assert hybrid_draft(None, np.array([1, 4], dtype=np.int32), 3, two,
                        served=served).tolist() == []


def test_served_votes_against_the_context_by_their_weights(datastore):
    path, _ = datastore
    # The context continued "5 6" with "9 9" once (vote 2 x context_weight); two served requests
    # continued it with "8 8 8" (they share 2 x served_weight).
    context = np.array([5, 6, 9, 9, 1, 5, 6], dtype=np.int32)
    served = served_store([5, 6, 8, 8, 8], [5, 6, 8, 8, 8])
    heavy_context = hybrid(path, context_weight=2.0, served_weight=1.0)
    assert hybrid_draft(None, context, 3, heavy_context, served=served).tolist() == [9, 9, 1]
    heavy_served = hybrid(path, context_weight=1.0, served_weight=2.0)
    assert hybrid_draft(None, context, 3, heavy_served, served=served).tolist() == [8, 8, 8]


def test_drafts_are_no_longer_than_the_evidence_allows():
    served = served_store(list(range(10, 40)))
    # A 2-token match: at most 2 x max_spec_factor tokens (never below min_draft_len).
    context = np.array([1, 10, 11], dtype=np.int32)
    for factor, expected in ((1.0, 3), (2.0, 4), (4.0, 8), (0.0, 12)):
        config = hybrid("", max_spec_factor=factor, num_speculative_tokens=12)
        draft = hybrid_draft(None, context, 12, config, served=served)
        assert draft.tolist() == list(range(12, 12 + expected)), factor
    # A longer match allows a longer draft.
    context = np.arange(10, 16, dtype=np.int32)
    config = hybrid("", max_spec_factor=1.0, num_speculative_tokens=12)
    assert len(hybrid_draft(None, context, 12, config, served=served)) == 6


class CountingReads(np.ndarray):
    """An array that counts the element reads made through it (``py_func`` runs the compiled
    function's Python source, so its reads can be counted)."""

    reads = 0

    def __getitem__(self, index):
        CountingReads.reads += 1
        return super().__getitem__(index)


def test_a_repetitive_context_is_not_scanned_past_what_can_change_the_result():
    # 5,000 spaces: every position matches the full max_len suffix, so once max_occurrences of
    # them are kept nothing earlier can change the result; scanning on cost O(len x max_len)
    # every step (1.45 ms at 131,072 tokens, over the accelerator's 1 ms draft budget).
    context = np.full(5000, 220, dtype=np.int32).view(CountingReads)
    CountingReads.reads = 0
    cands, lengths, n = find_context_matches.py_func(context, 1, 16, 64, 4)
    # The most recent occurrences end near the context's end: their continuations are short.
    assert n == 16 and lengths.tolist() == [1, 2, 3] + [4] * 61
    assert all((c[:length] == 220).all() for c, length in zip(cands, lengths))
    # 64 occurrences x 16 token pairs compared, and 64 continuations copied.
    assert CountingReads.reads <= 64 * 2 * 16 + 64
    compiled = find_context_matches(context.view(np.ndarray), 1, 16, 64, 4)
    assert compiled[2] == n and (compiled[0] == cands).all()
