"""Our drafter's hooks around vLLM's decoding step (``contract``): hidden states handed over,
the batch observed and drafts made before sampling, drafting timed, work done after the drafts
are handed over, the drafter closed at shutdown."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm_retrieval_spec.contract import Drafter

logger = logging.getLogger(__name__)


def drafter_of(runner: Any) -> Drafter | None:
    """The runner's drafter where it is ours (vLLM's own drafters are only timed)."""
    drafter = runner.__dict__.get("drafter")
    return drafter if isinstance(drafter, Drafter) else None


@contextlib.contextmanager
def _failures_reported(drafter: Drafter, what: str) -> Iterator[None]:
    """A hook of our drafter's that raises costs drafts (``report_failure``: counted, logged
    once), never the engine, as a failed draft does."""
    try:
        yield
    except Exception:
        drafter.report_failure("exception", what, exc_info=True)


def _drafting_timer(runner: Any) -> Any:
    from vllm_retrieval_spec.metrics import DraftingTimer

    timer = runner.__dict__.get("_rsd_drafting_timer")
    if timer is None:
        timer = runner._rsd_drafting_timer = DraftingTimer()
    return timer


def _aux_layers(runner: Any) -> tuple[int, ...]:
    drafter = drafter_of(runner)
    return drafter.capabilities.aux_hidden_state_layers if drafter is not None else ()


def with_aux_hidden_states(init: Callable) -> Callable:
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # Read at every forward, so the model's output is unpacked as (states, aux states).
        if _aux_layers(self):
            self.use_aux_hidden_state_outputs = True

    return wrapper


def drafter_aux_layers_first(get_aux_layers: Callable) -> Callable:
    @functools.wraps(get_aux_layers)
    def wrapper(self):
        return _aux_layers(self) or get_aux_layers(self)

    return wrapper


def with_drafts_before_sampling(sample: Callable) -> Callable:
    @functools.wraps(sample)
    def wrapper(self, logits, spec_decode_metadata):
        drafter = drafter_of(self)
        if drafter is not None:
            with _failures_reported(drafter, "could not observe the batch or draft before "
                                             "sampling"):
                _before_sampling(self, drafter, logits, spec_decode_metadata)
        return sample(self, logits, spec_decode_metadata)

    return wrapper


def _before_sampling(runner: Any, drafter: Drafter, logits: Any,
                     spec_decode_metadata: Any) -> None:
    """Tell our drafter which request is in which row, how many tokens each may reach, which
    may get a tree and, when it asks, which served store each is drafted from (no sampled token
    is needed for that); with ``drafts_before_sampling``, hand it what each greedy request will
    sample (the argmax of its rows of the logits along its draft), so it drafts now rather
    than after sampling."""
    from vllm_retrieval_spec.patches.trees import tree_verifier
    from vllm_retrieval_spec.verification.core import takes_argmax, tree_eligible

    start = time.perf_counter_ns()
    capabilities = drafter.capabilities
    verifier = tree_verifier(runner)
    req_ids = list(runner.input_batch.req_ids)
    before_sampling = capabilities.drafts_before_sampling
    states = [runner.requests[r] for r in req_ids]
    params = [state.sampling_params for state in states]
    greedy = [takes_argmax(p) for p in params] if before_sampling else None
    keys = None
    if capabilities.served_store_keys:
        from vllm_retrieval_spec.datastore.served import served_store_key

        keys = [served_store_key(p) for p in params]
    known_from = None
    # Every request with embeddings in its prompt has its row here: one look on the critical
    # path, not one a request.
    if getattr(runner.input_batch, "req_prompt_embeds", None):
        known_from = [_known_from(runner.input_batch, state, i) for i, state in enumerate(states)]
    drafter.observe_batch(req_ids, [tree_eligible(p) for p in params]
                          if verifier is not None else None, keys,
                          [_token_limit(state) for state in states], known_from)
    waited = 0
    if before_sampling and logits is not None and any(greedy):
        from vllm_retrieval_spec.drafting.overlap import row_argmax, sampled_before_sampling

        waited = _wait_for_forward(logits.device)
        if spec_decode_metadata is None:
            num_drafts, drafts = [0] * len(req_ids), []
        else:
            num_drafts = spec_decode_metadata.num_draft_tokens
            drafts = spec_decode_metadata.draft_token_ids.tolist()
        sampled, verified = sampled_before_sampling(
            row_argmax(logits), num_drafts, drafts, greedy,
            runner.discard_request_mask.np[:len(req_ids)])
        drafter.draft_before_sampling(sampled, verified, runner.input_batch.num_tokens_no_spec,
                                      runner.input_batch.token_ids_cpu)
    _drafting_timer(runner).add_before(time.perf_counter_ns() - start - waited)


def _known_from(input_batch: Any, state: Any, row: int) -> int:
    """The first position of batch row ``row`` from which every token id is known: vLLM
    writes none into its row for prompt positions given as embeddings (``is_token_ids``), which
    keep an earlier request's tokens (or, in a prompt mixing ids and embeddings, a placeholder
    id that may lie outside the vocabulary). Such a prompt always has ``prompt_embeds``."""
    if state is None or getattr(state, "prompt_embeds", None) is None:
        return 0
    import numpy as np

    unknown = np.flatnonzero(~input_batch.is_token_ids[row, :state.num_prompt_tokens])
    return int(unknown[-1]) + 1 if len(unknown) else 0


def _token_limit(state: Any) -> int | None:
    """The most tokens a request may reach, its prompt included (None: max_model_len alone)."""
    max_tokens = getattr(state.sampling_params, "max_tokens", None)
    return None if max_tokens is None else state.num_prompt_tokens + max_tokens


#: Output tokens searched for a finished request's stop string, at its end (``_as_served``).
STOP_STRING_WINDOW = 512


def _as_served(state: Any, tokens: Any, tokenizer: Callable[[], Any]) -> Any:
    """A finished request's ``tokens`` (its batch row) as vLLM served them: through the first
    output token that stopped it (its EOS, unless it ignores EOS, or a stop token id: the
    scheduler's ``check_stop``), and through the token that completed its first stop string.
    The row also holds what the same step accepted after that token, which vLLM cut from the
    output; after a stop string, the steps run before the frontend's abort reached the engine
    too. The frontend matches stop strings in its detokenized text, which the worker never
    sees: vLLM's detokenizer runs here on the output as it ran there (``tokenizer()``: the
    model's, loaded by the first request with stop strings)."""
    if state is None:
        return tokens
    import numpy as np

    params = state.sampling_params
    output = tokens[state.num_prompt_tokens:]
    stops = list(getattr(params, "stop_token_ids", None) or ())
    eos = getattr(params, "eos_token_id", None)
    if eos is not None:
        stops.append(eos)
    hits = np.flatnonzero(np.isin(output, stops)) if stops else ()
    if len(hits):
        output = output[:int(hits[0]) + 1]
    if getattr(params, "stop", None):
        import copy
        from types import SimpleNamespace

        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        # Only the end of a long output is searched (vLLM's detokenizer takes 2.4 us a token
        # here): the frontend aborts a request as soon as it sees a stop string, so only the
        # steps in flight by then follow it. What comes before primes the decoder, as the
        # prompt does.
        start = max(0, len(output) - STOP_STRING_WINDOW)
        prompt = state.prompt_token_ids
        if start <= params.min_tokens or prompt is None:
            start = 0
        else:
            prompt = [*prompt, *output[:start].tolist()]
            params = copy.copy(params)
            params.min_tokens = 0
        detokenizer = IncrementalDetokenizer.from_new_request(tokenizer(), SimpleNamespace(
            request_id=state.req_id, sampling_params=params, prompt_token_ids=prompt,
            prompt_embeds=state.prompt_embeds))
        # The frontend leaves out of the text the token the engine stopped at.
        detokenizer.update(output[start:].tolist(), bool(len(hits)))
        output = output[:start + detokenizer.num_output_tokens()]
    return tokens[:state.num_prompt_tokens + len(output)]


def _served_row(runner: Any, drafter: Drafter, req_id: str, row: int) -> Any:
    """The finished request's batch row as served (``_as_served``); whole where that fails: one
    request's cut must not keep the others from the drafter."""
    batch = runner.input_batch
    state = runner.requests.get(req_id)
    tokens = batch.token_ids_cpu[row, :batch.num_tokens_no_spec[row]]
    known_from = _known_from(batch, state, row)
    if known_from:
        from vllm_retrieval_spec.contract import UNKNOWN_TOKEN

        tokens = tokens.copy()
        tokens[:known_from] = UNKNOWN_TOKEN
    with _failures_reported(drafter, "could not cut a finished request where it stopped"):
        from vllm.tokenizers import cached_tokenizer_from_config

        return _as_served(state, tokens, lambda: cached_tokenizer_from_config(runner.model_config))
    return tokens


def _wait_for_forward(device: Any) -> int:
    """Nanoseconds spent waiting for the forward launched on ``device`` (none on vLLM-CPU).
    Reading the logits and the drafts on the host would wait for it anyway, as the step does
    after sampling: that wait is the forward's time, not drafting's."""
    if not _overlaps_forward(device):
        return 0
    import torch

    start = time.perf_counter_ns()
    torch.cuda.current_stream(device).synchronize()
    return time.perf_counter_ns() - start


def drafting_near_the_length_limit(input_fits_in_drafter: Callable) -> Callable:
    """vLLM calls no drafter in a step where any request of the batch is within k tokens of
    max_model_len (a draft model's positions could not hold its draft), and so no request of
    the batch drafts. Ours runs no model and caps each draft by its own request's room
    (``DraftLengths``); and PLD+ must see every step's states, or the request's cache stays
    incomplete and it drafts nothing for the rest of its life (``HiddenStateCache``). So with
    our drafter every step drafts."""

    @functools.wraps(input_fits_in_drafter)
    def wrapper(self, common_attn_metadata):
        if common_attn_metadata is not None and drafter_of(self) is not None:
            return True
        return input_fits_in_drafter(self, common_attn_metadata)

    return wrapper


def timed_with_hidden_states(propose_draft_token_ids: Callable) -> Callable:
    @functools.wraps(propose_draft_token_ids)
    def wrapper(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                sample_hidden_states, aux_hidden_states, spec_decode_metadata, *args, **kwargs):
        # vLLM hands over this step's sampled tokens here and waits for the drafts (for vLLM's
        # own methods too: the timer wraps every drafter).
        start = time.perf_counter_ns()
        drafter = drafter_of(self)
        if drafter is not None:
            with _failures_reported(drafter, "could not take hidden states"):
                _hand_hidden_states(self, drafter, scheduler_output, sampled_token_ids,
                                    sample_hidden_states, aux_hidden_states,
                                    spec_decode_metadata)
        drafts = propose_draft_token_ids(self, scheduler_output, sampled_token_ids,
                                         sampling_metadata, hidden_states, sample_hidden_states,
                                         aux_hidden_states, spec_decode_metadata, *args, **kwargs)
        elapsed = time.perf_counter_ns() - start
        timer = _drafting_timer(self)
        timer.record(elapsed)
        if drafter is not None and not drafter.has_work_after_handover:
            # This step's drafting is done; with work after the handover, once that is
            # (``after_handover``): the engine waits for some or all of it.
            drafter.observe_drafting_time(timer.last_critical_ns() / 1e9,
                                          timer.last_total_ns() / 1e9)
        return drafts

    return wrapper


def _hand_hidden_states(runner: Any, drafter: Drafter, scheduler_output: Any,
                        sampled_token_ids: list[list[int]], sample_hidden_states: Any,
                        aux_hidden_states: Any, spec_decode_metadata: Any) -> None:
    capabilities = drafter.capabilities
    batch = runner.input_batch
    if aux_hidden_states is not None and capabilities.aux_hidden_state_layers:
        from vllm_retrieval_spec.proposers.hidden_states import accepted_state_segments

        drafter.record_hidden_states(list(batch.req_ids), aux_hidden_states, accepted_state_segments(
            batch.req_ids, scheduler_output.num_scheduled_tokens,
            scheduler_output.scheduled_spec_decode_tokens, batch.num_computed_tokens_cpu,
            sampled_token_ids))
    if capabilities.last_hidden_states:
        from vllm_retrieval_spec.drafting.overlap import last_state_rows

        verifier = runner.__dict__.get("_rsd_tree_verifier")
        num_drafts = spec_decode_metadata.num_draft_tokens if spec_decode_metadata \
            else [0] * len(sampled_token_ids)
        drafter.record_last_hidden_states(sample_hidden_states, last_state_rows(
            sampled_token_ids, num_drafts, verifier.last_nodes if verifier else None))


def after_handover(method: Callable) -> Callable:
    """After ``method``, our drafter does the bookkeeping ``propose`` left for later and makes
    the next step's possible drafts. On a GPU ``method`` launched the forward: drafts are made
    ahead only until it is done (``ForwardWatch``), since each made after that delays the step
    by its own cost, where ``propose`` makes the one draft a request needs."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        drafter = drafter_of(self)
        if drafter is not None and drafter.has_work_after_handover:
            start = time.perf_counter_ns()
            watch = ForwardWatch(self.device)
            with _failures_reported(drafter, "could not finish the step's drafting"):
                drafter.after_handover(watch)
            timer = _drafting_timer(self)
            timer.add_after(*watch.timed(start))
            drafter.observe_drafting_time(timer.last_critical_ns() / 1e9,
                                          timer.last_total_ns() / 1e9)
        return result

    return wrapper


def _overlaps_forward(device: Any) -> bool:
    """Whether the work after the handover runs beside the next forward (launched on a GPU
    before it) rather than before it (vLLM-CPU runs the forward on the same cores)."""
    return device.type == "cuda"


class ForwardWatch:
    """Whether the work enqueued so far on ``device``'s current stream (the forward just
    launched) is done, as the drafts made ahead ask between drafts; the step waits for the
    work that goes on after that (the draft under way). Where the forward does not run beside
    the work after the handover: never done, so drafts ahead are made in full, and the step
    waits for all of them."""

    def __init__(self, device: Any) -> None:
        self._event = None
        self.done = False
        #: When the forward was last seen running: it ended after.
        self.running_ns = time.perf_counter_ns()
        if _overlaps_forward(device):
            import torch

            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def __call__(self) -> bool:
        if self._event is None or self.done:
            return self.done
        now = time.perf_counter_ns()
        if self._event.query():
            self.done = True
        else:
            self.running_ns = now
        return self.done

    def timed(self, start_ns: int) -> tuple[int, int]:
        """The work's time since ``start_ns``, and the part of it the step waited for: on a
        GPU, since the forward was last seen running (a last look now), so at most one look
        apart (the draft under way then) more than the step waited for."""
        self()
        end = time.perf_counter_ns()
        if self._event is None:
            return end - start_ns, end - start_ns
        return end - start_ns, end - self.running_ns if self.done else 0


def _searches_ahead(runner: Any) -> bool:
    drafter = drafter_of(runner)
    return drafter is not None and drafter.capabilities.last_hidden_states


def keeping_logits_indices(prepare_inputs: Callable) -> Callable:
    """Keeps the step's logits indices (the rows of the forward's hidden states that are
    sampled) for a drafter that searches them ahead (``searching_ahead_after``)."""

    @functools.wraps(prepare_inputs)
    def wrapper(self, scheduler_output, num_scheduled_tokens):
        result = prepare_inputs(self, scheduler_output, num_scheduled_tokens)
        if _searches_ahead(self):
            self._rsd_logits_indices = result[0]
        return result

    return wrapper


def telling_finished_requests(update_states: Callable) -> Callable:
    """Our drafter hears which requests vLLM finished at the start of every step: also in the
    empty step vLLM runs after a burst's last request to say so, which reaches no other hook
    (hybrid journals those requests then, not at the next request, however late). The step's
    forward waits for it, on every device: it is timed as work before sampling (after an
    empty step, the next step that drafts holds it)."""

    @functools.wraps(update_states)
    def wrapper(self, scheduler_output):
        drafter = drafter_of(self)
        if drafter is not None and scheduler_output.finished_req_ids:
            start = time.perf_counter_ns()
            with _failures_reported(drafter, "could not take finished requests"):
                # Their rows are still in the batch (update_states removes them): every token
                # sampled, those of steps with no propose included.
                batch = self.input_batch
                rows = {r: batch.req_id_to_index.get(r) for r in scheduler_output.finished_req_ids}
                drafter.observe_finished(scheduler_output.finished_req_ids, {
                    r: _served_row(self, drafter, r, i) for r, i in rows.items() if i is not None})
            _drafting_timer(self).add_before(time.perf_counter_ns() - start)
        return update_states(self, scheduler_output)

    return wrapper


def searching_ahead_after(model_forward: Callable) -> Callable:
    """After the forward, a drafter with ``last_hidden_states`` gets the hidden states of the
    rows vLLM will sample (``search_ahead``): any of them may be a request's last state once the
    drafts are verified, so DReSD's search of all of them need not wait for that, and with
    ``draft_before_sampling`` the one a greedy request needs is known from the logits."""

    @functools.wraps(model_forward)
    def wrapper(self, *args, **kwargs):
        output = model_forward(self, *args, **kwargs)
        # Popped: a dummy run's forward (no prepared inputs) must not search stale rows.
        logits_indices = self.__dict__.pop("_rsd_logits_indices", None)
        drafter = drafter_of(self)
        if drafter is not None and logits_indices is not None:
            import torch

            if isinstance(output, torch.Tensor):  # not a pipeline stage's intermediate tensors
                start = time.perf_counter_ns()
                # A failed search is made after sampling instead.
                with _failures_reported(drafter, "could not search ahead"):
                    drafter.search_ahead(output[logits_indices])
                _drafting_timer(self).add_before(time.perf_counter_ns() - start)
        return output

    return wrapper


def closing_drafter_first(shutdown: Callable) -> Callable:
    """Our drafter is closed as the worker's teardown starts (hybrid stores the last requests
    and saves its served store): vLLM kills a worker that is still tearing down a few seconds
    after the engine was asked to stop, before atexit handlers would run."""

    @functools.wraps(shutdown)
    def wrapper(self):
        runner = getattr(self, "model_runner", None)
        drafter = drafter_of(runner) if runner is not None else None
        if drafter is not None:
            try:
                drafter.close()
            except Exception:
                logger.exception("closing the drafter failed; shutting down anyway")
        return shutdown(self)

    return wrapper


def drafting_stats(worker: Any, reset: bool = False) -> dict[str, float | int]:
    """Worker RPC: drafting time per step since start (or the last reset)."""
    from vllm_retrieval_spec.metrics import DraftingTimer

    runner = worker.model_runner
    timer = runner.__dict__.get("_rsd_drafting_timer") or DraftingTimer(capacity=1)
    drafter = drafter_of(runner)
    verifier = runner.__dict__.get("_rsd_tree_verifier")
    return {**timer.summary(reset=reset), **(drafter.stats(reset) if drafter else {}),
            **(verifier.stats(reset) if verifier is not None else {})}
