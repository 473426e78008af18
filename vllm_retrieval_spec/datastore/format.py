"""On-disk layout of a datastore, and the only code that reads or writes it.

A datastore is a directory::

    manifest.json        format version, kind, tokenizer fingerprint, counts, per-file checksums
    tokens.npy           int32 [num_tokens]: every document's tokens, each followed by SEPARATOR
    suffix_array.npy     int32 (int64 from 2**31 tokens) [num_tokens]: the suffix array of tokens

Arrays are opened with ``np.load(mmap_mode="r")`` so a 50 M-token store costs page cache, not
process memory. A build writes into ``<out>.tmp-<pid>``, writes manifest.json last and renames the
directory into place, so a directory without a manifest (or a leftover temporary directory) is an
unfinished build and never loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
import struct
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from vllm_retrieval_spec.atomic import atomic_path, report_abandoned

FORMAT_VERSION = 1
#: Follows every document in the token stream; below every token id, so no match spans it.
SEPARATOR = -1
KIND = "token-stream+suffix-array"

MANIFEST_FILE = "manifest.json"
TOKENS_FILE = "tokens.npy"
SUFFIX_ARRAY_FILE = "suffix_array.npy"

REBUILD_HINT = "rebuild it with `vllm-rsd build-datastore`"

# Names a build gives its temporary (and, when replacing, its outgoing) directory.
_UNFINISHED_DIR = re.compile(r".+\.(tmp|old)-\d+")
# Room for the header of any 1-d array; the header is rewritten in place once the length is known.
_NPY_HEADER_BYTES = 128
_HASH_CHUNK_BYTES = 8 << 20
_FILE_ENTRY_KEYS = {"bytes", "sha256", "dtype", "shape"}


class DatastoreError(ValueError):
    """A datastore (or the corpus for one) is missing, malformed or does not fit the model."""


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of a tokenizer's vocabulary (added tokens included) and special token ids.

    Any two tokenizers that map some string to different ids get different fingerprints; the same
    tokenizer files loaded twice (by transformers or by vLLM) get the same one.
    """
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_ids": sorted(set(getattr(tokenizer, "all_special_ids", ()))),
    }
    # ensure_ascii: byte-level vocabularies may hold strings that do not encode as UTF-8.
    text = json.dumps(payload, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """One more than the largest token id the tokenizer can produce (added tokens included)."""
    return max(tokenizer.get_vocab().values()) + 1


def suffix_array_dtype(num_tokens: int) -> np.dtype:
    return np.dtype(np.int32 if num_tokens < 2**31 else np.int64)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything a reader checks before trusting the arrays; stored as manifest.json."""

    format_version: int = FORMAT_VERSION
    kind: str = KIND
    #: A human label (e.g. the model directory's name); the fingerprint is what is checked.
    tokenizer_name: str
    tokenizer_fingerprint: str
    #: One more than the largest token id of the tokenizer.
    vocab_size: int
    separator: int = SEPARATOR
    #: Length of tokens.npy, separators included.
    num_tokens: int
    num_documents: int
    #: File name -> {"bytes", "sha256", "dtype", "shape"}.
    files: dict[str, dict[str, Any]]
    sources: list[str]
    #: Files found in source directories but skipped as binary, not UTF-8 or unreadable.
    skipped_files: int = 0
    created: str = dataclasses.field(
        default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds")
    )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse manifest.json; raises DatastoreError (without the path) when it is unusable."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatastoreError(f"manifest.json is not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise DatastoreError("manifest.json does not hold a JSON object")
        # The version decides which fields exist, so it is checked before them.
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise DatastoreError(
                f"format version {version!r} is not supported (this version of "
                f"vllm-retrieval-spec reads format version {FORMAT_VERSION})"
            )
        fields = {f.name: f for f in dataclasses.fields(cls)}
        missing = [
            name
            for name, f in fields.items()
            if name not in data
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise DatastoreError(f"manifest.json lacks the field(s) {', '.join(missing)}")
        for name in ("vocab_size", "num_tokens", "num_documents", "separator", "skipped_files"):
            if name in data and not _is_int(data[name]):
                raise DatastoreError(f"manifest.json field {name!r} is not an integer")
        files = data["files"]
        if not isinstance(files, dict) or not all(map(is_file_entry, files.values())):
            raise DatastoreError(
                "manifest.json field 'files' must map names to {bytes: integer, sha256: string, "
                "dtype: string, shape: list of integers}"
            )
        # Unknown keys are ignored so optional indexes can add their own entries.
        return cls(**{name: data[name] for name in fields if name in data})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_file_entry(entry: Any) -> bool:
    """Whether a ``files`` entry has the types the loader compares with (a hand-edited manifest
    could hold a string of bytes or a bare shape, which would fail there as a TypeError)."""
    return (
        isinstance(entry, dict)
        and entry.keys() >= _FILE_ENTRY_KEYS
        and _is_int(entry["bytes"])
        and isinstance(entry["sha256"], str)
        and isinstance(entry["dtype"], str)
        and isinstance(entry["shape"], list)
        and all(map(_is_int, entry["shape"]))
    )


@dataclass
class Datastore:
    """A loaded, checked datastore; the arrays are read-only memory maps."""

    path: Path
    manifest: Manifest
    tokens: np.memmap
    suffix_array: np.memmap


def load_datastore(
    path: str | Path,
    *,
    expected_fingerprint: str | None = None,
    verify_checksums: bool = True,
) -> Datastore:
    """Open a datastore directory after checking it is complete, intact and fits the tokenizer.

    Cheap checks (manifest, sizes, array headers, tokenizer fingerprint) come before the
    checksums, which read every byte (streamed, so memory does not grow).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DatastoreError(
            f"{path} is a file, not a datastore directory; give the directory that "
            f"`vllm-rsd build-datastore -o` wrote"
        )
    if not path.is_dir():
        raise DatastoreError(
            f"datastore directory {path} does not exist; build one with "
            f"`vllm-rsd build-datastore` or fix the path"
        )
    if _UNFINISHED_DIR.fullmatch(path.name):
        raise DatastoreError(
            f"{path} is the temporary directory of an unfinished or interrupted build, not a "
            f"datastore; remove it and {REBUILD_HINT}"
        )
    manifest_path = path / MANIFEST_FILE
    try:
        text = manifest_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatastoreError(
            f"{path} is not a datastore: it has no {MANIFEST_FILE} (an interrupted build "
            f"leaves none); {REBUILD_HINT}"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise DatastoreError(f"cannot read {manifest_path} ({e}); {REBUILD_HINT}") from None
    try:
        manifest = Manifest.from_json(text)
    except DatastoreError as e:
        raise DatastoreError(f"{manifest_path}: {e}; {REBUILD_HINT}") from None
    if manifest.kind != KIND:
        raise DatastoreError(
            f"{manifest_path}: kind {manifest.kind!r} is not {KIND!r}; {REBUILD_HINT}"
        )
    if manifest.separator != SEPARATOR:
        raise DatastoreError(
            f"{manifest_path}: separator {manifest.separator} is not {SEPARATOR}; {REBUILD_HINT}"
        )

    for name, entry in manifest.files.items():
        _check_size(path / name, entry)
    expected_arrays = {
        TOKENS_FILE: np.dtype(np.int32),
        SUFFIX_ARRAY_FILE: suffix_array_dtype(manifest.num_tokens),
    }
    for name, dtype in expected_arrays.items():
        if name not in manifest.files:
            raise DatastoreError(f"{manifest_path} lists no {name}; {REBUILD_HINT}")
        _check_array_header(path / name, manifest.files[name], dtype, (manifest.num_tokens,))

    if expected_fingerprint is not None and expected_fingerprint != manifest.tokenizer_fingerprint:
        raise DatastoreError(
            f"datastore {path} was built with another tokenizer: it records tokenizer "
            f"{manifest.tokenizer_name!r} with fingerprint {manifest.tokenizer_fingerprint}, but "
            f"the model's tokenizer has fingerprint {expected_fingerprint}. Token ids would not "
            f"mean the same; rebuild it with `vllm-rsd build-datastore` and this model's tokenizer"
        )

    if verify_checksums:
        for name, entry in manifest.files.items():
            digest = file_sha256(path / name)
            if digest != entry["sha256"]:
                raise DatastoreError(
                    f"{path / name} is corrupt: its sha256 is {digest}, the manifest records "
                    f"{entry['sha256']}; {REBUILD_HINT}"
                )

    return Datastore(
        path=path,
        manifest=manifest,
        tokens=np.load(path / TOKENS_FILE, mmap_mode="r"),
        suffix_array=np.load(path / SUFFIX_ARRAY_FILE, mmap_mode="r"),
    )


def _check_size(file: Path, entry: dict[str, Any]) -> None:
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise DatastoreError(f"{file} is missing; {REBUILD_HINT}") from None
    if size != entry["bytes"]:
        what = "truncated" if size < entry["bytes"] else "modified"
        raise DatastoreError(
            f"{file} is {what}: it has {size} bytes, the manifest records {entry['bytes']}; "
            f"{REBUILD_HINT}"
        )


def _check_array_header(
    file: Path, entry: dict[str, Any], dtype: np.dtype, shape: tuple[int, ...]
) -> None:
    try:
        file_dtype, file_shape = read_npy_header(file)
    except ValueError as e:
        raise DatastoreError(f"{file} is not a valid .npy file ({e}); {REBUILD_HINT}") from None
    recorded = (entry["dtype"], tuple(entry["shape"]))
    if (file_dtype.name, file_shape) != recorded or file_dtype != dtype or file_shape != shape:
        raise DatastoreError(
            f"{file} holds {dtype_text(file_dtype)} {list(file_shape)}; the manifest records "
            f"{recorded[0]} {list(recorded[1])} and this format needs {dtype.name} {list(shape)}; "
            f"{REBUILD_HINT}"
        )


def dtype_text(dtype: np.dtype) -> str:
    """A file's dtype as an error names it: its name, and its byte order when that is not this
    machine's (the manifest records names only, which are the same for both orders)."""
    if dtype.isnative:
        return dtype.name
    return f"{'big' if dtype.byteorder == '>' else 'little'}-endian {dtype.name}"


def read_npy_header(file: Path) -> tuple[np.dtype, tuple[int, ...]]:
    """dtype and shape from a .npy header; ValueError when it is not a C-order .npy file."""
    with open(file, "rb") as f:
        version = np.lib.format.read_magic(f)
        try:
            if version == (1, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(f)
        except (SyntaxError, TypeError, tokenize.TokenError) as e:
            # A damaged byte can leave a bracket open (numpy's fallback parser then raises
            # these, not its ValueError) or make a key a bytes literal (a TypeError).
            raise ValueError(f"its header does not parse: {e}") from None
    if fortran_order:
        raise ValueError("array is in Fortran order")
    return dtype, tuple(shape)


def file_sha256(file: Path) -> str:
    """sha256 of a file read in chunks with ordinary reads (not a memory map, so RSS stays flat)."""
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def describe_file(file: Path) -> dict[str, Any]:
    """The manifest entry of an array file: size, checksum, dtype, shape."""
    dtype, shape = read_npy_header(file)
    return {
        "bytes": file.stat().st_size,
        "sha256": file_sha256(file),
        "dtype": dtype.name,
        "shape": list(shape),
    }


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write manifest.json; a builder calls this last, after every array file is complete."""
    with atomic_path(directory / MANIFEST_FILE) as temporary:
        temporary.write_text(manifest.to_json(), encoding="utf-8")


class Int32StreamWriter:
    """Append int32 chunks to a .npy file whose length is unknown until the end.

    A fixed-size header is reserved first and rewritten with the final length on ``close``, so a
    64 M-token stream is written incrementally without a second copy on disk or in memory.
    """

    def __init__(self, file: Path) -> None:
        self.file = file
        self.length = 0
        self._f: BinaryIO = open(file, "wb")
        self._f.write(_npy_header(np.dtype(np.int32), 0))

    def append(self, chunk: np.ndarray) -> None:
        self._f.write(np.ascontiguousarray(chunk, dtype=np.int32).tobytes())
        self.length += len(chunk)

    def close(self) -> None:
        self._f.seek(0)
        self._f.write(_npy_header(np.dtype(np.int32), self.length))
        self._f.close()

    def __enter__(self) -> Int32StreamWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
        else:
            self._f.close()


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    """A .npy v1.0 header for a 1-d C-order array, always exactly _NPY_HEADER_BYTES long."""
    text = repr(
        {
            "descr": np.lib.format.dtype_to_descr(dtype),
            "fortran_order": False,
            "shape": (length,),
        }
    ).encode("latin1")
    # Magic (6 bytes) + version (2) + header length (2) + text padded with spaces + "\n".
    body = text.ljust(_NPY_HEADER_BYTES - 11) + b"\n"
    return np.lib.format.magic(1, 0) + struct.pack("<H", len(body)) + body


@contextlib.contextmanager
def atomic_datastore_dir(output: str | Path, *, overwrite: bool = False,
                         private: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory that replaces ``output`` once the block succeeds;
    ``private``: mode 0700 from its creation, so no other user reads its files while written.

    The block must call ``write_manifest`` last. On any exception (KeyboardInterrupt included)
    the temporary directory is removed and ``output`` is left as it was. An existing datastore is
    replaced only with ``overwrite=True``; a non-empty directory that is not a datastore never is.
    """
    output = Path(output)
    if output.is_symlink():
        # A directory cannot be renamed over a link: the new store goes where the link points.
        output = output.resolve()
    check_replaceable(output, overwrite)
    # The parent first: atomic_path cannot even clear its temporary name under a file.
    make_output_dir(output.parent, output)
    report_abandoned(output)
    with atomic_path(output) as tmp:
        make_output_dir(tmp, output, mode=0o700 if private else 0o777)
        yield tmp
        if not (tmp / MANIFEST_FILE).is_file():
            raise RuntimeError(f"the build did not write {MANIFEST_FILE} into {tmp}")
        check_replaceable(output, overwrite)


def make_output_dir(directory: Path, output: Path, mode: int = 0o777) -> None:
    """mkdir -p for an output (a build's, a corpus's). Failing here means the output path is
    wrong (under a file, in a read-only place), which the user fixes, so it is a DatastoreError,
    not a traceback."""
    try:
        directory.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as e:
        raise DatastoreError(
            f"cannot create {output} ({e.strerror}: {e.filename}); choose another output"
        ) from None


def check_replaceable(output: Path, overwrite: bool) -> None:
    """``output`` may receive a new datastore: checked again after the build, and by the CLI
    before it loads a model (the first use converts one, half a minute)."""
    if output.name in ("", ".."):
        # ".", ".." or "/": no name to put the temporary directory beside and rename into place.
        raise DatastoreError(
            f"output {str(output)!r} is not a directory name; give one, e.g. "
            f"{str(output / 'datastore')!r}"
        )
    if not output.exists():
        return
    if not output.is_dir():
        raise DatastoreError(f"{output} exists and is not a directory; choose another output")
    if (output / MANIFEST_FILE).exists():
        if not overwrite:
            raise DatastoreError(
                f"{output} already holds a datastore; pass overwrite=True (`--overwrite`) to "
                f"replace it, or choose another output"
            )
    elif any(output.iterdir()):
        raise DatastoreError(
            f"{output} exists and is not a datastore (no {MANIFEST_FILE}); refusing to replace "
            f"it: choose another output or remove it"
        )
