"""The ``vllm.general_plugins`` entry point: the inventory of every patch of vLLM internals.

vLLM calls ``register()`` in each process it starts (front-end, engine core, workers). It checks
the vLLM version and the exact parameters of every attribute it wraps (``PATCHES``); on any
other vLLM it patches nothing (one warning; a config naming one of our methods fails with the
reason). Otherwise it applies ``PATCHES`` in order. The wrappers live in ``patches/``, by the
part of the step they serve; each one's docstring says what it does and why. They talk to a
drafter only through ``contract.Drafter``, calling what its ``capabilities`` declare; vLLM's
own drafters are only timed.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_retrieval_spec.config import METHODS
from vllm_retrieval_spec.patches import drafter, engine_args, trees, vllm_cpu

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = "0.32."
#: Set to 1 to load vLLM without any of our patches.
DISABLE_ENV = "VLLM_RSD_DISABLE"

_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
_FORWARD = ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds",
            "model_kwargs")
_ATTENTION = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
              "output_scale", "output_block_scale")


@dataclass(frozen=True)
class Patch:
    #: The vLLM attribute replaced: a method of a class, or a function of a module.
    target: str
    #: Its parameters, in order, as our wrapper relies on them (checked before any patching).
    parameters: tuple[str, ...]
    wrap: Callable[[Callable], Callable]
    #: "all", or only on "cpu" (vLLM-CPU) or "accelerator" platforms.
    where: str = "all"


#: Every patch, applied in this order (a later wrapper of the same target wraps the earlier).
PATCHES = (
    # Start-up, in the process that builds the engine config.
    Patch("vllm.engine.arg_utils.EngineArgs.create_engine_config",
          ("self", "usage_context", "headless"), engine_args.without_prefix_caching_for_pld_plus),
    Patch("vllm.engine.arg_utils.EngineArgs.create_speculative_config",
          ("self", "target_model_config", "target_parallel_config"),
          engine_args.with_retrieval_methods),
    # The worker's runner, in the order one decoding step reaches them.
    Patch(f"{_RUNNER}.__init__", ("self", "vllm_config", "device"),
          drafter.with_aux_hidden_states),
    Patch(f"{_RUNNER}._get_eagle3_aux_layers_from_config", ("self",),
          drafter.drafter_aux_layers_first),
    Patch(f"{_RUNNER}._update_states", ("self", "scheduler_output"),
          drafter.telling_finished_requests),
    Patch(f"{_RUNNER}._prepare_inputs", ("self", "scheduler_output", "num_scheduled_tokens"),
          drafter.keeping_logits_indices),
    Patch(f"{_RUNNER}.initialize_kv_cache",
          ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context"),
          trees.with_tree_verifier),
    Patch(f"{_RUNNER}._prepare_inputs", ("self", "scheduler_output", "num_scheduled_tokens"),
          trees.with_tree_positions),
    Patch("vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward",
          _ATTENTION, trees.with_tree_attention, "cpu"),
    Patch("vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward", _ATTENTION,
          trees.with_tree_attention, "accelerator"),
    Patch("vllm.v1.attention.backends.triton_attn.TritonAttentionImpl.forward", _ATTENTION,
          trees.with_tree_attention, "accelerator"),
    Patch(f"{_RUNNER}._model_forward", _FORWARD, drafter.searching_ahead_after),
    # On an accelerator the next step's drafts are made right after the next forward is
    # launched, while the host would only wait for it; on vLLM-CPU the forward runs on the same
    # cores, so right after the drafts are handed over, while the caches are warm.
    Patch(f"{_RUNNER}._model_forward", _FORWARD, drafter.after_handover, "accelerator"),
    Patch(f"{_RUNNER}._copy_draft_token_ids_to_cpu", ("self", "scheduler_output", "zeros_only"),
          drafter.after_handover, "cpu"),
    Patch(f"{_RUNNER}._sample", ("self", "logits", "spec_decode_metadata"),
          trees.with_tree_acceptance),
    Patch(f"{_RUNNER}._sample", ("self", "logits", "spec_decode_metadata"),
          drafter.with_drafts_before_sampling),
    Patch(f"{_RUNNER}._input_fits_in_drafter", ("self", "common_attn_metadata"),
          drafter.drafting_near_the_length_limit),
    Patch(f"{_RUNNER}.propose_draft_token_ids",
          ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
           "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata",
           "common_attn_metadata", "slot_mappings"), drafter.timed_with_hidden_states),
    Patch("vllm.v1.worker.gpu_worker.Worker.shutdown", ("self",), drafter.closing_drafter_first),
    # vLLM-CPU 0.32's own bugs.
    Patch("vllm.v1.sample.rejection_sampler.expand_batch_to_tokens",
          ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"),
          vllm_cpu.expand_batch_to_tokens, "cpu"),
    Patch("vllm.v1.sample.rejection_sampler.apply_top_k_top_p", ("logits", "k", "p"),
          vllm_cpu.without_empty_batches, "cpu"),
    Patch("vllm.platforms.cpu.CpuPlatform.register_triton_kernel_overrides", (),
          vllm_cpu.with_llvmlite_scannable, "cpu"),
)
#: Added to vLLM: the drafting timings, for ``LLM.collective_rpc("rsd_drafting_stats")``.
ADDED = {"vllm.v1.worker.gpu_worker.Worker.rsd_drafting_stats": drafter.drafting_stats}

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
    platform = _platform()
    for patch in PATCHES:
        if patch.where in ("all", platform):
            owner, name = _owner(patch.target)
            original = inspect.getattr_static(owner, name)
            if isinstance(original, classmethod):
                setattr(owner, name, classmethod(patch.wrap(original.__func__)))
            else:
                setattr(owner, name, patch.wrap(getattr(owner, name)))
    for target, added in ADDED.items():
        setattr(*_owner(target), added)


def _platform() -> str:
    """The ``Patch.where`` this process's platform takes: "cpu" or "accelerator"."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "accelerator"


def _owner(path: str) -> tuple[Any, str]:
    """(the class or module holding ``path``'s attribute, its name)."""
    module_name, owner_name, name = path.rsplit(".", 2)
    try:  # a method of a class, or a function of a module
        return importlib.import_module(f"{module_name}.{owner_name}"), name
    except ImportError:
        return getattr(importlib.import_module(module_name), owner_name, None), name


def vllm_incompatibility() -> str | None:
    """Why the installed vLLM is not one whose internals we were written against, or None."""
    import vllm

    hint = (f"vllm-retrieval-spec supports vLLM {SUPPORTED_VLLM}*; install that version, or set "
            f"{DISABLE_ENV}=1 to run vLLM without this plugin")
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        return f"found vLLM {vllm.__version__}. {hint}"
    platform = _platform()
    for patch in PATCHES:
        path, expected = patch.target, patch.parameters
        try:
            owner, name = _owner(path)
        except Exception as e:  # a backend's module may need its platform's libraries
            if patch.where not in ("all", platform):
                continue  # not patched here; its signature is checked where it imports
            return f"cannot import {path.rsplit('.', 2)[0]} ({type(e).__name__}: {e}). {hint}"
        method = getattr(owner, name, None)
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
