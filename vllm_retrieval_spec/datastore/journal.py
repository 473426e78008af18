"""The served store's journal: the files in a ``served_datastore`` directory that make it
durable and shared by a fleet of replicas, with no lock beyond atomic renames (and a lease
that only saves duplicated work).

    store.json                    the tokenizer's fingerprint and the salt of key hashes
    journal-<replica>.<n>         the n-th journal segment of one replica: only it appends
    journal-<replica>.<n>.sealed  a segment its replica will never append to again
    snapshot-<seq>-<replica>/     a snapshot: a datastore (``datastore.format``) of the
                                  requests kept, their times and keys, and how far into each
                                  segment it includes (``datastore.served_saver``)
    purge-<ms>-<random>.json      a purge: requests (of one key) finished before a time go
    compact.lock                  held while a replica writes a snapshot

A segment is a sequence of records, each ``magic | payload length | crc32 | payload``, the
payload ``time (ms) | document id | key digest | int32 tokens``. A replica appends a batch with
one write and one fsync; a reader takes the complete records and comes back for the rest. A
record that never completes (its writer was killed mid-write) or fails its checksum ends what
is read of that segment, with one warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_retrieval_spec.atomic import atomic_path, pid_alive

logger = logging.getLogger(__name__)

MAGIC = b"RSJ1"
_FRAME = struct.Struct("<4sII")
_HEADER = struct.Struct("<qQ16s")
#: A record holds at most this many tokens (``ServedSaver.record`` journals a longer request's
#: end): more than any model's context, and few enough that a length field torn or flipped into
#: a large number reads as corruption at once, not as a record still being written.
MAX_RECORD_TOKENS = 1 << 26
MAX_PAYLOAD = _HEADER.size + 4 * MAX_RECORD_TOKENS
#: The key digest of the shared store's requests.
NO_KEY = bytes(16)

STORE_FILE = "store.json"
LOCK_FILE = "compact.lock"
SEALED = ".sealed"
#: Replica ids (``new_replica_id``) have no dots: a name parses one way.
REPLICA = r"[A-Za-z0-9_-]+"
_SEGMENT = re.compile(rf"(journal-({REPLICA})\.(\d+))(\.sealed)?")
_PURGE = re.compile(r"purge-\d+-[0-9a-f]+\.json")
_TEMPORARY = re.compile(r".+\.(?:tmp|old)-(\d+)")
#: A record that stays incomplete or unreadable this long after its segment last changed was
#: cut off: its writer died (a live writer completes a batch within one write).
SETTLE_S = 30.0
#: A temporary left by another host is removed after this long: its pid means nothing here.
FOREIGN_TEMPORARY_S = 3600.0
#: A replica touches its open segment this often, written to or not (``JournalWriter.beat``):
#: another host cannot ask whether its pid lives, but can read the segment's age.
HEARTBEAT_S = 60.0
#: Another host's unsealed segment is a dead writer's once this long still: ten missed beats
#: (a live writer's thread only waits between them, and a flush interval is at most a minute).
FOREIGN_SEGMENT_S = 10 * HEARTBEAT_S
#: The compaction lock's holder renews its lease for this long at most, so that one stuck
#: is taken for a dead one within ten minutes, as before leases were renewed (a snapshot of 1 M
#: random token ids took 0.1 s on 2 cores).
MAX_HOLD_S = 480.0
#: Files and directories the store creates: readable by the serving user only.
FILE_MODE = 0o600
DIR_MODE = 0o700


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class Record:
    """One finished request: when it finished (ms since the epoch), its document id (unique in
    the fleet), its ``per_request`` key's digest (``NO_KEY``: the shared store), its tokens."""

    time_ms: int
    doc_id: int
    key: bytes
    tokens: np.ndarray


