"""Which requests the served store learns from: each running request's tokens as the drafter
sees them, handed to the store when vLLM finishes the request (``datastore.served``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np

from vllm_retrieval_spec.contract import UNKNOWN_TOKEN
from vllm_retrieval_spec.datastore.served import KeyedServedStores, ServedStore
from vllm_retrieval_spec.datastore.served_dense import ServedDenseStore


class ServedRequests:
    """Each running request's tokens as last seen by the drafter, handed to a ``ServedStore``
    (or, with keys, to its key's store in ``KeyedServedStores``) when vLLM says it finished
    (``finish``: ``Drafter.observe_finished``).

    A request that is only absent from the batch is not finished: vLLM takes preempted
    requests, and running ones it did not schedule this step, out of its batch and puts them
    back later with the same tokens (a preempted one's KV recomputed), so their entry is kept
    and grows on from where it was.
    """

    def __init__(self, store: ServedStore | KeyedServedStores, include_prompts: bool,
                 dense: ServedDenseStore | None = None,
                 persist: Callable[[Hashable | None, str, np.ndarray], None] | None = None
                 ) -> None:
        self.store = store
        self.include_prompts = include_prompts
        #: Called with (key, request id, stored tokens) for every request stored: the journal
        #: (``datastore.served_saver``).
        self.persist = persist
        #: The dense half, fed with each finished request's final hidden states.
        self.dense = dense
        #: Request id -> (prompt length, buffer, tokens in the buffer): a copy, since the
        #: batch's rows are reused once the request leaves, that grows by each step's new
        #: tokens only (a full copy per step would cost O(context) on every decoding step).
        self.running: dict[str, tuple[int, np.ndarray, int]] = {}
        #: Request id -> its store's key (``KeyedServedStores`` only).
        self.keys: dict[str, Hashable] = {}
        #: Request id -> its steps' (final hidden states [m, H], their positions), for ``dense``.
        self.states: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def observe(self, req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]],
                num_tokens: np.ndarray, token_ids: np.ndarray,
                keys: Sequence[Hashable | None] | None = None,
                states: Sequence[tuple[np.ndarray, np.ndarray] | None] | None = None,
                known_from: Sequence[int] = ()) -> None:
        """Record this step's tokens of every row that sampled (rows are ``req_ids``' order;
        ``token_ids[i]`` holds row i's tokens, at least its ``num_tokens[i]``, their ids known
        from position ``known_from[i]`` on, 0 where not given: ``Drafter.observe_batch``).
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
                if i < len(known_from):
                    buffer[:min(known_from[i], n)] = UNKNOWN_TOKEN
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
        requests never finish)."""
        self.finish(list(self.running))

    def finish(self, req_ids: Iterable[str],
               final: Mapping[str, np.ndarray] | None = None) -> None:
        """Hand these requests to the store (those tracked: a request seen by no step has
        nothing to store). ``final``: a request's every token, where known (vLLM's batch row):
        it also holds the tokens of steps not ``observe``d. What is stored starts after the
        last ``UNKNOWN_TOKEN`` (a prompt given as embeddings)."""
        for req_id in [r for r in req_ids if r in self.running]:
            prompt_len, buffer, length = self.running.pop(req_id)
            if final is not None and req_id in final:
                buffer, length = final[req_id], len(final[req_id])
            unknown = np.flatnonzero(buffer[:prompt_len] == UNKNOWN_TOKEN)
            start = max(0 if self.include_prompts else prompt_len,
                        int(unknown[-1]) + 1 if len(unknown) else 0)
            tokens = buffer[start:length]
            steps = self.states.pop(req_id, None)
            key = self.keys.pop(req_id, None)
            if isinstance(self.store, KeyedServedStores):
                document = self.store.add(key, req_id, tokens)
            elif steps:
                document = store_served(self.store, self.dense, req_id, tokens, start,
                                        np.concatenate([s for s, _ in steps]),
                                        np.concatenate([p for _, p in steps]))
            else:
                document = self.store.add(req_id, tokens)
            if self.persist is not None and document is not None:
                self.persist(key, req_id, document)


def store_served(store: ServedStore, dense: ServedDenseStore | None, req_id: str,
                 tokens: np.ndarray | Sequence[int], start: int, states: np.ndarray,
                 positions: np.ndarray) -> np.ndarray | None:
    """Store a finished request's ``tokens`` (its context from position ``start`` on) and, in
    ``dense``, its final hidden states ``states`` at context ``positions``, each pointing at
    its position in the stored document (which may keep only the end of ``tokens``). Returns
    the stored document."""
    document = store.add(req_id, tokens)
    if dense is None or document is None:
        return document
    positions = np.asarray(positions) - (start + len(tokens) - len(document))
    # A state predicts the token after its position, which must be in the document: its start
    # may be cut (the store's length limit), and its end too, where the row held tokens past
    # the request's EOS (``Drafter.observe_finished``), with their states.
    kept = (positions >= 0) & (positions < len(document) - 1)
    dense.add(document, states[kept], positions[kept])
    return document
