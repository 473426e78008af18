"""The served store's dense half: keys of served tokens' hidden states, searched while it grows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import batch, vllm_config
from vllm_retrieval_spec.config import VLLM_CPU_DEFAULTS, ConfigError, parse_speculative_config
from vllm_retrieval_spec.datastore.dense import Projection
from vllm_retrieval_spec.datastore.served import ServedStore
from vllm_retrieval_spec.datastore.served_requests import ServedRequests
from vllm_retrieval_spec.datastore.served_dense import ServedDenseStore, accepted_state_rows
from vllm_retrieval_spec.datastore.journal import NO_KEY, TokenizerFacts
from vllm_retrieval_spec.datastore.served_saver import Entry, read_snapshot, write_snapshot

DIMS = 8


def identity_projection(hidden: int = DIMS) -> Projection:
    """States already unit rows in DIMS dimensions: keys equal states (easy to check)."""
    return Projection(mean=np.zeros(hidden, np.float32), inv_std=np.ones(hidden, np.float32),
                      components=np.eye(hidden, DIMS, dtype=np.float32), explained_variance=1.0)


def unit(rng, n: int) -> np.ndarray:
    x = rng.standard_normal((n, DIMS)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def candidate_lists(store: ServedDenseStore, query, emitted, top_n=4, n=3):
    cands, lengths, weights = store.candidates(query, emitted, top_n, n)
    return [c[:m].tolist() for c, m in zip(cands, lengths)], weights


def test_nearest_key_drafts_what_followed_its_next_token():
    rng = np.random.default_rng(0)
    store = ServedDenseStore(100, DIMS, projection=identity_projection(), background=False)
    document = np.arange(10, 20, dtype=np.int32)
    states = unit(rng, 6)
    # States at positions 2..7: the state at p predicted token p + 1.
    store.add(document, states, np.arange(2, 8))
    assert store.num_keys == 6
    # The query equal to the key at position 4 (which predicted 15): emitting 15 drafts 16..18.
    found, weights = candidate_lists(store, states[2], emitted=15, top_n=1)
    assert found == [[16, 17, 18]] and weights[0] == pytest.approx(1.0, abs=1e-5)
    # Another emitted token fails DReSD's filter.
    assert candidate_lists(store, states[2], emitted=99, top_n=1)[0] == []
    # Exhaustive: with top_n covering every key, exactly the keys whose next token is the
    # emitted one draft, whatever their rank; continuations stop at the document's end.
    found, _ = candidate_lists(store, states[0], emitted=18, top_n=6, n=5)
    assert found == [[19]]
    # Scores are inner products, floored at 0 (hnswlib reports 1 - inner product).
    neighbours, scores = store.search(states[0], 6)
    exact = states @ states[0]
    np.testing.assert_allclose(np.sort(scores)[::-1], np.sort(exact)[::-1], atol=1e-5)
    assert sorted(neighbours.tolist()) == list(range(6))


def test_the_ring_overwrites_the_oldest_keys_first():
    rng = np.random.default_rng(1)
    store = ServedDenseStore(4, DIMS, projection=identity_projection(), background=False)
    old, new = np.arange(100, 110, dtype=np.int32), np.arange(200, 210, dtype=np.int32)
    old_states, new_states = unit(rng, 3), unit(rng, 3)
    store.add(old, old_states, np.arange(0, 3))
    store.add(new, new_states, np.arange(0, 3))
    assert store.num_keys == 4
    # Old positions 0 and 1 were overwritten by new 1 and 2; old 2 (predicting 103) is kept.
    neighbours, _ = store.search(old_states[0], 4)
    assert len(neighbours) == 4
    assert candidate_lists(store, old_states[0], emitted=101, top_n=4)[0] == []
    assert candidate_lists(store, old_states[2], emitted=103, top_n=4)[0] == [[104, 105, 106]]
    for p in range(3):
        assert candidate_lists(store, new_states[p], emitted=201 + p, top_n=4)[0] == \
            [list(range(202 + p, 205 + p))]


def test_projection_is_fitted_on_the_first_served_states_then_everything_is_indexed():
    rng = np.random.default_rng(2)
    hidden = 16
    store = ServedDenseStore(1000, DIMS, fit_states=40, background=False)
    document = np.arange(50, dtype=np.int32)
    first = rng.standard_normal((30, hidden)).astype(np.float32)
    store.add(document, first, np.arange(30))
    assert not store.fitted and store.num_keys == 0
    assert store.project(torch.from_numpy(first[:1])) is None
    assert store.candidates(None, 5, 4, 3)[0].shape == (0, 3)
    store.add(document, rng.standard_normal((15, hidden)).astype(np.float32), np.arange(30, 45))
    assert store.fitted and store.num_keys == 45
    query = store.project(torch.from_numpy(first[7:8]))[0]
    np.testing.assert_allclose(np.linalg.norm(query), 1.0, rtol=1e-5)
    # The state at 7 is its own nearest key: with 8 emitted, it drafts 9, 10, 11.
    assert candidate_lists(store, query, emitted=8, top_n=1)[0] == [[9, 10, 11]]


def test_a_search_never_waits_for_an_insert():
    rng = np.random.default_rng(3)
    store = ServedDenseStore(10, DIMS, projection=identity_projection(), background=False)
    states = unit(rng, 2)
    store.add(np.arange(5, dtype=np.int32), states, np.arange(2))
    with store._lock:  # an insert in progress
        assert store.search(states[0], 2) is None
    assert store.busy == 1 and store.search(states[0], 2) is not None


def test_background_inserts_are_indexed_after_wait_indexed():
    rng = np.random.default_rng(4)
    store = ServedDenseStore(100, DIMS, projection=identity_projection())
    try:
        states = unit(rng, 40)
        store.add(np.arange(60, dtype=np.int32), states, np.arange(40))
        assert store.wait_indexed()
        assert store.num_keys == 40
        assert candidate_lists(store, states[9], emitted=10, top_n=1)[0] == [[11, 12, 13]]
    finally:
        store.close()


def test_close_that_stops_waiting_leaves_the_thread_indexing_what_was_queued(monkeypatch):
    # Before, close() dropped the queue while a slow insert ran: the thread then failed on
    # its next get, and requests queued behind the slow one were never indexed.
    import threading

    release, inserted = threading.Event(), []

    def slow_insert(document, positions, states, keys):
        release.wait(10)
        inserted.append(int(document[0]))

    store = ServedDenseStore(100, DIMS, projection=identity_projection())
    monkeypatch.setattr(store, "_insert", slow_insert)
    monkeypatch.setattr(store, "CLOSE_WAIT_S", 0.1)
    thread, states = store._thread, unit(np.random.default_rng(5), 2)
    for first in (1, 2):
        store.add(np.arange(first, first + 4, dtype=np.int32), states, np.arange(2))
    store.close()
    assert thread.is_alive()
    store.add(np.arange(3, 7, dtype=np.int32), states, np.arange(2))  # after close: dropped
    release.set()
    thread.join(5)
    assert not thread.is_alive() and inserted == [1, 2]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="max_keys must be at least 1"):
        ServedDenseStore(0, DIMS)
    with pytest.raises(ValueError, match=r"fit_states must be at least dims \(8\)"):
        ServedDenseStore(10, DIMS, fit_states=4)


def test_accepted_state_rows_of_chains_and_trees():
    # Row 0: a chain that sampled 3 tokens ending at row 4; row 1: nothing sampled; row 2: a
    # tree whose last accepted node is at row 9 (its path is not contiguous).
    assert accepted_state_rows([4, -1, 9], [3, 0, 2], [True, True, False]) == \
        [(2, 4), (-1, -1), (9, 9)]


def one_request_in_two_steps(include_prompts: bool):
    """A store and its tracker that saw request "a": prompt 1 2 3; step 1 samples 10 (the
    prefill's state at 2), step 2 samples 11 12 (states at 3 and 4). Returns them, the states
    and the request's tokens."""
    dense = ServedDenseStore(100, DIMS, projection=identity_projection(), background=False)
    tracker = ServedRequests(ServedStore(100, background=False), include_prompts, dense)
    token_ids = np.array([[1, 2, 3, 10, 11, 12]], dtype=np.int32)
    states = unit(np.random.default_rng(5), 3)
    tracker.observe(["a"], [[10]], np.array([4]), token_ids, None,
                    [(states[:1], np.array([2]))])
    tracker.observe(["a"], [[11, 12]], np.array([6]), token_ids, None,
                    [(states[1:], np.array([3, 4]))])
    return dense, tracker, states, token_ids[0]


@pytest.mark.parametrize("include_prompts", [True, False])
def test_served_requests_hand_states_at_their_document_positions(include_prompts):
    dense, tracker, states, _ = one_request_in_two_steps(include_prompts)
    tracker.finish_all()
    # The state at context position 3 predicted 11: emitting 11 drafts 12.
    assert candidate_lists(dense, states[1], emitted=11, top_n=1)[0] == [[12]]
    # The prefill's state predicted the first output token: a key only when the prompt is
    # stored too (without it, the token it predicted starts the document: no position).
    assert dense.num_keys == (3 if include_prompts else 2)
    found = candidate_lists(dense, states[0], emitted=10, top_n=3)[0]
    assert found == ([[11, 12]] if include_prompts else [])


@pytest.mark.parametrize("include_prompts", [True, False])
def test_states_past_the_end_of_what_was_served_are_not_indexed(include_prompts):
    """A request told finished with fewer tokens than its steps saw (its last step ran past
    its EOS, ``Drafter.observe_finished``) keeps the keys of states whose next token it
    stored, not those past its end."""
    dense, tracker, states, tokens = one_request_in_two_steps(include_prompts)
    # Served through 11: the state at 4 predicted 12, which was not served.
    tracker.finish(["a"], {"a": tokens[:5]})
    assert dense.num_keys == (2 if include_prompts else 1)
    assert candidate_lists(dense, states[2], emitted=12, top_n=3)[0] == []


def test_hybrid_drafts_from_the_served_states_of_finished_requests():
    """A finished request's states are keys: a later request whose context matches nothing,
    but whose state is near one of them, is drafted what followed there."""
    from vllm_retrieval_spec.proposers.base import RetrievalProposer

    rng = np.random.default_rng(6)
    config = vllm_config({"method": "hybrid", "num_speculative_tokens": 4,
                          "served_dense": True, "served_dense_fit_states": 64,
                          "precompute_drafts": False, "draft_budget_ms": 0,
                          # Else the sparse served store's one-token match of 16 drafts too.
                          "context_min_match_len": 2, "min_match_len": 2},
                         max_model_len=128)
    config.model_config.get_hidden_size = lambda: DIMS
    proposer = RetrievalProposer(config)
    try:
        assert not proposer.ahead.precompute
        # Request "a": prompt 1 2, then it generates 10..79 one token a step (the projection
        # is fitted on its 70 states).
        prompt, output = [1, 2], list(range(10, 80))
        states = rng.standard_normal((len(output), DIMS)).astype(np.float32)
        proposer.observe_batch(["a"], None)
        for step, token in enumerate(output):
            context = prompt + output[:step + 1]
            tokens, lengths = batch(context, width=128)
            proposer.record_last_hidden_states(torch.from_numpy(states[step:step + 1]), [0])
            proposer.propose([[token]], lengths, tokens)
        proposer.observe_finished({"a"})  # served
        proposer.observe_batch(["b"], None)
        proposer.method.learning.dense.wait_indexed()
        assert proposer.stats()["served_dense_keys"] == len(output)
        # "b" emits 16 after unrelated tokens, from the state that predicted 16 in "a".
        tokens, lengths = batch([7, 8, 16])
        proposer.record_last_hidden_states(torch.from_numpy(states[6:7]), [0])
        # No exact match stands behind it, so the draft is as short as drafts get.
        cap = proposer.config.drafting.min_draft_len
        assert 0 < cap < 4
        assert proposer.propose([[16]], lengths, tokens) == [list(range(17, 17 + cap))]
        # From a state unlike any of "a"'s, the filter finds no neighbour predicting 16.
        tokens, lengths = batch([7, 8, 16])
        proposer.record_last_hidden_states(torch.from_numpy(-states[6:7]), [0])
        assert proposer.propose([[16]], lengths, tokens) == [[]]
    finally:
        proposer.close()


def test_served_dense_needs_the_shared_store():
    with pytest.raises(ConfigError, match=r"'served_dense'\] needs served_store 'shared', "
                                          r"got 'per_request'"):
        parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 8,
                                  "served_store": "per_request",
                                  "served_dense": True}, VLLM_CPU_DEFAULTS)
    with pytest.raises(ConfigError, match=r"'served_dense_fit_states'\]=63 is out of range"):
        parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 8,
                                  "served_dense": True,
                                  "served_dense_fit_states": 63}, VLLM_CPU_DEFAULTS)



