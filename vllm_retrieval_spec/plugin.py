"""The ``vllm.general_plugins`` entry point: every patch of vLLM internals lives here.

vLLM calls ``register()`` in each process it starts (front-end, engine core, workers). It
checks the vLLM version and the exact signatures of the private methods it wraps; on any other
vLLM it patches nothing (one warning; a config naming one of our methods fails with the reason).
Otherwise:

- ``EngineArgs.create_engine_config``: turns prefix caching off for PLD+ (refused if asked for).
- ``EngineArgs.create_speculative_config``: rewrites ``{"method": "rest", ...}`` into vLLM's
  ``custom_class`` method with our proposer class, validates our options once (including the
  datastore against the model's tokenizer) and moves them into ``additional_config``, which
  reaches the workers. This serves ``LLM(...)`` and the OpenAI server's ``--speculative-config``.
- ``GPUModelRunner.__init__`` and ``GPUModelRunner._get_eagle3_aux_layers_from_config``: a
  drafter that names ``aux_hidden_state_layers`` (PLD+) gets vLLM's EAGLE-3 auxiliary
  hidden-state path switched on for exactly those layers.
- ``GPUModelRunner.propose_draft_token_ids`` (also the CPU runner's): times every drafting step,
  for every method including vLLM's own, so benchmarks compare like with like (this is the
  critical part: vLLM waits for it); before drafting, hands a drafter that wants them this
  step's auxiliary hidden states with request ids and positions (``record_hidden_states``,
  PLD+) or each request's last final hidden state (``record_last_hidden_states``, DReSD).
- ``GPUModelRunner._copy_draft_token_ids_to_cpu`` on vLLM-CPU (once the drafts are handed
  over), ``GPUModelRunner._model_forward`` elsewhere (once the next forward is launched): our
  drafter does the bookkeeping ``propose`` left for later and makes the next step's possible
  drafts (``precompute_next``, ``drafting.overlap``).
- ``GPUModelRunner._prepare_inputs`` and ``GPUModelRunner._model_forward``: right after the
  forward, a drafter that searches hidden states (DReSD, hybrid with a dense source) gets the
  states of the rows vLLM samples (``search_ahead``): DReSD, with ``precompute_drafts``,
  starts searching every state that may be a request's last one, and with
  ``draft_before_sampling`` both draft from the one that predicted a greedy request's last
  token before vLLM samples.
- ``Worker.rsd_drafting_stats`` (added): lets ``LLM.collective_rpc`` read those timings.
- ``Worker.shutdown``: closes the drafter first (hybrid saves its served store there).
- ``GPUModelRunner._sample``: before sampling, tells our drafters the batch's request ids,
  which may get trees and, for hybrid's ``served_store: "per_request"``, each request's
  ``served_store_key`` (``observe_batch``): no sampled token is needed for that. With
  ``draft_before_sampling``, it also hands over what each greedy request will sample (the
  logits' argmax along its draft), and the drafter makes its next draft then.
- ``GPUModelRunner._prepare_inputs``, ``GPUModelRunner._sample`` and, on CPU,
  ``CPUAttentionBackendImpl.forward``: token-tree drafts are verified (``tree_verification``):
  depth positions, tree-masked attention of the draft rows, the longest accepted root path, and
  its KV entries moved where plain decoding puts them. Steps without trees are untouched.
- ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens``, on CPU only: vLLM-CPU 0.32's
  C++ stand-in for the Triton ``expand_kernel`` writes into an int64 copy of its output and
  drops it, so every speculative step of a batch holding a sampled (temperature > 0) request
  divides all logits by uninitialised memory: greedy requests beside it decode garbage, with
  vLLM's own ``ngram`` too. Replaced by a torch implementation.
- ``vllm.v1.sample.rejection_sampler.apply_top_k_top_p``, on CPU only: a step without any draft
  token crashes vLLM-CPU's top-k (``max()`` of an empty tensor) and kills the engine, with
  vLLM's own ``ngram`` too; an empty batch is now returned as it is.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.config import (
    METHODS,
    PLUGIN_KEY,
    ConfigError,
    DresdConfig,
    HybridConfig,
    MethodConfig,
    PldPlusConfig,
    parse_speculative_config,
    platform_defaults,
)

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = "0.32."
#: Set to 1 to load vLLM without any of our patches.
DISABLE_ENV = "VLLM_RSD_DISABLE"

# The private methods we wrap and the parameters we rely on, in order.
_WRAPPED_SIGNATURES = {
    "vllm.engine.arg_utils.EngineArgs.create_speculative_config": (
        "self", "target_model_config", "target_parallel_config"),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids": (
        "self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
        "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata",
        "common_attn_metadata", "slot_mappings"),
    "vllm.engine.arg_utils.EngineArgs.create_engine_config": (
        "self", "usage_context", "headless"),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__": ("self", "vllm_config", "device"),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._get_eagle3_aux_layers_from_config": (
        "self",),
    "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens": (
        "x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"),
    "vllm.v1.sample.rejection_sampler.apply_top_k_top_p": ("logits", "k", "p"),
    "vllm.v1.worker.gpu_worker.Worker.shutdown": ("self",),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs": (
        "self", "scheduler_output", "num_scheduled_tokens"),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample": (
        "self", "logits", "spec_decode_metadata"),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._copy_draft_token_ids_to_cpu": (
        "self", "scheduler_output", "zeros_only"),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward": (
        "self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs"),
    "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward": (
        "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
        "output_scale", "output_block_scale"),
    "vllm.platforms.cpu.CpuPlatform.register_triton_kernel_overrides": (),
}

_registered = False
#: Set once the incompatibility warning was logged, so vLLM's child processes (engine core,
#: workers), which load every plugin again, do not repeat it.
_WARNED_ENV = "VLLM_RSD_INCOMPATIBLE_WARNED"


class IncompatibleVllmError(RuntimeError):
    pass


def register() -> None:
    """Apply our patches once per process; on a vLLM we were not written against, patch
    nothing but a guard that explains why our methods are unavailable."""
    global _registered
    if _registered or os.environ.get(DISABLE_ENV) == "1":
        return
    _registered = True
    problem = vllm_incompatibility()
    if problem is not None:
        # Installing this plugin must never break vLLM for people who do not use its methods.
        if os.environ.get(_WARNED_ENV) != "1":
            logger.warning("vllm-retrieval-spec is inactive, vLLM runs unpatched: %s", problem)
            os.environ[_WARNED_ENV] = "1"
        _refuse_our_methods(problem)
        return

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    EngineArgs.create_speculative_config = _with_retrieval_methods(
        EngineArgs.create_speculative_config)
    EngineArgs.create_engine_config = _without_prefix_caching_for_pld_plus(
        EngineArgs.create_engine_config)
    GPUModelRunner.__init__ = _with_aux_hidden_states(GPUModelRunner.__init__)
    GPUModelRunner._get_eagle3_aux_layers_from_config = _drafter_aux_layers_first(
        GPUModelRunner._get_eagle3_aux_layers_from_config)
    GPUModelRunner.propose_draft_token_ids = _timed_with_hidden_states(
        GPUModelRunner.propose_draft_token_ids)
    from vllm.platforms import current_platform

    # Where the next step's drafts are made (drafting.overlap): on vLLM-CPU the forward runs on
    # the same cores, so right after drafting, while the caches are warm; on an accelerator
    # right after the next forward is launched, while the host would only wait for it.
    GPUModelRunner._prepare_inputs = _keeping_logits_indices(GPUModelRunner._prepare_inputs)
    GPUModelRunner._model_forward = _searching_ahead_after(GPUModelRunner._model_forward)
    if current_platform.is_cpu():
        GPUModelRunner._copy_draft_token_ids_to_cpu = _precomputing_after(
            GPUModelRunner._copy_draft_token_ids_to_cpu)
    else:
        GPUModelRunner._model_forward = _precomputing_after(GPUModelRunner._model_forward)
    Worker.rsd_drafting_stats = _drafting_stats
    Worker.shutdown = _closing_drafter_first(Worker.shutdown)
    _fix_cpu_rejection_sampler()
    _fix_cpu_kernel_rebinding()
    _verify_trees()


def vllm_incompatibility() -> str | None:
    """Why the installed vLLM is not one whose internals we were written against, or None."""
    import importlib

    import vllm

    hint = (f"vllm-retrieval-spec supports vLLM {SUPPORTED_VLLM}*; install that version, or set "
            f"{DISABLE_ENV}=1 to run vLLM without this plugin")
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        return f"found vLLM {vllm.__version__}. {hint}"
    for path, expected in _WRAPPED_SIGNATURES.items():
        module_name, owner_name, method_name = path.rsplit(".", 2)
        try:  # a method of a class, or a function of a module
            owner = importlib.import_module(f"{module_name}.{owner_name}")
        except ImportError:
            owner = getattr(importlib.import_module(module_name), owner_name, None)
        method = getattr(owner, method_name, None)
        if method is None:
            return f"vLLM {vllm.__version__} has no {path}. {hint}"
        found = tuple(inspect.signature(method).parameters)
        if found != expected:
            return (f"{path} has parameters {found} in vLLM {vllm.__version__}, expected "
                    f"{expected}. {hint}")
    return None


def _refuse_our_methods(problem: str) -> None:
    """The one thing installed on an unsupported vLLM: a speculative config naming one of our
    methods fails with ``problem`` instead of vLLM's list of its own method names. Every other
    config reaches vLLM's method untouched."""
    from vllm.engine.arg_utils import EngineArgs

    create_speculative_config = getattr(EngineArgs, "create_speculative_config", None)
    if create_speculative_config is None:
        return

    @functools.wraps(create_speculative_config)
    def guard(self, *args, **kwargs):
        options = self.speculative_config
        if isinstance(options, dict) and options.get("method") in METHODS:
            raise IncompatibleVllmError(
                f"speculative_config method {options['method']!r} is unavailable: {problem}")
        return create_speculative_config(self, *args, **kwargs)

    EngineArgs.create_speculative_config = guard


