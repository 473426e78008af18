"""Corpus -> documents -> one int32 token stream on disk.

Sources:
  * ``.jsonl`` / ``.jsonl.gz``: one JSON object per line holding a text field (default "text")
    or a chat field (default "messages": a list of {"role", "content"}), rendered with the
    tokenizer's chat template so the stream looks like what the model reads and writes;
  * a directory: every file below it whose name ends with one of ``extensions`` (default
    ``.py``; "py" means ".py", see ``file_suffixes``), in sorted order; each file is one
    document (``.jsonl`` files are read as above); binary, non-UTF-8 and unreadable files are
    skipped and counted;
  * any other file (``.txt``, ``.md``, ...): one document.

Documents are tokenised in batches (fast tokenizers spread a batch over all cores) and written
out batch by batch, each followed by SEPARATOR, so memory holds one batch, not the corpus.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from tqdm import tqdm

from vllm_retrieval_spec.datastore.format import SEPARATOR, DatastoreError, Int32StreamWriter

DEFAULT_EXTENSIONS = (".py",)
DEFAULT_BATCH_SIZE = 256
# A batch is also cut at this many characters, so one batch of huge files stays small.
_BATCH_CHARS = 2_000_000
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


@dataclass
class CorpusStats:
    num_documents: int = 0
    #: Tokens written, separators included.
    num_tokens: int = 0
    skipped_files: int = 0


def iter_documents(
    sources: Sequence[str | Path],
    tokenizer: Any,
    stats: CorpusStats,
    *,
    text_field: str = "text",
    messages_field: str = "messages",
    extensions: Sequence[str] = DEFAULT_EXTENSIONS,
) -> Iterator[str]:
    """Every document of every source, in order; counts skipped files in ``stats``."""
    for source in sources:
        path = Path(source)
        if path.is_dir():
            for file in _walk(path, file_suffixes(extensions)):
                if _is_jsonl(file):
                    yield from _read_jsonl(file, tokenizer, text_field, messages_field)
                    continue
                text = _read_text_or_none(file)
                if text is None:
                    stats.skipped_files += 1
                elif text:
                    yield text
        elif path.is_file():
            if _is_jsonl(path):
                yield from _read_jsonl(path, tokenizer, text_field, messages_field)
                continue
            text = _read_text_or_none(path)
            if text is None:
                raise DatastoreError(
                    f"source {path} is not a UTF-8 text file (or cannot be read); pass text, "
                    f".jsonl files or directories"
                )
            if text:
                yield text
        else:
            raise DatastoreError(f"source {path} does not exist")


def check_sources(sources: Sequence[str | Path]) -> None:
    """Every source exists: checked before the build, since ``iter_documents`` reaches a later
    source only after tokenising all the earlier ones (minutes for a large directory)."""
    for source in sources:
        if not Path(source).exists():
            raise DatastoreError(f"source {source} does not exist")


def file_suffixes(extensions: Sequence[str]) -> tuple[str, ...]:
    """``extensions`` as the lower-case suffixes a file name is matched with, each with its
    dot: "py" and ".py" both mean ".py" (a bare "py" would match "happy" and "numpy" too)."""
    suffixes = tuple("." + e.strip().lower().lstrip(".") for e in extensions)
    if "." in suffixes:
        # `--extensions py,` ends in one; unrefused, "" would match every file.
        empty = extensions[suffixes.index(".")]
        raise DatastoreError(f"extension {empty!r} is empty; give suffixes such as py or .py")
    return suffixes


def _walk(root: Path, extensions: tuple[str, ...]) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorted in place so the walk, and with it the token stream, is deterministic.
        dirnames.sort()
        for name in sorted(filenames):
            if name.lower().endswith(extensions):
                yield Path(dirpath, name)


def _is_jsonl(path: Path) -> bool:
    return path.name.lower().endswith(_JSONL_SUFFIXES)


def _read_text_or_none(path: Path) -> str | None:
    """The file's text, or None when it is unreadable, binary or not UTF-8."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def jsonl_objects(lines: Iterable[str], path: str | Path,
                  error: type[ValueError] = DatastoreError) -> Iterator[tuple[str, dict]]:
    """``(file:line, object)`` for every non-blank line of a jsonl file; ``error`` names the
    line of anything that is not a JSON object."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{where}: not a JSON object ({e})") from None
        if not isinstance(record, dict):
            raise error(f"{where}: not a JSON object")
        yield where, record


def _read_jsonl(path: Path, tokenizer: Any, text_field: str, messages_field: str) -> Iterator[str]:
    try:
        yield from _jsonl_documents(path, tokenizer, text_field, messages_field)
    except (UnicodeDecodeError, OSError, EOFError, zlib.error) as e:
        # Bytes that are not UTF-8, or a .gz that is not (whole, intact) gzip, are the corpus's
        # fault just like a malformed line: named, not a traceback. A damaged deflate stream
        # raises zlib.error, which is not an OSError.
        raise DatastoreError(
            f"{path} cannot be read as UTF-8 JSON lines ({e}); convert it to UTF-8 or leave it out"
        ) from None


def _jsonl_documents(path: Path, tokenizer: Any, text_field: str,
                     messages_field: str) -> Iterator[str]:
    f: TextIO
    with (
        gzip.open(path, "rt", encoding="utf-8")
        if path.name.lower().endswith(".gz")
        else open(path, encoding="utf-8")
    ) as f:
        for where, record in jsonl_objects(f, path):
            if text_field in record:
                text = record[text_field]
                if not isinstance(text, str):
                    raise DatastoreError(f"{where}: field {text_field!r} is not a string")
            elif messages_field in record:
                text = _render_chat(record[messages_field], tokenizer, where)
            else:
                raise DatastoreError(
                    f"{where}: neither a {text_field!r} nor a {messages_field!r} field; name "
                    f"the right ones with text_field / messages_field (`--text-field`, "
                    f"`--messages-field`)"
                )
            if text:
                yield text


def _render_chat(messages: Any, tokenizer: Any, where: str) -> str:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise DatastoreError(f"{where}: messages must be a list of {{'role', 'content'}} objects")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:
        raise DatastoreError(
            f"{where}: the tokenizer's chat template cannot render these messages ({e})"
        ) from e


def write_token_stream(
    documents: Iterable[str],
    tokenizer: Any,
    writer: Int32StreamWriter,
    stats: CorpusStats,
    *,
    vocab_size: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool | None = True,
) -> None:
    """Tokenise ``documents`` in batches and append each, followed by SEPARATOR, to ``writer``.

    ``progress``: True shows a bar on stderr, None only when stderr is a terminal, False never.
    Documents with no tokens are dropped.
    """
    with _progress_bar("tokenizing", progress) as bar:
        batch: list[str] = []
        chars = 0
        for doc in documents:
            batch.append(doc)
            chars += len(doc)
            if len(batch) >= batch_size or chars >= _BATCH_CHARS:
                _append_documents(_tokenize(tokenizer, batch), writer, stats, vocab_size, bar)
                batch = []
                chars = 0
        if batch:
            _append_documents(_tokenize(tokenizer, batch), writer, stats, vocab_size, bar)


def _tokenize(tokenizer: Any, batch: list[str]) -> list[list[int]]:
    # No attention masks: they would double the Python lists held per batch.
    return tokenizer(batch, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def write_token_id_stream(
    documents: Iterable[Sequence[int] | np.ndarray],
    writer: Int32StreamWriter,
    stats: CorpusStats,
    *,
    vocab_size: int,
    progress: bool | None = True,
) -> None:
    """Append already tokenised documents, each followed by SEPARATOR, to ``writer``."""
    with _progress_bar("writing", progress) as bar:
        for doc in documents:
            _append_documents([doc], writer, stats, vocab_size, bar)


def _progress_bar(desc: str, progress: bool | None) -> tqdm:
    return tqdm(
        desc=desc,
        unit=" docs",
        file=sys.stderr,
        disable=None if progress is None else not progress,
    )


def _append_documents(
    documents: Sequence[Sequence[int] | np.ndarray],
    writer: Int32StreamWriter,
    stats: CorpusStats,
    vocab_size: int,
    bar: tqdm,
) -> None:
    """Append token-id documents, each followed by SEPARATOR; empty ones are dropped."""
    docs = [d for d in documents if len(d)]
    if docs:
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        flat = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
        # A negative id would read as a separator, one past the vocabulary as a foreign token.
        if flat.min() < 0 or flat.max() >= vocab_size:
            raise DatastoreError(
                f"token ids outside [0, {vocab_size}) (min {flat.min()}, max {flat.max()}); "
                f"was the vocabulary size taken from this tokenizer?"
            )
        stream = np.insert(flat.astype(np.int32), np.cumsum(lengths), SEPARATOR)
        writer.append(stream)
        stats.num_documents += len(docs)
        stats.num_tokens += len(stream)
    bar.update(len(documents))
    bar.set_postfix(tokens=f"{stats.num_tokens:,}", refresh=False)