def model_facts():
    from vllm_retrieval_spec.datastore.served_dense import ModelFacts

    return ModelFacts(name="m", fingerprint="a" * 64, hidden_size=DIMS, layer=2, dtype="float32")


TOKENIZER = TokenizerFacts("t", "f" * 64, 1000)


def save(store: ServedStore, path, dense: ServedDenseStore) -> None:
    """``store`` and ``dense`` as a snapshot (``datastore.served_saver``)."""
    write_snapshot(path, [Entry(NO_KEY, i, time_ms, document)
                          for i, (_, time_ms, document) in enumerate(store.items())], {},
                   TOKENIZER, dense, model_facts())


def load(path, store: ServedStore) -> list[np.ndarray]:
    """A snapshot's requests, added to ``store``; the arrays it stores, in the saved order."""
    return [store.add(e.doc_id, e.tokens, e.time_ms)
            for e in read_snapshot(path, TOKENIZER.fingerprint).entries]


def served_pair(rng):
    """A sparse store of three requests and its dense half, the middle request's keys included
    (so positions past the first document are checked)."""
    store = ServedStore(1000, background=False)
    dense = ServedDenseStore(100, DIMS, projection=identity_projection(), background=False)
    states = {}
    for name, start in (("a", 100), ("b", 200), ("c", 300)):
        document = store.add(name, np.arange(start, start + 8, dtype=np.int32))
        states[name] = unit(rng, 5)
        dense.add(document, states[name], np.arange(1, 6))
    return store, dense, states


