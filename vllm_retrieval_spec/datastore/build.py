"""Builders behind `vllm-rsd build-datastore`.

Stages: token stream -> tokens.npy (streamed) -> suffix_array.npy -> checksums -> manifest.json,
all in a temporary directory renamed into place at the end, so an interrupted build leaves
nothing loadable behind. Peak memory is the suffix-array stage (see ``build_suffix_array``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vllm_retrieval_spec.atomic import report_abandoned
from vllm_retrieval_spec.datastore.corpus import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_EXTENSIONS,
    CorpusStats,
    check_sources,
    file_suffixes,
    iter_documents,
    write_token_id_stream,
    write_token_stream,
)
from vllm_retrieval_spec.datastore.format import (
    SUFFIX_ARRAY_FILE,
    TOKENS_FILE,
    DatastoreError,
    Int32StreamWriter,
    Manifest,
    atomic_datastore_dir,
    describe_file,
    tokenizer_fingerprint,
    tokenizer_vocab_size,
    write_manifest,
)
from vllm_retrieval_spec.datastore.suffix_array import build_suffix_array


def build_datastore(
    sources: Sequence[str | Path],
    output: str | Path,
    tokenizer: Any,
    *,
    tokenizer_name: str,
    text_field: str = "text",
    messages_field: str = "messages",
    extensions: Sequence[str] = DEFAULT_EXTENSIONS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    overwrite: bool = False,
    progress: bool | None = True,
) -> Manifest:
    """Tokenise ``sources`` (see ``corpus``) into a new REST datastore at ``output``.

    ``progress``: True shows a bar on stderr, None only when stderr is a terminal, False never;
    a one-line summary goes to stderr in any case.
    """
    source_names = [os.fspath(s) for s in sources]
    check_sources(source_names)
    # Checked here too, not only when the walk reaches a directory after earlier sources.
    suffixes = file_suffixes(extensions)
    vocab_size = tokenizer_vocab_size(tokenizer)

    def write_tokens(writer: Int32StreamWriter, stats: CorpusStats) -> None:
        documents = iter_documents(
            source_names,
            tokenizer,
            stats,
            text_field=text_field,
            messages_field=messages_field,
            extensions=suffixes,
        )
        write_token_stream(
            documents,
            tokenizer,
            writer,
            stats,
            vocab_size=vocab_size,
            batch_size=batch_size,
            progress=progress,
        )

    return _build(
        output,
        write_tokens,
        tokenizer_name=tokenizer_name,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        vocab_size=vocab_size,
        sources=source_names,
        empty_hint=f"extensions {list(suffixes)}",
        overwrite=overwrite,
        progress=progress,
    )


def build_datastore_from_token_ids(
    documents: Iterable[Sequence[int] | np.ndarray],
    output: str | Path,
    *,
    tokenizer_name: str,
    tokenizer_fingerprint: str,
    vocab_size: int,
    sources: Sequence[str] = (),
    overwrite: bool = False,
    progress: bool | None = True,
    then: Callable[[Path, Manifest], None] | None = None,
    private: bool = False,
) -> Manifest:
    """A datastore from already tokenised documents, e.g. the target model's own generations.
    ``then(directory, manifest)`` writes more into the datastore (a dense index) before it is
    renamed into place, so that everything appears at once. ``private``: written in a
    directory only its user can enter (``atomic_datastore_dir``)."""
    return _build(
        output,
        lambda writer, stats: write_token_id_stream(
            documents, writer, stats, vocab_size=vocab_size, progress=progress
        ),
        tokenizer_name=tokenizer_name,
        tokenizer_fingerprint=tokenizer_fingerprint,
        vocab_size=vocab_size,
        sources=list(sources),
        empty_hint="token-id documents",
        overwrite=overwrite,
        progress=progress,
        then=then,
        private=private,
    )


def _build(
    output: str | Path,
    write_tokens: Callable[[Int32StreamWriter, CorpusStats], None],
    *,
    tokenizer_name: str,
    tokenizer_fingerprint: str,
    vocab_size: int,
    sources: list[str],
    empty_hint: str,
    overwrite: bool,
    progress: bool | None,
    then: Callable[[Path, Manifest], None] | None = None,
    private: bool = False,
) -> Manifest:
    timings: dict[str, float] = {}
    stats = CorpusStats()
    with atomic_datastore_dir(output, overwrite=overwrite, private=private) as tmp:
        start = time.perf_counter()
        with Int32StreamWriter(tmp / TOKENS_FILE) as writer:
            write_tokens(writer, stats)
        if stats.num_documents == 0:
            raise DatastoreError(
                f"no documents with any tokens in {sources} ({empty_hint}, "
                f"{stats.skipped_files} file(s) skipped as binary or unreadable); nothing to build"
            )
        timings["tokens"] = time.perf_counter() - start

        start = time.perf_counter()
        if progress is not False:
            print(f"building the suffix array of {stats.num_tokens:,} tokens", file=sys.stderr)
        sa = build_suffix_array(np.load(tmp / TOKENS_FILE, mmap_mode="r"))
        np.save(tmp / SUFFIX_ARRAY_FILE, sa)
        del sa
        timings["suffix array"] = time.perf_counter() - start

        start = time.perf_counter()
        manifest = Manifest(
            tokenizer_name=tokenizer_name,
            tokenizer_fingerprint=tokenizer_fingerprint,
            vocab_size=vocab_size,
            num_tokens=stats.num_tokens,
            num_documents=stats.num_documents,
            files={name: describe_file(tmp / name) for name in (TOKENS_FILE, SUFFIX_ARRAY_FILE)},
            sources=sources,
            skipped_files=stats.skipped_files,
        )
        write_manifest(tmp, manifest)
        timings["checksums"] = time.perf_counter() - start
        if then is not None:
            then(tmp, manifest)

    stages = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in timings.items())
    print(
        f"datastore {output}: {manifest.num_tokens:,} tokens, {manifest.num_documents:,} "
        f"documents, {manifest.skipped_files} file(s) skipped ({stages})",
        file=sys.stderr,
    )
    return manifest


def build_dense_index(
    datastore_path: str | Path,
    model: str | Path,
    *,
    dims: int = 64,
    fit_samples: int = 1_000_000,
    dtype: str = "float32",
    window: int = 1024,
    overlap: int = 256,
    scann: bool = True,
    overwrite: bool = False,
    progress: bool | None = True,
) -> Any:
    """Add DReSD's dense index to an existing datastore (``vllm-rsd build-datastore --dense``).

    ``model`` is a model folder or a Hugging Face id in the local cache (``model_files.resolve_model_dir``);
    ``dtype`` is vLLM's (e.g. "auto"), and the manifest records the dtype it resolves to.

    vLLM itself runs the forward passes (a pooling engine that returns every token's final
    hidden state), so build and serve share kernels and numerics. Documents longer than
    ``window`` tokens are cut into windows that overlap by ``overlap`` tokens; each window
    contributes only the states of its new tokens, which see at least ``overlap`` tokens of
    context. The raw states go to a temporary float32 file in the datastore's directory (4 x
    hidden size bytes per token) and are deleted afterwards.
    """
    from vllm_retrieval_spec.datastore.dense import (
        DENSE_DIR, check_dense_replaceable, dtype_name, write_dense_index)
    from vllm_retrieval_spec.model_files import model_fingerprint
    from vllm_retrieval_spec.datastore.format import load_datastore

    # Everything that can be wrong is checked before minutes of forward passes.
    check_dense_options(model, dims=dims, window=window, overlap=overlap)
    datastore = load_datastore(datastore_path)
    check_dense_replaceable(Path(datastore_path) / DENSE_DIR, overwrite)
    # The states file is named as atomic_path names its temporaries: a killed build's is named.
    report_abandoned(Path(datastore_path) / f"{DENSE_DIR}.states")
    fingerprint = model_fingerprint(model)
    windows, positions = _dense_windows(np.asarray(datastore.tokens), window, overlap)
    if not len(positions):
        raise DatastoreError(f"{datastore_path} has no document of 2 or more tokens to index")
    llm = _hidden_state_engine(model, dtype, window)
    hidden_size = llm.llm_engine.model_config.get_hidden_size()
    depth = llm.llm_engine.model_config.hf_text_config.num_hidden_layers
    # What the forward passes really ran in: serving compares its own resolved dtype with it.
    resolved_dtype = dtype_name(llm.llm_engine.model_config.dtype)
    states_file = Path(datastore_path) / f"{DENSE_DIR}.states.tmp-{os.getpid()}"
    try:
        states = np.lib.format.open_memmap(states_file, mode="w+", dtype=np.float32,
                                           shape=(len(positions), hidden_size))
        _write_hidden_states(llm, np.asarray(datastore.tokens), windows, states, progress)
        llm.llm_engine.engine_core.shutdown()
        del llm
        return write_dense_index(
            datastore, states, positions, model_name=Path(model).name,
            model_fingerprint=fingerprint, layer=depth, dtype=resolved_dtype, dims=dims,
            fit_samples=fit_samples, scann=scann, overwrite=overwrite, progress=progress)
    finally:
        states_file.unlink(missing_ok=True)


def check_dense_options(model: str | Path, *, dims: int, window: int, overlap: int) -> None:
    """The options of ``build_dense_index`` that ``model`` can refuse, checked from its
    config.json alone: by the CLI also before it builds a datastore from sources (minutes of
    tokenising, then a datastore left without the index asked for)."""
    from vllm_retrieval_spec.datastore.projection import check_pca_dims
    from vllm_retrieval_spec.model_files import model_config_json

    if not 0 <= overlap < window:
        raise DatastoreError(f"overlap {overlap} must be in [0, window={window})")
    config = model_config_json(model)
    check_pca_dims(dims, config["hidden_size"])
    positions = config.get("max_position_embeddings")
    # vLLM refuses a longer max_model_len (the window) with a pydantic traceback; a config that
    # scales its rope, or VLLM_ALLOW_LONG_MAX_MODEL_LEN, may allow more, which vLLM alone
    # knows how to work out.
    if (isinstance(positions, int) and window > positions and not scales_rope(config)
            and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0") in ("", "0")):
        raise DatastoreError(f"a dense window of {window} tokens is longer than the model's "
                             f"{positions} positions (max_position_embeddings); give "
                             f"--dense-window {positions} or less")


def scales_rope(config: dict[str, Any]) -> bool:
    """Whether config.json scales its rotary positions: ``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (5; one dict, or one per layer type) of a type other than "default"."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        return False
    layers = [rope] if "rope_type" in rope or "type" in rope else [
        value for value in rope.values() if isinstance(value, dict)]
    return any(layer.get("rope_type", layer.get("type")) not in (None, "default")
               for layer in layers)


