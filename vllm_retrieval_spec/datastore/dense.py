"""DReSD's index: projected hidden states of the target model, each pointing into the token stream.

Lives in ``<datastore>/dense/`` beside the REST index and shares its ``tokens.npy``::

    dense/manifest.json   model, layer, dtype, dims, explained variance, token-stream checksum, files
    dense/keys.npy        float16 [num_keys, dims]: unit rows, z-norm -> PCA -> L2 of a hidden state
    dense/positions.npy   int64 [num_keys]: the token position whose final hidden state the key is
                          (the state predicted the token after it; the tokens after that are the draft)
    dense/mean.npy, inv_std.npy   float32 [hidden_size]: z-score statistics
    dense/components.npy  float32 [hidden_size, dims]: PCA directions of the z-scored states
    dense/scann/          the ScaNN searcher (optional; exact search needs only keys.npy), its
                          files' sizes and checksums recorded in the manifest's ``scann_files``

A key stores a position (8 bytes), not a copy of the next tokens, and every array is opened as a
read-only memory map. Exact search (a matmul over all keys) serves small stores and is the oracle
ScaNN's recall is measured against.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from vllm_retrieval_spec.config.options import DENSE_SEARCH_BACKENDS
from vllm_retrieval_spec.datastore.dense_search import (
    SCANN_ASSETS, SCANN_MIN_KEYS, ExactSearcher, ScannSearcher, build_scann, scann_settings)
from vllm_retrieval_spec.datastore.projection import Projection, chunk_rows, fit_projection
from vllm_retrieval_spec.datastore.format import (
    atomic_datastore_dir,
    TOKENS_FILE,
    Datastore,
    DatastoreError,
    describe_file,
    dtype_text,
    is_file_entry,
    file_sha256,
    load_datastore,
    read_npy_header,
)

DENSE_DIR = "dense"
DENSE_FORMAT_VERSION = 1
DENSE_KIND = "dense-keys"
MANIFEST_FILE = "manifest.json"
KEYS_FILE = "keys.npy"
POSITIONS_FILE = "positions.npy"
MEAN_FILE = "mean.npy"
INV_STD_FILE = "inv_std.npy"
COMPONENTS_FILE = "components.npy"
SCANN_DIR = "scann"

DENSE_REBUILD_HINT = "rebuild it with `vllm-rsd build-datastore --dense`"

@dataclass(frozen=True, kw_only=True)
class DenseManifest:
    """What serving checks before trusting the keys; stored as dense/manifest.json."""

    format_version: int = DENSE_FORMAT_VERSION
    kind: str = DENSE_KIND
    #: A human label for the model; ``model_fingerprint`` is what is checked.
    model_name: str
    model_fingerprint: str
    hidden_size: int
    #: Hidden state after this many decoder layers; the model's depth = the final (normed) state.
    layer: int
    #: dtype of the forward passes that produced the keys, as resolved by vLLM ("float32",
    #: never "auto"; see ``dtype_name``): build and serve must agree.
    dtype: str
    dims: int
    #: Share of the z-scored states' variance the ``dims`` components keep.
    explained_variance: float
    num_keys: int
    num_fit_samples: int
    #: sha256 of the tokens.npy the positions point into.
    tokens_sha256: str
    files: dict[str, dict[str, Any]]
    scann: dict[str, Any] | None = None
    #: File name in scann/ -> {"bytes", "sha256"}; None in indexes built before it was recorded.
    scann_files: dict[str, dict[str, Any]] | None = None
    created: str = dataclasses.field(
        default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"


class DenseIndex:
    """A loaded dense index: keys, their token positions, the projection and a searcher."""

    def __init__(self, path: Path, manifest: DenseManifest, datastore: Datastore,
                 search: str = "auto") -> None:
        # Sizes only: the start-up check (``check_dense_index``) verified the checksums.
        search = check_searcher(path, manifest, search, verify_checksums=False)
        self.path = path
        self.manifest = manifest
        self.datastore = datastore
        self.tokens = np.asarray(datastore.tokens)
        self.keys = np.load(path / KEYS_FILE, mmap_mode="r")
        self.positions = np.asarray(np.load(path / POSITIONS_FILE, mmap_mode="r"))
        self.projection = Projection(
            mean=np.load(path / MEAN_FILE), inv_std=np.load(path / INV_STD_FILE),
            components=np.load(path / COMPONENTS_FILE),
            explained_variance=manifest.explained_variance)
        if search == "scann":
            self.searcher: ExactSearcher | ScannSearcher = ScannSearcher(path / SCANN_DIR)
        else:
            self.searcher = ExactSearcher(self.keys)
        self.search_backend = search

    @classmethod
    def from_path(
        cls,
        datastore_path: str | Path,
        *,
        expected_model_fingerprint: str | None = None,
        hidden_size: int | None = None,
        search: str = "auto",
        verify_checksums: bool = True,
    ) -> DenseIndex:
        datastore, manifest = check_dense_index(
            datastore_path, expected_model_fingerprint=expected_model_fingerprint,
            hidden_size=hidden_size, search=search, verify_checksums=verify_checksums)
        return cls(Path(datastore_path) / DENSE_DIR, manifest, datastore, search)

    def search(self, queries: np.ndarray, top_n: int) -> tuple[np.ndarray, np.ndarray]:
        """(key indices int64 [B, n], inner products float32 [B, n]) of unit queries [B, d],
        best first; rows may hold fewer than ``top_n`` hits, padded with index -1."""
        return self.searcher.search(np.ascontiguousarray(queries, dtype=np.float32), top_n)


def dense_index_in_use(datastore: str | Path, mode: str) -> bool:
    """Whether hybrid drafting searches ``datastore``'s dense index; ``mode`` is its ``dense``
    option: "auto" (when there is one), "on" (there must be one) or "off"."""
    if mode == "off":
        return False
    present = (Path(datastore) / DENSE_DIR).is_dir()
    if mode == "on" and not present:
        raise DatastoreError(
            f"speculative_config['dense']='on' but {datastore} has no dense index; "
            f"{DENSE_REBUILD_HINT} -o {datastore}, or use dense 'auto'")
    return present


def check_dense_index(
    datastore_path: str | Path,
    *,
    expected_model_fingerprint: str | None = None,
    hidden_size: int | None = None,
    dtype: Any = None,
    expected_tokenizer_fingerprint: str | None = None,
    search: str = "auto",
    verify_checksums: bool = True,
) -> tuple[Datastore, DenseManifest]:
    """Start-up checks: the datastore and its dense index are complete, intact and were built
    from the model being served (same hidden size and weights, and forward passes in ``dtype``,
    the served dtype: a torch.dtype or its name), and the searcher ``search`` picks is there."""
    datastore = load_datastore(datastore_path, expected_fingerprint=expected_tokenizer_fingerprint,
                               verify_checksums=verify_checksums)
    path = Path(datastore_path) / DENSE_DIR
    manifest = load_dense_manifest(path, datastore)
    if hidden_size is not None and hidden_size != manifest.hidden_size:
        raise DatastoreError(
            f"dense index {path} holds states of hidden size {manifest.hidden_size} "
            f"(model {manifest.model_name!r}), but the model being served has hidden size "
            f"{hidden_size}; {DENSE_REBUILD_HINT} and this model")
    if (expected_model_fingerprint is not None
            and expected_model_fingerprint != manifest.model_fingerprint):
        raise DatastoreError(
            f"dense index {path} was built from another model: it records "
            f"{manifest.model_name!r} with fingerprint {manifest.model_fingerprint}, the model "
            f"being served has fingerprint {expected_model_fingerprint}. Its keys would not be "
            f"comparable with this model's hidden states; {DENSE_REBUILD_HINT} and this model")
    if dtype is not None and dtype_name(dtype) != manifest.dtype:
        served = dtype_name(dtype)
        raise DatastoreError(
            f"dense index {path} was built from {manifest.dtype} forward passes, but the model is "
            f"served in {served}: its keys would not match the served hidden states. Serve in "
            f"{manifest.dtype} (dtype={manifest.dtype!r}, --dtype {manifest.dtype}), or rebuild "
            f"the index in {served}: `vllm-rsd build-datastore --dense --overwrite --dtype "
            f"{served} -o {datastore_path} --model MODEL`")
    check_dense_files(path, manifest, verify_checksums=verify_checksums)
    check_searcher(path, manifest, search, verify_checksums=verify_checksums)
    return datastore, manifest


def check_searcher(path: Path, manifest: DenseManifest, search: str, *,
                   verify_checksums: bool) -> str:
    """The backend ``search`` resolves to ("auto": ScaNN when the index has a searcher), after
    checking that a ScaNN searcher's files are all there, of the recorded sizes (and checksums);
    ScaNN itself fails on a damaged file only when it loads it, in the worker, as a traceback."""
    if search not in DENSE_SEARCH_BACKENDS:
        raise DatastoreError(f"dense search {search!r} is not one of {DENSE_SEARCH_BACKENDS}")
    if search == "auto":
        search = "exact" if manifest.scann is None else "scann"
    if search != "scann":
        return search
    if manifest.scann is None:
        raise DatastoreError(
            f"{path} has no ScaNN searcher (built with --dense-index exact, or fewer than "
            f"{SCANN_MIN_KEYS} keys); use search 'exact' or {DENSE_REBUILD_HINT}")
    directory = path / SCANN_DIR
    if not (directory / SCANN_ASSETS).is_file():
        # A partial copy can lack it.
        raise DatastoreError(
            f"{directory} has no ScaNN searcher ({SCANN_ASSETS} is missing), "
            f"which the manifest records; use search 'exact' or {DENSE_REBUILD_HINT}")
    for name, entry in (manifest.scann_files or {}).items():
        _check_recorded_size(directory / name, entry)
        if verify_checksums:
            _check_checksum(directory / name, entry)
    return search


def dtype_name(dtype: Any) -> str:
    """How a manifest records a dtype: "float32" for torch.float32 (and for "float32")."""
    return str(dtype).removeprefix("torch.")


def load_dense_manifest(path: Path, datastore: Datastore) -> DenseManifest:
    """Read dense/manifest.json and check it belongs to this datastore's token stream."""
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise DatastoreError(
            f"datastore {datastore.path} has no dense index ({manifest_path} is missing), which "
            f"method 'dresd' needs; {DENSE_REBUILD_HINT}")
    try:
        data = json.loads(manifest_path.read_text(encoding="utf-8"))
        if data.get("format_version") != DENSE_FORMAT_VERSION or data.get("kind") != DENSE_KIND:
            raise DatastoreError(
                f"format {data.get('kind')!r} version {data.get('format_version')!r} is not "
                f"{DENSE_KIND!r} version {DENSE_FORMAT_VERSION}")
        names = {f.name for f in dataclasses.fields(DenseManifest)}
        manifest = DenseManifest(**{k: v for k, v in data.items() if k in names})
        if not isinstance(manifest.files, dict) or not all(
                map(is_file_entry, manifest.files.values())):
            raise DatastoreError("its 'files' must map names to {bytes: integer, sha256: "
                                 "string, dtype: string, shape: list of integers}")
        if manifest.scann_files is not None and not (
                isinstance(manifest.scann_files, dict) and all(
                    isinstance(e, dict) and isinstance(e.get("bytes"), int)
                    and isinstance(e.get("sha256"), str) for e in manifest.scann_files.values())):
            raise DatastoreError("its 'scann_files' must map names to {bytes: integer, "
                                 "sha256: string}")
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise DatastoreError(f"{manifest_path} is unusable ({e}); {DENSE_REBUILD_HINT}") from None
    if manifest.tokens_sha256 != datastore.manifest.files[TOKENS_FILE]["sha256"]:
        raise DatastoreError(
            f"{path} was built for another token stream than {datastore.path / TOKENS_FILE} "
            f"(the datastore was rebuilt since); {DENSE_REBUILD_HINT}")
    return manifest


