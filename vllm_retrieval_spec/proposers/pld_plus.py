"""PLD+ (arXiv 2412.01447, "PLD+(h)"): drafting from the request's own context, ranked by
hidden states.

Every earlier occurrence of the last token is a candidate; they are ranked by the cosine
similarity of an early layer's hidden states and the best one's continuation is drafted. The
paper's attention-based ranking, PLD+(a), needs attention weights, which vLLM's fused attention
kernels never materialise, so it is not offered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_retrieval_spec.config import PldPlusConfig
from vllm_retrieval_spec.contract import Capabilities, MethodDrafter
from vllm_retrieval_spec.proposers.hidden_states import HiddenStateCache, unit_rows


def rank_occurrences(context: np.ndarray, unit_states: np.ndarray, min_similarity: float,
                     max_candidates: int) -> int:
    """PLD+(h): the earlier occurrence ``j`` of the last token whose preceding state is most
    similar to the state before the last token, or -1.

    ``unit_states[p]`` is the unit-normalised early-layer state of context position ``p``; the
    last token's own state is not computed yet, so ``cos(H[j - 1], H[n - 2])`` compares the
    states that led to each occurrence with the one that led to the last token.
    """
    n = len(context)
    if n < 3 or len(unit_states) < n - 1:
        return -1
    occurrences = np.flatnonzero(context[1:n - 1] == context[n - 1]) + 1
    if not len(occurrences):
        return -1
    occurrences = occurrences[-max_candidates:]
    # float32 for the product: numpy multiplies float16 without BLAS, element by element.
    similarity = (unit_states[occurrences - 1].astype(np.float32, copy=False)
                  @ unit_states[n - 2].astype(np.float32, copy=False))
    best = int(np.argmax(similarity))
    return int(occurrences[best]) if similarity[best] >= min_similarity else -1


def pld_plus_draft(context: np.ndarray, unit_states: np.ndarray, max_len: int,
                   config: PldPlusConfig) -> np.ndarray:
    """The continuation of the best-ranked occurrence of the last token."""
    j = rank_occurrences(context, unit_states, config.min_similarity, config.max_candidates)
    if j < 0:
        return np.empty(0, dtype=np.int32)
    return np.asarray(context[j + 1:j + 1 + max_len], dtype=np.int32)


class PldPlusDrafter(MethodDrafter):
    """Keeps every request's early-layer states (``record_hidden_states``) and drafts with
    ``pld_plus_draft``."""

    def __init__(self, config: PldPlusConfig, hidden_size: int, max_model_len: int,
                 report: Callable[..., None]) -> None:
        self.config = config
        self.hidden_size = hidden_size
        self.max_model_len = max_model_len
        self.report = report
        self.capabilities = Capabilities(aux_hidden_state_layers=(config.layer,))
        self.caches: dict[str, HiddenStateCache] = {}
        #: Request id of each batch row this step.
        self.row_req_ids: list[str] = []

    def begin_step(self, req_ids: list[str], served_keys: list[str | None] | None) -> None:
        self.row_req_ids = req_ids

    def record_hidden_states(self, req_ids: list[str], aux_hidden_states: list[Any],
                             segments: list[tuple[int, int, int]]) -> None:
        """Store this step's accepted states.

        A failure here must not reach the engine: the caches are dropped instead, so requests
        get no draft until their states are complete again (a recompute from position 0).
        """
        try:
            # One copy to the host for the step (on a GPU each copy waits for the device), its
            # rejected draft tokens' rows included.
            end = max((offset + count for _, offset, count in segments), default=0)
            states = aux_hidden_states[0][:end].float().cpu().numpy()
            for req_id, (position, offset, count) in zip(req_ids, segments):
                cache = self.caches.get(req_id)
                if cache is None:
                    cache = self.caches[req_id] = HiddenStateCache(self.hidden_size,
                                                                   self.max_model_len)
                cache.write(position, unit_rows(states[offset:offset + count]))
        except Exception:
            self.report("exception", "could not record hidden states", exc_info=True)
            self.caches.clear()

    def finished(self, req_ids: set[str], tokens: dict[str, np.ndarray] | None = None) -> None:
        # Not when a request leaves the batch: vLLM drops a running request from it for every
        # step it does not schedule, and its states are needed when it comes back.
        for req_id in req_ids:
            self.caches.pop(req_id, None)

    def draft(self, row: int, context: np.ndarray, max_len: int) -> np.ndarray:
        cache = self.caches.get(self.row_req_ids[row]) if row < len(self.row_req_ids) else None
        states = cache.view() if cache is not None else None
        if states is None:
            # States for part of the context were never seen: no draft rather than a guess.
            return np.empty(0, dtype=np.int32)
        return pld_plus_draft(context, states, max_len, self.config)

    def warm_up(self, max_len: int, device: Any, dtype: Any) -> None:
        # The first step's conversions and similarity product (BLAS start-up) happen now.
        import torch

        states = unit_rows(torch.ones(4, self.hidden_size, device=device, dtype=dtype)
                           .float().cpu().numpy())
        pld_plus_draft(np.array([1, 2, 1, 2], dtype=np.int32), states, max_len, self.config)


def make_drafter(config: PldPlusConfig, vllm_config: Any,
                 report: Callable[..., None]) -> PldPlusDrafter:
    model = vllm_config.model_config
    return PldPlusDrafter(config, model.get_hidden_size(), model.max_model_len, report)
