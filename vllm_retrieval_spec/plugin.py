"""The ``vllm.general_plugins`` entry point: every patch of vLLM internals lives here.

vLLM calls ``register()`` in each process it starts (front-end, engine core, workers). It
checks the vLLM version and the exact signatures of the private methods it wraps, then:

- ``EngineArgs.create_speculative_config``: rewrites ``{"method": "rest", ...}`` into vLLM's
  ``custom_class`` method with our proposer class, validates our options once (including the
  datastore against the model's tokenizer) and moves them into ``additional_config``, which
  reaches the workers. This serves ``LLM(...)`` and the OpenAI server's ``--speculative-config``.
- ``GPUModelRunner.propose_draft_token_ids`` (also the CPU runner's): times every drafting step,
  for every method including vLLM's own, so benchmarks compare like with like.
- ``Worker.rsd_drafting_stats`` (added): lets ``LLM.collective_rpc`` read those timings.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from vllm_retrieval_spec.config import METHODS, PLUGIN_KEY, MethodConfig, parse_speculative_config

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
}

_registered = False


class IncompatibleVllmError(RuntimeError):
    pass


def register() -> None:
    """Apply our patches once per process."""
    global _registered
    if _registered or os.environ.get(DISABLE_ENV) == "1":
        return
    check_vllm_compatibility()

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    EngineArgs.create_speculative_config = _with_retrieval_methods(
        EngineArgs.create_speculative_config)
    GPUModelRunner.propose_draft_token_ids = _timed(GPUModelRunner.propose_draft_token_ids)
    Worker.rsd_drafting_stats = _drafting_stats
    _registered = True


def check_vllm_compatibility() -> None:
    """Fail with a clear message on a vLLM whose internals we were not written against."""
    import importlib

    import vllm

    hint = (f"vllm-retrieval-spec supports vLLM {SUPPORTED_VLLM}*; install that version, or set "
            f"{DISABLE_ENV}=1 to run vLLM without this plugin")
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise IncompatibleVllmError(f"found vLLM {vllm.__version__}. {hint}")
    for path, expected in _WRAPPED_SIGNATURES.items():
        module_name, class_name, method_name = path.rsplit(".", 2)
        cls = getattr(importlib.import_module(module_name), class_name, None)
        method = getattr(cls, method_name, None)
        if method is None:
            raise IncompatibleVllmError(f"vLLM {vllm.__version__} has no {path}. {hint}")
        found = tuple(inspect.signature(method).parameters)
        if found != expected:
            raise IncompatibleVllmError(
                f"{path} has parameters {found} in vLLM {vllm.__version__}, expected "
                f"{expected}. {hint}")


def _with_retrieval_methods(create_speculative_config: Callable) -> Callable:
    def wrapper(self, target_model_config, target_parallel_config):
        options = self.speculative_config
        if isinstance(options, dict) and options.get("method") in METHODS:
            config = parse_speculative_config(options)
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


def validate_against_model(config: MethodConfig, model_config: Any) -> None:
    """Start-up checks that need the target model: the datastore's tokenizer must be the model's."""
    datastore = getattr(config, "datastore", None)
    if not datastore:
        return
    from transformers import AutoTokenizer

    from vllm_retrieval_spec.datastore.format import load_datastore, tokenizer_fingerprint

    tokenizer = AutoTokenizer.from_pretrained(
        model_config.tokenizer,
        revision=model_config.tokenizer_revision,
        trust_remote_code=model_config.trust_remote_code,
    )
    load_datastore(datastore, expected_fingerprint=tokenizer_fingerprint(tokenizer),
                   verify_checksums=config.verify_checksums)


def _timed(propose_draft_token_ids: Callable) -> Callable:
    from vllm_retrieval_spec.metrics import DraftingTimer

    def wrapper(self, *args, **kwargs):
        timer = self.__dict__.get("_rsd_drafting_timer")
        if timer is None:
            timer = self._rsd_drafting_timer = DraftingTimer()
        start = time.perf_counter_ns()
        drafts = propose_draft_token_ids(self, *args, **kwargs)
        timer.record(time.perf_counter_ns() - start)
        return drafts

    return wrapper


def _drafting_stats(worker: Any, reset: bool = False) -> dict[str, float | int]:
    """Worker RPC: drafting time per step since start (or the last reset)."""
    from vllm_retrieval_spec.metrics import DraftingTimer

    runner = worker.model_runner
    timer = runner.__dict__.get("_rsd_drafting_timer") or DraftingTimer(capacity=1)
    return timer.summary(reset=reset)
