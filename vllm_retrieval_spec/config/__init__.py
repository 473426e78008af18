"""Typed, validated options for each drafting method: option groups (``options``), the methods
composing them (``methods``) and the defaults that depend on the platform (``platform``)."""

from vllm_retrieval_spec.config.methods import (
    METHODS,
    PLUGIN_KEY,
    DresdConfig,
    HybridConfig,
    MethodConfig,
    PldConfig,
    PldPlusConfig,
    RestConfig,
    config_from_dict,
    misspelt_method,
    parse_speculative_config,
)
from vllm_retrieval_spec.config.options import (
    MAX_SPECULATIVE_TOKENS,
    TREE_COST_FACTOR,
    ConfigError,
    TrieOptions,
)
from vllm_retrieval_spec.config.platform import (
    ACCELERATOR_DEFAULTS,
    VLLM_CPU_DEFAULTS,
    PlatformDefaults,
    platform_defaults,
)

__all__ = [
    "ACCELERATOR_DEFAULTS", "METHODS", "MAX_SPECULATIVE_TOKENS", "PLUGIN_KEY", "TREE_COST_FACTOR",
    "VLLM_CPU_DEFAULTS", "ConfigError", "DresdConfig", "HybridConfig", "MethodConfig",
    "PlatformDefaults", "PldConfig", "PldPlusConfig", "RestConfig", "TrieOptions",
    "config_from_dict", "misspelt_method", "parse_speculative_config", "platform_defaults",
]
