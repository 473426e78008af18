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
from typing import Any

import numpy as np

from vllm_retrieval_spec.datastore.dense import DENSE_DIR
from vllm_retrieval_spec.datastore.format import MANIFEST_FILE, SEPARATOR, load_datastore
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

        documents = self.documents()
        if not documents:
            return
        then = None
        if dense is not None and dense.fitted:
            then = functools.partial(_write_dense_keys, dense.snapshot(documents),
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


class ServedRequests:
    """Each running request's tokens as last seen by the drafter, handed to a ``ServedStore``
    (or, with keys, to its key's store in ``KeyedServedStores``) when the request leaves the
    batch.

    vLLM gives a ``custom_class`` drafter no "request finished" call: a request is finished
    (or preempted; a resumed one replaces its entry) when it is no longer in the batch.
    """

    def __init__(self, store: ServedStore | KeyedServedStores, include_prompts: bool,
                 dense: ServedDenseStore | None = None) -> None:
        self.store = store
        self.include_prompts = include_prompts
        #: The dense half, fed with each finished request's final hidden states.
        self.dense = dense
        #: Request id -> (prompt length, buffer, tokens in the buffer): a copy, since the
        #: batch's rows are reused once the request leaves, that grows by each step's new
        #: tokens only (a full copy per step would cost O(context) on every decoding step).
        self.running: dict[str, tuple[int, np.ndarray, int]] = {}
        #: Request id -> its store's key (``KeyedServedStores`` only).
        self.keys: dict[str, str] = {}
        #: Request id -> its steps' (final hidden states [m, H], their positions), for ``dense``.
        self.states: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def observe(self, req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]],
                num_tokens: np.ndarray, token_ids: np.ndarray,
                keys: Sequence[str | None] | None = None,
                states: Sequence[tuple[np.ndarray, np.ndarray] | None] | None = None) -> None:
        """Record this step's tokens of every row that sampled (rows are ``req_ids``' order;
        ``token_ids[i]`` holds row i's tokens, at least its ``num_tokens[i]``).
        With ``KeyedServedStores``, ``keys`` names each row's store; rows without a key are
        not recorded. ``states[i]``: row i's final hidden states of this step and the context
        positions they are at (for the dense store)."""
        keyed = isinstance(self.store, KeyedServedStores)
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled or i >= len(req_ids):
                continue
            req_id = req_ids[i]
            if keyed:
                key = keys[i] if keys is not None and i < len(keys) else None
                if key is None:
                    continue
                self.keys[req_id] = key
            n = int(num_tokens[i])
            known = self.running.get(req_id)
            if known is None or known[2] > n:
                # The first step that samples is the prefill's: everything before its tokens
                # is the prompt.
                prompt_len = n - len(sampled) if known is None else known[0]
                buffer = np.empty(max(2 * n, 64), dtype=np.int32)
                buffer[:n] = token_ids[i][:n]
                # Resumed after preemption: its context is recomputed, its states start over.
                self.states.pop(req_id, None)
            else:
                prompt_len, buffer, length = known
                if n > len(buffer):
                    buffer = np.concatenate([buffer[:length],
                                             np.empty(max(n, len(buffer)), dtype=np.int32)])
                buffer[length:n] = token_ids[i][length:n]
            self.running[req_id] = (prompt_len, buffer, n)
            if self.dense is not None and states is not None and i < len(states) \
                    and states[i] is not None:
                self.states.setdefault(req_id, []).append(states[i])

    def finish_all(self) -> None:
        """Hand every tracked request to the store (the engine is shutting down: the last
        requests never leave a batch)."""
        self.finish_absent(())

    def finish_absent(self, req_ids: Sequence[str]) -> None:
        """Hand every tracked request that is no longer in the batch to the store."""
        for req_id in self.running.keys() - set(req_ids):
            prompt_len, buffer, length = self.running.pop(req_id)
            start = 0 if self.include_prompts else prompt_len
            tokens = buffer[start:length]
            steps = self.states.pop(req_id, None)
            if isinstance(self.store, KeyedServedStores):
                self.store.add(self.keys.pop(req_id), req_id, tokens)
            elif steps:
                store_served(self.store, self.dense, req_id, tokens, start,
                             np.concatenate([s for s, _ in steps]),
                             np.concatenate([p for _, p in steps]))
            else:
                self.store.add(req_id, tokens)


