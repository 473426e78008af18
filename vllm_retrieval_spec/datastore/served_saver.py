"""The served store on disk (``served_datastore``): every finished request goes to this
replica's journal, snapshots compact the journals, and every replica given the same directory
reads the others' journals (``datastore.journal`` for the files).

At start-up a replica loads the newest snapshot that loads, then every journal segment from
where that snapshot stopped including it (and again, on top, a snapshot written meanwhile).
While it serves, it reads the other replicas' new records every flush interval, and every
``compact_s`` seals its segment and, if no snapshot is younger than half that and nobody holds
the lock, writes the next snapshot: what it holds, and how far into each segment that is.
Segments a snapshot includes whole are then deleted once their writer is done with them. A new
purge file seals the segment at once, and its snapshot follows once that segment settled.

A snapshot is written by one replica while others append, so it cannot know exactly what
their unread records hold: it records offsets, not contents, and a request read twice (the
writer's own records flushed after it listed them) is stored once, by its document id.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Container, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_retrieval_spec.atomic import atomic_path
from vllm_retrieval_spec.datastore.dense import DENSE_DIR
from vllm_retrieval_spec.datastore.format import (
    MANIFEST_FILE, SEPARATOR, DatastoreError, file_sha256, load_datastore)
from vllm_retrieval_spec.datastore.journal import (
    DIR_MODE, FILE_MODE, MAX_HOLD_S, MAX_RECORD_TOKENS, NO_KEY, REPLICA, SETTLE_S, STORE_FILE,
    CompactionLock, JournalReader, JournalWriter, PurgeRules, Record, Segment, TokenizerFacts,
    check_keyed, check_tokenizer, doc_id, fsync_directory, key_digest, list_segments,
    new_replica_id, now_ms, purge_files, read_purges, remove_stale_temporaries,
    segment_holds_purged, stale_segment, read_store_facts, store_facts, this_host, write_purge)
from vllm_retrieval_spec.datastore.served import KeyedServedStores, ServedStore
from vllm_retrieval_spec.datastore.served_dense import (
    ModelFacts, ServedDenseStore, document_starts)

logger = logging.getLogger(__name__)

#: What a snapshot's datastore lists as its source.
SERVED_SOURCE = "served requests"
_SNAPSHOT = re.compile(rf"snapshot-(\d+)-{REPLICA}")
#: uint64 [n, 4] per stored request, in the token stream's order: finishing time (ms),
#: document id, key digest (two words).
DOCUMENTS_FILE = "documents.npy"
#: The segments' offsets a snapshot includes, and documents.npy's checksum.
SERVED_FILE = "served.json"
#: A replica killed while writing a snapshot holds the lock this long (a live one renews it).
LEASE_S = 120.0
#: Requests past ``max_age_s`` are looked for this often.
RETENTION_SWEEP_S = 60.0


def tokenizer_facts(model_config: Any) -> TokenizerFacts:
    """The served model's tokenizer, as a snapshot's manifest records it. Its vocabulary size
    is the model's where that is larger (a padded embedding): vLLM takes a prompt's token ids
    up to the model's, and a snapshot refusing one such id would stop every compaction and
    purge until its request left the store."""
    from transformers import AutoTokenizer

    from vllm_retrieval_spec.datastore.format import tokenizer_fingerprint, tokenizer_vocab_size

    tokenizer = AutoTokenizer.from_pretrained(
        model_config.tokenizer, revision=model_config.tokenizer_revision,
        trust_remote_code=model_config.trust_remote_code)
    return TokenizerFacts(Path(str(model_config.tokenizer)).name,
                          tokenizer_fingerprint(tokenizer),
                          max(tokenizer_vocab_size(tokenizer), model_config.get_vocab_size()))


def write_served_dense_keys(snapshot: tuple[np.ndarray, np.ndarray], projection: Any,
                            model: ModelFacts, directory: Path, manifest: Any) -> None:
    """The served dense keys as ``directory``'s dense index (``build``'s ``then`` hook)."""
    from vllm_retrieval_spec.datastore.dense import write_dense_keys
    from vllm_retrieval_spec.datastore.format import TOKENS_FILE

    keys, positions = snapshot
    if not len(keys):
        return

    def fill(out: np.ndarray) -> None:
        out[:] = keys.astype(np.float16)

    write_dense_keys(directory / DENSE_DIR, manifest.files[TOKENS_FILE]["sha256"], len(keys),
                     fill, positions, projection, model_name=model.name,
                     model_fingerprint=model.fingerprint, hidden_size=model.hidden_size,
                     layer=model.layer, dtype=model.dtype, num_fit_samples=0, scann=False,
                     progress=False)


@dataclass(frozen=True)
class Entry:
    """A stored request as a snapshot holds it (``tokens`` may be a memory map)."""

    key: bytes
    doc_id: int
    time_ms: int
    tokens: np.ndarray


@dataclass(frozen=True)
class Snapshot:
    path: Path
    #: Segment name -> bytes of it this snapshot includes.
    segments: dict[str, int]
    entries: list[Entry]


def list_snapshots(directory: Path) -> list[Path]:
    """Snapshot directories, newest first (two written at once: the replica's name decides)."""
    found = [(int(m[1]), p.name, p) for p in directory.iterdir()
             if (m := _SNAPSHOT.fullmatch(p.name))]
    return [path for _, _, path in sorted(found, reverse=True)]


def write_snapshot(path: Path, entries: list[Entry], segments: dict[str, int],
                   tokenizer: TokenizerFacts, dense: ServedDenseStore | None = None,
                   model: ModelFacts | None = None) -> None:
    """A snapshot at ``path``, renamed into place whole, every file mode 0600 and fsynced (and
    written in a directory of mode 0700: the store's may be one others can enter):
    the requests' tokens as a datastore (with ``dense``'s keys into them as its dense index),
    their times and keys, and the ``segments`` offsets they include."""
    from vllm_retrieval_spec.datastore.build import build_datastore_from_token_ids

    documents = np.array([[e.time_ms, e.doc_id, *np.frombuffer(e.key, "<u8")]
                          for e in entries], dtype="<u8").reshape(-1, 4)

    def finish(directory: Path, manifest: Any = None) -> None:
        if dense is not None and dense.fitted and entries:
            write_served_dense_keys(dense.snapshot([e.tokens for e in entries]),
                                    dense.projection, model, directory, manifest)
        np.save(directory / DOCUMENTS_FILE, documents)
        (directory / SERVED_FILE).write_text(json.dumps({
            "segments": segments, "documents_sha256": file_sha256(directory / DOCUMENTS_FILE)}))
        make_private_and_durable(directory)

    if entries:
        build_datastore_from_token_ids(
            [e.tokens for e in entries], path, tokenizer_name=tokenizer.name,
            tokenizer_fingerprint=tokenizer.fingerprint, vocab_size=tokenizer.vocab_size,
            sources=[SERVED_SOURCE], overwrite=True, progress=False, then=finish,
            private=True)
    else:
        # Every request evicted or purged: a snapshot without a datastore says so.
        with atomic_path(path) as temporary:
            temporary.mkdir(mode=DIR_MODE)
            finish(temporary)
    fsync_directory(path.parent)


def make_private_and_durable(directory: Path) -> None:
    for path in [directory, *directory.rglob("*")]:
        if path.is_dir():
            path.chmod(DIR_MODE)
            # Its entries too: a snapshot that came back from a power loss without its files
            # would not load, and the segments it included are deleted once it is written.
            fsync_directory(path)
        else:
            path.chmod(FILE_MODE)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())