def encode_record(record: Record) -> bytes:
    payload = _HEADER.pack(record.time_ms, record.doc_id, record.key) + \
        np.ascontiguousarray(record.tokens, dtype="<i4").tobytes()
    return _FRAME.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def decode_records(data: bytes) -> tuple[list[Record], int, bool]:
    """The complete records at the start of ``data``: (records, bytes they take, whether
    reading stopped at a corrupt record rather than at the end or an incomplete one)."""
    records = []
    offset = 0
    view = memoryview(data)
    while len(data) - offset >= _FRAME.size:
        magic, length, crc = _FRAME.unpack_from(data, offset)
        if magic != MAGIC or not _HEADER.size <= length <= MAX_PAYLOAD \
                or (length - _HEADER.size) % 4:
            return records, offset, True
        end = offset + _FRAME.size + length
        if end > len(data):
            break
        payload = view[offset + _FRAME.size:end]
        if zlib.crc32(payload) != crc:
            return records, offset, True
        time_ms, doc_id, key = _HEADER.unpack_from(payload)
        tokens = np.frombuffer(payload[_HEADER.size:], dtype="<i4").astype(np.int32)
        records.append(Record(time_ms, doc_id, key, tokens))
        offset = end
    return records, offset, False


def doc_id(replica: str, request_id: str) -> int:
    """A fleet-wide document id: a resumed request (same replica, same request id) gets the
    same one, so that its later record replaces the earlier one."""
    digest = hashlib.blake2b(f"{replica}/{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def key_digest(key: str, salt: bytes) -> bytes:
    """What the store keeps of a ``per_request`` key: a salted hash (the salt is the
    directory's), so the files do not hold tenants' names."""
    return hashlib.blake2b(key.encode(), digest_size=16, key=salt).digest()


def new_replica_id() -> str:
    """``<host>-<pid>-<random>``: unique per process, and names the host and pid that wrote a
    file (``stale_temporary`` reads them)."""
    host = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


def create_private(path: Path) -> int:
    """A new file only the serving user can read, opened for appending."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, FILE_MODE)


def fsync_directory(directory: Path) -> None:
    """Make a created or renamed entry of ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_private(path: Path, text: str) -> None:
    """Write a small file atomically (renamed into place), mode 0600, fsynced."""
    with atomic_path(path) as temporary:
        fd = create_private(temporary)
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_directory(path.parent)


# ------------------------------------------------------------------------------ segments

@dataclass(frozen=True)
class Segment:
    """A journal segment file: ``name`` is its identity (sealing does not change it)."""

    path: Path
    name: str
    replica: str
    number: int
    sealed: bool

    @classmethod
    def parse(cls, path: Path) -> Segment | None:
        match = _SEGMENT.fullmatch(path.name)
        if match is None:
            return None
        return cls(path, match[1], match[2], int(match[3]), match[4] is not None)


def list_segments(directory: Path) -> dict[str, Segment]:
    """Every journal segment in ``directory`` by name, each replica's in the order written
    (a resumed request's later record must replace its earlier one); one sealed while the
    directory was listed may show under both its names: it is listed once, sealed."""
    segments: dict[str, Segment] = {}
    for path in directory.iterdir():
        segment = Segment.parse(path)
        if segment is not None and (segment.sealed or segment.name not in segments):
            segments[segment.name] = segment
    return dict(sorted(segments.items(), key=lambda item: (item[1].replica, item[1].number)))


#: Tokens of failed batches a writer holds to write again (``JournalWriter._requeue``): a
#: default served store's worth (``served_max_tokens``).
RETRY_TOKENS = 1_000_000


class JournalWriter:
    """This replica's journal. ``append`` only queues (the drafting path calls it); a thread
    writes what is queued every ``flush_s`` seconds as one write and one fsync, so a crash
    loses at most the last interval.

    ``rotate`` seals the current segment: the next batch starts segment n + 1, and a snapshot
    that includes a sealed segment whole lets it be deleted. ``drops``: records purged while
    queued, never written. ``background=False``: no thread, the caller flushes (tests).
    """

    def __init__(self, directory: Path, replica: str, flush_s: float, *,
                 drops: Callable[[Record], bool] | None = None,
                 background: bool = True) -> None:
        self.directory = directory
        self.replica = replica
        self.flush_s = flush_s
        self.drops = drops
        self._queue: list[Record] = []
        self._queue_lock = threading.Lock()
        #: Held while writing, rotating and reading sizes: one writer at a time.
        self._write_lock = threading.Lock()
        self._number = 0
        self._fd: int | None = None
        self._path: Path | None = None
        #: Bytes written to each of this replica's segments (the current one last).
        self.sizes: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._flush_forever, name="served-journal",
                                            daemon=True)
            self._thread.start()

    def append(self, record: Record) -> None:
        with self._queue_lock:
            self._queue.append(record)

    def flush(self) -> None:
        """Write and fsync everything queued (the thread calls this every interval)."""
        with self._queue_lock:
            batch, self._queue = self._queue, []
        if self.drops is not None:
            batch = [record for record in batch if not self.drops(record)]
        if not batch:
            return
        data = b"".join(map(encode_record, batch))
        with self._write_lock:
            try:
                fd = self._current()
                written = 0
                while written < len(data):
                    written += os.write(fd, data[written:])
                os.fsync(fd)
                self.sizes[self._segment_name()] += len(data)
            except OSError:
                # Serving goes on, and the batch is written with the next one: a snapshot may
                # never come first (a clean shutdown writes none; in a fleet another replica
                # may always have written one recently).
                logger.exception("served store: could not write %d records to the journal in "
                                 "%s; tried again at the next flush", len(batch),
                                 self.directory)
                self._seal(cut_back=True)
                self._requeue(batch)

    def _requeue(self, batch: list[Record]) -> None:
        """Put a batch that failed back before what was queued since, keeping at most the
        newest ``RETRY_TOKENS`` tokens of it: a disk that stays full must not hold evicted
        requests in memory without bound."""
        kept, tokens = len(batch), 0
        while kept and tokens + len(batch[kept - 1].tokens) <= RETRY_TOKENS:
            kept -= 1
            tokens += len(batch[kept].tokens)
        if kept:
            logger.error("served store: %d records are left out of the journal (it could not "
                         "be written for too long)", kept)
        with self._queue_lock:
            self._queue[:0] = batch[kept:]

    def rotate(self) -> None:
        """Seal the current segment (if it has records): it is never appended to again."""
        with self._write_lock:
            self._seal()

    def _seal(self, cut_back: bool = False) -> None:
        """Seal the current segment; with ``cut_back`` (after a failed batch, which may have
        left part of itself there: readers stop at the first torn record) first cut it back to
        its last whole batch. Whatever fails here, the next batch starts another segment: this
        one's name, still on disk, would refuse it (O_EXCL) at every later batch."""
        if self._fd is None:
            return
        fd, path, self._fd = self._fd, self._path, None
        size = self.sizes[self._segment_name()]
        self._number += 1
        try:
            try:
                if cut_back:
                    os.ftruncate(fd, size)
            finally:
                os.close(fd)
            os.rename(path, path.with_name(path.name + SEALED))
        except FileNotFoundError:
            pass  # deleted as a dead replica's (``stale_segment``): nothing left to seal
        except OSError:
            # Left unsealed, it is read all the same (readers warn once about a torn tail and
            # skip it), and taken for a dead replica's once this process is gone.
            logger.exception("served store: could not %s the journal segment %s",
                             "cut back and seal" if cut_back else "seal", path)

    def flushed_sizes(self) -> dict[str, int]:
        with self._write_lock:
            return dict(self.sizes)

    def forget(self, names: Iterable[str]) -> None:
        """Segments deleted after a snapshot included them."""
        with self._write_lock:
            for name in names:
                if self._fd is None or name != self._segment_name():
                    self.sizes.pop(name, None)

    def close(self) -> None:
        """A last flush, then the segment is sealed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.flush()
        self.rotate()

    def _segment_name(self) -> str:
        return f"journal-{self.replica}.{self._number}"

    def _current(self) -> int:
        """The current segment's fd: created at the first batch after a rotation, and again if
        another replica took this one for a dead replica's and deleted it."""
        if self._fd is not None:
            try:
                alive = os.fstat(self._fd).st_ino == os.stat(self._path).st_ino
            except FileNotFoundError:
                alive = False
            if alive:
                return self._fd
            os.close(self._fd)
            self._fd = None
            self._number += 1
        self._path = self.directory / self._segment_name()
        self._fd = create_private(self._path)
        # Known before anything else can fail: a failure cuts the segment back to this size.
        self.sizes[self._segment_name()] = 0
        fsync_directory(self.directory)
        return self._fd

    def beat(self) -> None:
        """Touch the open segment, so that other hosts read its writer as alive
        (``stale_segment``)."""
        with self._write_lock:
            if self._fd is None:
                return
            try:
                os.utime(self._fd)
            except OSError:
                # Taken for a dead writer's, the segment is deleted once a snapshot includes
                # it whole, and the next batch starts another (``_current``): nothing is lost.
                logger.warning("served store: could not touch the journal segment %s",
                               self._path)

    def _flush_forever(self) -> None:
        last_beat = time.monotonic()
        while not self._stop.wait(self.flush_s):
            self.flush()
            if time.monotonic() - last_beat >= HEARTBEAT_S:
                self.beat()
                last_beat = time.monotonic()


