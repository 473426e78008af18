"""Start-up checks that need the target model, run once in the process that builds the engine
config: a datastore must hold the model's tokens (its tokenizer's fingerprint), a dense index
the model's own hidden states, and a hidden-state layer must exist."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_retrieval_spec.config.methods import (
    DresdConfig, HybridConfig, MethodConfig, PldPlusConfig)
from vllm_retrieval_spec.config.options import ConfigError


def validate_against_model(config: MethodConfig, model_config: Any) -> None:
    if isinstance(config, PldPlusConfig):
        depth = model_config.hf_text_config.num_hidden_layers
        if config.layer > depth:
            raise ConfigError(
                f"speculative_config['layer']={config.layer} is out of range for this model: "
                f"it has {depth} layers, so the layer must be in [0, {depth}]")
    store = getattr(config, "store", None)
    datastore = store.datastore if store is not None else ""
    verify = store.verify_checksums if store is not None else True
    served = config.served.served_datastore if isinstance(config, HybridConfig) else ""
    if served and Path(served).exists() and not Path(served).is_dir():
        # The worker would fail creating it, once the engine had started (FileExistsError).
        raise ConfigError(
            f"speculative_config['served_datastore']={served!r} exists and is not a directory: "
            "give a directory (one that does not exist yet is created)")
    if not datastore and not (served and Path(served).is_dir()):
        return
    from transformers import AutoTokenizer

    from vllm_retrieval_spec.datastore.dense import check_dense_index, dense_index_in_use
    from vllm_retrieval_spec.datastore.format import load_datastore, tokenizer_fingerprint
    from vllm_retrieval_spec.model_files import model_fingerprint

    tokenizer = AutoTokenizer.from_pretrained(
        model_config.tokenizer,
        revision=model_config.tokenizer_revision,
        trust_remote_code=model_config.trust_remote_code,
    )
    fingerprint = tokenizer_fingerprint(tokenizer)

    if served:
        from vllm_retrieval_spec.datastore.served_saver import check_served_directory

        # Here rather than in the worker: the engine would start before the replica refused.
        check_served_directory(Path(served), fingerprint,
                               config.served.served_store == "per_request",
                               verify_checksums=verify)
    if not datastore:
        return
    if isinstance(config, DresdConfig) or (
            isinstance(config, HybridConfig) and dense_index_in_use(datastore, config.dense.dense)):
        # Its keys are hidden states: they must be this model's, in this dtype.
        check_dense_index(
            datastore, expected_tokenizer_fingerprint=fingerprint,
            hidden_size=model_config.get_hidden_size(), dtype=model_config.dtype,
            expected_model_fingerprint=model_fingerprint(model_config.model),
            search=config.search.search, verify_checksums=verify)
    else:
        # Tokens of another tokenizer would draft nonsense, or ids outside the vocabulary.
        load_datastore(datastore, expected_fingerprint=fingerprint, verify_checksums=verify)