def read_snapshot(path: Path, fingerprint: str) -> Snapshot:
    """A snapshot, checked whole (checksums included) before anything is used; DatastoreError
    or OSError when it does not load."""
    served = json.loads((path / SERVED_FILE).read_text())
    if file_sha256(path / DOCUMENTS_FILE) != served["documents_sha256"]:
        raise DatastoreError(f"{path / DOCUMENTS_FILE} is corrupt (checksum)")
    documents = np.load(path / DOCUMENTS_FILE, mmap_mode="r")
    entries = []
    if len(documents):
        tokens = load_datastore(path, expected_fingerprint=fingerprint).tokens
        ends = np.flatnonzero(np.asarray(tokens) == SEPARATOR)
        if len(ends) != len(documents):
            raise DatastoreError(f"{path} holds {len(ends)} requests and {len(documents)} "
                                 f"requests' times and keys")
        starts = np.concatenate([[0], ends[:-1] + 1])
        entries = [Entry(row[2:].astype("<u8").tobytes(), int(row[1]), int(row[0]),
                         tokens[start:end])
                   for row, start, end in zip(documents, starts, ends)]
    return Snapshot(path, {str(k): int(v) for k, v in served["segments"].items()}, entries)


def read_newest_snapshot(snapshots: list[Path], fingerprint: str
                         ) -> tuple[Snapshot | None, set[str]]:
    """The newest of ``snapshots`` (newest first) that loads, or None, and the names of the
    newer ones that do not: each is logged and skipped, so that a damaged snapshot costs the
    requests it alone holds."""
    unloadable = set()
    for path in snapshots:
        try:
            return read_snapshot(path, fingerprint), unloadable
        except (DatastoreError, OSError, ValueError, KeyError) as e:
            logger.warning("served store: snapshot %s does not load (%s); trying an older "
                           "one", path, e)
            unloadable.add(path.name)
    return None, unloadable


