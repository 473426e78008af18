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

from vllm_retrieval_spec.datastore.corpus import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_EXTENSIONS,
    CorpusStats,
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
    vocab_size = tokenizer_vocab_size(tokenizer)

    def write_tokens(writer: Int32StreamWriter, stats: CorpusStats) -> None:
        documents = iter_documents(
            source_names,
            tokenizer,
            stats,
            text_field=text_field,
            messages_field=messages_field,
            extensions=extensions,
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
        empty_hint=f"extensions {list(extensions)}",
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
) -> Manifest:
    """A datastore from already tokenised documents, e.g. the target model's own generations."""
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
) -> Manifest:
    timings: dict[str, float] = {}
    stats = CorpusStats()
    with atomic_datastore_dir(output, overwrite=overwrite) as tmp:
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

    stages = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in timings.items())
    print(
        f"datastore {output}: {manifest.num_tokens:,} tokens, {manifest.num_documents:,} "
        f"documents, {manifest.skipped_files} file(s) skipped ({stages})",
        file=sys.stderr,
    )
    return manifest