def segment_holds_purged(segment: Segment, rules: PurgeRules) -> bool:
    """Whether ``segment`` holds a request ``rules`` drop, or may (bytes past its readable
    records). Its first record is its earliest (records are appended as they finish): one
    at or after every rule's time spares reading the rest."""
    try:
        with open(segment.path, "rb") as f:
            head = f.read(_FRAME.size + _HEADER.size)
            if len(head) == _FRAME.size + _HEADER.size and head.startswith(MAGIC) \
                    and _HEADER.unpack_from(head, _FRAME.size)[0] >= rules.latest_ms():
                return False
            data = head + f.read()
    except FileNotFoundError:
        return False  # deleted meanwhile
    records, consumed, _ = decode_records(data)
    return consumed < len(data) or any(rules.drops(r.time_ms, r.key) for r in records)


class JournalReader:
    """Reads the records other replicas (and earlier processes) appended: each segment from
    where the last ``poll`` (or the snapshot loaded) stopped, complete records only."""

    def __init__(self, directory: Path, replica: str, offsets: dict[str, int]) -> None:
        self.directory = directory
        self.replica = replica
        #: Segment name -> bytes read (or included in the snapshot loaded).
        self.offsets = dict(offsets)
        #: Segments whose rest is unreadable (warned once each).
        self.broken: set[str] = set()

    def poll(self, now: float | None = None) -> list[Record]:
        now = time.time() if now is None else now
        records: list[Record] = []
        for segment in list_segments(self.directory).values():
            if segment.replica == self.replica or segment.name in self.broken:
                continue
            records += self._read(segment, now)
        return records

    def _read(self, segment: Segment, now: float) -> list[Record]:
        offset = self.offsets.get(segment.name, 0)
        try:
            with open(segment.path, "rb") as f:
                stat = os.fstat(f.fileno())
                if stat.st_size <= offset:
                    # Recorded even at 0: an empty segment (a write cut back on a full disk)
                    # is then included whole by a snapshot, and deleted.
                    self.offsets[segment.name] = offset
                    return []
                f.seek(offset)
                data = f.read()
                # Its time after the read: a batch written since the size was taken, half
                # copied when read, must not make a long-quiet segment look cut off by a crash
                # (it would be skipped for good, and deleted by this reader's next snapshot).
                modified = os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return []  # sealed or deleted meanwhile: read at the next poll, or included
        records, consumed, corrupt = decode_records(data)
        self.offsets[segment.name] = offset + consumed
        if consumed < len(data) and (corrupt or segment.sealed
                                     or now - modified > SETTLE_S):
            self.broken.add(segment.name)
            logger.warning("served store: %s holds %d unreadable bytes after byte %d (%s); "
                           "they are skipped", segment.path, len(data) - consumed,
                           offset + consumed, "a corrupt record" if corrupt
                           else "a record cut off by a crash")
        return records