def _fix_cpu_rejection_sampler() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    rejection_sampler.expand_batch_to_tokens = _expand_batch_to_tokens(
        rejection_sampler.expand_batch_to_tokens)
    rejection_sampler.apply_top_k_top_p = _without_empty_batches(
        rejection_sampler.apply_top_k_top_p)


def _fix_cpu_kernel_rebinding() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.register_triton_kernel_overrides = classmethod(_with_llvmlite_scannable(
        CpuPlatform.register_triton_kernel_overrides.__func__))


def _with_llvmlite_scannable(register_overrides: Callable) -> Callable:
    """vLLM-CPU's worker start-up rebinds its kernel overrides by reading ``vars()`` of every
    attribute of every loaded module. llvmlite's library wrapper, loaded with numba (which our
    drafters compile with), answers ``__dict__`` as it answers any unknown name, with a wrapped
    C symbol, and the scan fails on ``.get``: in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    every engine after the first that drafted would fail to start. Its symbol table gets a real,
    empty ``__dict__`` first; llvmlite never looks that name up itself."""

    @functools.wraps(register_overrides)
    def register(cls):
        library = getattr(sys.modules.get("llvmlite.binding.ffi"), "lib", None)
        symbols = getattr(library, "_fntab", None)
        if isinstance(symbols, dict):
            symbols.setdefault("__dict__", {})
        return register_overrides(cls)

    return register


