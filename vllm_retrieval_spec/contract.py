"""The two interfaces between vLLM's decoding step and a retrieval method.

``Drafter`` is what ``plugin.py`` calls on the runner's drafter (``runner.drafter``): vLLM's own
``custom_class`` calls (``load_model``, ``propose``) and the hooks our patches add around the
step. ``proposers.base.RetrievalProposer`` is the one implementation; the plugin calls a hook
only where the drafter's ``capabilities`` declare it, and never probes for attributes.

``MethodDrafter`` is what a method implements (``proposers/``): drafting one request's tokens,
and the hooks its sources need. ``RetrievalProposer`` does everything methods share (lengths,
acceptance caps, padding, drafts made ahead, failures, metrics) and forwards the hooks.

One decoding step of vLLM 0.32's ``GPUModelRunner``, in order, with the hooks it reaches:

1. ``_prepare_inputs``: the tree verifier places tree drafts (``verification``).
2. ``_model_forward``: the forward. Right after it, ``search_ahead(states)`` (capability
   ``last_hidden_states``) with the hidden states of the rows vLLM will sample.
3. ``_sample``: before vLLM samples, ``observe_batch`` (every step), then
   ``draft_before_sampling`` (capability ``drafts_before_sampling``) with what each row will
   sample: a greedy request's tokens, read from the logits; None for a sampled one; nothing
   for a row whose token vLLM discards (a partial prefill).
4. ``propose_draft_token_ids``: ``record_hidden_states`` (``aux_hidden_state_layers``) and
   ``record_last_hidden_states`` (``last_hidden_states``), then vLLM's ``propose``.
5. Once the drafts are handed over (``_copy_draft_token_ids_to_cpu`` on vLLM-CPU, after the next
   forward is launched elsewhere, and there until that forward is done): ``after_handover``
   while ``has_work_after_handover``.

``close`` runs when the worker shuts down; ``stats`` answers the ``rsd_drafting_stats`` RPC.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Capabilities:
    """What a drafter needs from the step beyond vLLM's ``propose`` arguments."""

    #: Layers whose residual stream the drafter records (PLD+): the plugin switches vLLM's
    #: EAGLE-3 auxiliary hidden-state path on for exactly these and calls
    #: ``record_hidden_states``.
    aux_hidden_state_layers: tuple[int, ...] = ()
    #: The drafter searches with each request's last final hidden state (DReSD, hybrid with a
    #: dense source): the plugin calls ``search_ahead`` after the forward and
    #: ``record_last_hidden_states`` before ``propose``.
    last_hidden_states: bool = False
    #: Drafts can be made before the tokens they follow are sampled (the method's
    #: ``followers``): precomputed after the handover, or made from the logits.
    precomputable: bool = False
    #: The plugin calls ``draft_before_sampling`` with what each row will sample (the
    #: greedy rows' tokens, read from the logits).
    drafts_before_sampling: bool = False
    #: ``observe_batch`` gets each row's ``served_store_key`` (hybrid, ``per_request``).
    served_store_keys: bool = False
    #: The drafter drafts token trees for the rows ``observe_batch`` says may get one; the
    #: plugin verifies them.
    trees: bool = False


#: What a drafter reads at a position whose token id is unknown (``Drafter.observe_batch``):
#: negative, as the datastores' separators, so that no match runs over it.
UNKNOWN_TOKEN = -1