# ------------------------------------------------------------------------------- purges

@dataclass
class PurgeRules:
    """Requests finished before ``before_ms`` go, and those of a key before its time."""

    before_ms: int = 0
    key_before_ms: dict[bytes, int] = dataclasses.field(default_factory=dict)

    def drops(self, time_ms: int, key: bytes) -> bool:
        return time_ms < self.before_ms or time_ms < self.key_before_ms.get(key, 0)

    def add(self, before_ms: int, key: bytes | None) -> None:
        if key is None:
            self.before_ms = max(self.before_ms, before_ms)
        else:
            self.key_before_ms[key] = max(self.key_before_ms.get(key, 0), before_ms)

    def latest_ms(self) -> int:
        """No request finished at or after this is dropped."""
        return max([self.before_ms, *self.key_before_ms.values()])


def write_purge(directory: Path, rules: PurgeRules) -> Path:
    """A purge file: every replica drops the requests ``rules`` name at its next poll."""
    path = directory / f"purge-{now_ms()}-{secrets.token_hex(4)}.json"
    write_private(path, json.dumps({"before_ms": rules.before_ms, "keys": {
        key.hex(): before_ms for key, before_ms in rules.key_before_ms.items()}}))
    return path


def read_purges(directory: Path) -> tuple[list[Path], PurgeRules]:
    """The purge files and their rules together. A file merged into another between the
    listing and its reading (``served_saver.remove_obsolete``) is listed again: the merged
    file is written before the files it merges are deleted, so the next listing has it."""
    while True:
        paths = purge_files(directory)
        rules = PurgeRules()
        try:
            for path in paths:
                data = json.loads(path.read_text())
                rules.add(int(data["before_ms"]), None)
                for key, before_ms in data["keys"].items():
                    rules.add(int(before_ms), bytes.fromhex(key))
        except FileNotFoundError:
            continue
        return paths, rules