def _without_empty_batches(apply_top_k_top_p: Callable) -> Callable:
    """A step can reach the rejection sampler with no draft tokens at all (every request's
    draft empty), and vLLM-CPU's top-k then calls ``max()`` on an empty tensor: the engine dies,
    with vLLM's own ``ngram`` as with our methods, as soon as a sampled request sets top_k.
    No rows, nothing to mask."""

    @functools.wraps(apply_top_k_top_p)
    def apply(logits, k, p):
        if logits.shape[0] == 0:
            return logits
        return apply_top_k_top_p(logits, k, p)

    return apply


#: The tree verifier of this process's runner while a step with trees is in flight: the
#: attention backend has no reference to the runner.
_trees_in_flight: Any = None


def _verify_trees() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    GPUModelRunner._prepare_inputs = _with_tree_positions(GPUModelRunner._prepare_inputs)
    GPUModelRunner._sample = _with_tree_acceptance(GPUModelRunner._sample)
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        CPUAttentionBackendImpl.forward = _with_tree_attention(CPUAttentionBackendImpl.forward)


def _tree_verifier(runner: Any) -> Any:
    """The runner's verifier, made at its first drafting step once the KV cache exists; None
    where the drafter drafts no trees or this platform cannot verify them."""
    if "_rsd_tree_verifier" in runner.__dict__:
        return runner._rsd_tree_verifier
    verifier = None
    config = getattr(runner.__dict__.get("drafter"), "config", None)
    if getattr(config, "tree", "off") != "off":
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            logger.warning("tree: %r needs vLLM-CPU's attention backend in this version; drafts "
                           "stay chains on this platform", config.tree)
        elif runner.kv_caches:
            from vllm_retrieval_spec.tree_verification import cpu_tree_verifier

            verifier = cpu_tree_verifier(runner.kv_caches[0],
                                         runner.model_config.get_head_size(),
                                         runner.cache_config.cache_dtype)
    runner._rsd_tree_verifier = verifier
    return verifier