def test_saved_keys_load_back_into_the_next_engines_store(tmp_path):
    from vllm_retrieval_spec.datastore.dense import DenseIndex, check_dense_index

    rng = np.random.default_rng(7)
    store, dense, states = served_pair(rng)
    path = tmp_path / "served"
    save(store, path, dense)
    # A regular datastore with a dense index of this model, checked as any at start-up.
    _, manifest = check_dense_index(path, expected_model_fingerprint="a" * 64,
                                    hidden_size=DIMS, dtype="float32")
    assert manifest.num_keys == 15 and manifest.dims == DIMS
    index = DenseIndex.from_path(path, search="exact")
    # Key at position 3 of "b" predicted 204: in the saved stream "b" starts after "a" + 1.
    row = int(np.flatnonzero(index.positions == 9 + 3)[0])
    np.testing.assert_allclose(index.keys[row], states["b"][2], atol=1e-3)

    restored = ServedStore(1000, background=False)
    restored_dense = ServedDenseStore(100, DIMS, background=False)
    documents = load(path, restored)
    assert restored_dense.load_keys(documents, np.asarray(index.keys), index.positions,
                                    index.projection) == 15
    assert restored_dense.fitted and restored_dense.num_keys == 15
    for name, start in (("a", 100), ("b", 200), ("c", 300)):
        # The state at position 3 predicted start + 4; emitting it drafts start + 5...
        found = candidate_lists(restored_dense, states[name][2], emitted=start + 4, top_n=1)[0]
        assert found == [[start + 5, start + 6, start + 7]]


