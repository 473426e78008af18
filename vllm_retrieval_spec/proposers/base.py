"""What every retrieval proposer shares: vLLM's ``custom_class`` contract and its safety rules.

vLLM builds the proposer with ``Class(vllm_config)`` in the worker, calls ``load_model(model)``
once, then ``propose(...)`` once per decoding step for the whole batch (see
``GPUModelRunner.propose_draft_token_ids``). A draft longer than ``num_speculative_tokens``
kills the engine, and so does an exception, so each request's draft is checked here and any
failure costs that request one step's draft, never the engine.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from vllm_retrieval_spec.config import PLUGIN_KEY, MethodConfig, config_from_dict

logger = logging.getLogger(__name__)


class RetrievalProposer:
    """Adapts vLLM's per-batch ``propose`` call to a per-request ``draft(context, max_len)``."""

    def __init__(self, vllm_config: Any) -> None:
        self.config: MethodConfig = config_from_dict(vllm_config.additional_config[PLUGIN_KEY])
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        #: Steps on which a request got no draft because drafting failed or returned garbage.
        self.num_failed_drafts = 0

    def load_model(self, model: Any) -> None:
        """The CPU runner hands over the target model; retrieval needs none by default."""

    def draft(self, context: np.ndarray, max_len: int) -> np.ndarray:
        """Draft at most ``max_len`` tokens to follow ``context`` (int32, the request's tokens)."""
        raise NotImplementedError

    def draft_row(self, row: int, context: np.ndarray, max_len: int) -> np.ndarray:
        """``draft`` for batch row ``row``; methods with per-request state override this."""
        return self.draft(context, max_len)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                # Partial prefill: nothing was sampled, so there is nothing to continue.
                drafts.append([])
                continue
            num_tokens = int(num_tokens_no_spec[i])
            # Leave room for the bonus token: a draft may not push past max_model_len.
            max_len = min(self.k, self.max_model_len - num_tokens - 1)
            if max_len <= 0:
                drafts.append([])
                continue
            drafts.append(self._safe_draft(i, token_ids_cpu[i, :num_tokens], max_len))
        return drafts

    def _safe_draft(self, row: int, context: np.ndarray, max_len: int) -> list[int]:
        try:
            draft = self.draft_row(row, context, max_len)
        except Exception:
            self._fail("raised", exc_info=True)
            return []
        if len(draft) > max_len:
            self._fail(f"returned {len(draft)} tokens, more than the allowed {max_len}")
            return []
        if len(draft) and (draft.min() < 0 or draft.max() >= self.vocab_size):
            self._fail(f"returned token ids outside [0, {self.vocab_size}): {draft.tolist()}")
            return []
        return draft.tolist()

    def _fail(self, what: str, exc_info: bool = False) -> None:
        self.num_failed_drafts += 1
        if self.num_failed_drafts == 1:
            logger.error(
                "%s drafting %s; that request gets no draft this step (logged once; see "
                "num_failed_drafts)", type(self).__name__, what, exc_info=exc_info)