def _with_tree_positions(prepare_inputs: Callable) -> Callable:
    @functools.wraps(prepare_inputs)
    def wrapper(self, scheduler_output, num_scheduled_tokens):
        global _trees_in_flight
        result = prepare_inputs(self, scheduler_output, num_scheduled_tokens)
        verifier = self.__dict__.get("_rsd_tree_verifier")
        if verifier is not None:
            verifier.begin_step(self.drafter.trees, list(self.input_batch.req_ids),
                                scheduler_output.scheduled_spec_decode_tokens,
                                num_scheduled_tokens,
                                self.input_batch.num_computed_tokens_cpu, self.positions,
                                scheduler_output.total_num_scheduled_tokens)
            _trees_in_flight = verifier if verifier.step is not None else None
        return result

    return wrapper


def _with_tree_attention(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def wrapper(self, layer, query, key, value, kv_cache, attn_metadata, output, *args,
                **kwargs):
        result = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args,
                         **kwargs)
        if _trees_in_flight is not None:
            _trees_in_flight.attend(self, query, key, value, kv_cache, attn_metadata, output)
        return result

    return wrapper


def _with_tree_acceptance(sample: Callable) -> Callable:
    @functools.wraps(sample)
    def wrapper(self, logits, spec_decode_metadata):
        global _trees_in_flight
        if self.speculative_config is not None:
            _observe_batch(self)
            _draft_before_sampling(self, logits, spec_decode_metadata)
        verifier = self.__dict__.get("_rsd_tree_verifier")
        if verifier is None or verifier.step is None or spec_decode_metadata is None:
            return sample(self, logits, spec_decode_metadata)
        walks = verifier.walk(logits, spec_decode_metadata.num_draft_tokens,
                              spec_decode_metadata.draft_token_ids)
        output = sample(self, logits, spec_decode_metadata)
        verifier.accept(walks, output.sampled_token_ids)
        _trees_in_flight = None
        return output

    return wrapper


def _expand_batch_to_tokens(expand_batch_to_tokens: Callable) -> Callable:
    import torch

    @functools.wraps(expand_batch_to_tokens)
    def expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
        expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
        if replace_from != replace_to:
            expanded = torch.where(expanded == replace_from,
                                   torch.as_tensor(replace_to, dtype=x.dtype), expanded)
        return expanded

    return expand