def test_keys_of_evicted_requests_are_not_saved_and_other_projections_not_loaded(tmp_path):
    from vllm_retrieval_spec.datastore.dense import DenseIndex

    rng = np.random.default_rng(8)
    store, dense, _ = served_pair(rng)
    assert store.evict_oldest() == 8  # "a" leaves the sparse store; its keys stay in the ring
    keys, positions = dense.snapshot(store.documents())
    assert len(keys) == 10 and positions.min() == 1 and positions.max() == 9 + 5
    path = tmp_path / "served"
    save(store, path, dense)
    index = DenseIndex.from_path(path, search="exact")
    assert index.manifest.num_keys == 10
    other = Projection(mean=np.zeros(DIMS, np.float32), inv_std=np.ones(DIMS, np.float32),
                       components=-np.eye(DIMS, dtype=np.float32), explained_variance=1.0)
    fresh = ServedDenseStore(100, DIMS, projection=other, background=False)
    assert fresh.load_keys(load(path, ServedStore(1000, background=False)),
                           np.asarray(index.keys), index.positions, index.projection) == 0
    assert fresh.num_keys == 0


def test_a_crash_while_writing_keys_leaves_the_previous_save(tmp_path, monkeypatch):
    from vllm_retrieval_spec.datastore import dense as dense_module
    from vllm_retrieval_spec.datastore.format import load_datastore

    rng = np.random.default_rng(9)
    store, dense, _ = served_pair(rng)
    path = tmp_path / "served"
    save(store, path, dense)
    before = sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))
    store.add("d", [1, 2, 3])

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(dense_module, "write_dense_keys", crash)
    with pytest.raises(OSError, match="disk full"):
        save(store, path, dense)
    # Tokens and keys of the previous save, together: never new tokens with old keys.
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*")) == before
    assert load_datastore(path).manifest.num_documents == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]