def purge_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if _PURGE.fullmatch(p.name))


# ------------------------------------------------------------------------ housekeeping

class CompactionLock:
    """One snapshot writer at a time: ``compact.lock`` is created exclusively, and taken over
    once its holder's lease (``lease_s`` since the file last changed) ran out. The holder's
    thread renews the lease while it lives, for ``MAX_HOLD_S`` at most: a holder killed
    mid-snapshot blocks the others for one lease, one stuck for ``MAX_HOLD_S``. Two replicas
    taking over one lease at once would both write a snapshot: that costs work, never data
    (``datastore.served_saver``)."""

    def __init__(self, directory: Path, owner: str, lease_s: float) -> None:
        self.path = directory / LOCK_FILE
        self.owner = owner
        self.lease_s = lease_s
        self._released = threading.Event()

    def acquire(self) -> bool:
        for _ in range(2):
            try:
                fd = create_private(self.path)
            except FileExistsError:
                if self.held():
                    return False
                self.path.unlink(missing_ok=True)
                continue
            os.write(fd, self.owner.encode())
            os.close(fd)
            self._released = threading.Event()
            threading.Thread(target=self._renew, args=(self._released,),
                             name="served-lock-lease", daemon=True).start()
            return True
        return False

    def _renew(self, released: threading.Event) -> None:
        deadline = time.monotonic() + MAX_HOLD_S
        while not released.wait(self.lease_s / 4) and time.monotonic() < deadline:
            try:
                if self.path.read_text() != self.owner:
                    return  # taken over: this holder's lease had run out
                os.utime(self.path)
            except OSError:
                return

    def held(self) -> bool:
        """Whether a holder's lease on the lock is running."""
        try:
            return time.time() - self.path.stat().st_mtime <= self.lease_s
        except FileNotFoundError:
            return False

    def release(self) -> None:
        self._released.set()
        try:
            if self.path.read_text() == self.owner:
                self.path.unlink()
        except FileNotFoundError:
            pass


def stale_temporary(name: str, age_s: float, host: str) -> bool:
    """Whether ``name`` is what a cut-off atomic write left (``atomic.atomic_path``'s
    ``.tmp-<pid>``, ``.old-<pid>``): its pid is dead on this host and the name says this host
    wrote it (snapshots name their replica), or it is old enough that no write still runs.

    Other names (``store.json``'s, a purge file's) do not say which host wrote them, and
    another host's live writer may have a pid dead here (replicas starting together on a new
    directory): they count as this host's once still for ``SETTLE_S``, past any such write."""
    match = _TEMPORARY.fullmatch(name)
    if match is None:
        return False
    if age_s > FOREIGN_TEMPORARY_S:
        return True
    ours = f"-{host}-" in name if name.startswith("snapshot-") else age_s > SETTLE_S
    return ours and not pid_alive(int(match[1]))


def stale_segment(segment: Segment, age_s: float, host: str) -> bool:
    """Whether an unsealed segment's writer is gone: its pid is dead on this host, or it has
    been still for ``FOREIGN_SEGMENT_S``, past every heartbeat (another host's)."""
    return age_s > FOREIGN_SEGMENT_S or dead_here(segment.replica, host)


def dead_here(replica: str, host: str) -> bool:
    """Whether a ``new_replica_id`` name (``<host>-<pid>-<random>``) is ``host``'s and its pid
    is dead."""
    parts = replica.rsplit("-", 2)
    return len(parts) == 3 and parts[0] == host and parts[1].isdigit() \
        and not pid_alive(int(parts[1]))


def this_host() -> str:
    return new_replica_id().rsplit("-", 2)[0]


