"""Reading a model folder without loading the model: its config, and a fingerprint of what
makes its hidden states comparable (the dense index records it and is checked against it)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.datastore.format import DatastoreError


#: Files of a model folder that match the weight patterns but hold no weights (as vLLM's loader
#: skips them: ``filter_files_not_needed_for_inference``).
NOT_WEIGHT_FILES = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt",
                    "scaler.pt")

#: (weight files, the index naming the file of each tensor in a sharded checkpoint), in the
#: order vLLM's loader prefers them.
WEIGHT_FORMATS = (("*.safetensors", "model.safetensors.index.json"),
                  ("*.bin", "pytorch_model.bin.index.json"),
                  ("*.pt", None))


def resolve_model_dir(model: str | Path) -> Path:
    """The local folder of a model named as vLLM takes it: a folder, or a Hugging Face model id
    found in the local cache. Nothing is downloaded: building and checking a dense index must
    not depend on the network."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(str(model), local_files_only=True))
    except ValueError:
        # Not even the form of a model id: a path.
        if Path(model).exists():
            raise DatastoreError(
                f"model {model} is a file; the dense index needs a model folder (config.json "
                f"and safetensors or PyTorch weights)") from None
        raise DatastoreError(f"model folder {model} does not exist") from None
    except OSError:
        raise DatastoreError(
            f"model {str(model)!r} is not a folder, and not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) either; the dense index reads the model's config and "
            f"weights without downloading anything: download it first (`hf download {model}`) "
            f"or pass the folder of a local copy") from None


def model_config_json(model: str | Path) -> dict[str, Any]:
    config_file = resolve_model_dir(model) / "config.json"
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DatastoreError(
            f"cannot read {config_file} ({e}); the dense index needs the model's config") from None


def model_fingerprint(model: str | Path) -> str:
    """sha256 of what makes two models' hidden states comparable: the architecture numbers of
    config.json and the weights of the final norm (which differ between fine-tunes of one base).

    ``model`` is a folder or a cached Hugging Face id, with safetensors or PyTorch weights (single
    or sharded); only the final norm's tensor is read (memory-mapped), so start-up stays cheap.
    The weights are hashed as float32, so one model saved in either format has one fingerprint.
    """
    import hashlib

    model_dir = resolve_model_dir(model)
    config = model_config_json(model_dir)
    keys = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "vocab_size")
    digest = hashlib.sha256(json.dumps({k: config.get(k) for k in keys},
                                       sort_keys=True).encode())
    locations = _weight_locations(model_dir)
    norms = sorted(name for name in locations if _is_final_norm(name))
    if not norms:
        raise DatastoreError(
            f"{model_dir} has no safetensors or PyTorch (.bin, .pt) weights with a final norm "
            f"weight (model.norm.weight or alike), which the dense index fingerprints the model "
            f"by; pass a folder holding the model's complete weights")
    # The first in name order: deterministic when a model has several (e.g. a vision tower's).
    with _open_weights(locations[norms[0]]) as (_, read):
        weight = read(norms[0])
    digest.update(weight.float().numpy().tobytes())
    return digest.hexdigest()


def _is_final_norm(name: str) -> bool:
    """A norm's weight outside the numbered blocks (model.norm.weight, transformer.ln_f.weight,
    model.decoder.final_layer_norm.weight; not model.layers.3.input_layernorm.weight)."""
    parts = name.split(".")
    return (len(parts) >= 2 and parts[-1] == "weight"
            and ("norm" in parts[-2] or parts[-2] == "ln_f")
            and not any(part.isdigit() for part in parts))


def _weight_locations(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it, in the first format present: from a sharded
    checkpoint's index when there is one, else from the files' own tensor lists."""
    for pattern, index_name in WEIGHT_FORMATS:
        index = model_dir / index_name if index_name else None
        if index is not None and index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise DatastoreError(
                    f"cannot read {index} ({e!r}); pass a folder holding the model's complete "
                    f"weights") from None
            return {name: model_dir / file for name, file in weight_map.items()}
        files = _weight_files(model_dir, pattern)
        if files:
            locations: dict[str, Path] = {}
            for file in files:
                with _open_weights(file) as (names, _):
                    locations.update(dict.fromkeys(names, file))
            return locations
    return {}


def _weight_files(model_dir: Path, pattern: str) -> list[Path]:
    return [f for f in sorted(model_dir.glob(pattern)) if f.name not in NOT_WEIGHT_FILES]


def not_a_model_folder(path: Path) -> str | None:
    """Why ``path`` is no model folder vLLM could load (a file, no config.json, no weights), or
    None. Only names are looked at: a file's contents are vLLM's to judge."""
    if not path.is_dir():
        return "a file"
    if not (path / "config.json").is_file():
        return "no config.json"
    if not any(_weight_files(path, pattern) for pattern, _ in WEIGHT_FORMATS):
        return "no safetensors or PyTorch weights"
    return None


@contextmanager
def _open_weights(file: Path) -> Iterator[tuple[list[str], Callable[[str], Any]]]:
    """(tensor names, name -> tensor) of a safetensors or PyTorch weight file, memory-mapped: a
    tensor's bytes are read only when it is."""
    try:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            opened = safe_open(str(file), framework="pt")
        else:
            import torch

            opened = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    # safetensors, torch and pickle each raise their own types for a file they cannot read.
    except Exception as e:
        raise DatastoreError(
            f"cannot read the weights in {file} ({type(e).__name__}: {e}); pass a folder holding "
            f"the model's complete weights") from None
    if isinstance(opened, dict):
        yield list(opened), opened.__getitem__
    else:
        with opened:
            yield list(opened.keys()), opened.get_tensor
