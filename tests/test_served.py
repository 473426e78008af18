"""The served store: what it keeps, what it finds, when it learns, and how it is saved."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from helpers import brute_force_match, make_tokenizer
from vllm_retrieval_spec.datastore.format import (
    DatastoreError, file_sha256, load_datastore, tokenizer_fingerprint)
from vllm_retrieval_spec.datastore.journal import NO_KEY, TokenizerFacts
from vllm_retrieval_spec.datastore.served import KeyedServedStores, ServedStore, SuffixIndex
from vllm_retrieval_spec.datastore.served_requests import ServedRequests
from vllm_retrieval_spec.datastore.served_saver import (
    DOCUMENTS_FILE, SERVED_FILE, Entry, read_snapshot, tokenizer_facts, write_snapshot)

LOOKUP = {"min_len": 2, "max_len": 16, "max_occurrences": 64, "continuation_len": 4}


def continuations(store: ServedStore, context, **options) -> tuple[int, list[list[int]]]:
    cands, lengths, n = store.lookup(np.asarray(context, dtype=np.int32), **{**LOOKUP, **options})
    return n, sorted(c[:length].tolist() for c, length in zip(cands, lengths))


def test_finds_the_longest_match_across_requests_and_never_runs_over_one():
    store = ServedStore(1000, background=False)
    store.add("a", [5, 6, 7, 8, 9])
    store.add("b", [1, 5, 6, 7, 3])
    # "5 6 7" is the longest suffix of the context found; it continues differently in each
    # request, and the continuation in "a" stops at its end, not in "b".
    assert continuations(store, [4, 5, 6, 7]) == (3, [[3], [8, 9]])
    assert continuations(store, [2, 3]) == (0, [])


@pytest.mark.parametrize("seed", range(12))
def test_lookup_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    store = ServedStore(10_000, background=False)
    documents = [rng.integers(0, 4, int(rng.integers(1, 40))).astype(np.int32)
                 for _ in range(int(rng.integers(1, 8)))]
    for i, document in enumerate(documents):
        store.add(str(i), document)
    context = rng.integers(0, 4, 12).astype(np.int32)
    stream = store.index.tokens.tolist()
    n, starts = brute_force_match(store.index.tokens, context, 2, 16)

    def continuation(start: int) -> list[int]:
        following = stream[start:start + 4]
        return following[:following.index(-1)] if -1 in following else following

    expected = sorted(continuation(start + n) for start in starts)
    assert continuations(store, context, max_occurrences=10_000) == (n, expected)


def test_evicts_whole_requests_oldest_first():
    store = ServedStore(10, background=False)
    store.add("a", [1, 2, 3, 4])
    store.add("b", [5, 6, 7, 8])
    store.add("c", [9, 10, 11])  # 11 tokens: "a" goes, whole
    assert [d.tolist() for d in store.documents()] == [[5, 6, 7, 8], [9, 10, 11]]
    assert store.num_tokens == 7
    assert continuations(store, [1, 2]) == (0, [])
    assert continuations(store, [5, 6]) == (2, [[7, 8]])
    # A request longer than the whole store keeps its end.
    store.add("d", list(range(100, 120)))
    assert [d.tolist() for d in store.documents()] == [list(range(110, 120))]


def test_a_resumed_request_replaces_its_entry():
    store = ServedStore(100, background=False)
    store.add("a", [1, 2, 3])
    store.add("a", [1, 2, 3, 4, 5])
    assert store.num_tokens == 5 and store.num_documents == 1


def test_adds_are_copies():
    tokens = np.array([1, 2, 3, 4], dtype=np.int32)
    store = ServedStore(100, background=False)
    store.add("a", tokens)
    tokens[:] = 0
    assert continuations(store, [1, 2]) == (2, [[3, 4]])


def test_background_indexing_swaps_in_a_complete_snapshot():
    store = ServedStore(100_000)
    try:
        snapshots = []
        stop = threading.Event()

        def read():
            while not stop.is_set():
                index = store.index
                snapshots.append((len(index.tokens), len(index.suffix_array)))

        reader = threading.Thread(target=read)
        reader.start()
        for i in range(50):
            store.add(str(i), np.arange(i, i + 200, dtype=np.int32))
        assert store.wait_indexed()
        stop.set()
        reader.join()
        # Every snapshot a reader saw had its suffix array; the last holds everything.
        assert snapshots and all(tokens == sa for tokens, sa in snapshots)
        assert len(store.index.tokens) == 50 * 201
        assert continuations(store, [48, 49]) == (2, sorted([[50, 51, 52, 53]] * 49))
    finally:
        store.close()


def test_requests_removed_leave_the_background_index():
    store = ServedStore(1000)
    try:
        store.add("a", [5, 6, 7], time_ms=100)
        store.add("b", [5, 6, 8], time_ms=300)
        assert store.wait_indexed()
        assert continuations(store, [5, 6]) == (2, [[7], [8]])
        # A purge or the age limit: the rebuilt index no longer drafts the request removed.
        assert store.remove_where(lambda time_ms: time_ms < 200) == 1
        assert store.wait_indexed()
        assert continuations(store, [5, 6]) == (2, [[8]])
    finally:
        store.close()


def test_keyed_stores_drop_the_least_recently_used_and_the_emptied():
    stores = KeyedServedStores(max_tokens=100, max_stores=2, background=False)
    stores.add("x", "1", [1, 1], time_ms=100)
    stores.add("y", "2", [2, 2], time_ms=300)
    assert stores.get("x") is not None  # drafted from: now the most recently used
    stores.add("z", "3", [3, 3], time_ms=300)
    assert [key for key, _ in stores.items()] == ["x", "z"]
    # A store a purge or the age limit empties goes; removing again finds nothing more.
    assert stores.remove_where(lambda time_ms, key: time_ms < 200) == 1
    assert [key for key, _ in stores.items()] == ["z"]
    assert stores.remove_where(lambda time_ms, key: time_ms < 200) == 0
    assert stores.get("z").remove_where(lambda time_ms: True) == 1
    assert stores.get("z").remove_where(lambda time_ms: True) == 0


def test_a_failed_rebuild_keeps_the_last_index_and_does_not_hold_up_waiters(monkeypatch, caplog):
    store = ServedStore(1000)
    try:
        store.add("a", [5, 6, 7])
        assert store.wait_indexed()
        tries = []

        def failing_refresh():
            tries.append(1)
            raise MemoryError("no room for the suffix array")

        monkeypatch.setattr(store, "refresh", failing_refresh)
        store.add("b", [5, 6, 8])
        assert store.wait_indexed(timeout=2)
        # Drafting goes on from the last index; the next request that finishes retries.
        assert continuations(store, [5, 6]) == (2, [[7]]) and len(tries) == 1
        assert "could not index the served store" in caplog.text
    finally:
        store.close()


def test_requests_enter_the_store_when_vllm_finishes_them():
    store = ServedStore(1000, background=False)
    journaled = []
    tracker = ServedRequests(store, include_prompts=False, persist=lambda key, req_id, doc:
                             journaled.append((key, req_id, doc.tolist())))
    token_ids = np.zeros((2, 16), dtype=np.int32)
    # Step 1: both prefills sampled one token after prompts of 3 and 2 tokens.
    token_ids[0, :4] = [1, 2, 3, 10]
    token_ids[1, :3] = [4, 5, 20]
    tracker.observe(["a", "b"], [[10], [20]], np.array([4, 3]), token_ids)
    # Step 2: "a" accepted two draft tokens and sampled a bonus; "b" is in a partial step.
    token_ids[0, 4:7] = [11, 12, 13]
    tracker.observe(["a", "b"], [[11, 12, 13], []], np.array([7, 3]), token_ids)
    assert store.num_documents == 0
    # "a" finished; "b" now sits in row 0 (rows are reused).
    tracker.finish({"a"})
    token_ids[0, :4] = [4, 5, 20, 21]
    tracker.observe(["b"], [[21]], np.array([4]), token_ids)
    assert [d.tolist() for d in store.documents()] == [[10, 11, 12, 13]]
    tracker.finish({"b", "never-seen"})
    assert [d.tolist() for d in store.documents()] == [[10, 11, 12, 13], [20, 21]]
    # Each stored request goes to the journal (served_datastore) as stored, once.
    assert journaled == [(None, "a", [10, 11, 12, 13]), (None, "b", [20, 21])]


def test_a_request_is_stored_with_its_final_tokens_and_from_scratch_if_it_shrank():
    store = ServedStore(1000, background=False)
    tracker = ServedRequests(store, include_prompts=False)
    tracker.observe(["a"], [[10]], np.array([4]), np.array([[1, 2, 3, 10]], np.int32))
    # A row that sampled nothing (a partial prefill) is not a request yet.
    tracker.observe(["b"], [[]], np.array([2]), np.array([[4, 5]], np.int32))
    assert sorted(tracker.running) == ["a"]
    # vLLM's row at the finish holds tokens of steps not observed.
    tracker.finish({"a"}, final={"a": np.array([1, 2, 3, 10, 13, 14], dtype=np.int32)})
    assert [d.tolist() for d in store.documents()] == [[10, 13, 14]]
    # Fewer tokens than it had (recomputed after preemption): its row is read again.
    tracker.observe(["c"], [[10]], np.array([4]), np.array([[1, 2, 3, 10]], np.int32))
    tracker.observe(["c"], [[11]], np.array([5]), np.array([[1, 2, 3, 10, 11]], np.int32))
    tracker.observe(["c"], [[12]], np.array([4]), np.array([[1, 2, 3, 12]], np.int32))
    tracker.finish({"c"})
    assert [d.tolist() for d in store.documents()][-1] == [12]


def test_prompts_are_stored_when_asked():
    store = ServedStore(1000, background=False)
    tracker = ServedRequests(store, include_prompts=True)
    token_ids = np.array([[1, 2, 3, 10]], dtype=np.int32)
    tracker.observe(["a"], [[10]], np.array([4]), token_ids)
    tracker.finish_all()
    assert [d.tolist() for d in store.documents()] == [[1, 2, 3, 10]]


def test_a_snapshot_is_a_datastore_that_loads_back(tmp_path):
    tokenizer = make_tokenizer()
    facts = TokenizerFacts("test", tokenizer_fingerprint(tokenizer), 100)
    key = bytes(range(16))
    entries = [Entry(key, 7, 1_000, np.array([5, 6, 7, 8], np.int32)),
               Entry(key, 2**64 - 1, 2_000, np.array([6, 7, 9], np.int32))]
    path = tmp_path / "snapshot-1-r"
    write_snapshot(path, entries, {"journal-r.0": 40}, facts)
    datastore = load_datastore(path, expected_fingerprint=facts.fingerprint)
    assert datastore.manifest.num_documents == 2 and datastore.manifest.num_tokens == 9
    assert datastore.manifest.sources == ["served requests"]
    snapshot = read_snapshot(path, facts.fingerprint)
    assert snapshot.segments == {"journal-r.0": 40}
    assert [(e.key, e.doc_id, e.time_ms, e.tokens.tolist()) for e in snapshot.entries] == [
        (key, 7, 1_000, [5, 6, 7, 8]), (key, 2**64 - 1, 2_000, [6, 7, 9])]
    # Only the serving user reads it.
    assert {p.stat().st_mode & 0o777 for p in path.iterdir()} == {0o600}
    assert path.stat().st_mode & 0o777 == 0o700
    with pytest.raises(DatastoreError, match="tokenizer"):
        read_snapshot(path, "0" * 64)
    # Times and keys for fewer requests than it holds (checksum and all): it does not load.
    np.save(path / DOCUMENTS_FILE, np.load(path / DOCUMENTS_FILE)[:1])
    served = json.loads((path / SERVED_FILE).read_text())
    served["documents_sha256"] = file_sha256(path / DOCUMENTS_FILE)
    (path / SERVED_FILE).write_text(json.dumps(served))
    with pytest.raises(DatastoreError, match="holds 2 requests and 1 requests' times and keys"):
        read_snapshot(path, facts.fingerprint)
    # Nothing left: a snapshot without a datastore.
    write_snapshot(tmp_path / "snapshot-2-r", [], {}, facts)
    assert read_snapshot(tmp_path / "snapshot-2-r", facts.fingerprint).entries == []


@pytest.mark.parametrize("entries", [[Entry(NO_KEY, 7, 1_000, np.array([5, 6], np.int32))], []])
def test_a_snapshot_is_private_while_written_in_a_directory_others_can_enter(
        tmp_path, monkeypatch, entries):
    # A store directory made by hand with the default umask: others may list and enter it,
    # so the snapshot's own directory must shut them out before its first file is written.
    from vllm_retrieval_spec.datastore import served_saver

    store = tmp_path / "store"
    store.mkdir()
    store.chmod(0o755)
    seen = []
    make_private = served_saver.make_private_and_durable

    def observe(directory):
        seen.append(directory.stat().st_mode & 0o777)
        make_private(directory)

    monkeypatch.setattr(served_saver, "make_private_and_durable", observe)
    write_snapshot(store / "snapshot-1-r", entries, {},
                   TokenizerFacts("test", tokenizer_fingerprint(make_tokenizer()), 100))
    assert seen == [0o700]


def test_a_snapshot_takes_token_ids_the_model_takes_past_its_tokenizer(tmp_path):
    # A padded embedding: vLLM accepts prompt ids up to the model's vocabulary, and one such
    # id refused by the snapshot would stop every compaction and purge.
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    tokenizer_vocab = max(tokenizer.get_vocab().values()) + 1

    class ModelConfig:
        tokenizer = str(tmp_path / "tokenizer")
        tokenizer_revision = None
        trust_remote_code = False

        def get_vocab_size(self):
            return tokenizer_vocab + 64

    facts = tokenizer_facts(ModelConfig())
    assert facts.vocab_size == tokenizer_vocab + 64
    assert facts.fingerprint == tokenizer_fingerprint(tokenizer)
    path = tmp_path / "snapshot-1-r"
    write_snapshot(path, [Entry(NO_KEY, 1, 1_000, np.array([5, tokenizer_vocab + 63], np.int32))],
                   {}, facts)
    assert [e.tokens.tolist() for e in read_snapshot(path, facts.fingerprint).entries] == [
        [5, tokenizer_vocab + 63]]


def test_a_failed_snapshot_leaves_nothing(tmp_path, monkeypatch):
    from vllm_retrieval_spec.datastore import build

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(build, "build_suffix_array", crash)
    with pytest.raises(OSError, match="disk full"):
        write_snapshot(tmp_path / "snapshot-1-r", [Entry(NO_KEY, 1, 1, np.arange(3))], {},
                       TokenizerFacts("t", "f" * 64, 100))
    assert list(tmp_path.iterdir()) == []


def test_empty_index_finds_nothing():
    index = SuffixIndex.of_documents([])
    assert len(index.tokens) == 0
    assert continuations(ServedStore(10, background=False), [1, 2]) == (0, [])


def test_long_requests_are_recorded_whole_as_they_grow():
    """Each step copies only its new tokens; the stored request is every token, in order."""
    store = ServedStore(100_000, background=False)
    tracker = ServedRequests(store, include_prompts=True)
    sequence = np.arange(1, 1001, dtype=np.int32)
    token_ids = np.zeros((1, 1024), dtype=np.int32)
    n = 10  # a 9-token prompt, then steps of 1 to 7 tokens
    token_ids[0, :n] = sequence[:n]
    tracker.observe(["a"], [[int(sequence[n - 1])]], np.array([n]), token_ids)
    rng = np.random.default_rng(0)
    while n < 1000:
        step = min(int(rng.integers(1, 8)), 1000 - n)
        token_ids[0, n:n + step] = sequence[n:n + step]
        # Stale draft tokens past the valid length are never read.
        token_ids[0, n + step:n + step + 3] = -7
        n += step
        tracker.observe(["a"], [sequence[n - step:n].tolist()], np.array([n]), token_ids)
    tracker.finish_all()
    assert [d.tolist() for d in store.documents()] == [sequence.tolist()]


def test_keyed_stores_are_apart_and_bounded_together():
    stores = KeyedServedStores(max_tokens=10, max_stores=2, background=False)
    stores.add("x", "a", [5, 6, 7, 8])
    stores.add("y", "b", [5, 6, 9])
    assert continuations(stores.get("x"), [5, 6]) == (2, [[7, 8]])
    assert continuations(stores.get("y"), [5, 6]) == (2, [[9]])
    assert stores.get("z") is None and stores.get(None) is None
    assert (stores.num_tokens, stores.num_documents, stores.num_stores) == (7, 2, 2)
    # 7 + 4 > 10 tokens: the least recently used key ("x", read before "y") loses its oldest.
    stores.get("x")
    stores.get("y")
    stores.add("y", "c", [1, 2, 3, 4])
    assert stores.get("x").num_documents == 0
    assert [d.tolist() for d in stores.get("y").documents()] == [[5, 6, 9], [1, 2, 3, 4]]
    assert continuations(stores.get("x"), [5, 6]) == (0, [])
    # A third key: the least recently used store ("x", once "y" was read after it) goes whole.
    stores.get("y")
    stores.add("z", "d", [3])
    assert stores.get("x") is None and stores.num_stores == 2
    assert stores.num_tokens == 8
    with pytest.raises(ValueError, match="max_stores must be at least 1"):
        KeyedServedStores(10, 0)


def test_requests_without_a_key_are_not_kept_for_keyed_stores():
    stores = KeyedServedStores(max_tokens=100, max_stores=4, background=False)
    journaled = []
    tracker = ServedRequests(stores, include_prompts=False, persist=lambda key, req_id, doc:
                             journaled.append((key, req_id)))
    token_ids = np.array([[1, 2, 10], [3, 4, 20], [5, 6, 30]], dtype=np.int32)
    tracker.observe(["a", "b", "c"], [[10], [20], [30]], np.array([3, 3, 3]), token_ids,
                    ["x", None, "x"])
    assert sorted(tracker.running) == ["a", "c"]
    tracker.finish_all()
    assert sorted(d.tolist() for d in stores.get("x").documents()) == [[10], [30]]
    assert stores.num_stores == 1 and not tracker.keys
    assert sorted(journaled) == [("x", "a"), ("x", "c")]  # under their key; "b" nowhere


def test_evict_oldest_drops_one_request_and_reindexes():
    store = ServedStore(100, background=False)
    store.add("a", [5, 6, 7])
    store.add("b", [5, 6, 8])
    assert store.evict_oldest() == 3
    assert continuations(store, [5, 6]) == (2, [[8]])
    assert store.evict_oldest() == 3 and store.evict_oldest() == 0
    assert store.num_tokens == 0 and continuations(store, [5, 6]) == (0, [])


def test_dropping_a_key_does_not_wait_for_its_store_to_finish_indexing(monkeypatch):
    # A key's store dropped (least recently used) while its thread rebuilds: the add that drops
    # it runs in the engine's step (observe_finished) and holds the stores' lock, which every
    # step's get() takes, so it must not wait for that rebuild (0.1 s at 1 M tokens).
    import vllm_retrieval_spec.datastore.served as served

    building, release = threading.Event(), threading.Event()
    build = served.build_suffix_array

    def blocked_build(tokens):
        building.set()
        release.wait(30)
        return build(tokens)

    monkeypatch.setattr(served, "build_suffix_array", blocked_build)
    stores = KeyedServedStores(max_tokens=100, max_stores=1)
    try:
        stores.add("x", "a", [5, 6, 7])
        assert building.wait(30)
        adding = threading.Thread(target=stores.add, args=("y", "b", [5, 6, 8]))
        adding.start()
        adding.join(5)
        # Returned while "x"'s rebuild is still blocked.
        assert not adding.is_alive() and not release.is_set()
        assert stores.get("x") is None and stores.num_stores == 1
    finally:
        release.set()
        stores.close()