def remove_stale_temporaries(directory: Path) -> list[str]:
    """Remove what cut-off writes left in ``directory``; returns their names."""
    import shutil

    host = this_host()
    removed = []
    for path in directory.iterdir():
        try:
            age = time.time() - path.lstat().st_mtime
        except FileNotFoundError:
            continue
        if stale_temporary(path.name, age, host):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


@dataclass(frozen=True)
class TokenizerFacts:
    """The served model's tokenizer, as snapshots' manifests record it."""

    name: str
    fingerprint: str
    vocab_size: int


@dataclass(frozen=True)
class StoreFacts:
    """``store.json``: whose tokens the directory holds, the salt of its key digests, and
    whether its requests are keyed (None: written before that was recorded)."""

    tokenizer: TokenizerFacts
    salt: bytes
    keyed: bool | None


def read_store_facts(directory: Path) -> StoreFacts:
    from vllm_retrieval_spec.datastore.format import DatastoreError

    try:
        data = json.loads((directory / STORE_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError):
        # NotADirectoryError: ``directory`` is a file (``vllm-rsd served purge FILE``).
        raise DatastoreError(f"{directory} is not a served store: it has no {STORE_FILE}") \
            from None
    except ValueError as e:
        raise _unusable_store_file(directory, e) from None
    try:
        facts = StoreFacts(TokenizerFacts(**data["tokenizer"]), bytes.fromhex(data["key_salt"]),
                           data.get("keyed"))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _unusable_store_file(directory, e) from None
    if facts.keyed not in (None, True, False):
        raise _unusable_store_file(directory, f"'keyed' is {facts.keyed!r}")
    return facts


def _unusable_store_file(directory: Path, why: object) -> Exception:
    """A hand-edited or damaged store.json: a one-line error, not a traceback. Not replaced:
    a new salt would orphan the keyed requests, and the tokenizer check would go."""
    from vllm_retrieval_spec.datastore.format import DatastoreError

    return DatastoreError(f"{directory / STORE_FILE} is unusable ({why!s}); restore it, or "
                          f"give this server a directory of its own")


def store_facts(directory: Path, tokenizer: TokenizerFacts, keyed: bool) -> StoreFacts:
    """The directory's facts, after checking that it holds this tokenizer's tokens and
    requests keyed (``per_request``) or not as this replica's are (the first replica writes
    ``store.json``: journals would otherwise be read as any model's tokens)."""
    path = directory / STORE_FILE
    if not path.is_file():
        staged = path.with_name(f"{STORE_FILE}.tmp-{os.getpid()}")
        staged.unlink(missing_ok=True)  # only a dead process with our pid left it
        fd = create_private(staged)
        try:
            os.write(fd, json.dumps({"tokenizer": dataclasses.asdict(tokenizer),
                                     "key_salt": secrets.token_hex(16),
                                     "keyed": keyed}).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            # Not a rename: two replicas starting together must agree on one salt.
            os.link(staged, path)
        except FileExistsError:
            pass
        finally:
            staged.unlink()
        fsync_directory(directory)
    facts = read_store_facts(directory)
    check_tokenizer(directory, facts.tokenizer, tokenizer.fingerprint)
    check_keyed(directory, facts.keyed, keyed)
    return facts


def check_keyed(directory: Path, recorded: bool | None, keyed: bool) -> None:
    """Refuse a directory of the other served-store mode's requests: a replica stores and
    snapshots only its own mode's, and a snapshot's offsets pass over the others', so they
    would be lost once it compacts."""
    from vllm_retrieval_spec.datastore.format import DatastoreError

    if recorded is not None and recorded != keyed:
        modes = {True: "'per_request'", False: "'shared'"}
        raise DatastoreError(
            f"served store {directory} holds requests of served_store {modes[recorded]}; this "
            f"server's is {modes[keyed]}: give it a directory of its own")


def check_tokenizer(directory: Path, recorded: TokenizerFacts, fingerprint: str) -> None:
    """Refuse a directory of another tokenizer's tokens: they would draft nonsense, or ids
    outside the vocabulary (the front-end checks at start-up, each replica again)."""
    from vllm_retrieval_spec.datastore.format import DatastoreError

    if recorded.fingerprint != fingerprint:
        raise DatastoreError(
            f"served store {directory} holds tokens of another tokenizer "
            f"({recorded.name!r}, fingerprint {recorded.fingerprint}; the model's "
            f"is {fingerprint}): give this model a directory of its own")