def _with_retrieval_methods(create_speculative_config: Callable) -> Callable:
    @functools.wraps(create_speculative_config)
    def wrapper(self, target_model_config, target_parallel_config):
        options = self.speculative_config
        if isinstance(options, dict) and options.get("method") in METHODS:
            from vllm.platforms import current_platform

            config = parse_speculative_config(options, platform_defaults(current_platform.is_cpu()))
            validate_against_model(config, target_model_config)
            self.additional_config = {**(self.additional_config or {}),
                                      PLUGIN_KEY: config.to_dict()}
            self.speculative_config = {
                "method": "custom_class",
                "model": config.proposer_class,
                "num_speculative_tokens": config.num_speculative_tokens,
            }
        return create_speculative_config(self, target_model_config, target_parallel_config)

    return wrapper


def _without_prefix_caching_for_pld_plus(create_engine_config: Callable) -> Callable:
    """PLD+ needs every context position's hidden state; prefix-cached tokens are never
    recomputed, so their states would be missing. Decided before vLLM fills in its defaults,
    so that only an explicit request for prefix caching is refused."""

    @functools.wraps(create_engine_config)
    def wrapper(self, *args, **kwargs):
        options = self.speculative_config
        if isinstance(options, dict) and options.get("method") == PldPlusConfig.method:
            _refuse_prefix_caching(self)
        return create_engine_config(self, *args, **kwargs)

    return wrapper


def _refuse_prefix_caching(engine_args: Any) -> None:
    if engine_args.enable_prefix_caching:
        raise ConfigError(
            "method 'pld_plus' needs hidden states for every context token, and prefix-cached "
            "tokens are not recomputed: pass enable_prefix_caching=False "
            "(--no-enable-prefix-caching)")
    if engine_args.enable_prefix_caching is None:
        logger.info("method 'pld_plus': prefix caching turned off (it would hide hidden states)")
        engine_args.enable_prefix_caching = False


def validate_against_model(config: MethodConfig, model_config: Any) -> None:
    """Start-up checks that need the target model: the datastore's tokenizer must be the model's,
    a hidden-state layer must exist."""
    if isinstance(config, PldPlusConfig):
        depth = model_config.hf_text_config.num_hidden_layers
        if config.layer > depth:
            raise ConfigError(
                f"speculative_config['layer']={config.layer} is out of range for this model: "
                f"it has {depth} layers, so the layer must be in [0, {depth}]")
    from vllm_retrieval_spec.datastore.format import MANIFEST_FILE

    datastore = getattr(config, "datastore", None)
    served = getattr(config, "served_datastore", "")
    saved = bool(served) and (Path(served) / MANIFEST_FILE).is_file()
    if not datastore and not saved:
        return
    from transformers import AutoTokenizer

    from vllm_retrieval_spec.datastore.dense import (
        check_dense_index, dense_index_in_use, model_fingerprint)
    from vllm_retrieval_spec.datastore.format import load_datastore, tokenizer_fingerprint

    tokenizer = AutoTokenizer.from_pretrained(
        model_config.tokenizer,
        revision=model_config.tokenizer_revision,
        trust_remote_code=model_config.trust_remote_code,
    )
    fingerprint = tokenizer_fingerprint(tokenizer)

    def check(path: str, dense: bool) -> None:
        if dense:
            # Its keys are hidden states: they must be this model's, in this dtype.
            check_dense_index(
                path, expected_tokenizer_fingerprint=fingerprint,
                hidden_size=model_config.get_hidden_size(), dtype=model_config.dtype,
                expected_model_fingerprint=model_fingerprint(model_config.model),
                verify_checksums=config.verify_checksums)
        else:
            # Tokens of another tokenizer would draft nonsense, or ids outside the vocabulary.
            load_datastore(path, expected_fingerprint=fingerprint,
                           verify_checksums=config.verify_checksums)

    if saved:
        check(served, getattr(config, "served_dense", False) and dense_index_in_use(served, "auto"))
    if datastore:
        check(datastore, isinstance(config, DresdConfig) or (
            isinstance(config, HybridConfig) and dense_index_in_use(datastore, config.dense)))