def check_served_directory(path: Path, fingerprint: str, keyed: bool, *,
                           verify_checksums: bool = True) -> None:
    """The front-end's start-up check of a ``served_datastore`` directory: the tokens it holds
    (``store.json``, or a store saved before the journal) are of the tokenizer ``fingerprint``,
    its requests ``keyed`` or not as this server's. A directory that does not exist yet, or
    holds nothing, passes."""
    if (path / STORE_FILE).is_file():
        facts = read_store_facts(path)
        check_tokenizer(path, facts.tokenizer, fingerprint)
        check_keyed(path, facts.keyed, keyed)
    if (path / MANIFEST_FILE).is_file():
        load_datastore(path, expected_fingerprint=fingerprint, verify_checksums=verify_checksums)


#: The requests of a store saved before the journal: its own document ids.
LEGACY_REPLICA = "legacy"
#: How long a replica waits for another that is adopting a legacy store (or compacting).
ADOPT_WAIT_S = MAX_HOLD_S + LEASE_S


def adopt_legacy_store(directory: Path, tokenizer: TokenizerFacts, replica: str) -> int:
    """A store saved by the version before the journal (a datastore at the directory's root:
    ``manifest.json``, ``tokens.npy`` ...) becomes the directory's first snapshot, once, under
    the compaction lock; then its files go (the snapshot holds its requests). Returns the
    requests adopted. Its dense keys are not adopted: new traffic fits them again."""
    if not (directory / MANIFEST_FILE).is_file():
        return 0
    lock = CompactionLock(directory, replica, LEASE_S)
    adopted = 0
    deadline = time.monotonic() + ADOPT_WAIT_S
    # A snapshot next to the legacy files: a replica adopted them and died before removing
    # them (the journal's version never writes a datastore at the root).
    while not list_snapshots(directory):
        if lock.acquire():
            try:
                if not list_snapshots(directory):
                    adopted = _write_legacy_snapshot(directory, tokenizer, replica)
            finally:
                lock.release()
            break
        if time.monotonic() > deadline:
            raise DatastoreError(f"served store {directory}: {lock.path} has been held for "
                                 f"{ADOPT_WAIT_S:.0f} s while its saved store waits to be adopted")
        time.sleep(1.0)
    _remove_legacy_files(directory)
    return adopted


def _write_legacy_snapshot(directory: Path, tokenizer: TokenizerFacts, replica: str) -> int:
    datastore = load_datastore(directory, expected_fingerprint=tokenizer.fingerprint)
    tokens = np.asarray(datastore.tokens)
    ends = np.flatnonzero(tokens == SEPARATOR)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    # When they finished is not recorded: the last save is the latest it can be, so retention
    # keeps them no longer than it would have.
    saved_ms = int(1000 * (directory / MANIFEST_FILE).stat().st_mtime)
    entries = [Entry(NO_KEY, doc_id(LEGACY_REPLICA, str(i)), saved_ms, tokens[start:end])
               for i, (start, end) in enumerate(zip(starts, ends))]
    write_snapshot(directory / f"snapshot-{1:010d}-{replica}", entries, {}, tokenizer)
    logger.info("served store %s: adopted the %d requests saved before the journal as its "
                "first snapshot", directory, len(entries))
    return len(entries)


def _remove_legacy_files(directory: Path) -> None:
    """The legacy datastore's files, its manifest last (a start-up cut off here finishes)."""
    manifest = directory / MANIFEST_FILE
    try:
        files = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        return
    for name in files:
        (directory / name).unlink(missing_ok=True)
    shutil.rmtree(directory / DENSE_DIR, ignore_errors=True)
    manifest.unlink(missing_ok=True)
    fsync_directory(directory)


