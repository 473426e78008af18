"""The served store: what this engine has already generated, as one more source of drafts.

A server's own outputs are the most in-distribution text there is: the same model, the same kind
of prompts, the same phrasing. vLLM's ``suffix`` method learns from them and beats every static
datastore we built on prompts nobody tuned for; this store gives ``hybrid`` the same evidence.

Finished requests' tokens are kept whole, oldest first, up to ``max_tokens`` (whole requests
are evicted, oldest first). Lookups read an immutable snapshot, the documents joined by
SEPARATOR and their suffix array, searched with the same compiled functions as REST's
datastore. A background thread rebuilds the snapshot after requests were added and swaps it in
with one reference assignment, so drafting never waits for an insert and never sees a
half-built index; requests finishing while a rebuild runs are taken by the next one, and the
thread pauses between rebuilds so that it takes at most a fifth of a core.

Memory, for N stored tokens: 4N bytes of documents and 8N for the index (int32 tokens and
suffix array), so 12 MB at 1 M tokens; a rebuild allocates about 16N more while it runs (the
next index and divsufsort's working set). Measured at 1 M tokens on our CPU
(benchmarks/results/served-store.md): a rebuild takes about 0.1 s of one core and peaks at
16.5 MB, a lookup about 5 us (p50).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_retrieval_spec.datastore.format import SEPARATOR
from vllm_retrieval_spec.datastore.journal import now_ms
from vllm_retrieval_spec.datastore.suffix_array import (
    build_suffix_array,
    suffix_followers,
    suffix_lookup,
)

logger = logging.getLogger(__name__)

#: What a served-store datastore directory lists as its source.
SERVED_SOURCE = "served requests"
#: After a rebuild that took t seconds, the next one waits this many times t.
REBUILD_PAUSE = 4.0


@dataclass(frozen=True)
class SuffixIndex:
    """An in-memory token stream (documents joined by SEPARATOR) and its suffix array."""

    tokens: np.ndarray
    suffix_array: np.ndarray

    @classmethod
    def of_documents(cls, documents: Sequence[np.ndarray]) -> SuffixIndex:
        if not documents:
            return cls(np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int32))
        separator = np.full(1, SEPARATOR, dtype=np.int32)
        tokens = np.concatenate([part for doc in documents for part in (doc, separator)])
        return cls(tokens, build_suffix_array(tokens))


class ServedStore:
    """Finished requests' tokens, bounded, with REST's longest-suffix lookup.

    ``background=False`` rebuilds the index inside ``add`` (tests, offline replay); the engine
    uses a background thread.
    """

    def __init__(self, max_tokens: int, *, background: bool = True) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._documents: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        #: Key -> when its request finished (ms since the epoch), for retention.
        self._times: dict[Hashable, int] = {}
        self._num_tokens = 0
        self._lock = threading.Lock()
        #: Bumped by every add; a snapshot built at version v holds everything added before it.
        self._version = 0
        self._indexed_version = 0
        self.index = SuffixIndex.of_documents([])
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._rebuild_forever,
                                            name="served-store-index", daemon=True)
            self._thread.start()

    @property
    def num_tokens(self) -> int:
        """Tokens stored (separators not counted); the index may still lack the newest ones."""
        return self._num_tokens

    @property
    def num_documents(self) -> int:
        return len(self._documents)

    @property
    def version(self) -> int:
        """Changes with every add (savers compare it)."""
        return self._version

    def add(self, key: Hashable, tokens: np.ndarray | Sequence[int],
            time_ms: int | None = None) -> np.ndarray | None:
        """Store a finished request's tokens under ``key``, replacing an earlier entry with that
        key (a request vLLM preempted and resumed, or one read twice from disk: the same tokens
        keep the stored array); evict the oldest requests while the store holds more than
        ``max_tokens``. A request longer than the whole store keeps its end. ``time_ms``: when
        it finished (default: now).
        Returns the stored array (the dense store's keys point into it), None if empty."""
        document = np.array(np.asarray(tokens)[-self.max_tokens:], dtype=np.int32)
        if not len(document):
            return None
        with self._lock:
            old = self._documents.pop(key, None)
            if old is not None:
                self._num_tokens -= len(old)
                if np.array_equal(old, document):
                    # Read twice (a snapshot and the journal after it): the dense store's keys
                    # point into the first copy, the one ``ServedDenseStore.retain`` looks for.
                    document = old
            self._documents[key] = document
            self._times[key] = now_ms() if time_ms is None else time_ms
            self._num_tokens += len(document)
            while self._num_tokens > self.max_tokens:
                self._pop_oldest()
            self._changed()
        if self._thread is None:
            self.refresh()
        return document

    def evict_oldest(self) -> int:
        """Drop the oldest stored request; returns its number of tokens (0: none was left)."""
        with self._lock:
            if not self._documents:
                return 0
            evicted = self._pop_oldest()
            self._changed()
        if self._thread is None:
            self.refresh()
        return len(evicted)

    def remove_where(self, drop: Callable[[int], bool]) -> int:
        """Drop the requests whose finishing time (ms) ``drop`` is true of (retention, purges);
        returns their number."""
        with self._lock:
            gone = [key for key, time_ms in self._times.items() if drop(time_ms)]
            for key in gone:
                self._num_tokens -= len(self._documents.pop(key))
                del self._times[key]
            if gone:
                self._changed()
        if gone and self._thread is None:
            self.refresh()
        return len(gone)

    def _pop_oldest(self) -> np.ndarray:
        # Called with the lock held.
        key, evicted = self._documents.popitem(last=False)
        del self._times[key]
        self._num_tokens -= len(evicted)
        return evicted

    def _changed(self) -> None:
        # Called with the lock held.
        self._version += 1
        # All: waiters in wait_indexed share the condition with the rebuilding thread.
        self._wake.notify_all()

    def documents(self) -> list[np.ndarray]:
        """The stored requests' tokens, oldest first."""
        with self._lock:
            return list(self._documents.values())

    def items(self) -> list[tuple[Hashable, int, np.ndarray]]:
        """(key, finishing time in ms, tokens) of every stored request, oldest first."""
        with self._lock:
            return [(key, self._times[key], document)
                    for key, document in self._documents.items()]

    def refresh(self) -> None:
        """Index everything added so far (the background thread calls this after adds)."""
        with self._lock:
            version = self._version
            documents = list(self._documents.values())
        index = SuffixIndex.of_documents(documents)
        with self._lock:
            # Two refreshes may race (a caller's and the thread's); the newer snapshot wins.
            if version >= self._indexed_version:
                self.index = index
                self._indexed_version = version

    def wait_indexed(self, timeout: float = 60.0) -> bool:
        """Block until everything added so far is in the index (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._indexed_version < self._version:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._wake.wait(min(remaining, 0.05))
        return True

    def lookup(self, context: np.ndarray, *, min_len: int, max_len: int, max_occurrences: int,
               continuation_len: int) -> tuple[np.ndarray, np.ndarray, int]:
        """``SuffixArrayDatastore.lookup`` on the current snapshot."""
        index = self.index  # one read: a concurrent swap cannot mix two snapshots
        return suffix_lookup(index.tokens, index.suffix_array, context, min_len=min_len,
                             max_len=max_len, max_occurrences=max_occurrences,
                             continuation_len=continuation_len)

    def followers(self, last_token: int, max_samples: int) -> tuple[np.ndarray, bool]:
        """``suffix_followers`` in the snapshot ``self.index``."""
        index = self.index
        return suffix_followers(index.tokens, index.suffix_array, last_token, max_samples)

    def close(self, wait: bool = True) -> None:
        """Stop the background thread; ``wait``: until a rebuild under way ends (without, the
        thread ends by itself once it has)."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join(timeout=10)

    def _rebuild_forever(self) -> None:
        while True:
            with self._lock:
                while self._version == self._indexed_version and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
            start = time.monotonic()
            try:
                self.refresh()
            except Exception:
                # Drafting goes on from the last good snapshot; the next add retries.
                logger.exception("could not index the served store; drafts keep using the last "
                                 "index")
                with self._lock:
                    self._indexed_version = self._version
            with self._lock:
                self._wake.notify_all()
            # Under a stream of finishing requests, rebuild at most a fifth of the time: a
            # large store's rebuild takes a core for a fraction of a second (0.11 s at 1 M
            # tokens), and the engine needs its cores more than the newest requests.
            self._stop.wait(REBUILD_PAUSE * (time.monotonic() - start))


#: ``SamplingParams.extra_args`` key naming a request's served store (``served_store:
#: "per_request"``); the OpenAI server fills extra_args from a request's ``vllm_xargs``.
SERVED_STORE_KEY = "served_store_key"


def served_store_key(sampling_params: object) -> str | None:
    """The request's served-store key (its ``str``), or None when it names none."""
    key = (getattr(sampling_params, "extra_args", None) or {}).get(SERVED_STORE_KEY)
    return None if key is None else str(key)


class KeyedServedStores:
    """One served store per key, for ``served_store: "per_request"``: a request is drafted from,
    and stored in, only the store its key names, so requests learn only from requests with the
    same key (a tenant, a user) and time nothing about the others.

    Bounded together: at most ``max_tokens`` tokens in all stores (the least recently used key's
    oldest requests go first) and at most ``max_stores`` keys (the least recently used key's
    store goes whole). Each store rebuilds its index in its own background thread, idle between
    rebuilds. Thread-safe: with a ``served_datastore`` other replicas' requests arrive from the
    thread that reads their journals.
    """

    def __init__(self, max_tokens: int, max_stores: int, *, background: bool = True) -> None:
        if max_stores < 1:
            raise ValueError(f"max_stores must be at least 1, got {max_stores}")
        self.max_tokens = max_tokens
        self.max_stores = max_stores
        self.background = background
        #: Key -> its store, least recently used first.
        self._stores: OrderedDict[Hashable, ServedStore] = OrderedDict()
        self._lock = threading.RLock()

    @property
    def num_tokens(self) -> int:
        with self._lock:
            return sum(store.num_tokens for store in self._stores.values())

    @property
    def num_documents(self) -> int:
        with self._lock:
            return sum(store.num_documents for store in self._stores.values())

    @property
    def num_stores(self) -> int:
        return len(self._stores)

    def get(self, key: Hashable | None) -> ServedStore | None:
        """The store of ``key`` (None: no key, or nothing stored under it yet)."""
        if key is None:
            return None
        with self._lock:
            store = self._stores.get(key)
            if store is not None:
                self._stores.move_to_end(key)
            return store

    def add(self, key: Hashable, request_id: Hashable, tokens: np.ndarray | Sequence[int],
            time_ms: int | None = None) -> np.ndarray | None:
        """Store a finished request's tokens under ``key``, then evict to the bounds; returns
        the stored array (``ServedStore.add``)."""
        with self._lock:
            store = self._stores.get(key)
            if store is None:
                store = self._stores[key] = ServedStore(self.max_tokens,
                                                        background=self.background)
                if len(self._stores) > self.max_stores:
                    _, dropped = self._stores.popitem(last=False)
                    # Not waiting for a rebuild of what nobody reads any more: this runs in
                    # the engine's step, holding the lock every step's get() takes.
                    dropped.close(wait=False)
            self._stores.move_to_end(key)
            document = store.add(request_id, tokens, time_ms)
            excess = self.num_tokens - self.max_tokens
            for other in list(self._stores.values()):
                while excess > 0 and other.num_tokens:
                    excess -= other.evict_oldest()
            return document

    def items(self) -> list[tuple[Hashable, ServedStore]]:
        """(key, store) of every key, least recently used first."""
        with self._lock:
            return list(self._stores.items())

    def remove_where(self, drop: Callable[[int, Hashable], bool]) -> int:
        """Drop the requests whose (finishing time in ms, key) ``drop`` is true of; a store
        left empty goes. Returns the number of requests dropped."""
        removed = 0
        with self._lock:
            for key, store in list(self._stores.items()):
                removed += store.remove_where(lambda time_ms: drop(time_ms, key))
                if not store.num_documents:
                    del self._stores[key]
                    store.close(wait=False)
        return removed

    def wait_indexed(self, timeout: float = 60.0) -> bool:
        return all(store.wait_indexed(timeout) for _, store in self.items())

    def close(self) -> None:
        for _, store in self.items():
            store.close()