def _drafter_aux_layers(runner: Any) -> tuple[int, ...] | None:
    return getattr(runner.__dict__.get("drafter"), "aux_hidden_state_layers", None)


def _with_aux_hidden_states(init: Callable) -> Callable:
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # Read at every forward, so the model's output is unpacked as (states, aux states).
        if _drafter_aux_layers(self):
            self.use_aux_hidden_state_outputs = True

    return wrapper


def _drafter_aux_layers_first(get_aux_layers: Callable) -> Callable:
    @functools.wraps(get_aux_layers)
    def wrapper(self):
        return _drafter_aux_layers(self) or get_aux_layers(self)

    return wrapper


def _drafting_timer(runner: Any) -> Any:
    from vllm_retrieval_spec.metrics import DraftingTimer

    timer = runner.__dict__.get("_rsd_drafting_timer")
    if timer is None:
        timer = runner._rsd_drafting_timer = DraftingTimer()
    return timer


#: ``SamplingParams.extra_args`` key naming a request's served store (``served_store:
#: "per_request"``); the OpenAI server fills extra_args from a request's ``vllm_xargs``.
SERVED_STORE_KEY = "served_store_key"


def served_store_key(sampling_params: Any) -> str | None:
    """The request's served-store key (its ``str``), or None when it names none."""
    key = (getattr(sampling_params, "extra_args", None) or {}).get(SERVED_STORE_KEY)
    return None if key is None else str(key)


def _observe_batch(runner: Any) -> None:
    """Tell our drafter which request is in which row, which may get a tree and, when it
    asks, which served store each is drafted from: this needs no sampled token, so it runs
    before sampling, off the drafting's critical path."""
    drafter = runner.__dict__.get("drafter")
    observe_batch = getattr(drafter, "observe_batch", None)
    if observe_batch is None:
        return
    from vllm_retrieval_spec.tree_verification import tree_eligible

    start = time.perf_counter_ns()
    verifier = _tree_verifier(runner)
    req_ids = list(runner.input_batch.req_ids)
    tree_rows = None if verifier is None else [
        tree_eligible(runner.requests[r].sampling_params) for r in req_ids]
    if getattr(drafter, "served_keys_wanted", False):
        observe_batch(req_ids, tree_rows, [
            served_store_key(runner.requests[r].sampling_params) for r in req_ids])
    else:
        observe_batch(req_ids, tree_rows)
    _drafting_timer(runner).add_before(time.perf_counter_ns() - start)


def _draft_before_sampling(runner: Any, logits: Any, spec_decode_metadata: Any) -> None:
    """Hand our drafter what each greedy request will sample (the argmax of its rows of the
    logits along its draft), so it drafts now rather than after sampling
    (``draft_before_sampling``)."""
    drafter = runner.__dict__.get("drafter")
    if not getattr(drafter, "drafts_from_logits", False) or logits is None:
        return
    from vllm_retrieval_spec.drafting.overlap import greedy_sampled
    from vllm_retrieval_spec.tree_verification import tree_eligible

    start = time.perf_counter_ns()
    req_ids = runner.input_batch.req_ids
    # With a tree verifier, ``_observe_batch`` has just asked the same of every row.
    greedy = drafter.tree_rows if len(drafter.tree_rows) == len(req_ids) else [
        tree_eligible(runner.requests[r].sampling_params) for r in req_ids]
    if any(greedy):
        if spec_decode_metadata is None:
            num_drafts = [0] * len(req_ids)
            flat: list[int] = []
        else:
            num_drafts = spec_decode_metadata.num_draft_tokens
            flat = spec_decode_metadata.draft_token_ids.tolist()
        import torch

        # A request's rows of the logits are contiguous: one after each draft token's
        # predecessor (the root first), then the bonus row (``_calc_spec_decode_metadata``).
        rows = logits.detach().cpu()
        rows = (rows if rows.dtype in (torch.float32, torch.float64) else rows.float()).numpy()
        sampled: list[list[int] | None] = []
        verified: list[list[int]] = []
        row = drafted = 0
        for i, n in enumerate(num_drafts):
            draft = flat[drafted:drafted + n]
            verified.append(draft)
            sampled.append(greedy_sampled(draft, rows[row:row + n + 1]) if greedy[i] else None)
            row += n + 1
            drafted += n
        drafter.draft_before_sampling(sampled, verified, runner.input_batch.num_tokens_no_spec,
                                      runner.input_batch.token_ids_cpu)
    _drafting_timer(runner).add_before(time.perf_counter_ns() - start)


