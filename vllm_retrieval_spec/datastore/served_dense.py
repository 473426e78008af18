"""The served store's dense half: the final hidden states of the tokens this engine generated,
projected as DReSD's keys are (z-norm, PCA, L2), searchable while it grows.

The forward pass already computed every generated token's final hidden state, so indexing
served traffic densely costs no second pass. A key is the state at position p of a served
request (the state that predicted token p + 1); it points into that request's stored tokens
(the array the sparse served store keeps, never a copy), and a neighbour drafts the tokens after
p + 1 when token p + 1 is the token just emitted (DReSD's filter).

The projection is the static dense index's when there is one (so one query serves both),
otherwise it is fitted on the first ``fit_states`` served states; states served before the fit
are indexed once it is done.

The keys live in an HNSW graph (hnswlib) that takes inserts: ScaNN 1.4.2 can upsert only into a
searcher already trained on a database, which a store that starts empty does not have. Slots
are a ring of ``max_keys``: once full, the oldest key's slot is overwritten by the newest
(hnswlib updates a label in place), so the store is bounded without deletions. A purged
request's slots are emptied and its keys marked deleted (``retain``): searches no longer return
them, so they take no neighbour's place, though their vectors stay in the graph's memory until
the ring overwrites them. Memory per slot:
the graph's ``4 * dims + 8 * M + 16`` bytes (400 at dims 64, M 16) plus about 80 for its
pointer into the tokens (a Python tuple), so 96 MB at 200,000 keys; the whole graph is
allocated when the first key is inserted.

A background thread projects and inserts finished requests' states in small batches under a
lock; a search that finds the lock taken is skipped (drafting never waits for an insert) and
counted in ``busy``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_retrieval_spec.datastore.projection import Projection, fit_projection
from vllm_retrieval_spec.datastore.format import SEPARATOR

logger = logging.getLogger(__name__)

#: Keys inserted per hold of the lock: about 1.5 ms of one core (measured 92 us per insert on
#: random unit vectors), so a search is skipped in at most that window.
INSERT_BATCH = 16
#: HNSW graph degree and beam widths (hnswlib's defaults are M 16, ef 10).
HNSW_M = 16
HNSW_EF_CONSTRUCTION = 64
HNSW_EF_SEARCH = 64


@dataclass(frozen=True)
class ModelFacts:
    """What a saved dense index records of the model whose states it holds (``DenseManifest``),
    read once at start-up."""

    name: str
    fingerprint: str
    hidden_size: int
    #: The final, normed state: the model's depth.
    layer: int
    dtype: str

    @classmethod
    def of(cls, model_config: Any) -> ModelFacts:
        from pathlib import Path

        from vllm_retrieval_spec.datastore.dense import dtype_name
        from vllm_retrieval_spec.model_files import model_fingerprint

        return cls(Path(str(model_config.model)).name, model_fingerprint(model_config.model),
                   model_config.get_hidden_size(),
                   model_config.hf_text_config.num_hidden_layers, dtype_name(model_config.dtype))


class ServedDenseStore:
    """Projected final hidden states of served tokens -> their positions, in an HNSW graph.

    ``background=False`` inserts inside ``add`` (tests, offline replay).
    """

    def __init__(self, max_keys: int, dims: int, *, projection: Projection | None = None,
                 fit_states: int = 256, background: bool = True) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys}")
        if projection is None and fit_states < dims:
            raise ValueError(f"fit_states must be at least dims ({dims}) to fit a projection, "
                             f"got {fit_states}")
        self.max_keys = max_keys
        self.dims = dims
        self.projection = projection
        self.fit_states = fit_states
        #: Requests served before the projection was fitted: (document, positions, states).
        self._unfitted: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._unfitted_states = 0
        self._graph: Any = None
        #: Slot -> (the document its key points into, the key's position in it): one object,
        #: read at once, since the inserting thread may point the slot at a newer key.
        self._slots: list[tuple[np.ndarray, int] | None] = []
        self._next_slot = 0
        #: Keys a search can return: inserted, and neither overwritten nor purged.
        self.num_keys = 0
        #: Searches skipped because an insert held the graph; searches that found candidates.
        self.busy = 0
        self.hits = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        if background:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._insert_forever, args=(self._queue,),
                                             name="served-dense-index", daemon=True)
            self._thread.start()

    @property
    def fitted(self) -> bool:
        return self.projection is not None

    def add(self, document: np.ndarray, states: np.ndarray, positions: np.ndarray) -> None:
        """Index a finished request: ``states[j]`` (float32 [m, H]) is the final hidden state at
        ``document`` position ``positions[j]``, the one that predicted the next token."""
        if not len(states):
            return
        self._enqueue((document, np.asarray(positions, dtype=np.int64),
                       np.asarray(states, dtype=np.float32), None))

    def load_keys(self, documents: Sequence[np.ndarray], keys: np.ndarray,
                  positions: np.ndarray, projection: Projection) -> int:
        """Index saved keys (``snapshot``'s, projected by ``projection``): ``positions`` are in
        ``documents`` joined by SEPARATOR, as a saved datastore's tokens are. Returns the
        number of keys queued: 0 when this store projects differently (its static dense index
        changed since the save), since those keys would not be comparable with its queries."""
        if self.projection is not None and not np.array_equal(
                self.projection.components, projection.components):
            logger.warning("served dense store: the saved keys were projected differently from "
                           "this datastore's dense index; they are not loaded")
            return 0
        self.projection = projection
        starts = document_starts(documents)
        which = np.searchsorted(starts, positions, side="right") - 1
        keys = np.asarray(keys, dtype=np.float32)
        for i, document in enumerate(documents):
            rows = np.flatnonzero(which == i)
            if len(rows):
                self._enqueue((document, positions[rows] - starts[i], None, keys[rows]))
        return len(keys)

    def snapshot(self, documents: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(keys float32 [n, dims], positions int64 [n]) of the keys pointing into
        ``documents`` (the same arrays, as the sparse store holds them), positions in the
        documents joined by SEPARATOR; keys of documents not among them are left out."""
        starts = {id(d): s for d, s in zip(documents, document_starts(documents).tolist())}
        with self._lock:
            slots, positions = [], []
            for slot, key in enumerate(self._slots):
                if key is not None and id(key[0]) in starts:
                    slots.append(slot)
                    positions.append(starts[id(key[0])] + key[1])
            keys = self._graph.get_items(slots, return_type="numpy") if slots else \
                np.empty((0, self.dims), dtype=np.float32)
        return np.asarray(keys, dtype=np.float32), np.asarray(positions, dtype=np.int64)

    def retain(self, documents: Sequence[np.ndarray]) -> None:
        """Draft from ``documents`` only (what the sparse store holds once a purge or the age
        limit removed requests): the slots of other documents' keys are emptied (the ring
        refills them), after the inserts already queued. Those of requests the sparse store
        evicted go too: the ring may outlive them (long prompts, few keys each), and they
        are older than any it holds, so as old as those removed, and maybe purged. (A request
        stored after ``documents`` were listed, its insert queued before this, loses its keys:
        drafts, not data.)"""
        self._enqueue(_Retain(list(documents)))

    def _enqueue(self, item: tuple | _Retain) -> None:
        """``item``: an insert's arguments, or a retain."""
        if self._closed:
            return  # shut down: an insert here could race one the thread has not finished
        if self._queue is not None:
            self._queue.put(item)
        else:
            self._apply(item)

    def _apply(self, item: tuple | _Retain) -> None:
        if isinstance(item, _Retain):
            self._retain(item.documents)
        else:
            self._insert(*item)

    def _retain(self, documents: list[np.ndarray]) -> None:
        kept = {id(document) for document in documents}
        self._unfitted = [u for u in self._unfitted if id(u[0]) in kept]
        self._unfitted_states = sum(len(states) for _, _, states in self._unfitted)
        # Found without the lock (only this thread writes slots), so searches are not skipped
        # while ``max_keys`` slots are scanned.
        slots = [slot for slot, key in enumerate(self._slots)
                 if key is not None and id(key[0]) not in kept]
        with self._lock:
            for slot in slots:
                self._slots[slot] = None
                # Unmarked by hnswlib when the ring reuses the slot.
                self._graph.mark_deleted(slot)
            self.num_keys -= len(slots)

    def project(self, states: Any) -> np.ndarray | None:
        """Unit queries [B, dims] for final hidden states [B, H] (torch, any device), or None
        before the projection is fitted."""
        projection = self.projection
        return None if projection is None else projection(states)

    def search(self, query: np.ndarray, top_n: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(slots int64 [n], inner products float32 [n]) of the nearest keys of one unit query,
        best first; None when nothing is indexed or an insert holds the graph."""
        if not self.num_keys:
            return None
        if not self._lock.acquire(blocking=False):
            self.busy += 1
            return None
        try:
            k = min(top_n, self.num_keys)
            labels, distances = self._graph.knn_query(query[None], k=k)
        finally:
            self._lock.release()
        # hnswlib's "ip" distance is 1 - inner product.
        return labels[0].astype(np.int64), (1.0 - distances[0]).astype(np.float32)

    def candidates(self, query: np.ndarray | None, emitted: int, top_n: int,
                   continuation_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Continuations of the nearest keys whose stored next token is ``emitted``: (cands
        int32 [m, continuation_len] padded with SEPARATOR, lengths int32 [m], similarities
        float64 [m], floored at 0), as ``matching_continuations`` gives for a static index."""
        found = None if query is None else self.search(query, top_n)
        cands = np.full((0 if found is None else len(found[0]), continuation_len), SEPARATOR,
                        dtype=np.int32)
        lengths = np.zeros(len(cands), dtype=np.int32)
        weights = np.zeros(len(cands), dtype=np.float64)
        kept = 0
        for slot, score in zip(*found) if found is not None else ():
            key = self._slots[slot]
            if key is None:
                continue
            document, position = key
            if position + 1 >= len(document) or document[position + 1] != emitted:
                continue
            continuation = document[position + 2:position + 2 + continuation_len]
            cands[kept, :len(continuation)] = continuation
            lengths[kept] = len(continuation)
            weights[kept] = score if score > 0.0 else 0.0  # NaN too (matching_continuations)
            kept += 1
        self.hits += kept > 0
        return cands[:kept], lengths[:kept], weights[:kept]

    def wait_indexed(self, timeout: float = 60.0) -> bool:
        """Block until every request added so far is indexed (or waits for the fit)."""
        if self._queue is None:
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    #: How long ``close`` waits for what is queued to be indexed.
    CLOSE_WAIT_S = 10.0

    def close(self) -> None:
        """Stop indexing: what is queued is indexed first, for at most ``CLOSE_WAIT_S``
        (the thread goes on after that, with the queue it was given); later requests are
        dropped."""
        self._closed = True
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=self.CLOSE_WAIT_S)
            self._queue = None

    def _insert_forever(self, requests: queue.SimpleQueue) -> None:
        while True:
            item = requests.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._apply(item)
            except Exception:
                # Drafting goes on from the keys indexed so far.
                logger.exception("could not index a served request's hidden states")

    def _insert(self, document: np.ndarray, positions: np.ndarray, states: np.ndarray | None,
                keys: np.ndarray | None) -> None:
        """Index ``keys``, or ``states`` projected (held back until the projection is fitted)."""
        if keys is None and self.projection is None:
            self._unfitted.append((document, positions, states))
            self._unfitted_states += len(states)
            if self._unfitted_states < self.fit_states:
                return
            import torch

            self.projection = fit_projection(
                torch.from_numpy(np.concatenate([s for _, _, s in self._unfitted])), self.dims)
            logger.info("served dense store: projection fitted on %d served states "
                        "(%.0f%% of their variance)", self._unfitted_states,
                        100 * self.projection.explained_variance)
            pending, self._unfitted = self._unfitted, []
            for document, positions, states in pending:
                self._insert(document, positions, states, None)
            return
        if keys is None:
            import torch

            keys = self.projection(torch.from_numpy(states))
        # A request longer than the store keeps its last keys.
        keys, positions = keys[-self.max_keys:], positions[-self.max_keys:]
        for start in range(0, len(keys), INSERT_BATCH):
            batch = slice(start, start + INSERT_BATCH)
            self._insert_batch(document, keys[batch], positions[batch])

    def _insert_batch(self, document: np.ndarray, keys: np.ndarray,
                      positions: np.ndarray) -> None:
        slots = (self._next_slot + np.arange(len(keys))) % self.max_keys
        with self._lock:
            if self._graph is None:
                import hnswlib

                self._graph = hnswlib.Index(space="ip", dim=self.dims)
                self._graph.init_index(max_elements=self.max_keys,
                                       ef_construction=HNSW_EF_CONSTRUCTION, M=HNSW_M)
                self._graph.set_ef(HNSW_EF_SEARCH)
                # Inserts run in this one background thread: the engine needs the cores.
                self._graph.set_num_threads(1)
                self._slots = [None] * self.max_keys
            slots = slots.tolist()
            new_keys = sum(self._slots[slot] is None for slot in slots)
            # A slot already in the graph is updated in place (the ring's oldest key goes), a
            # purged one's key is also unmarked.
            self._graph.add_items(keys, slots)
            for slot, position in zip(slots, positions.tolist()):
                self._slots[slot] = (document, position)
            self._next_slot = int((self._next_slot + len(keys)) % self.max_keys)
            self.num_keys += new_keys


@dataclass(frozen=True)
class _Retain:
    """A queued ``ServedDenseStore.retain``: it holds the documents, so that their ids stay
    theirs until it is applied."""

    documents: list[np.ndarray]


def document_starts(documents: Sequence[np.ndarray]) -> np.ndarray:
    """Where each document starts in ``documents`` joined by SEPARATOR (a saved datastore's
    token stream)."""
    return np.cumsum([0] + [len(d) + 1 for d in documents[:-1]])


def accepted_state_rows(last_rows: Sequence[int], num_sampled: Sequence[int],
                        whole: Sequence[bool]) -> list[tuple[int, int]]:
    """For each batch row, the rows ``[first, last]`` of the step's sampled hidden states that
    produced its sampled tokens, in order: a chain's accepted states are contiguous and end at
    its last state; where ``whole`` is False (a tree's path is not contiguous) only the last
    state is known. ``(-1, -1)`` where nothing was sampled."""
    spans = []
    for last, n, contiguous in zip(last_rows, num_sampled, whole):
        if last < 0 or n < 1:
            spans.append((-1, -1))
        else:
            spans.append((last - n + 1 if contiguous else last, last))
    return spans