def test_a_snapshots_keys_load_into_the_requests_it_keeps(tmp_path):
    """A served directory's snapshot carries the dense keys; at start-up they point into the
    requests stored, those dropped (here by age) leave theirs behind."""
    import time

    from vllm_retrieval_spec.datastore.served_saver import ServedDirectory

    rng = np.random.default_rng(10)
    store = ServedStore(1000, background=False)
    dense = ServedDenseStore(100, DIMS, projection=identity_projection(), background=False)
    old = time.time_ns() // 1_000_000 - 2 * 3600 * 1000
    states = {}
    for name, start, time_ms in (("a", 100, None), ("b", 200, old), ("c", 300, None)):
        document = store.add(name, np.arange(start, start + 8, dtype=np.int32), time_ms)
        states[name] = unit(rng, 5)
        dense.add(document, states[name], np.arange(1, 6))
    options = {"flush_s": 1.0, "compact_s": 60.0, "model": model_facts(), "background": False}
    ServedDirectory(tmp_path, store, TOKENIZER, dense=dense, **options).compact(force=True)
    restored = ServedStore(1000, background=False)
    restored_dense = ServedDenseStore(100, DIMS, background=False)
    ServedDirectory(tmp_path, restored, TOKENIZER, max_age_s=3600, dense=restored_dense,
                    **options)
    assert restored.num_documents == 2 and restored_dense.num_keys == 10
    for name, start in (("a", 100), ("c", 300)):
        found = candidate_lists(restored_dense, states[name][2], emitted=start + 4, top_n=1)[0]
        assert found == [[start + 5, start + 6, start + 7]]


def test_purged_keys_take_no_neighbours_place_and_their_slots_refill():
    rng = np.random.default_rng(13)
    store = ServedDenseStore(6, DIMS, projection=identity_projection(), background=False)
    purged, kept = np.arange(100, 110, dtype=np.int32), np.arange(200, 210, dtype=np.int32)
    purged_states, kept_states = unit(rng, 3), unit(rng, 2)
    store.add(purged, purged_states, np.arange(0, 3))
    store.add(kept, kept_states, np.arange(0, 2))
    store.retain([kept])
    assert store.num_keys == 2
    # Before: the purged key nearest the query came first and one neighbour drafted nothing.
    neighbours, _ = store.search(purged_states[0], 1)
    assert neighbours.tolist()[0] in (3, 4)
    assert sorted(store.search(purged_states[0], 6)[0].tolist()) == [3, 4]
    # The ring goes on at slot 5, then reuses the purged slots 0 and 1, unmarked.
    refill = unit(rng, 3)
    store.add(kept, refill, np.arange(3, 6))
    assert store.num_keys == 5
    assert sorted(store.search(refill[2], 6)[0].tolist()) == [0, 1, 3, 4, 5]
    assert candidate_lists(store, refill[2], emitted=206, top_n=1)[0] == [[207, 208, 209]]


