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
suffix array), so 12 MB at 1 M tokens; a rebuild allocates about 15N more while it runs (the
next index and divsufsort's working set). Measured at 1 M tokens on our CPU
(benchmarks/results/served-store.md): a rebuild takes 0.11 s of one core, a lookup 7.5 us
(p50).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_retrieval_spec.datastore.format import SEPARATOR, load_datastore
from vllm_retrieval_spec.datastore.served_dense import ModelFacts, ServedDenseStore
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
        self._documents: OrderedDict[str, np.ndarray] = OrderedDict()
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

    def add(self, key: str, tokens: np.ndarray | Sequence[int]) -> np.ndarray | None:
        """Store a finished request's tokens under ``key``, replacing an earlier entry with that
        key (a request vLLM preempted and resumed); evict the oldest requests while the store
        holds more than ``max_tokens``. A request longer than the whole store keeps its end.
        Returns the stored array (the dense store's keys point into it), None if empty."""
        document = np.array(np.asarray(tokens)[-self.max_tokens:], dtype=np.int32)
        if not len(document):
            return None
        with self._lock:
            old = self._documents.pop(key, None)
            if old is not None:
                self._num_tokens -= len(old)
            self._documents[key] = document
            self._num_tokens += len(document)
            while self._num_tokens > self.max_tokens:
                _, evicted = self._documents.popitem(last=False)
                self._num_tokens -= len(evicted)
            self._changed()
        if self._thread is None:
            self.refresh()
        return document

    def evict_oldest(self) -> int:
        """Drop the oldest stored request; returns its number of tokens (0: none was left)."""
        with self._lock:
            if not self._documents:
                return 0
            _, evicted = self._documents.popitem(last=False)
            self._num_tokens -= len(evicted)
            self._changed()
        if self._thread is None:
            self.refresh()
        return len(evicted)

    def _changed(self) -> None:
        # Called with the lock held.
        self._version += 1
        # All: waiters in wait_indexed share the condition with the rebuilding thread.
        self._wake.notify_all()

    def documents(self) -> list[np.ndarray]:
        """The stored requests' tokens, oldest first."""
        with self._lock:
            return list(self._documents.values())

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

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        self._stop.set()
        if self._thread is not None:
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

    # -------------------------------------------------------------------------- persistence

    def save(self, path: str | Path, *, tokenizer_name: str, tokenizer_fingerprint: str,
             vocab_size: int, dense: ServedDenseStore | None = None,
             model: ModelFacts | None = None) -> None:
        """Write the store as a datastore directory (tokens, suffix array, manifest and, with
        ``dense``, its keys as a dense index of ``model``), atomically: ``path`` is either the
        previous save or this one, never a mix."""
        from vllm_retrieval_spec.datastore.build import build_datastore_from_token_ids
        from vllm_retrieval_spec.datastore.served_saver import write_served_dense_keys

        documents = self.documents()
        if not documents:
            return
        then = None
        if dense is not None and dense.fitted:
            then = functools.partial(write_served_dense_keys, dense.snapshot(documents),
                                     dense.projection, model)
        build_datastore_from_token_ids(
            documents, path, tokenizer_name=tokenizer_name,
            tokenizer_fingerprint=tokenizer_fingerprint, vocab_size=vocab_size,
            sources=[SERVED_SOURCE], overwrite=True, progress=False, then=then)

    def load(self, path: str | Path, *,
             expected_fingerprint: str | None = None) -> list[np.ndarray]:
        """Add the documents of a datastore directory written by ``save`` (oldest first, as
        saved); returns the stored arrays, in the saved order (one per saved document)."""
        datastore = load_datastore(path, expected_fingerprint=expected_fingerprint)
        tokens = np.asarray(datastore.tokens)
        ends = np.flatnonzero(tokens == SEPARATOR)
        start = 0
        with self._lock:
            first = len(self._documents)
        documents = []
        for i, end in enumerate(ends):
            # save() writes no empty document: every one between separators has tokens.
            documents.append(self.add(f"saved-{first + i}", tokens[start:end]))
            start = end + 1
        return documents


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
    rebuilds.
    """

    def __init__(self, max_tokens: int, max_stores: int, *, background: bool = True) -> None:
        if max_stores < 1:
            raise ValueError(f"max_stores must be at least 1, got {max_stores}")
        self.max_tokens = max_tokens
        self.max_stores = max_stores
        self.background = background
        #: Key -> its store, least recently used first.
        self._stores: OrderedDict[str, ServedStore] = OrderedDict()

    @property
    def num_tokens(self) -> int:
        return sum(store.num_tokens for store in self._stores.values())

    @property
    def num_documents(self) -> int:
        return sum(store.num_documents for store in self._stores.values())

    @property
    def num_stores(self) -> int:
        return len(self._stores)

    def get(self, key: str | None) -> ServedStore | None:
        """The store of ``key`` (None: no key, or nothing stored under it yet)."""
        if key is None:
            return None
        store = self._stores.get(key)
        if store is not None:
            self._stores.move_to_end(key)
        return store

    def add(self, key: str, request_id: str, tokens: np.ndarray | Sequence[int]) -> None:
        """Store a finished request's tokens under ``key``, then evict to the bounds."""
        store = self._stores.get(key)
        if store is None:
            store = self._stores[key] = ServedStore(self.max_tokens, background=self.background)
            if len(self._stores) > self.max_stores:
                _, dropped = self._stores.popitem(last=False)
                dropped.close()
        self._stores.move_to_end(key)
        store.add(request_id, tokens)
        excess = self.num_tokens - self.max_tokens
        for other in list(self._stores.values()):
            while excess > 0 and other.num_tokens:
                excess -= other.evict_oldest()

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