def check_dense_files(path: Path, manifest: DenseManifest, *, verify_checksums: bool) -> None:
    """Every array is present, of the recorded size, dtype and shape (and checksum)."""
    expected = {
        KEYS_FILE: ("float16", [manifest.num_keys, manifest.dims]),
        POSITIONS_FILE: ("int64", [manifest.num_keys]),
        MEAN_FILE: ("float32", [manifest.hidden_size]),
        INV_STD_FILE: ("float32", [manifest.hidden_size]),
        COMPONENTS_FILE: ("float32", [manifest.hidden_size, manifest.dims]),
    }
    for name, (dtype, shape) in expected.items():
        file = path / name
        entry = manifest.files.get(name)
        _check_recorded_size(file, entry)
        try:
            file_dtype, file_shape = read_npy_header(file)
        except ValueError as e:
            # numpy's own error would be a traceback; a damaged header is a rebuild.
            raise DatastoreError(
                f"{file} is not a valid .npy file ({e}); {DENSE_REBUILD_HINT}") from None
        # Compared as dtypes, not names: np.load keeps a file's byte order, and an index
        # written on a big-endian machine ("float16" too) would reach torch and numba, which
        # refuse it only at the first drafting step.
        if file_dtype != np.dtype(dtype) or list(file_shape) != shape:
            raise DatastoreError(
                f"{file} holds {dtype_text(file_dtype)} {list(file_shape)}, expected {dtype} "
                f"{shape}; "
                f"{DENSE_REBUILD_HINT}")
        if verify_checksums:
            _check_checksum(file, entry)