@pytest.mark.parametrize("background", [False, True])
def test_purged_requests_leave_the_dense_drafts_too(tmp_path, background):
    """A purge (or the age limit) drops requests from the sparse store; their dense keys point
    into the same documents and must not draft them either, also those queued for insertion."""
    import time

    from vllm_retrieval_spec.datastore.served_saver import ServedDirectory, purge

    rng = np.random.default_rng(11)
    store = ServedStore(1000, background=False)
    dense = ServedDenseStore(100, DIMS, projection=identity_projection(), background=background)
    directory = ServedDirectory(tmp_path, store, TOKENIZER, dense=dense, flush_s=1.0,
                                compact_s=60.0, model=model_facts(), background=False)
    old = store.add("old", np.arange(100, 108, dtype=np.int32))
    old_states = unit(rng, 5)
    dense.add(old, old_states, np.arange(1, 6))
    time.sleep(0.01)
    purge(tmp_path)
    new = store.add("new", np.arange(200, 208, dtype=np.int32))
    new_states = unit(rng, 5)
    dense.add(new, new_states, np.arange(1, 6))
    directory.sync()
    assert dense.wait_indexed()
    assert [d.tolist() for d in store.documents()] == [list(range(200, 208))]
    # Before: the purged request's keys went on drafting it until the ring overwrote them.
    assert candidate_lists(dense, old_states[2], emitted=104, top_n=10)[0] == []
    assert candidate_lists(dense, new_states[2], emitted=204, top_n=1)[0] == [[205, 206, 207]]
    dense.close()


def test_a_request_read_twice_at_start_up_leaves_the_dense_drafts_when_purged(tmp_path):
    """At start-up a request both in the snapshot (with its keys) and in the journal after the
    snapshot's offsets (flushed after its writer listed them) is read twice: a purge must
    still reach the keys loaded from the snapshot."""
    import time

    from vllm_retrieval_spec.datastore.served_saver import ServedDirectory, purge

    rng = np.random.default_rng(12)
    options = {"flush_s": 1.0, "compact_s": 60.0, "model": model_facts(), "background": False}
    store = ServedStore(1000, background=False)
    dense = ServedDenseStore(100, DIMS, projection=identity_projection(), background=False)
    writer = ServedDirectory(tmp_path, store, TOKENIZER, dense=dense, **options)
    document = store.add("r", np.arange(100, 108, dtype=np.int32))
    states = unit(rng, 5)
    dense.add(document, states, np.arange(1, 6))
    writer.record(None, "r", document)
    writer.compact(force=True)  # holds "r"; its offsets do not: it is flushed after
    writer.writer.flush()
    restored = ServedStore(1000, background=False)
    restored_dense = ServedDenseStore(100, DIMS, background=False)
    reader = ServedDirectory(tmp_path, restored, TOKENIZER, dense=restored_dense, **options)
    assert restored.num_documents == 1 and restored_dense.num_keys == 5
    # A purge of other requests keeps its keys: they point into the array stored.
    reader.remove_dropped(purged=True)
    assert candidate_lists(restored_dense, states[2], emitted=104, top_n=1)[0] == \
        [[105, 106, 107]]
    time.sleep(0.01)
    purge(tmp_path)
    reader.sync()
    assert restored.num_documents == 0
    # Before: the journal's copy replaced the snapshot's in the sparse store, and the purge
    # forgot that copy only: the keys loaded from the snapshot went on drafting the request.
    assert candidate_lists(restored_dense, states[2], emitted=104, top_n=10)[0] == []


def test_a_purge_reaches_the_dense_keys_of_requests_the_sparse_store_evicted(tmp_path):
    """The dense ring outlives the sparse store's documents (long prompts, few keys each):
    an evicted request still drafts from its keys, and a purge must stop that too."""
    import time

    from vllm_retrieval_spec.datastore.served_saver import ServedDirectory, purge

    rng = np.random.default_rng(13)
    store = ServedStore(8, background=False)
    dense = ServedDenseStore(100, DIMS, projection=identity_projection(), background=False)
    directory = ServedDirectory(tmp_path, store, TOKENIZER, dense=dense, flush_s=1.0,
                                compact_s=60.0, model=model_facts(), background=False)
    states = {}
    for name, start in (("evicted", 100), ("stored", 200)):
        document = store.add(name, np.arange(start, start + 8, dtype=np.int32))
        states[name] = unit(rng, 5)
        dense.add(document, states[name], np.arange(1, 6))
    assert store.num_documents == 1
    assert candidate_lists(dense, states["evicted"][2], emitted=104, top_n=1)[0] == \
        [[105, 106, 107]]
    time.sleep(0.01)
    purge(tmp_path)
    directory.sync()
    # Before: only the documents the purge removed from the sparse store were forgotten.
    for name, start in (("evicted", 100), ("stored", 200)):
        assert candidate_lists(dense, states[name][2], emitted=start + 4, top_n=10)[0] == []