def _dense_windows(tokens: np.ndarray, window: int,
                   overlap: int) -> tuple[list[tuple[int, int, int, int]], np.ndarray]:
    """Forward windows (first, stop, keep from, keep to) over every document, and the positions
    that get keys, in the order the windows produce them: every token that has a next token in
    its document (its state predicted that token)."""
    from vllm_retrieval_spec.datastore.format import SEPARATOR

    ends = np.flatnonzero(tokens == SEPARATOR)
    windows: list[tuple[int, int, int, int]] = []
    keyed: list[np.ndarray] = []
    start = 0
    for end in ends.tolist():
        # Keys for [start, end - 1): the last token of a document predicts nothing.
        kept = start
        while kept < end - 1:
            first = max(start, kept - overlap)
            stop = min(end, first + window)
            windows.append((first, stop, kept, min(stop, end - 1)))
            keyed.append(np.arange(kept, min(stop, end - 1), dtype=np.int64))
            kept = stop
        start = end + 1
    positions = np.concatenate(keyed) if keyed else np.empty(0, dtype=np.int64)
    return windows, positions


def _hidden_state_engine(model: str | Path, dtype: str, window: int) -> Any:
    from vllm import LLM
    from vllm.config import PoolerConfig

    return LLM(
        str(model), runner="pooling", convert="embed", dtype=dtype, enforce_eager=True,
        max_model_len=window, enable_prefix_caching=False,
        # "ALL" pooling without activation hands back the final (normed) hidden state of every
        # prompt token: the states the generating runner gives the drafter.
        pooler_config=PoolerConfig(pooling_type="ALL", use_activation=False, task="token_embed"),
    )


def _write_hidden_states(llm: Any, tokens: np.ndarray, windows: list[tuple[int, int, int, int]],
                         states: np.ndarray, progress: bool | None) -> None:
    from tqdm import tqdm

    disable = progress is False or (progress is None and not sys.stderr.isatty())
    row = 0
    batch = 64
    with tqdm(total=len(states), desc="hidden states", unit="tok", disable=disable) as bar:
        for i in range(0, len(windows), batch):
            group = windows[i:i + batch]
            prompts = [{"prompt_token_ids": tokens[first:stop].tolist()}
                       for first, stop, _, _ in group]
            outputs = llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
            for (first, _, keep_from, keep_to), output in zip(group, outputs):
                data = output.outputs.data[keep_from - first:keep_to - first].float().numpy()
                states[row:row + len(data)] = data
                row += len(data)
            bar.update(row - bar.n)
    if row != len(states):
        raise RuntimeError(f"wrote {row} hidden states, expected {len(states)}")