def _check_recorded_size(file: Path, entry: dict[str, Any] | None) -> None:
    """``file`` is there, of the size its manifest ``entry`` records."""
    if entry is None or not file.is_file():
        raise DatastoreError(f"{file} is missing; {DENSE_REBUILD_HINT}")
    if file.stat().st_size != entry["bytes"]:
        raise DatastoreError(
            f"{file} has {file.stat().st_size} bytes, the manifest records "
            f"{entry['bytes']}; {DENSE_REBUILD_HINT}")


def _check_checksum(file: Path, entry: dict[str, Any]) -> None:
    if file_sha256(file) != entry["sha256"]:
        raise DatastoreError(f"{file} is corrupt (sha256 differs); {DENSE_REBUILD_HINT}")


def check_dense_replaceable(path: Path, overwrite: bool) -> None:
    if (path / MANIFEST_FILE).exists() and not overwrite:
        raise DatastoreError(
            f"{path} already holds a dense index; pass --overwrite to replace it")


def fit_sample_rows(num_keys: int, fit_samples: int, seed: int = 0) -> np.ndarray:
    """The rows of ``num_keys`` states the projection is fitted on: at most ``fit_samples``,
    drawn without replacement, in order (a memory map is read front to back)."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(num_keys, size=min(fit_samples, num_keys), replace=False))


def write_dense_index(
    datastore: Datastore,
    states: np.ndarray,
    positions: np.ndarray,
    *,
    model_name: str,
    model_fingerprint: str,
    layer: int,
    dtype: str,
    dims: int = 64,
    fit_samples: int = 1_000_000,
    scann: bool = True,
    overwrite: bool = False,
    progress: bool | None = True,
    seed: int = 0,
) -> DenseManifest:
    """Fit the projection on a sample of ``states`` ([N, H], e.g. a memory map), project every
    state into a key and write ``<datastore>/dense`` (temporary directory, renamed when complete).
    """
    import torch
    from tqdm import tqdm

    path = datastore.path / DENSE_DIR
    check_dense_replaceable(path, overwrite)
    num_keys, hidden_size = states.shape
    if num_keys == 0:
        raise DatastoreError("no hidden states to index (every document is a single token?)")
    sample_rows = fit_sample_rows(num_keys, fit_samples, seed)
    show_progress = progress is True or (progress is None and sys.stderr.isatty())
    projection = fit_projection(states, dims, sample_rows, progress=show_progress)

    def project_into(keys: np.ndarray) -> None:
        step = chunk_rows(hidden_size)
        for start in tqdm(range(0, num_keys, step), desc="projecting keys", unit="chunk",
                          disable=not show_progress):
            batch = torch.from_numpy(np.asarray(states[start:start + step], dtype=np.float32))
            keys[start:start + step] = projection(batch).astype(np.float16)

    return write_dense_keys(
        path, datastore.manifest.files[TOKENS_FILE]["sha256"], num_keys, project_into,
        positions, projection, model_name=model_name, model_fingerprint=model_fingerprint,
        hidden_size=hidden_size, layer=layer, dtype=dtype, num_fit_samples=len(sample_rows),
        scann=scann, progress=progress)


def write_dense_keys(
    path: Path,
    tokens_sha256: str,
    num_keys: int,
    fill_keys: Callable[[np.ndarray], None],
    positions: np.ndarray,
    projection: Projection,
    *,
    model_name: str,
    model_fingerprint: str,
    hidden_size: int,
    layer: int,
    dtype: str,
    num_fit_samples: int,
    scann: bool = True,
    progress: bool | None = True,
) -> DenseManifest:
    """Write a dense index directory ``path`` (temporary directory, renamed when complete):
    ``fill_keys`` writes the projected keys into a float16 [num_keys, dims] memory map;
    ``positions`` point into the token stream whose sha256 is ``tokens_sha256``."""
    dims = projection.components.shape[1]
    # The same temporary-directory-and-rename as a whole datastore: dense/ appears complete
    # or not at all, and the REST files beside it are never touched.
    with atomic_datastore_dir(path, overwrite=True) as tmp:
        keys = np.lib.format.open_memmap(tmp / KEYS_FILE, mode="w+", dtype=np.float16,
                                         shape=(num_keys, dims))
        fill_keys(keys)
        keys.flush()
        np.save(tmp / POSITIONS_FILE, np.asarray(positions, dtype=np.int64))
        np.save(tmp / MEAN_FILE, projection.mean)
        np.save(tmp / INV_STD_FILE, projection.inv_std)
        np.save(tmp / COMPONENTS_FILE, projection.components)
        settings = scann_files = None
        if scann and num_keys >= SCANN_MIN_KEYS:
            if progress is not False:
                print(f"building the ScaNN searcher over {num_keys:,} keys", file=sys.stderr)
            settings = scann_settings(num_keys)
            build_scann(keys, tmp / SCANN_DIR, settings)
            scann_files = {file.name: {"bytes": file.stat().st_size, "sha256": file_sha256(file)}
                           for file in sorted((tmp / SCANN_DIR).iterdir())}
        del keys
        files = (KEYS_FILE, POSITIONS_FILE, MEAN_FILE, INV_STD_FILE, COMPONENTS_FILE)
        manifest = DenseManifest(
            model_name=model_name, model_fingerprint=model_fingerprint,
            hidden_size=hidden_size, layer=layer, dtype=dtype, dims=dims,
            explained_variance=projection.explained_variance, num_keys=num_keys,
            num_fit_samples=num_fit_samples, tokens_sha256=tokens_sha256,
            files={name: describe_file(tmp / name) for name in files}, scann=settings,
            scann_files=scann_files)
        (tmp / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
    return manifest