def _timed_with_hidden_states(propose_draft_token_ids: Callable) -> Callable:
    @functools.wraps(propose_draft_token_ids)
    def wrapper(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                sample_hidden_states, aux_hidden_states, spec_decode_metadata, *args, **kwargs):
        # The critical part: vLLM hands over this step's sampled tokens here and waits for the
        # drafts (for vLLM's own methods too: the timer wraps every drafter).
        start = time.perf_counter_ns()
        if aux_hidden_states is not None and _drafter_aux_layers(self):
            self.drafter.record_hidden_states(
                list(self.input_batch.req_ids), aux_hidden_states,
                _accepted_state_segments(self, scheduler_output, sampled_token_ids))
        drafter = self.__dict__.get("drafter")
        record_last = getattr(drafter, "record_last_hidden_states", None)
        if record_last is not None and not drafter.drafts_without_states:
            verifier = self.__dict__.get("_rsd_tree_verifier")
            from vllm_retrieval_spec.drafting.overlap import last_state_rows

            num_drafts = spec_decode_metadata.num_draft_tokens if spec_decode_metadata \
                else [0] * len(sampled_token_ids)
            record_last(sample_hidden_states,
                        last_state_rows(sampled_token_ids, num_drafts,
                                        verifier.last_nodes if verifier else None))
        drafts = propose_draft_token_ids(self, scheduler_output, sampled_token_ids,
                                         sampling_metadata, hidden_states, sample_hidden_states,
                                         aux_hidden_states, spec_decode_metadata, *args, **kwargs)
        elapsed = time.perf_counter_ns() - start
        _drafting_timer(self).record(elapsed)
        metrics = getattr(drafter, "metrics", None)
        if metrics is not None:
            metrics.drafting_critical_seconds.observe(elapsed / 1e9)
            if not drafter.work_after_handover:
                # Nothing to precompute or to book: this step's drafting is done.
                metrics.drafting_seconds.observe(_drafting_timer(self).last_total_ns() / 1e9)
        return drafts

    return wrapper