class Drafter(abc.ABC):
    """What the plugin calls on ``runner.drafter`` (see the step above)."""

    capabilities: Capabilities
    #: Request id -> its draft this step, for the rows whose draft is a tree (not a chain);
    #: the tree verifier reads it when vLLM schedules those drafts.
    trees: dict[str, Any]

    @abc.abstractmethod
    def load_model(self, model: Any) -> None:
        """vLLM hands over the target model once, before the first step."""

    @abc.abstractmethod
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """vLLM's ``custom_class`` call after sampling: one draft per batch row, each at most
        ``num_speculative_tokens`` long."""

    @abc.abstractmethod
    def observe_batch(self, req_ids: list[str], tree_rows: list[bool] | None,
                      served_keys: list[str | None] | None,
                      token_limits: list[int | None] | None,
                      known_from: list[int] | None = None) -> None:
        """Before sampling, every step: which request is in which row, which rows may get a
        tree, (``served_store_keys``) each row's served-store key, how many tokens each
        request may reach, its prompt included (its max_tokens; None: no limit but
        max_model_len), and (None: 0 for every row) the first position of each row from which
        every token id is known. Prompt positions given as embeddings (``prompt_embeds``) have
        none: vLLM's row holds whatever an earlier request left there, which the drafter must
        neither draft from nor store; it reads them as ``UNKNOWN_TOKEN``."""

    @abc.abstractmethod
    def observe_finished(self, req_ids: set[str],
                         tokens: dict[str, np.ndarray] | None = None) -> None:
        """At the start of every step, an empty one included: the requests vLLM finished since
        the last one. After the last request of a burst, vLLM runs one empty step to say so,
        so this is where what a finished request leaves (a served store's journal record) is
        written without waiting for more traffic. ``tokens``: those still in vLLM's batch,
        their tokens there (views of its buffer, read at once) through the token that stopped
        the request (EOS, a stop token id, or the one that completed a stop string; the batch
        also holds the tokens accepted after it, which vLLM did not serve): they include the
        steps vLLM called no ``propose`` for (none is called while a request of the batch is
        within ``num_speculative_tokens`` of max_model_len), with ``UNKNOWN_TOKEN`` where no
        token id is known (see ``observe_batch``)."""

    @abc.abstractmethod
    def draft_before_sampling(self, sampled: list[list[int] | None], verified: list[list[int]],
                              num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray) -> None:
        """Before sampling (``drafts_before_sampling``): row i will sample ``sampled[i]`` (None
        where not known yet, empty where it samples nothing: a partial prefill) after verifying
        ``verified[i]``, and has ``num_tokens_no_spec[i]`` tokens before them."""

    @abc.abstractmethod
    def search_ahead(self, states: Any) -> None:
        """After the forward (``last_hidden_states``): the hidden states of the rows vLLM will
        sample, [rows, H], on the forward's device."""

    @abc.abstractmethod
    def record_hidden_states(self, req_ids: list[str], aux_hidden_states: list[Any],
                             segments: list[tuple[int, int, int]]) -> None:
        """Before ``propose`` (``aux_hidden_state_layers``): this step's auxiliary states and,
        per row, (first position, first row in the states, rows to keep)."""

    @abc.abstractmethod
    def record_last_hidden_states(self, states: Any, rows: list[int]) -> None:
        """Before ``propose`` (``last_hidden_states``): ``states[rows[i]]`` produced row i's
        last sampled token (-1: nothing sampled)."""

    @property
    @abc.abstractmethod
    def has_work_after_handover(self) -> bool:
        """Whether ``after_handover`` has work this step."""

    @abc.abstractmethod
    def after_handover(self, forward_done: Callable[[], bool] = lambda: False) -> None:
        """Once the drafts are handed to vLLM: bookkeeping ``propose`` left for later, and the
        next step's drafts made ahead, no longer once ``forward_done()`` (on a GPU, the forward
        running meanwhile has finished: from then on they would delay the step)."""

    @abc.abstractmethod
    def report_failure(self, kind: str, what: str, exc_info: bool = False) -> None:
        """A hook the plugin ran for the drafter failed: counted and logged once, never
        raised into the engine."""

    @abc.abstractmethod
    def observe_drafting_time(self, critical_s: float, total_s: float | None) -> None:
        """The plugin's timing of this step's drafting: the part vLLM waited for, and all of
        it once known (None while ``after_handover`` is still to come)."""

    @abc.abstractmethod
    def stats(self, reset: bool = False) -> dict[str, int]:
        """Counters for the ``rsd_drafting_stats`` worker RPC."""

    @abc.abstractmethod
    def close(self) -> None:
        """The worker is shutting down (hybrid saves its served store). Idempotent."""


class MethodDrafter:
    """What one method implements; the hooks have no-op defaults and are called only where
    ``capabilities`` declare them. A method is usually a ``drafting.trie.TrieDrafter`` over its
    candidate sources (``sources/``); ``docs/adding-a-method.md`` walks through one."""

    capabilities = Capabilities()

    def draft(self, row: int, context: np.ndarray, max_len: int) -> Any:
        """At most ``max_len`` tokens to follow ``context`` (int32, batch row ``row``'s tokens):
        an int32 array (a chain) or a ``drafting.tree.TreeDraft``."""
        raise NotImplementedError

    def followers(self, row: int, context: np.ndarray) -> tuple[np.ndarray, bool] | None:
        """(``precomputable``) The tokens ``b`` for which drafting after ``context + [b]`` can
        find anything, most likely first, and whether that list is complete (every other ``b``
        drafts nothing)."""
        return None

    def snapshot(self, row: int) -> Any:
        """What row ``row``'s drafts depend on besides its context (a served store's index):
        drafts made ahead from another snapshot are not used."""
        return None

    def warm_up(self, max_len: int, device: Any, dtype: Any) -> None:
        """Compile and load what the first draft would (called at ``load_model``). ``device``
        and ``dtype``: the target model's, which its hidden states have: a method that reads
        them warms up on such tensors, so that a GPU's kernels compile here, not in the first
        requests."""

    def begin_step(self, req_ids: list[str], served_keys: list[str | None] | None) -> None:
        """Before sampling, every step: the batch's requests (and their served-store keys)."""

    def finished(self, req_ids: set[str], tokens: dict[str, np.ndarray] | None = None) -> None:
        """As ``Drafter.observe_finished``, after ``settle``."""

    def record_hidden_states(self, req_ids: list[str], aux_hidden_states: list[Any],
                             segments: list[tuple[int, int, int]]) -> None:
        """As ``Drafter.record_hidden_states``."""

    def record_last_hidden_states(self, states: Any, rows: list[int]) -> None:
        """As ``Drafter.record_last_hidden_states``."""

    def search_ahead(self, states: Any) -> None:
        """As ``Drafter.search_ahead``."""

    def observe_sampled(self, step: Any) -> None:
        """After every ``propose``, drafting on or off: what the step sampled
        (``proposers.base.SampledStep``)."""

    def settle(self) -> None:
        """Bookkeeping left from the last ``propose``, done off the critical path."""

    def stats(self, reset: bool) -> dict[str, int]:
        return {}

    def close(self) -> None:
        """The worker is shutting down. Idempotent."""
