"""The served store's journal and directory: records, torn and corrupt tails, replicas sharing
one directory, compaction, retention, purges, file modes, what cut-off writes leave."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import time
import zlib

import numpy as np
import pytest

from vllm_retrieval_spec.datastore import journal, served_saver
from vllm_retrieval_spec.datastore.format import DatastoreError
from vllm_retrieval_spec.datastore.journal import (
    NO_KEY, STORE_FILE, CompactionLock, JournalReader, JournalWriter, Record, TokenizerFacts,
    decode_records, encode_record, list_segments, stale_temporary, this_host)
from vllm_retrieval_spec.datastore.served import KeyedServedStores, ServedStore
from vllm_retrieval_spec.datastore.served_saver import (
    ServedDirectory, check_served_directory, list_snapshots, purge, read_snapshot)

TOKENIZER = TokenizerFacts("t", "f" * 64, 1000)
LONG_AGO = time.time() - 3600


def record(doc: int, tokens, time_ms: int = 1_000, key: bytes = NO_KEY) -> Record:
    return Record(time_ms, doc, key, np.asarray(tokens, dtype=np.int32))


def as_tuples(records):
    return [(r.time_ms, r.doc_id, r.key, r.tokens.tolist()) for r in records]


def replica(path, name: str, *, max_tokens: int = 1000, keyed: bool = False,
            **options) -> ServedDirectory:
    """A replica without threads: the test flushes, polls and compacts."""
    stores = KeyedServedStores(max_tokens, 8, background=False) if keyed \
        else ServedStore(max_tokens, background=False)
    return ServedDirectory(path, stores, TOKENIZER, flush_s=1.0, compact_s=600.0,
                           background=False, replica=name, **options)


def serve(directory: ServedDirectory, request_id: str, tokens, key: str | None = None) -> None:
    """What ``ServedRequests`` does when vLLM finishes a request: store it, journal it."""
    digest = directory.key_of(key)
    if directory.keyed:
        document = directory.stores.add(digest, request_id, tokens)
    else:
        document = directory.stores.add(request_id, tokens)
    directory.record(digest, request_id, document)


def stored(directory: ServedDirectory, key: str | None = None) -> list[list[int]]:
    store = directory.stores.get(directory.key_of(key)) if directory.keyed else directory.stores
    return sorted(d.tolist() for d in store.documents()) if store is not None else []


def settle(path) -> None:
    """Age every file, as if the replicas had been quiet for an hour."""
    for file in path.iterdir():
        os.utime(file, (LONG_AGO, LONG_AGO))


def purged_in_open_segment(path) -> ServedDirectory:
    """Replica h-1-a, whose open segment holds SECRET's request, purged after it was written
    (the purge leaves that segment to a)."""
    a = replica(path, "h-1-a")
    serve(a, "1", SECRET)
    a.writer.flush()
    time.sleep(0.01)
    purge(path)
    return a


# ------------------------------------------------------------------------------ records

def test_records_round_trip():
    records = [record(1, [5, 6, 7], 123), record(2**64 - 1, [], 4, bytes(range(16))),
               record(3, [2**31 - 1, 0])]
    data = b"".join(map(encode_record, records))
    decoded, consumed, corrupt = decode_records(data)
    assert as_tuples(decoded) == as_tuples(records)
    assert (consumed, corrupt) == (len(data), False)


def test_a_torn_record_stops_reading_and_a_corrupt_one_is_flagged():
    first, second = encode_record(record(1, [5, 6])), encode_record(record(2, [7, 8, 9]))
    # Cut off anywhere in the second record: the first is read, the rest waits.
    for cut in range(1, len(second)):
        decoded, consumed, corrupt = decode_records(first + second[:cut])
        assert ([r.doc_id for r in decoded], consumed, corrupt) == ([1], len(first), False)
    # One flipped bit in the payload, or a wrong magic: corrupt.
    flipped = bytearray(second)
    flipped[-1] ^= 1
    assert decode_records(first + bytes(flipped))[1:] == (len(first), True)
    assert decode_records(first + b"XXXX" + second[4:])[1:] == (len(first), True)
    # A frame whose checksum holds but whose length cannot be a record's (shorter than the
    # header, or tokens of 3 bytes): corrupt, not an exception.
    header = second[12:44]
    for payload in (header[:20], header + b"abc"):
        frame = journal.MAGIC + len(payload).to_bytes(4, "little") \
            + zlib.crc32(payload).to_bytes(4, "little") + payload
        assert decode_records(first + frame)[1:] == (len(first), True)
    # A length longer than a record can be (a flipped high bit): corrupt now, not a record
    # waited for until its segment settles.
    for length in (journal.MAX_PAYLOAD + 4, 2**32 - 4):
        frame = journal.MAGIC + length.to_bytes(4, "little") + second[8:]
        assert decode_records(first + frame)[1:] == (len(first), True)


def test_segments_are_listed_in_the_order_written_once_each_sealed_if_so(tmp_path, monkeypatch):
    for name in ("journal-r.10", "journal-r.2", "journal-q.1.sealed"):
        (tmp_path / name).write_bytes(b"")
    assert list(list_segments(tmp_path)) == ["journal-q.1", "journal-r.2", "journal-r.10"]
    # Sealed while the directory was listed: seen under both names, it is the sealed one.
    both = [tmp_path / "journal-s.0.sealed", tmp_path / "journal-s.0"]
    monkeypatch.setattr(type(tmp_path), "iterdir", lambda self: iter(both))
    assert list_segments(tmp_path)["journal-s.0"].sealed


def test_the_writer_flushes_segments_mode_0600_and_rotation_seals_them(tmp_path):
    writer = JournalWriter(tmp_path, "r", 1.0, background=False)
    writer.flush()
    assert list(tmp_path.iterdir()) == []  # no segment before the first record
    writer.append(record(1, [5, 6]))
    writer.append(record(2, [7]))
    writer.flush()
    (segment,) = tmp_path.iterdir()
    assert segment.name == "journal-r.0" and segment.stat().st_mode & 0o777 == 0o600
    assert writer.flushed_sizes() == {"journal-r.0": segment.stat().st_size}
    writer.rotate()
    writer.append(record(3, [8]))
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal-r.0.sealed",
                                                          "journal-r.1.sealed"]
    reader = JournalReader(tmp_path, "other", {})
    assert [r.doc_id for r in reader.poll()] == [1, 2, 3]
    assert reader.poll() == []  # nothing new


def test_a_writer_whose_segment_was_deleted_starts_another(tmp_path):
    writer = JournalWriter(tmp_path, "r", 1.0, background=False)
    writer.append(record(1, [5]))
    writer.flush()
    reader = JournalReader(tmp_path, "x", {})
    assert [r.doc_id for r in reader.poll()] == [1]
    (tmp_path / "journal-r.0").unlink()  # taken for a dead replica's
    writer.append(record(2, [6]))
    writer.flush()
    assert [r.doc_id for r in JournalReader(tmp_path, "x", {}).poll()] == [2]
    # Under a new name: a reader that read the deleted segment to its end, were the name
    # reused, would skip the new segment's records up to that offset.
    assert [s.name for s in list_segments(tmp_path).values()] == ["journal-r.1"]
    writer.append(record(3, [7]))
    writer.flush()
    assert [r.doc_id for r in reader.poll()] == [2, 3]


class OsFailingAt:
    """``os`` for the journal module, but for one call that fails."""

    def __init__(self, name, failure):
        self.name, self.failure = name, failure

    def __getattr__(self, attr):
        return self.failure if attr == self.name else getattr(os, attr)


def half_a_write_then_a_full_disk(fd, data):
    os.write(fd, data[:len(data) // 2])
    raise OSError(errno.ENOSPC, "No space left on device")


def a_failed_fsync(fd):
    raise OSError(errno.EIO, "Input/output error")


@pytest.mark.parametrize("call, failure", [("write", half_a_write_then_a_full_disk),
                                           ("fsync", a_failed_fsync)])
def test_a_failed_write_leaves_nothing_torn_before_the_next_batch(tmp_path, monkeypatch,
                                                                  caplog, call, failure):
    writer = JournalWriter(tmp_path, "r", 1.0, background=False)
    writer.append(record(1, [5, 6]))
    writer.flush()
    # Two whole batches before the failed one: cut back to its last whole batch, the segment
    # keeps both (the size it is cut to counts every batch written, not the last one).
    writer.append(record(4, [9]))
    writer.flush()
    writer.append(record(2, [7]))
    with monkeypatch.context() as patch, caplog.at_level(logging.ERROR):
        patch.setattr(journal, "os", OsFailingAt(call, failure))
        writer.flush()  # serving goes on: record 2 is written with the next batch
    assert "could not write 1 records to the journal" in caplog.text
    writer.append(record(3, [8]))
    # Before: record 2 was left to a snapshot, which a clean shutdown does not write.
    writer.flush()
    files = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert files == {"journal-r.0.sealed": writer.flushed_sizes()["journal-r.0"],
                     "journal-r.1": writer.flushed_sizes()["journal-r.1"]}
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert [r.doc_id for r in JournalReader(tmp_path, "other", {}).poll(
            time.time() + 3600)] == [1, 4, 2, 3]
    assert "unreadable" not in caplog.text


def test_a_disk_full_for_long_holds_only_the_newest_failed_records(tmp_path, monkeypatch,
                                                                   caplog):
    monkeypatch.setattr(journal, "RETRY_TOKENS", 5)
    writer = JournalWriter(tmp_path, "r", 1.0, background=False)
    with monkeypatch.context() as patch, caplog.at_level(logging.ERROR):
        patch.setattr(journal, "os", OsFailingAt("write", half_a_write_then_a_full_disk))
        for doc in range(4):
            writer.append(record(doc, [doc, doc]))
            writer.flush()
    assert caplog.text.count("1 records are left out of the journal") == 2
    writer.flush()
    assert [r.doc_id for r in JournalReader(tmp_path, "other", {}).poll()] == [2, 3]


def test_a_failed_fsync_of_a_new_segment_delays_only_that_batch(tmp_path, monkeypatch, caplog):
    writer = JournalWriter(tmp_path, "r", 1.0, background=False)
    writer.append(record(1, [5, 6]))
    with monkeypatch.context() as patch, caplog.at_level(logging.ERROR):
        # The first batch creates the segment: the fsync of its directory entry fails.
        patch.setattr(journal, "os", OsFailingAt("fsync", a_failed_fsync))
        writer.flush()
    assert "could not write 1 records to the journal" in caplog.text
    writer.append(record(2, [7]))
    writer.flush()
    assert [r.doc_id for r in JournalReader(tmp_path, "other", {}).poll()] == [1, 2]


def a_full_disk(*args):
    raise OSError(errno.ENOSPC, "No space left on device")


def a_close_that_fails(fd):
    os.close(fd)  # Linux frees the descriptor even when close reports an error
    raise OSError(errno.EIO, "Input/output error")


@pytest.mark.parametrize("call, failure", [("rename", a_full_disk),
                                           ("close", a_close_that_fails)])
def test_a_segment_that_cannot_be_sealed_does_not_stop_the_journal(tmp_path, monkeypatch,
                                                                   caplog, call, failure):
    writer = JournalWriter(tmp_path, "r", 1.0, background=False)
    writer.append(record(1, [5, 6]))
    writer.flush()
    with monkeypatch.context() as patch, caplog.at_level(logging.ERROR):
        patch.setattr(journal, "os", OsFailingAt(call, failure))
        writer.rotate()  # a compaction goes on
    assert "could not seal the journal segment" in caplog.text
    caplog.clear()
    writer.append(record(2, [7]))
    with caplog.at_level(logging.ERROR):
        writer.flush()
    assert caplog.text == ""
    # The unsealed segment is read as any other; the next batch went to a segment of its own.
    assert [r.doc_id for r in JournalReader(tmp_path, "other", {}).poll()] == [1, 2]
    assert list(writer.flushed_sizes()) == ["journal-r.0", "journal-r.1"]


def test_segments_a_full_disk_left_empty_are_deleted_by_a_snapshot(tmp_path, monkeypatch):
    a = replica(tmp_path, "h-1-a")
    with monkeypatch.context() as patch:
        patch.setattr(journal, "os", OsFailingAt("write", a_full_disk))
        for i in range(3):
            serve(a, str(i), [1, i])
            a.writer.flush()
    assert {p.stat().st_size for p in tmp_path.glob("journal-h-1-a.*")} == {0}
    # Before: no offset was recorded for an empty segment, so no snapshot included it, and
    # one stayed on disk per failed flush, listed and opened by every replica at every poll.
    b = replica(tmp_path, "h-2-b")
    settle(tmp_path)
    b.compact(force=True)
    assert list(tmp_path.glob("journal-h-1-a.*")) == []


def test_torn_and_corrupt_tails_are_skipped_with_one_warning(tmp_path, caplog):
    good = encode_record(record(1, [5, 6]))
    (tmp_path / "journal-a.0").write_bytes(good + encode_record(record(2, [7, 8]))[:-3])
    broken = bytearray(good + encode_record(record(3, [9])))
    broken[-2] ^= 0xFF
    (tmp_path / "journal-b.0").write_bytes(bytes(broken))
    reader = JournalReader(tmp_path, "me", {})
    with caplog.at_level(logging.WARNING):
        # A fresh torn tail may be a write in progress: no warning yet, the corrupt one warns.
        assert [r.doc_id for r in reader.poll()] == [1, 1]
        assert reader.poll() == []
        assert len(caplog.records) == 1 and "journal-b.0" in caplog.text
        # Still torn long after its last write: its writer died mid-write.
        settle(tmp_path)
        assert reader.poll() == [] and reader.poll() == []
    assert len(caplog.records) == 2 and "cut off by a crash" in caplog.records[1].message
    assert reader.offsets == {"journal-a.0": len(good), "journal-b.0": len(good)}
    # A sealed segment is written no more: a torn tail there is broken at once.
    (tmp_path / "journal-c.0.sealed").write_bytes(good + encode_record(record(4, [1]))[:-3])
    assert [r.doc_id for r in reader.poll()] == [1]
    assert reader.broken == {"journal-a.0", "journal-b.0", "journal-c.0"}


def test_a_batch_written_while_a_quiet_segment_is_read_is_not_taken_for_a_crash(tmp_path,
                                                                                monkeypatch):
    segment = tmp_path / "journal-a.0"
    segment.write_bytes(encode_record(record(1, [5, 6])))
    quiet = time.time() - 2 * journal.SETTLE_S
    os.utime(segment, (quiet, quiet))
    late = encode_record(record(2, [7, 8]))

    class WriterBetweenSizeAndRead:
        """``os`` whose first fstat is followed by half of the writer's next batch."""

        calls = 0

        def __getattr__(self, name):
            return getattr(os, name)

        def fstat(self, fd):
            stat = os.fstat(fd)
            WriterBetweenSizeAndRead.calls += 1
            if WriterBetweenSizeAndRead.calls == 1:
                with open(segment, "ab") as f:
                    f.write(late[:len(late) // 2])
            return stat

    reader = JournalReader(tmp_path, "me", {})
    with monkeypatch.context() as patch:
        patch.setattr(journal, "os", WriterBetweenSizeAndRead())
        assert [r.doc_id for r in reader.poll()] == [1]
    with open(segment, "ab") as f:
        f.write(late[len(late) // 2:])
    # Before: the size's time, not the read's, said "quiet for long", and the segment was
    # skipped for good.
    assert reader.broken == set()
    assert [r.doc_id for r in reader.poll()] == [2]


# ---------------------------------------------------------------------------- replicas

def test_start_up_replays_the_journal_of_a_killed_replica(tmp_path):
    first = replica(tmp_path, "h-1-a")
    serve(first, "x", [5, 6, 7])
    serve(first, "y", [8, 9])
    first.writer.flush()
    serve(first, "z", [1, 2])  # queued, never flushed: the kill -9 loses it
    # No close: a killed process leaves its segment unsealed.
    second = replica(tmp_path, "h-2-b")
    assert stored(second) == [[5, 6, 7], [8, 9]]
    # Every record carries its finishing time.
    assert all(abs(t - time.time() * 1000) < 60_000 for _, t, _ in second.stores.items())


def test_replicas_tail_each_other_and_keys_stay_apart(tmp_path):
    a = replica(tmp_path, "h-1-a", keyed=True)
    b = replica(tmp_path, "h-2-b", keyed=True)
    assert a.salt == b.salt  # one directory, one salt
    serve(a, "r1", [5, 6, 7], key="tenant-x")
    serve(a, "r2", [5, 6, 9], key="tenant-y")
    a.writer.flush()
    b.sync()
    assert stored(b, "tenant-x") == [[5, 6, 7]] and stored(b, "tenant-y") == [[5, 6, 9]]
    assert stored(b, "tenant-z") == []
    serve(b, "r1", [1, 2], key="tenant-x")  # the same request id on another replica
    b.writer.flush()
    a.sync()
    assert stored(a, "tenant-x") == [[1, 2], [5, 6, 7]]
    # The key is on disk only as a salted digest.
    for segment in list_segments(tmp_path).values():
        assert b"tenant" not in segment.path.read_bytes()


@pytest.mark.parametrize("keyed", [True, False])
def test_a_directory_holds_one_served_store_modes_requests(tmp_path, keyed):
    """A replica stores and snapshots only its mode's requests, and its snapshot's offsets pass
    over the others': a directory of the other mode is refused, by the front-end's check and
    by the replica."""
    modes = {True: "'per_request'", False: "'shared'"}
    a = replica(tmp_path, "h-1-a", keyed=keyed)
    serve(a, "r1", [5, 6], key="k" if keyed else None)
    a.writer.flush()
    refused = (f"holds requests of served_store {modes[keyed]}; this server's is "
               f"{modes[not keyed]}: give it a directory of its own")
    with pytest.raises(DatastoreError, match=re.escape(refused)):
        check_served_directory(tmp_path, TOKENIZER.fingerprint, not keyed)
    with pytest.raises(DatastoreError, match=re.escape(refused)):
        replica(tmp_path, "h-2-b", keyed=not keyed)
    check_served_directory(tmp_path, TOKENIZER.fingerprint, keyed)
    # A store.json written before the mode was recorded takes either (and each replica keeps
    # to its own mode's requests).
    facts = json.loads((tmp_path / STORE_FILE).read_text())
    del facts["keyed"]
    (tmp_path / STORE_FILE).write_text(json.dumps(facts))
    assert replica(tmp_path, "h-3-c", keyed=not keyed).stores.num_documents == 0
    assert replica(tmp_path, "h-4-d", keyed=keyed).stores.num_documents == 1


@pytest.mark.parametrize("text", ["{", "[]", '{"tokenizer": {}}', '{"key_salt": "zz"}',
                                  '{"tokenizer": {"name": "t", "fingerprint": "f", '
                                  '"vocab_size": 9}, "key_salt": "00", "keyed": "yes"}'])
def test_an_unusable_store_json_is_a_one_line_error(tmp_path, text):
    serve(replica(tmp_path, "h-1-a"), "r1", [5, 6])
    (tmp_path / STORE_FILE).write_text(text)
    with pytest.raises(DatastoreError, match=r"store.json is unusable \(.+\); restore it"):
        check_served_directory(tmp_path, TOKENIZER.fingerprint, False)


def test_compaction_with_several_writers_loses_and_duplicates_nothing(tmp_path):
    a, b = replica(tmp_path, "h-1-a"), replica(tmp_path, "h-2-b")
    serve(a, "1", [1, 1])
    serve(b, "2", [2, 2])
    a.writer.flush()
    b.writer.flush()
    a.sync()
    serve(a, "3", [3, 3])  # stored, not yet flushed: in the snapshot and, later, the journal
    snapshot = a.compact(force=True)
    assert snapshot is not None and snapshot.name.startswith("snapshot-0000000001-h-1-a")
    assert {p.stat().st_mode & 0o777 for p in snapshot.iterdir()} == {0o600}
    a.writer.flush()
    serve(b, "4", [4, 4])  # after the snapshot: only in b's journal
    b.writer.flush()
    b.sync()
    # b's lease on the lock is refused while a holds it.
    assert CompactionLock(tmp_path, "a", 600).acquire()
    assert b.compact(force=True) is None
    (tmp_path / "compact.lock").unlink()
    # A third replica: the snapshot, then every segment after it; request 3 once.
    c = replica(tmp_path, "h-3-c")
    assert stored(c) == [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert c.stores.num_documents == 4
    # b compacts next; once quiet, the segments it includes whole and whose writers are done
    # go (a's and b's sealed ones), and only the newest two snapshots stay.
    serve(b, "5", [5, 5])
    b.writer.flush()
    b.compact(force=True)
    settle(tmp_path)
    c.sync()
    c.compact(force=True)
    segments = list_segments(tmp_path)
    assert all(not s.sealed for s in segments.values())
    assert len(list_snapshots(tmp_path)) == 2
    d = replica(tmp_path, "h-4-d")
    assert stored(d) == [[1, 1], [2, 2], [3, 3], [4, 4], [5, 5]]


def test_a_request_whose_journal_write_failed_is_journaled_with_the_next_batch(tmp_path,
                                                                               monkeypatch):
    a = replica(tmp_path, "h-1-a")
    serve(a, "1", [1, 1])
    a.writer.flush()
    serve(a, "2", [2, 2])
    with monkeypatch.context() as patch:
        patch.setattr(journal, "os", OsFailingAt("write", half_a_write_then_a_full_disk))
        a.writer.flush()
    serve(a, "3", [3, 3])
    a.writer.flush()
    # Before: request 2 waited for a snapshot, which a clean shutdown does not write (nor, in
    # a fleet, a replica whose peers always wrote one recently): a restart lost it.
    a.close()
    assert stored(replica(tmp_path, "h-2-b")) == [[1, 1], [2, 2], [3, 3]]


def test_a_snapshot_written_while_a_replica_starts_loses_it_nothing(tmp_path, monkeypatch):
    a, b = replica(tmp_path, "h-1-a"), replica(tmp_path, "h-2-b")
    serve(a, "1", [1, 1])
    a.writer.flush()
    b.sync()
    b.compact(force=True)  # includes request 1, not 2
    serve(a, "2", [2, 2])
    a.writer.flush()
    a.writer.rotate()
    b.sync()
    settle(tmp_path)
    load = served_saver.read_snapshot

    def load_slowly(path, fingerprint):
        # While c loads the first snapshot, b writes the next and deletes a's sealed segment.
        snapshot = load(path, fingerprint)
        if len(list_snapshots(tmp_path)) == 1:
            b.compact(force=True)
            assert not list_segments(tmp_path)
        return snapshot

    monkeypatch.setattr(served_saver, "read_snapshot", load_slowly)
    c = replica(tmp_path, "h-3-c")
    monkeypatch.undo()
    assert stored(c) == [[1, 1], [2, 2]]
    # Nor does c's own snapshot, the newest, lose it.
    c.compact(force=True)
    assert stored(replica(tmp_path, "h-4-d")) == [[1, 1], [2, 2]]

def test_a_snapshot_is_durable_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    a = replica(tmp_path, "h-1-a")
    serve(a, "1", [1, 1])
    a.writer.flush()
    events = []
    fsync, replace = os.fsync, os.replace

    def record_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def record_replace(source, target):
        events.append(("rename", str(source)))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    snapshot = a.compact(force=True)
    monkeypatch.undo()
    # Every entry of the snapshot, its files' and its own directory's: after a power loss, a
    # snapshot renamed into place whose files are missing would not load, and the segments it
    # included are deleted already.
    staged = str(snapshot.with_name(f"{snapshot.name}.tmp-{os.getpid()}"))
    renamed = events.index(("rename", staged))
    fsynced = {path for event, path in events[:renamed] if event == "fsync"}
    assert staged in fsynced
    assert {staged + "/" + p.name for p in snapshot.iterdir()} <= fsynced


def test_a_snapshot_that_does_not_load_falls_back_to_the_one_before(tmp_path, caplog):
    a = replica(tmp_path, "h-1-a")
    serve(a, "1", [1, 1])
    a.writer.flush()
    a.compact(force=True)
    serve(a, "2", [2, 2])
    a.writer.flush()
    newest = a.compact(force=True)
    (newest / "tokens.npy").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        b = replica(tmp_path, "h-2-b")
    assert "does not load" in caplog.text
    assert stored(b) == [[1, 1], [2, 2]]


def test_a_snapshot_that_does_not_load_is_not_kept_as_the_next_ones_fallback(tmp_path):
    a = replica(tmp_path, "h-1-a")
    serve(a, "1", [1, 1])
    a.writer.flush()
    good = a.compact(force=True)
    serve(a, "2", [2, 2])
    a.writer.flush()
    damaged = a.compact(force=True)
    a.close()
    (damaged / "tokens.npy").write_bytes(b"garbage")
    b = replica(tmp_path, "h-2-b")
    newest = b.compact(force=True)
    b.close()
    # Before: the damaged one was kept as the fallback, the one that loads deleted.
    assert list_snapshots(tmp_path) == [newest, good]
    # So that a newest damaged in turn still falls back to something.
    (newest / "tokens.npy").write_bytes(b"garbage")
    assert stored(replica(tmp_path, "h-3-c")) == [[1, 1], [2, 2]]


def test_a_scheduled_snapshot_is_written_only_after_changes_and_none_recent(tmp_path):
    a = replica(tmp_path, "h-1-a")
    assert a.compact() is None  # nothing stored
    serve(a, "1", [1, 1])
    assert a.compact() is not None
    serve(a, "2", [2, 2])
    assert a.compact() is None  # the last is younger than half an interval
    settle(tmp_path)
    assert a.compact() is not None
    settle(tmp_path)
    assert a.compact() is None  # nothing changed since
    # Requests read from another replica's journal are changes too.
    b = replica(tmp_path, "h-2-b")
    serve(b, "3", [3, 3])
    b.writer.flush()
    a.sync()
    settle(tmp_path)
    assert a.compact() is not None
    assert stored(replica(tmp_path, "h-3-c")) == [[1, 1], [2, 2], [3, 3]]


def test_another_tokenizers_directory_is_refused(tmp_path):
    replica(tmp_path, "h-1-a")
    with pytest.raises(DatastoreError, match="another tokenizer"):
        ServedDirectory(tmp_path, ServedStore(10, background=False),
                        TokenizerFacts("u", "0" * 64, 1000), flush_s=1, compact_s=60,
                        background=False)


# ---------------------------------------------------------------------------- retention

def test_requests_older_than_the_age_limit_are_evicted_and_leave_the_snapshot(tmp_path):
    a = replica(tmp_path, "h-1-a", max_age_s=3600)
    now = time.time_ns() // 1_000_000
    a.stores.add("old", [1, 1], now - 2 * 3600 * 1000)
    serve(a, "new", [2, 2])
    # Another replica journaled an old request: it is not even stored.
    writer = JournalWriter(tmp_path, "h-9-z", 1.0, background=False)
    writer.append(record(7, [3, 3], now - 2 * 3600 * 1000))
    writer.flush()
    a.sync()
    assert stored(a) == [[1, 1], [2, 2]]
    assert a.remove_dropped() == 1
    assert stored(a) == [[2, 2]]
    a.writer.flush()
    a.compact(force=True)
    assert stored(replica(tmp_path, "h-2-b")) == [[2, 2]]


def test_no_snapshot_kept_as_a_fallback_holds_requests_past_the_age_limit(tmp_path):
    a = replica(tmp_path, "h-1-a", max_age_s=3600)
    now = time.time_ns() // 1_000_000
    a.stores.add("old", [1, 1], now - 2 * 3600 * 1000)
    serve(a, "new", [2, 2])
    a.compact(force=True)
    assert a.remove_dropped() == 1
    newest = a.compact(force=True)
    # Before: the snapshot before it stayed as its fallback, and a quiet fleet writes no
    # other, so the expired request stayed on disk.
    assert [[e.tokens.tolist() for e in read_snapshot(path, TOKENIZER.fingerprint).entries]
            for path in list_snapshots(tmp_path)] == [[[2, 2]]]
    assert list_snapshots(tmp_path) == [newest]


def test_a_fallback_past_the_age_limit_goes_once_the_fleet_is_quiet(tmp_path, monkeypatch):
    a = replica(tmp_path, "h-1-a", max_age_s=3600)
    now = time.time_ns() // 1_000_000
    # Expired a minute ago: under steady traffic the snapshot before the newest holds such
    # requests, and stays the fallback.
    a.stores.add("old", [1, 1], now - 3600 * 1000 - 60_000)
    serve(a, "new", [2, 2])
    first = a.compact(force=True)
    assert a.remove_dropped() == 1
    newest = a.compact(force=True)
    assert list_snapshots(tmp_path) == [newest, first]
    assert a.compact_after_expiry() is None  # no retention sweep yet
    # Half an hour later nothing was served: no scheduled snapshot comes, the sweep's does.
    monkeypatch.setattr(served_saver, "now_ms", lambda: now + 1800 * 1000)
    a._swept -= served_saver.RETENTION_SWEEP_S
    a.sync()
    latest = a.compact_after_expiry()
    assert latest is not None and first not in list_snapshots(tmp_path)
    assert [[e.tokens.tolist() for e in read_snapshot(path, TOKENIZER.fingerprint).entries]
            for path in list_snapshots(tmp_path)] == [[[2, 2]], [[2, 2]]]
    a._swept -= served_saver.RETENTION_SWEEP_S
    a.sync()
    assert a.compact_after_expiry() is None  # nothing past the limit is left on disk


def test_a_start_up_over_the_bound_keeps_the_newest_requests_of_a_snapshot(tmp_path):
    a = replica(tmp_path, "h-1-a")
    now = time.time_ns() // 1_000_000
    for i, age_ms in enumerate((1000, 3000, 2000)):  # not in time order
        a.stores.add(str(i), [i, i], now - age_ms)
    a.compact(force=True)
    a.close()
    assert stored(replica(tmp_path, "h-2-b", max_tokens=4)) == [[0, 0], [2, 2]]


def test_keyed_requests_older_than_the_age_limit_are_evicted(tmp_path):
    a = replica(tmp_path, "h-1-a", keyed=True, max_age_s=3600)
    now = time.time_ns() // 1_000_000
    digest = a.key_of("x")
    a.stores.add(digest, "old", [1, 1], now - 2 * 3600 * 1000)
    serve(a, "new", [2, 2], key="x")
    assert a.remove_dropped() == 1
    assert stored(a, "x") == [[2, 2]]


def test_purge_by_key_and_age_reaches_running_replicas_and_the_disk(tmp_path):
    a = replica(tmp_path, "h-1-a", keyed=True)
    serve(a, "1", [1, 1], key="x")
    serve(a, "2", [2, 2], key="y")
    a.writer.flush()
    time.sleep(0.01)
    snapshot, removed = purge(tmp_path, key="x")
    assert removed == 1 and snapshot is not None
    # The running replica drops it at its next poll; later requests of "x" are kept.
    a.sync()
    assert stored(a, "x") == [] and stored(a, "y") == [[2, 2]]
    serve(a, "3", [3, 3], key="x")
    a.writer.flush()
    a.close()
    # On disk: no request of "x" from before the purge, anywhere a new replica reads.
    b = replica(tmp_path, "h-2-b", keyed=True)
    assert stored(b, "x") == [[3, 3]] and stored(b, "y") == [[2, 2]]
    # Everything older than an hour: nothing here is.
    assert purge(tmp_path, older_than_hours=1)[1] == 0
    # Everything: the stopped fleet's files hold nothing more.
    settle(tmp_path)
    snapshot, removed = purge(tmp_path)
    assert removed == 2
    assert replica(tmp_path, "h-3-c", keyed=True).stores.num_documents == 0
    assert [s.name for s in list_segments(tmp_path).values()] == []

SECRET = [901, 902, 903, 904]


def files_holding(path, tokens) -> list[str]:
    """The files under ``path`` whose bytes hold ``tokens`` (int32, as journals and snapshots
    keep them)."""
    needle = np.asarray(tokens, dtype="<i4").tobytes()
    return sorted(str(f.relative_to(path)) for f in path.rglob("*")
                  if f.is_file() and needle in f.read_bytes())


def test_a_purge_of_a_stopped_fleet_leaves_no_snapshot_holding_the_requests(tmp_path):
    a = replica(tmp_path, "h-1-a", keyed=True)
    serve(a, "1", SECRET, key="x")
    serve(a, "2", [2, 2], key="y")
    a.writer.flush()
    a.compact(force=True)
    a.close()
    settle(tmp_path)
    time.sleep(0.01)
    assert purge(tmp_path, key="x")[1] == 1
    # Before: the snapshot before the purge's stayed as its fallback, holding the request
    # until two more were written: never, while the fleet is stopped.
    assert files_holding(tmp_path, SECRET) == []
    assert stored(replica(tmp_path, "h-2-b", keyed=True), "y") == [[2, 2]]
    # Without a purge the snapshot before the newest stays, as the newest's fallback.
    assert purge(tmp_path, key="z")[1] == 0
    assert len(list_snapshots(tmp_path)) == 2


def test_a_purge_falls_back_from_a_newest_snapshot_that_does_not_load(tmp_path, caplog):
    a = replica(tmp_path, "h-1-a", keyed=True)
    serve(a, "1", SECRET, key="x")
    a.writer.flush()
    a.compact(force=True)
    serve(a, "2", [2, 2], key="y")
    a.writer.flush()
    newest = a.compact(force=True)
    a.close()
    (newest / "tokens.npy").write_bytes(b"garbage")
    settle(tmp_path)
    time.sleep(0.01)
    # Before: the newest snapshot's DatastoreError stopped the purge, which removed nothing.
    with caplog.at_level(logging.WARNING):
        assert purge(tmp_path, key="x")[1] == 1
    assert "does not load" in caplog.text
    assert files_holding(tmp_path, SECRET) == []
    assert stored(replica(tmp_path, "h-2-b", keyed=True), "y") == [[2, 2]]


def test_a_purge_keeps_as_fallback_a_snapshot_that_loads(tmp_path):
    a = replica(tmp_path, "h-1-a")
    serve(a, "1", [1, 1])
    good = a.compact(force=True)
    serve(a, "2", [2, 2])
    damaged = a.compact(force=True)
    a.close()
    (damaged / "tokens.npy").write_bytes(b"garbage")
    settle(tmp_path)
    time.sleep(0.01)
    written, removed = purge(tmp_path, older_than_hours=1)  # nothing is that old
    # As after a replica's snapshot: the one that does not load goes, not the one that does.
    assert removed == 0 and list_snapshots(tmp_path) == [written, good]


def test_a_segment_with_bytes_past_its_records_may_hold_purged_requests(tmp_path):
    writer = JournalWriter(tmp_path, "r", 1.0, background=False)
    writer.append(record(1, [5], time_ms=1_000))
    writer.flush()
    rules = journal.PurgeRules()
    rules.add(2_000, b"z" * 16)  # another key's: record 1 is kept
    (segment,) = list_segments(tmp_path).values()
    assert not journal.segment_holds_purged(segment, rules)
    with open(segment.path, "ab") as f:
        f.write(b"\x00" * 7)  # a torn record: what it held is not known
    assert journal.segment_holds_purged(segment, rules)


def test_a_snapshot_holds_purged_requests_by_time_and_by_the_whole_key(tmp_path):
    x = bytes(range(16))
    half_of_x = bytes(range(8)) + b"\xff" * 8  # the first half of x's digest, not the second
    snapshot = tmp_path / "snapshot-0000000001-h-1-a"
    served_saver.write_snapshot(snapshot, [served_saver.Entry(x, 1, 1000, np.arange(3)),
                                           served_saver.Entry(NO_KEY, 2, 5000, np.arange(2))],
                                {}, TOKENIZER)

    def holds(before_ms, key=None):
        rules = journal.PurgeRules()
        rules.add(before_ms, key)
        return served_saver.holds_dropped(snapshot, rules)

    assert holds(1001) and not holds(1000)  # every key's requests
    assert holds(1001, x) and not holds(1000, x) and not holds(6000, half_of_x)
    assert holds(5001, NO_KEY) and not holds(5000, NO_KEY)
    # Its times and keys unreadable: it may hold them.
    (snapshot / served_saver.DOCUMENTS_FILE).unlink()
    assert holds(1, half_of_x)


def test_a_snapshot_whose_times_and_keys_are_damaged_is_taken_to_hold_purged_requests(
        tmp_path):
    a = replica(tmp_path, "h-1-a")
    serve(a, "1", SECRET)
    a.compact(force=True)
    serve(a, "2", [2, 2])
    damaged = a.compact(force=True)
    a.close()
    (damaged / served_saver.DOCUMENTS_FILE).write_bytes(b"")
    rules = journal.PurgeRules()
    rules.add(journal.now_ms(), b"z" * 16)
    journal.write_purge(tmp_path, rules)
    # Before: numpy's EOFError (a file cut to nothing) stopped the start-up check, and the
    # first snapshot's clean-up.
    b = replica(tmp_path, "h-2-b")
    assert stored(b) == [[2, 2], SECRET]
    newest = b.compact(force=True)
    assert newest is not None and damaged not in list_snapshots(tmp_path)
    b.close()
    # A time changed: the file no longer has the checksum its snapshot records, and no longer
    # loads. Before: it was read as it says.
    assert served_saver.holds_dropped(newest, rules) is False
    documents = np.load(newest / served_saver.DOCUMENTS_FILE)
    documents[0, 0] += 1
    np.save(newest / served_saver.DOCUMENTS_FILE, documents)
    assert served_saver.holds_dropped(newest, rules) is True


def test_a_running_replica_drops_purged_requests_from_its_journal_once_it_settled(
        tmp_path, monkeypatch):
    a = replica(tmp_path, "h-1-a", keyed=True)
    b = replica(tmp_path, "h-2-b", keyed=True)
    serve(a, "1", SECRET, key="x")
    a.writer.flush()  # in a's open segment, which a purge cannot delete
    serve(a, "2", SECRET[::-1], key="x")  # queued, not yet written
    serve(a, "3", [2, 2], key="y")
    time.sleep(0.01)
    purge(tmp_path, key="x")
    a.sync()
    a.writer.flush()
    b.sync()
    # A queued request the purge drops is never written; the open segment is sealed at once.
    assert files_holding(tmp_path, SECRET[::-1]) == []
    assert files_holding(tmp_path, SECRET) == ["journal-h-1-a.0.sealed"]
    # Before: it stayed until a's next scheduled snapshot (``served_save_minutes``), skipped
    # if another was recent (the purge's), and its deletion waited for the one after.
    assert a.compact_after_purge() is None  # not before the segment settled (SETTLE_S)
    monkeypatch.setattr(served_saver, "SETTLE_S", 0.0)
    assert a.compact_after_purge() is not None
    assert files_holding(tmp_path, SECRET) == []
    assert a.compact_after_purge() is None  # once per purge
    assert stored(b, "y") == [[2, 2]] and stored(b, "x") == []
    assert stored(replica(tmp_path, "h-3-c", keyed=True), "y") == [[2, 2]]


def test_after_a_purge_a_replica_writes_no_snapshot_once_another_deleted_what_held_it(
        tmp_path, monkeypatch):
    a = replica(tmp_path, "h-1-a", keyed=True)
    b = replica(tmp_path, "h-2-b", keyed=True)
    serve(a, "1", SECRET, key="x")
    serve(b, "2", SECRET[::-1], key="x")
    serve(b, "3", [2, 2], key="y")
    a.writer.flush()
    b.writer.flush()
    time.sleep(0.01)
    purge(tmp_path, key="x")
    a.sync()
    b.sync()  # both open segments sealed
    a.sync()  # a has read b's sealed segment to its end
    monkeypatch.setattr(served_saver, "SETTLE_S", 0.0)
    assert a.compact_after_purge() is not None
    assert files_holding(tmp_path, SECRET) == files_holding(tmp_path, SECRET[::-1]) == []
    # Before: every replica wrote a snapshot after a purge, N for a fleet of N, though the
    # first had deleted every file that held a purged request.
    newest = list_snapshots(tmp_path)[0]
    assert b.compact_after_purge() is None
    assert list_snapshots(tmp_path)[0] == newest
    assert b.compact_after_purge() is None  # and it does not look again every poll
    assert stored(replica(tmp_path, "h-3-c", keyed=True), "y") == [[2, 2]]


def test_a_replica_stopped_before_its_purge_snapshot_writes_it_at_its_next_start(
        tmp_path, monkeypatch):
    a = purged_in_open_segment(tmp_path)
    a.sync()  # sealed; a is stopped before its snapshot follows
    a.close()
    monkeypatch.setattr(served_saver, "SETTLE_S", 0.0)
    assert files_holding(tmp_path, SECRET) == ["journal-h-1-a.0.sealed"]
    # Before: the next process never wrote that snapshot (nothing new to save), and the
    # purged request stayed on disk until traffic and the next scheduled one.
    assert replica(tmp_path, "h-1-b").compact_after_purge() is not None
    assert files_holding(tmp_path, SECRET) == []
    # Once: the start after that finds nothing purged on disk.
    assert replica(tmp_path, "h-1-c").compact_after_purge() is None


def test_a_snapshot_finished_while_a_replica_takes_the_lock_is_numbered_over(
        tmp_path, monkeypatch):
    a = replica(tmp_path, "h-9-a")
    b = replica(tmp_path, "h-1-b")
    serve(a, "1", [1, 1])
    a.compact(force=True)
    serve(b, "2", [2, 2])
    acquire = b.lock.acquire

    def a_finishes_first() -> bool:
        # As when b retries after a purge every poll while a writes a snapshot.
        a.compact(force=True)
        return acquire()

    monkeypatch.setattr(b.lock, "acquire", a_finishes_first)
    written = b.compact(force=True)
    # Before: b numbered its snapshot from a listing made before a's, a's sorted as the
    # newest, and b's, which includes more of the journals, was left as the fallback.
    assert list_snapshots(tmp_path)[0] == written


def test_after_a_purge_no_file_is_read_while_another_replica_writes_a_snapshot(
        tmp_path, monkeypatch):
    a = purged_in_open_segment(tmp_path)
    a.sync()
    monkeypatch.setattr(served_saver, "SETTLE_S", 0.0)
    scans = []
    files_holding_purged = served_saver.files_holding_purged
    monkeypatch.setattr(served_saver, "files_holding_purged",
                        lambda *args: scans.append(1) or files_holding_purged(*args))
    other = CompactionLock(tmp_path, "h-2-b", served_saver.LEASE_S)
    assert other.acquire()
    # Before: every poll read every snapshot and segment while the lock was held (up to a
    # dead holder's lease).
    assert a.compact_after_purge() is None and a.compact_after_purge() is None and not scans
    other.release()
    settle(tmp_path)
    assert a.compact_after_purge() is not None and scans
    assert files_holding(tmp_path, SECRET) == []


def test_a_snapshot_after_a_purge_that_fails_is_tried_again_once_settled_not_every_poll(
        tmp_path, monkeypatch):
    a = purged_in_open_segment(tmp_path)
    clock = [time.monotonic()]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    a.sync()
    attempts = []

    def full_disk(*args, **kwargs):
        attempts.append(args[0])
        raise OSError(errno.ENOSPC, "No space left on device")

    write_snapshot = served_saver.write_snapshot
    monkeypatch.setattr(served_saver, "write_snapshot", full_disk)
    clock[0] += served_saver.SETTLE_S
    with pytest.raises(OSError, match="No space"):
        a.compact_after_purge()
    # Before: every poll (served_flush_ms) built another snapshot, on a full disk.
    clock[0] += a.flush_s
    assert a.compact_after_purge() is None and len(attempts) == 1
    monkeypatch.setattr(served_saver, "write_snapshot", write_snapshot)
    clock[0] += served_saver.SETTLE_S
    settle(tmp_path)  # the files' clock
    assert a.compact_after_purge() is not None
    assert files_holding(tmp_path, SECRET) == []


def test_a_purge_file_merged_while_a_replica_lists_them_is_read_all_the_same(
        tmp_path, monkeypatch):
    a = replica(tmp_path, "h-1-a")
    b = replica(tmp_path, "h-2-b")
    serve(a, "1", SECRET)
    a.writer.flush()
    time.sleep(0.01)
    rules = journal.PurgeRules()
    rules.add(journal.now_ms(), None)
    first = journal.write_purge(tmp_path, rules)
    # A compaction merges it into another file between b's listing and its reading.
    journal.write_purge(tmp_path, rules)
    first.unlink()
    real = journal.purge_files
    for module in (journal, served_saver):  # wherever the listing is made: once, too early
        listings = iter([[first]])
        monkeypatch.setattr(module, "purge_files",
                            lambda directory, listings=listings: next(listings, None)
                            or real(directory))
    b.sync()
    # Before: the purge was read as no purge, and b stored the purged request it read.
    assert stored(b) == []
    assert b.purges == rules
    # Merged again under another name: no new purge, b's open segment stays open.
    monkeypatch.undo()
    serve(b, "2", [2, 2])
    b.writer.flush()
    (merged,) = journal.purge_files(tmp_path)
    journal.write_purge(tmp_path, rules)
    merged.unlink()
    b.sync()
    assert [s.sealed for s in list_segments(tmp_path).values() if s.replica == "h-2-b"] == [False]


def test_a_snapshot_deletes_no_segment_it_does_not_include(tmp_path):
    a = replica(tmp_path, "h-1-a")
    b = replica(tmp_path, "h-2-b")
    serve(a, "1", [1, 1])
    a.writer.flush()
    a.close()  # sealed
    settle(tmp_path)
    # b never read a's segment: its snapshot includes none of it, and must leave it.
    serve(b, "2", [2, 2])
    b.compact(force=True)
    assert [s.replica for s in list_segments(tmp_path).values()] == ["h-1-a"]
    assert stored(replica(tmp_path, "h-3-c")) == [[1, 1], [2, 2]]


def test_purge_files_merge_into_one_holding_every_rule_at_its_latest(tmp_path):
    x, y = b"x" * 8, b"y" * 8
    for before_ms, key in ((300, None), (100, None), (50, x), (20, x), (70, y)):
        rules = journal.PurgeRules()
        rules.add(before_ms, key)
        journal.write_purge(tmp_path, rules)
    paths, rules = journal.read_purges(tmp_path)
    # A later file with an earlier time lowers nothing, globally or for a key.
    assert len(paths) == 5 and rules == journal.PurgeRules(300, {x: 50, y: 70})
    # Dropped: finished before the time, not at it.
    assert rules.drops(299, NO_KEY) and not rules.drops(300, NO_KEY)
    # A compaction merges them into one file, which every replica still reads the same.
    a = replica(tmp_path, "h-1-a")
    serve(a, "1", [1, 1])
    a.compact(force=True)
    paths, merged = journal.read_purges(tmp_path)
    assert len(paths) == 1 and merged == rules


def test_purge_leaves_a_just_sealed_segment_to_replicas_yet_to_read_it(tmp_path):
    a = replica(tmp_path, "h-1-a")
    b = replica(tmp_path, "h-2-b")
    serve(a, "1", [1, 1])
    a.close()  # flushed and sealed; b has not polled since
    assert purge(tmp_path, older_than_hours=1)[1] == 0
    # Before: purge deleted the segment at once, so b never read the request, and b's next
    # snapshot, the newest, left it out for every later start-up too.
    b.sync()
    assert stored(b) == [[1, 1]]
    b.writer.flush()
    b.compact(force=True)
    assert stored(replica(tmp_path, "h-3-c")) == [[1, 1]]


def test_purge_counts_and_keeps_a_request_read_twice_once(tmp_path):
    a = replica(tmp_path, "h-1-a", keyed=True)
    serve(a, "1", [1, 1], key="x")
    serve(a, "2", [2, 2], key="y")
    a.compact(force=True)  # from memory: the journal has neither yet
    a.writer.flush()  # now it has both, after what the snapshot includes of it
    time.sleep(0.01)
    snapshot, removed = purge(tmp_path, key="x")
    assert removed == 1
    kept = read_snapshot(snapshot, TOKENIZER.fingerprint).entries
    assert [e.tokens.tolist() for e in kept] == [[2, 2]]


def test_purge_needs_a_served_store(tmp_path):
    with pytest.raises(DatastoreError, match="not a served store"):
        purge(tmp_path)


# ------------------------------------------------------------------------- housekeeping

def test_a_snapshot_deletes_a_broken_segment_it_includes_up_to_where_it_breaks(tmp_path):
    good = encode_record(record(1, [5, 6], time_ms=journal.now_ms()))
    (tmp_path / "journal-h-9-z.0.sealed").write_bytes(good + b"\x00" * 5)
    b = replica(tmp_path, "h-2-b")
    assert stored(b) == [[5, 6]]
    settle(tmp_path)
    b.compact(force=True)
    assert list(list_segments(tmp_path)) == []
    assert stored(replica(tmp_path, "h-3-c")) == [[5, 6]]


def test_an_unsealed_segment_is_stale_once_its_writer_is_gone(tmp_path):
    host, dead = this_host(), 2**22 + 12345  # above pid_max's default: no such process

    def segment(replica):
        path = tmp_path / f"journal-{replica}.0"
        path.write_bytes(b"")
        return journal.Segment.parse(path)

    assert journal.stale_segment(segment(f"{host}-{dead}-a"), 0, host)
    assert not journal.stale_segment(segment(f"{host}-{os.getpid()}-b"), 0, host)
    # Another host's pid means nothing here: its segment is stale once still past its beats.
    assert not journal.stale_segment(segment(f"other-{dead}-c"), 60, host)
    assert not journal.stale_segment(segment(f"other-{dead}-c"),
                                     journal.FOREIGN_SEGMENT_S - 1, host)
    assert journal.stale_segment(segment(f"other-{dead}-c"), journal.FOREIGN_SEGMENT_S + 1, host)


def test_a_live_writer_keeps_its_quiet_segment_from_reading_as_a_dead_ones(tmp_path,
                                                                            monkeypatch):
    def age(segment) -> float:
        return time.time() - segment.path.stat().st_mtime

    writer = JournalWriter(tmp_path, "other-1-a", 1.0, background=False)
    writer.beat()  # no segment open yet: nothing to touch, nothing created
    assert list(tmp_path.iterdir()) == []
    writer.append(record(1, [1, 2]))
    writer.flush()
    [segment] = list_segments(tmp_path).values()
    os.utime(segment.path, (LONG_AGO, LONG_AGO))
    assert journal.stale_segment(segment, age(segment), this_host())
    writer.beat()
    assert not journal.stale_segment(segment, age(segment), this_host())
    writer.close()

    # The writer's thread beats though it has nothing more to write.
    monkeypatch.setattr(journal, "HEARTBEAT_S", 0.0)
    size = len(encode_record(record(2, [3, 4])))
    threaded = JournalWriter(tmp_path, "other-2-b", 0.01)
    threaded.append(record(2, [3, 4]))
    deadline = time.monotonic() + 10
    while threaded.flushed_sizes() != {"journal-other-2-b.0": size} \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    segment = list_segments(tmp_path)["journal-other-2-b.0"]
    os.utime(segment.path, (LONG_AGO, LONG_AGO))
    while age(segment) > 60 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not journal.stale_segment(segment, age(segment), this_host())
    assert segment.path.stat().st_size == size
    threaded.close()


def test_a_snapshot_deletes_the_unsealed_segment_of_a_dead_replica_it_includes(tmp_path):
    dead = replica(tmp_path, f"{this_host()}-{2**22 + 12345}-a")
    serve(dead, "1", [1, 1])
    dead.writer.flush()  # killed: its segment is never sealed
    b = replica(tmp_path, "h-2-b")
    settle(tmp_path)
    b.compact(force=True)
    assert list(list_segments(tmp_path)) == []
    assert stored(replica(tmp_path, "h-3-c")) == [[1, 1]]


def test_what_cut_off_writes_left_is_removed_at_start_up(tmp_path):
    dead = 2**22 + 12345  # above pid_max's default: no such process
    assert not stale_temporary("snapshot-1-h-1-a", 0, "h")
    assert stale_temporary(f"snapshot-1-h-1-a.tmp-{dead}", 0, "h")
    assert not stale_temporary(f"snapshot-1-h-1-a.tmp-{os.getpid()}", 0, "h")
    # Another host's pid means nothing here: only age tells.
    assert not stale_temporary(f"snapshot-1-g-1-a.tmp-{dead}", 60, "h")
    assert stale_temporary(f"snapshot-1-g-1-a.tmp-{dead}", 7200, "h")
    # A name without a host may be another host's write under way, for a moment.
    assert not stale_temporary(f"store.json.tmp-{dead}", 1, "h")
    assert stale_temporary(f"store.json.tmp-{dead}", 60, "h")
    cut_off = tmp_path / f"store.json.tmp-{dead}"
    cut_off.write_text("{")
    os.utime(cut_off, (time.time() - 60,) * 2)
    (tmp_path / f"purge-1-ab12.json.tmp-{dead}").write_text("{")  # under way: left
    (tmp_path / f"snapshot-1-{this_host()}-{dead}-a.tmp-{dead}").mkdir()
    (tmp_path / f"snapshot-1-{this_host()}-1-a.tmp-{os.getpid()}").mkdir()  # being written
    replica(tmp_path, "h-1-a")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"purge-1-ab12.json.tmp-{dead}", f"snapshot-1-{this_host()}-1-a.tmp-{os.getpid()}",
        "store.json"]


def test_the_lock_is_taken_over_once_its_lease_ran_out(tmp_path):
    held = CompactionLock(tmp_path, "a", 600)
    assert held.acquire()
    assert not CompactionLock(tmp_path, "b", 600).acquire()
    settle(tmp_path)
    taker = CompactionLock(tmp_path, "b", 600)
    assert taker.acquire()
    held.release()  # not a's any more: left alone
    assert (tmp_path / "compact.lock").read_text() == "b"
    taker.release()
    assert not (tmp_path / "compact.lock").exists()


def test_a_live_holder_renews_its_lease_for_max_hold_s_at_most(tmp_path, monkeypatch):
    lease_s = 1.0  # renewed every quarter: a busy machine's thread has 0.75 s of slack
    held = CompactionLock(tmp_path, "a", lease_s)
    assert held.acquire()
    time.sleep(1.5 * lease_s)
    assert held.held()
    assert not CompactionLock(tmp_path, "b", lease_s).acquire()
    held.release()
    assert not (tmp_path / "compact.lock").exists()
    # A lock released stays released: the renewing thread ended with it.
    time.sleep(0.5 * lease_s)
    assert not (tmp_path / "compact.lock").exists()

    # One stuck past MAX_HOLD_S is taken for a dead one.
    monkeypatch.setattr(journal, "MAX_HOLD_S", 0.5 * lease_s)
    stuck = CompactionLock(tmp_path, "a", lease_s)
    assert stuck.acquire()
    time.sleep(2 * lease_s)
    taker = CompactionLock(tmp_path, "b", lease_s)
    assert taker.acquire()
    stuck.release()  # not a's any more: left alone
    assert (tmp_path / "compact.lock").read_text() == "b"
    taker.release()


# --------------------------------------------------------- a store saved before the journal

def save_legacy(path, documents, fingerprint=TOKENIZER.fingerprint) -> None:
    """What the version before the journal saved: the store as a datastore at the root."""
    from vllm_retrieval_spec.datastore.build import build_datastore_from_token_ids

    build_datastore_from_token_ids(documents, path, tokenizer_name="t",
                                   tokenizer_fingerprint=fingerprint, vocab_size=1000,
                                   overwrite=True, progress=False)


def test_a_store_saved_before_the_journal_is_adopted_once_as_the_first_snapshot(tmp_path):
    save_legacy(tmp_path, [[1, 1], [2, 2, 2]])
    a = replica(tmp_path, "h-1-a")
    assert stored(a) == [[1, 1], [2, 2, 2]]
    # Its files are gone: the snapshot holds its requests, and nothing adopts them twice.
    assert not (tmp_path / "manifest.json").exists() and not (tmp_path / "tokens.npy").exists()
    assert [p.name for p in list_snapshots(tmp_path)] == ["snapshot-0000000001-h-1-a"]
    serve(a, "3", [3, 3])
    a.writer.flush()
    b = replica(tmp_path, "h-2-b")
    assert stored(b) == [[1, 1], [2, 2, 2], [3, 3]]


def test_adoption_cut_off_after_the_snapshot_finishes_at_the_next_start(tmp_path):
    save_legacy(tmp_path, [[1, 1]])
    replica(tmp_path, "h-1-a")
    # The legacy files again beside the snapshot, as if removing them had been cut off.
    save_legacy(tmp_path / "again", [[1, 1]])
    for file in (tmp_path / "again").iterdir():
        file.rename(tmp_path / file.name)
    b = replica(tmp_path, "h-2-b")
    assert stored(b) == [[1, 1]]
    assert not (tmp_path / "manifest.json").exists()
    assert len(list_snapshots(tmp_path)) == 1


def test_a_legacy_store_of_another_tokenizer_is_refused(tmp_path):
    save_legacy(tmp_path, [[1, 1]], fingerprint="0" * 64)
    with pytest.raises(DatastoreError, match="another tokenizer"):
        replica(tmp_path, "h-1-a")
    assert (tmp_path / "manifest.json").exists()