class ServedDirectory:
    """The served stores (``stores``: the shared store, or the stores by key digest) backed by
    a ``served_datastore`` directory shared with other replicas.

    ``background=False``: no threads; the caller runs ``sync``, ``compact`` and the writer's
    ``flush`` (tests).
    """

    def __init__(self, path: str | Path, stores: ServedStore | KeyedServedStores,
                 tokenizer: TokenizerFacts, *, flush_s: float, compact_s: float,
                 max_age_s: float = 0.0, dense: ServedDenseStore | None = None,
                 model: ModelFacts | None = None, background: bool = True,
                 replica: str | None = None) -> None:
        self.path = Path(path)
        self.stores = stores
        self.keyed = isinstance(stores, KeyedServedStores)
        self.tokenizer = tokenizer
        self.flush_s, self.compact_s, self.max_age_s = flush_s, compact_s, max_age_s
        self.dense, self.model = dense, model
        self.replica = replica or new_replica_id()
        self.path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        removed = remove_stale_temporaries(self.path)
        if removed:
            logger.info("served store: removed what cut-off writes left in %s: %s", self.path,
                        ", ".join(removed))
        self.salt = store_facts(self.path, tokenizer, self.keyed).salt
        adopt_legacy_store(self.path, tokenizer, self.replica)
        paths, self.purges = read_purges(self.path)
        self._purge_names = [p.name for p in paths]
        #: Bumped by every change to the stores: a replica with nothing new writes no snapshot.
        self.changes = 0
        self._compacted_at_change = 0
        self._swept = time.monotonic()
        #: A retention sweep ran since ``compact_after_expiry`` last looked at the snapshots.
        self._expiry_due = False
        self.reader = JournalReader(self.path, self.replica, {})
        #: Snapshots that did not load here: never kept as the newest's fallback.
        self.unloadable: set[str] = set()
        loaded, replayed = self._load()
        # Indexed before the first request is drafted (start-up, not a decoding step).
        stores.wait_indexed()
        if dense is not None:
            dense.wait_indexed()
        logger.info("served store %s: replica %s loaded %d requests from a snapshot and %d "
                    "from journals", self.path, self.replica, loaded, replayed)
        self.writer = JournalWriter(
            self.path, self.replica, flush_s, background=background,
            drops=lambda record: self.purges.drops(record.time_ms, record.key))
        #: When this replica noticed a purge its journal may hold requests of (monotonic);
        #: at start-up, if files hold purged requests (a replica stopped before its snapshot).
        self._purged_at = time.monotonic() \
            if files_holding_purged(self.path, self.purges) else None
        self.lock = CompactionLock(self.path, self.replica, LEASE_S)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._sync_forever, name="served-sync",
                                            daemon=True)
            self._thread.start()

    def key_of(self, key: str | None) -> bytes | None:
        """What a request's ``per_request`` key is stored and journaled under."""
        return None if key is None else key_digest(key, self.salt)

    def record(self, key: bytes | None, request_id: str, document: np.ndarray) -> None:
        """Journal a request just stored (the drafting path: this only queues)."""
        self.writer.append(Record(now_ms(), doc_id(self.replica, request_id), key or NO_KEY,
                                  document[-MAX_RECORD_TOKENS:]))
        self.changes += 1

    # ------------------------------------------------------------------------- reading

    def apply(self, records: list[Record]) -> int:
        """Store records read from disk, but those evicted by age or purged, or of another
        mode (a keyed request never enters the shared store, nor the reverse)."""
        added = 0
        cutoff = self._cutoff_ms()
        for record in records:
            if record.time_ms < cutoff or self.purges.drops(record.time_ms, record.key) \
                    or self.keyed == (record.key == NO_KEY):
                continue
            self._add(record.key, record.doc_id, record.tokens, record.time_ms)
            added += 1
        self.changes += added
        return added

    def _add(self, key: bytes, doc: int, tokens: np.ndarray, time_ms: int) -> np.ndarray | None:
        if self.keyed:
            return self.stores.add(key, doc, tokens, time_ms)
        return self.stores.add(doc, tokens, time_ms)

    def sync(self) -> None:
        """Read the other replicas' new records and new purges; drop what retention and
        purges say must go."""
        purged = False
        if [p.name for p in purge_files(self.path)] != self._purge_names:
            paths, rules = read_purges(self.path)
            self._purge_names = [p.name for p in paths]
            # The same rules under a new name: purge files merged by a compaction.
            purged, self.purges = rules != self.purges, rules
        if purged:
            # The open segment may hold purged requests: sealed, a snapshot can delete it
            # once it settled (``compact_after_purge``).
            self.writer.rotate()
            self._purged_at = time.monotonic()
        self.apply(self.reader.poll())
        due = self.max_age_s and time.monotonic() - self._swept >= RETENTION_SWEEP_S
        if purged or due:
            self._swept = time.monotonic()
            self.remove_dropped(purged=purged)
            self._expiry_due = self._expiry_due or bool(due)

    def remove_dropped(self, *, purged: bool = False) -> int:
        """Drop what retention and purges say must go (``purged``: a purge came, which may
        name requests only the dense store's keys still hold); returns how many went."""
        cutoff = self._cutoff_ms()
        purges = self.purges
        if self.keyed:
            removed = self.stores.remove_where(
                lambda time_ms, key: time_ms < cutoff or purges.drops(time_ms, key))
        else:
            removed = self.stores.remove_where(
                lambda time_ms: time_ms < cutoff or purges.drops(time_ms, NO_KEY))
            if self.dense is not None and (removed or purged):
                self.dense.retain(self.stores.documents())
        self.changes += removed
        return removed

    def _cutoff_ms(self) -> int:
        return now_ms() - int(1000 * self.max_age_s) if self.max_age_s else 0

    def _fallback_cutoff_ms(self) -> int:
        """Requests finished before this are past the age limit by two compaction intervals:
        a snapshot holding one is no fallback. (Under steady traffic the one before the newest
        always holds requests that expired in the interval since: it stays the fallback.)"""
        return self._cutoff_ms() - int(2000 * self.compact_s) if self.max_age_s else 0

    def _load(self) -> tuple[int, int]:
        """Load the newest snapshot, then the journals after it; returns how many requests
        came from each. A snapshot that appeared meanwhile is loaded on top and the journals
        read again: its writer deletes the segments it includes, perhaps before they were read
        (a long load, segments sealed long ago), and they are in no snapshot loaded before."""
        snapshots = list_snapshots(self.path)
        listed: set[str] = set()
        loaded = replayed = 0
        while True:
            listed.update(p.name for p in snapshots)
            offsets, count = self._load_snapshot(snapshots)
            loaded += count
            # What was read of a segment, or what the snapshot includes of it: both are stored.
            for name, offset in offsets.items():
                self.reader.offsets[name] = max(offset, self.reader.offsets.get(name, 0))
            replayed += self.apply(self.reader.poll())
            snapshots = list_snapshots(self.path)
            if {p.name for p in snapshots} <= listed:
                return loaded, replayed

    def _load_snapshot(self, snapshots: list[Path]) -> tuple[dict[str, int], int]:
        """Load the newest of ``snapshots`` that loads; returns the offsets it includes and how
        many requests were stored."""
        snapshot, unloadable = read_newest_snapshot(snapshots, self.tokenizer.fingerprint)
        self.unloadable |= unloadable
        if snapshot is None:
            return {}, 0
        cutoff = self._cutoff_ms()
        documents: list[np.ndarray | None] = [None] * len(snapshot.entries)
        # Oldest first, so that bounds evict the oldest.
        for i in sorted(range(len(snapshot.entries)),
                        key=lambda i: snapshot.entries[i].time_ms):
            e = snapshot.entries[i]
            if e.time_ms >= cutoff and not self.purges.drops(e.time_ms, e.key) \
                    and self.keyed != (e.key == NO_KEY):
                documents[i] = self._add(e.key, e.doc_id, e.tokens, e.time_ms)
        if self.dense is not None and (snapshot.path / DENSE_DIR).is_dir():
            self._load_dense(snapshot.path, snapshot.entries, documents)
        return snapshot.segments, sum(d is not None for d in documents)

    def _load_dense(self, path: Path, entries: list[Entry],
                    documents: list[np.ndarray | None]) -> None:
        """The snapshot's dense keys, into the stored documents (``documents[i]``: entry i's,
        None where it was dropped; a stored one may keep only its end)."""
        from vllm_retrieval_spec.datastore.dense import DenseIndex

        try:
            index = DenseIndex.from_path(path, expected_model_fingerprint=self.model.fingerprint,
                                         hidden_size=self.model.hidden_size, search="exact")
        except DatastoreError as e:
            logger.warning("served dense store: the keys in %s are not loaded (%s)", path, e)
            return
        positions = np.asarray(index.positions)
        starts = document_starts([e.tokens for e in entries])
        which = np.searchsorted(starts, positions, side="right") - 1
        cut = np.array([len(e.tokens) - (0 if d is None else len(d))
                        for e, d in zip(entries, documents)], dtype=np.int64)
        # Each key's position in its stored document; kept where that document is.
        within = positions - starts[which] - cut[which]
        stored = np.array([d is not None for d in documents])
        ok = stored[which] & (within >= 0)
        kept = [d for d in documents if d is not None]
        new_row = np.cumsum(stored) - 1
        new_positions = (document_starts(kept)[new_row[which[ok]]] if kept else 0) + within[ok]
        loaded = self.dense.load_keys(kept, np.asarray(index.keys)[ok], new_positions,
                                      index.projection)
        logger.info("served dense store: loaded %d keys from %s", loaded, path)

    # ---------------------------------------------------------------------- compaction

    def entries(self) -> list[Entry]:
        """What this replica stores, as a snapshot keeps it."""
        def of(key: bytes, items: list[tuple[Hashable, int, np.ndarray]]) -> list[Entry]:
            return [Entry(key, doc if isinstance(doc, int) else doc_id(self.replica, doc),
                          time_ms, tokens) for doc, time_ms, tokens in items]

        if self.keyed:
            return [e for key, store in self.stores.items() for e in of(key, store.items())]
        return of(NO_KEY, self.stores.items())

    def compact(self, *, force: bool = False) -> Path | None:
        """Seal this replica's segment; then, unless another replica wrote a snapshot less
        than half an interval ago or holds the lock (or nothing changed), write a snapshot and
        delete what it makes obsolete. Returns the snapshot written."""
        self.writer.rotate()
        snapshots = list_snapshots(self.path)
        recent = snapshots and time.time() - snapshots[0].stat().st_mtime < self.compact_s / 2
        if not force and (recent or self.changes == self._compacted_at_change):
            return None
        if not self.lock.acquire():
            return None
        try:
            changes = self.changes
            # Again under the lock: one written since the listing above is numbered over.
            snapshots = list_snapshots(self.path)
            on_disk = list_segments(self.path)
            # Own offsets before the entries: what was flushed is stored already.
            offsets = {name: offset for name, offset in
                       {**self.reader.offsets, **self.writer.flushed_sizes()}.items()
                       if name in on_disk}
            entries = self.entries()
            seq = int(_SNAPSHOT.fullmatch(snapshots[0].name)[1]) + 1 if snapshots else 1
            path = self.path / f"snapshot-{seq:010d}-{self.replica}"
            write_snapshot(path, entries, offsets, self.tokenizer, self.dense, self.model)
            self._compacted_at_change = changes
            self.writer.forget(remove_obsolete(self.path, offsets, self.reader.broken,
                                               self.replica, SETTLE_S, self.unloadable,
                                               self._fallback_cutoff_ms()))
            logger.info("served store: snapshot %s holds %d requests", path.name, len(entries))
            return path
        finally:
            self.lock.release()

    def compact_after_purge(self) -> Path | None:
        """After a purge: once the segment sealed when it was noticed has settled
        (``SETTLE_S``: the other replicas have read it), a snapshot whatever the schedule,
        which deletes that segment and the purged requests with it; tried again at the next
        poll while another replica holds the lock, ``SETTLE_S`` after one that failed (a
        full disk: not a snapshot built every poll); none once no file holds a purged request
        (another replica's deleted them). Returns the snapshot written."""
        if self._purged_at is None or time.monotonic() - self._purged_at < SETTLE_S \
                or self.lock.held():
            return None
        # Read every file only once nobody writes a snapshot (which may delete them): not at
        # every poll while another replica holds the lock.
        if not files_holding_purged(self.path, self.purges):
            self._purged_at = None
            return None
        try:
            path = self.compact(force=True)
        except Exception:
            self._purged_at = time.monotonic()
            raise
        if path is not None:
            self._purged_at = None
        return path

    def compact_after_expiry(self) -> Path | None:
        """After a retention sweep: a snapshot whatever the schedule if one kept as the
        newest's fallback holds a request past the age limit (``_fallback_cutoff_ms``), which
        deletes it; a fleet gone quiet writes no other, and the request would stay on disk.
        Returns the snapshot written."""
        if not self._expiry_due or self.lock.held():
            return None
        self._expiry_due = False
        cutoff = self._fallback_cutoff_ms()
        if not any(holds_dropped(old, self.purges, cutoff)
                   for old in list_snapshots(self.path)[1:]):
            return None
        return self.compact(force=True)

    # --------------------------------------------------------------------------- life

    def _sync_forever(self) -> None:
        next_compaction = time.monotonic() + self.compact_s
        while not self._stop.wait(self.flush_s):
            try:
                self.sync()
                self.compact_after_purge()
                self.compact_after_expiry()
                if time.monotonic() >= next_compaction:
                    next_compaction = time.monotonic() + self.compact_s
                    self.compact()
            except Exception:
                # Serving goes on; the journal keeps every request until a snapshot does.
                logger.exception("served store: could not read or compact %s", self.path)

    def close(self) -> None:
        """Stop reading and compacting; flush the journal one last time and seal it. Nothing
        else is needed at shutdown: the journal has every request already."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.writer.close()


def remove_obsolete(directory: Path, offsets: dict[str, int], broken: set[str], replica: str,
                    settle_s: float, unloadable: Container[str] = (),
                    cutoff_ms: int = 0) -> list[str]:
    """After a snapshot including ``offsets`` was written: delete the segments it includes
    whole (or up to where they break) once their writer is done with them (sealed, or its
    process is gone) and they have been still for ``settle_s`` (a replica reading them a
    little late still finds them); every snapshot but the newest and its fallback, the next
    one not ``unloadable`` (it did not load here) nor holding a purged request or one older
    than ``cutoff_ms`` (the age limit's: a fleet gone quiet writes no snapshot after the one
    that dropped them); merge the purge files into one. Returns the names of the segments
    deleted."""
    now = time.time()
    host = this_host()
    deleted = []
    for segment in list_segments(directory).values():
        try:
            stat = segment.path.stat()
        except FileNotFoundError:
            continue
        idle = now - stat.st_mtime
        included = segment.name in offsets and (
            offsets[segment.name] >= stat.st_size or segment.name in broken)
        done = segment.sealed or (segment.replica != replica
                                  and stale_segment(segment, idle, host))
        if included and done and idle >= settle_s:
            segment.path.unlink(missing_ok=True)
            deleted.append(segment.name)
    purges, rules = read_purges(directory)
    # One is kept as the newest's fallback (``_load_snapshot``): one that loads, and that
    # keeps on disk nothing a purge or the age limit removed.
    fallback = None
    for old in list_snapshots(directory)[1:]:
        if fallback is None and old.name not in unloadable \
                and not holds_dropped(old, rules, cutoff_ms):
            fallback = old
        else:
            shutil.rmtree(old, ignore_errors=True)
    if len(purges) > 1:
        # The merged file first: a replica listing meanwhile sees every rule at least once.
        write_purge(directory, rules)
        for path in purges:
            path.unlink(missing_ok=True)
    return deleted


def holds_dropped(snapshot: Path, rules: PurgeRules, cutoff_ms: int = 0) -> bool:
    """Whether ``snapshot`` holds a request ``rules`` drop, or one older than ``cutoff_ms``
    (its times and keys unreadable, or not those its ``SERVED_FILE`` records: it may)."""
    if not rules.latest_ms() and not cutoff_ms:
        return False
    try:
        served = json.loads((snapshot / SERVED_FILE).read_text())
        if file_sha256(snapshot / DOCUMENTS_FILE) != served["documents_sha256"]:
            return True
        documents = np.load(snapshot / DOCUMENTS_FILE)
    except (OSError, ValueError, KeyError, TypeError):
        return True
    times = np.asarray(documents[:, 0]).astype(np.int64)
    if (times < max(rules.before_ms, cutoff_ms)).any():
        return True
    keys = np.asarray(documents[:, 2:])
    return any((times[(keys == np.frombuffer(key, "<u8")).all(axis=1)] < before_ms).any()
               for key, before_ms in rules.key_before_ms.items())


def files_holding_purged(directory: Path, rules: PurgeRules) -> list[Path]:
    """The snapshots and journal segments in ``directory`` that hold a request ``rules`` drop
    (or may: unreadable)."""
    if not rules.latest_ms():
        return []
    return [path for path in list_snapshots(directory) if holds_dropped(path, rules)] + \
        [s.path for s in list_segments(directory).values() if segment_holds_purged(s, rules)]


def in_open_segments(paths: list[Path]) -> bool:
    """Whether every one of ``paths`` is an unsealed segment whose writer may still append to
    it (``stale_segment``): no snapshot written now could delete any of them."""
    host, now = this_host(), time.time()
    for path in paths:
        segment = Segment.parse(path)
        try:
            if segment is None or segment.sealed \
                    or stale_segment(segment, now - path.stat().st_mtime, host):
                return False
        except FileNotFoundError:
            return False
    return True


def purge(directory: str | Path, *, key: str | None = None,
          older_than_hours: float | None = None) -> tuple[Path | None, int]:
    """Remove served requests (of ``key``; finished more than ``older_than_hours`` ago; with
    neither, all) from a fleet's directory, running or not.

    A purge file first: every replica applies it at its next poll (and every start-up after):
    the requests leave its memory (and drafts, once its index is rebuilt: well under a second
    at 1 M tokens), and its journal queue unwritten, within a flush interval, and it seals its
    open segment. Then, unless a replica is writing a snapshot, a snapshot of
    everything else on disk; the segments it includes are deleted where their writers are done
    and they have been still for ``SETTLE_S``, and the snapshot before it if it holds purged
    requests. Each running replica writes a snapshot once the segment it sealed has settled
    and some file still holds a purged request (``compact_after_purge``; one stopped before
    that, once it starts again), which deletes the rest: the files lose the purged requests
    within ``SETTLE_S`` and two flush intervals. But for a stopped fleet's segments sealed in
    the last ``SETTLE_S`` (``compact_purged`` once they settled), and the unsealed segment of a
    replica killed on another host: at the first snapshot after ``FOREIGN_SEGMENT_S`` (ten
    minutes) without writes or heartbeats. Returns the snapshot written (None: left to the
    fleet) and the requests it removed."""
    directory = Path(directory)
    facts = read_store_facts(directory)
    before = now_ms() - (int(3_600_000 * older_than_hours) if older_than_hours else 0)
    rules = PurgeRules()
    rules.add(before, None if key is None else key_digest(key, facts.salt))
    write_purge(directory, rules)
    return compact_purged(directory)


def compact_purged(directory: Path) -> tuple[Path | None, int]:
    """A snapshot of every request on disk that the purge files keep, and the files it makes
    obsolete deleted, as :func:`purge` does after writing its rule; a purge's files that had
    not settled then are deleted by one of these once they have. Returns the snapshot written
    (None: the compaction lock is held) and the requests it left out."""
    facts = read_store_facts(directory)
    rules = read_purges(directory)[1]
    lock = CompactionLock(directory, new_replica_id(), LEASE_S)
    if not lock.acquire():
        return None, 0
    try:
        snapshots = list_snapshots(directory)
        # As start-up: a newest that does not load falls back to the one before.
        snapshot, unloadable = read_newest_snapshot(snapshots, facts.tokenizer.fingerprint)
        snapshot = snapshot or Snapshot(directory, {}, [])
        # Reads every segment, its own writer's included (an empty replica name is nobody's).
        reader = JournalReader(directory, "", snapshot.segments)
        read = snapshot.entries + [Entry(r.key, r.doc_id, r.time_ms, r.tokens)
                                   for r in reader.poll()]
        # A request read twice (a snapshot's writer flushed it after listing its offsets) is one
        # request, the later read, as start-up stores it: counted once, kept once.
        everything = list({e.doc_id: e for e in read}.values())
        kept = [e for e in everything if not rules.drops(e.time_ms, e.key)]
        seq = int(_SNAPSHOT.fullmatch(snapshots[0].name)[1]) + 1 if snapshots else 1
        path = directory / f"snapshot-{seq:010d}-{lock.owner}"
        write_snapshot(path, kept, reader.offsets, facts.tokenizer)
        # Settled as a compaction's: a replica yet to read a just-sealed segment would lose its
        # last requests, and then leave them out of its own next snapshot, the newest.
        remove_obsolete(directory, reader.offsets, reader.broken, "", SETTLE_S, unloadable)
        return path, len(everything) - len(kept)
    finally:
        lock.release()