def store_served(store: ServedStore, dense: ServedDenseStore | None, req_id: str,
                 tokens: np.ndarray | Sequence[int], start: int, states: np.ndarray,
                 positions: np.ndarray) -> None:
    """Store a finished request's ``tokens`` (its context from position ``start`` on) and, in
    ``dense``, its final hidden states ``states`` at context ``positions``, each pointing at
    its position in the stored document (which may keep only the end of ``tokens``)."""
    document = store.add(req_id, tokens)
    if dense is None or document is None:
        return
    positions = np.asarray(positions) - (start + len(tokens) - len(document))
    kept = positions >= 0
    dense.add(document, states[kept], positions[kept])


def _write_dense_keys(snapshot: tuple[np.ndarray, np.ndarray], projection: Any,
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


class PeriodicSaver:
    """Saves a served store to a datastore directory every ``interval_s`` seconds while it
    changes, and once more when the process exits; loads that directory first if it exists.

    Each save is a complete datastore written under a temporary name and renamed into place
    (``atomic_path``), so a crash mid-save leaves the previous save, which loads.
    """

    def __init__(self, store: ServedStore, path: str | Path, model_config: Any,
                 interval_s: float, dense: ServedDenseStore | None = None) -> None:
        self.store = store
        self.dense = dense
        self.path = Path(path)
        self.interval_s = interval_s
        self._saved_version: tuple[int, int] = (-1, -1)
        # At start-up, not at the first save: the last save happens while vLLM shuts the worker
        # down, and a worker that takes long to exit is killed.
        self._tokenizer = self._tokenizer_facts(model_config)
        self._model = ModelFacts.of(model_config) if dense is not None else None
        if (self.path / MANIFEST_FILE).is_file():
            # The front-end checked its tokenizer fingerprint against the model's (and its
            # dense index against the model, ``plugin.validate_against_model``).
            documents = store.load(self.path)
            # Indexed before the first request is drafted (start-up, not a decoding step).
            store.wait_indexed()
            logger.info("served store: loaded %d tokens from %s", sum(map(len, documents)),
                        self.path)
            if dense is not None and (self.path / DENSE_DIR / MANIFEST_FILE).is_file():
                self._load_dense(documents)
        self._saved_version = self._version()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._save_periodically, name="served-store-save",
                                        daemon=True)
        self._thread.start()

    def save_if_changed(self) -> bool:
        version = self._version()
        if version == self._saved_version:
            return False
        name, fingerprint, vocab_size = self._tokenizer
        self.store.save(self.path, tokenizer_name=name, tokenizer_fingerprint=fingerprint,
                        vocab_size=vocab_size, dense=self.dense, model=self._model)
        self._saved_version = version
        return True

    def _version(self) -> tuple[int, int]:
        # The dense keys of a finished request are indexed after its tokens are stored.
        return self.store.version, 0 if self.dense is None else self.dense.inserted

    def _load_dense(self, documents: list[np.ndarray]) -> None:
        from vllm_retrieval_spec.datastore.dense import DenseIndex

        index = DenseIndex.from_path(self.path, search="exact", verify_checksums=False)
        loaded = self.dense.load_keys(documents, np.asarray(index.keys), index.positions,
                                      index.projection)
        self.dense.wait_indexed()
        logger.info("served dense store: loaded %d keys from %s", loaded, self.path)

    def close(self) -> None:
        """Stop saving periodically; save what changed since the last save."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=60)
        self._save_logged()

    def _save_periodically(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._save_logged()

    def _save_logged(self) -> None:
        try:
            if self.save_if_changed():
                logger.info("served store: saved %d tokens to %s", self.store.num_tokens,
                            self.path)
        except Exception:
            # Serving goes on; the previous save stays in place.
            logger.exception("could not save the served store to %s", self.path)

    @staticmethod
    def _tokenizer_facts(model_config: Any) -> tuple[str, str, int]:
        """(name, fingerprint, vocab size) of the served model's tokenizer, for the manifest."""
        from transformers import AutoTokenizer

        from vllm_retrieval_spec.datastore.format import tokenizer_fingerprint, tokenizer_vocab_size

        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer, revision=model_config.tokenizer_revision,
            trust_remote_code=model_config.trust_remote_code)
        return (Path(str(model_config.tokenizer)).name, tokenizer_fingerprint(tokenizer),
                tokenizer_vocab_size(tokenizer))