def _precomputing_after(method: Callable) -> Callable:
    """After ``method``, our drafter does the bookkeeping ``propose`` left for later and makes
    the next step's possible drafts."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        drafter = self.__dict__.get("drafter")
        precompute_next = getattr(drafter, "precompute_next", None)
        if precompute_next is not None and drafter.work_after_handover:
            start = time.perf_counter_ns()
            precompute_next()
            timer = _drafting_timer(self)
            timer.add_after(time.perf_counter_ns() - start)
            drafter.metrics.drafting_seconds.observe(timer.last_total_ns() / 1e9)
        return result

    return wrapper


def _keeping_logits_indices(prepare_inputs: Callable) -> Callable:
    """Keeps the step's logits indices (the rows of the forward's hidden states that are
    sampled) for a drafter that searches them ahead (``_searching_ahead_after``)."""

    @functools.wraps(prepare_inputs)
    def wrapper(self, scheduler_output, num_scheduled_tokens):
        result = prepare_inputs(self, scheduler_output, num_scheduled_tokens)
        if _searches_ahead(self.__dict__.get("drafter")):
            self._rsd_logits_indices = result[0]
        return result

    return wrapper


def _searches_ahead(drafter: Any) -> bool:
    """Whether ``drafter`` gets the forward's hidden states of the rows vLLM samples
    (``search_ahead``): DReSD, and hybrid with a dense source."""
    return hasattr(drafter, "search_ahead") and not drafter.drafts_without_states


def _searching_ahead_after(model_forward: Callable) -> Callable:
    """After the forward, a drafter with ``search_ahead`` (DReSD, hybrid with a dense source)
    gets the hidden states of the rows vLLM will sample: any of them may be a request's last
    state once the draft tokens are verified, so DReSD's search of all of them need not wait
    for that, and with ``draft_before_sampling`` the one a greedy request needs is known from
    the logits, before vLLM samples."""

    @functools.wraps(model_forward)
    def wrapper(self, *args, **kwargs):
        output = model_forward(self, *args, **kwargs)
        # Popped: a dummy run's forward (no prepared inputs) must not search stale rows.
        logits_indices = self.__dict__.pop("_rsd_logits_indices", None)
        search_ahead = getattr(self.__dict__.get("drafter"), "search_ahead", None)
        if search_ahead is not None and logits_indices is not None:
            import torch

            if isinstance(output, torch.Tensor):  # not a pipeline stage's intermediate tensors
                start = time.perf_counter_ns()
                try:
                    search_ahead(output[logits_indices])
                except Exception:
                    # Searched after sampling instead: the engine goes on.
                    self.drafter._fail("exception", "could not search ahead", exc_info=True)
                _drafting_timer(self).add_before(time.perf_counter_ns() - start)
        return output

    return wrapper


def _accepted_state_segments(runner: Any, scheduler_output: Any,
                             sampled_token_ids: list[list[int]]) -> list[tuple[int, int, int]]:
    """For each batch row: (first position, first row in this step's states, rows to keep).

    A row's scheduled tokens are contiguous in the step's states, in batch order. Their states
    belong to the context only up to the last accepted draft token: rejected drafts' states
    are dropped (a prefill chunk keeps all of its tokens).
    """
    segments = []
    offset = 0
    for i, req_id in enumerate(runner.input_batch.req_ids):
        scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
        drafted = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
        sampled = sampled_token_ids[i] if i < len(sampled_token_ids) else []
        rejected = drafted - (len(sampled) - 1) if drafted and sampled else drafted
        position = int(runner.input_batch.num_computed_tokens_cpu[i])
        segments.append((position, offset, scheduled - rejected))
        offset += scheduled
    return segments


def _closing_drafter_first(shutdown: Callable) -> Callable:
    """A drafter with a ``close`` (hybrid's served store: store the last requests, save) is
    closed as the worker's teardown starts: vLLM kills a worker that is still tearing down a few
    seconds after the engine was asked to stop, before atexit handlers would run."""

    @functools.wraps(shutdown)
    def wrapper(self):
        runner = getattr(self, "model_runner", None)
        close = getattr(getattr(runner, "__dict__", {}).get("drafter"), "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                logger.exception("closing the drafter failed; shutting down anyway")
        return shutdown(self)

    return wrapper


def _drafting_stats(worker: Any, reset: bool = False) -> dict[str, float | int]:
    """Worker RPC: drafting time per step since start (or the last reset)."""
    from vllm_retrieval_spec.metrics import DraftingTimer

    runner = worker.model_runner
    timer = runner.__dict__.get("_rsd_drafting_timer") or DraftingTimer(capacity=1)
    drafter_stats = getattr(runner.__dict__.get("drafter"), "stats", None)
    verifier = runner.__dict__.get("_rsd_tree_verifier")
    return {**timer.summary(reset=reset), **(drafter_stats(reset) if drafter_stats else {}),
            **(verifier.stats(reset) if verifier is not None else {})}
