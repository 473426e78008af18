"""DReSD's index: projected hidden states of the target model, each pointing into the token stream.

Lives in ``<datastore>/dense/`` beside the REST index and shares its ``tokens.npy``::

    dense/manifest.json   model, layer, dtype, dims, explained variance, token-stream checksum, files
    dense/keys.npy        float16 [num_keys, dims]: unit rows, z-norm -> PCA -> L2 of a hidden state
    dense/positions.npy   int64 [num_keys]: the token position whose final hidden state the key is
                          (the state predicted the token after it; the tokens after that are the draft)
    dense/mean.npy, inv_std.npy   float32 [hidden_size]: z-score statistics
    dense/components.npy  float32 [hidden_size, dims]: PCA directions of the z-scored states
    dense/scann/          the ScaNN searcher (optional; exact search needs only keys.npy)

A key stores a position (8 bytes), not a copy of the next tokens, and every array is opened as a
read-only memory map. Exact search (a matmul over all keys) serves small stores and is the oracle
ScaNN's recall is measured against.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from vllm_retrieval_spec.config import DENSE_SEARCH_BACKENDS
from vllm_retrieval_spec.datastore.format import (
    atomic_datastore_dir,
    TOKENS_FILE,
    Datastore,
    DatastoreError,
    describe_file,
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

#: Fewer keys than this get no ScaNN searcher (its tree needs points to train on) and are
#: searched exactly. Above it ScaNN wins early: at 42 k keys a query took 38 us p50 against
#: 650 us for the exact matmul, with the same drafts (replay of HumanEval prompts 20-39).
SCANN_MIN_KEYS = 4096

DENSE_REBUILD_HINT = "rebuild it with `vllm-rsd build-datastore --dense`"

#: Rows of hidden states read at a time by the PCA fit and the key projection: a chunk of
#: float64 rows takes at most this many bytes, whatever the hidden size.
CHUNK_BYTES = 64 << 20


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
    created: str = dataclasses.field(
        default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"


@dataclass(frozen=True)
class Projection:
    """z-norm -> PCA -> L2, fitted on a sample of hidden states."""

    mean: np.ndarray  # float32 [H]
    inv_std: np.ndarray  # float32 [H]
    components: np.ndarray  # float32 [H, d]
    explained_variance: float

    def __call__(self, states: Any) -> np.ndarray:
        """Unit rows float32 [B, d] for a [B, H] torch tensor of any float dtype (on any device:
        the fused Triton kernel on GPU, the torch reference on CPU)."""
        from vllm_retrieval_spec.kernels.projection import project

        return project(states, *self._on_device(states.device)).cpu().numpy()

    def _on_device(self, device: Any) -> tuple[Any, Any, Any]:
        # Converted once per device: every decoding step projects.
        cache = self.__dict__.setdefault("_device_params", {})
        if device not in cache:
            import torch

            cache[device] = tuple(torch.from_numpy(np.asarray(a)).to(device)
                                  for a in (self.mean, self.inv_std, self.components))
        return cache[device]


def check_pca_dims(dims: int, hidden_size: int) -> None:
    if not 1 <= dims <= hidden_size:
        raise DatastoreError(
            f"PCA dims {dims} is out of range: must be in [1, {hidden_size}] (the hidden size)")


def chunk_rows(hidden_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows of float64 hidden states that fit in ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // (8 * hidden_size))


def fit_projection(states: Any, dims: int, rows: np.ndarray | None = None, *,
                   chunk_bytes: int = CHUNK_BYTES, progress: bool = False) -> Projection:
    """z-score statistics and the top ``dims`` principal directions of ``states[rows]`` (every
    row by default); ``states`` is [N, H]: an array, a memory map or a CPU tensor.

    Streamed, so that memory does not grow with the sample: chunks of rows (``chunk_bytes`` as
    float64) are read in turn while their sum and Gram matrix accumulate in float64 (H^2 x 8
    bytes plus 1.5 chunks: the float32 rows read and their float64 copy). The peak is at the
    eigendecomposition: the H x H covariance, its eigenvectors and LAPACK's workspace (syevd:
    2 x H x H), 4 x H^2 x 8 bytes (512 MiB for H = 4096; measured in
    benchmarks/results/pca-fit-memory.md). The covariance of z-scored states is only H x H, so
    an exact symmetric eigendecomposition (torch.linalg.eigh) is cheaper than an iterative
    low-rank PCA and gives the explained variance for free.
    """
    import torch
    from tqdm import tqdm

    states = np.asarray(states)  # a view: of a CPU tensor, or of a memory map (still mapped)
    hidden_size = states.shape[1]
    n = states.shape[0] if rows is None else len(rows)
    check_pca_dims(dims, hidden_size)
    if n < 2:
        raise DatastoreError(f"need at least 2 hidden states to fit the projection, got {n}")
    step = chunk_rows(hidden_size, chunk_bytes)
    total = torch.zeros(hidden_size, dtype=torch.float64)
    gram = torch.zeros(hidden_size, hidden_size, dtype=torch.float64)
    shift = None
    for start in tqdm(range(0, n, step), desc="fitting the projection", unit="chunk",
                      disable=not progress):
        index = slice(start, start + step) if rows is None else rows[start:start + step]
        # np.array copies: a slice of a read-only memory map is never written to.
        chunk = torch.from_numpy(np.array(states[index], dtype=np.float64))
        if shift is None:
            # Sums around a point near the mean rather than around 0: the covariance is then a
            # difference of numbers of the spread's size, not of the states' magnitude.
            shift = chunk.mean(0)
        chunk -= shift
        total += chunk.sum(0)
        gram.addmm_(chunk.T, chunk)
        del chunk  # before the next one is read: one chunk at a time
    offset = total / n  # mean - shift
    mean = shift + offset
    # In place (no second H x H matrix): sum (x - mean)(x - mean)^T = gram - n offset offset^T.
    covariance = gram.addr_(offset, offset, alpha=-n).div_(n - 1)
    # Constant dimensions carry nothing; a floor on the std keeps them from blowing up.
    std = covariance.diagonal().clamp_min(0).sqrt().clamp_min(1e-6)
    # The covariance of the z-scored states (x - mean) / std, in place.
    covariance.div_(std[:, None]).div_(std[None, :])
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    top = torch.argsort(eigenvalues, descending=True)[:dims]
    explained = float(eigenvalues[top].clamp_min(0).sum() / eigenvalues.clamp_min(0).sum())
    return Projection(
        mean=mean.float().numpy(),
        inv_std=(1.0 / std).float().numpy(),
        components=eigenvectors[:, top].float().contiguous().numpy(),
        explained_variance=explained,
    )


class DenseIndex:
    """A loaded dense index: keys, their token positions, the projection and a searcher."""

    def __init__(self, path: Path, manifest: DenseManifest, datastore: Datastore,
                 search: str = "auto") -> None:
        if search not in DENSE_SEARCH_BACKENDS:
            raise DatastoreError(f"dense search {search!r} is not one of {DENSE_SEARCH_BACKENDS}")
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
        if search == "auto":
            search = "exact" if manifest.scann is None else "scann"
        if search == "scann":
            if manifest.scann is None:
                raise DatastoreError(
                    f"{path} has no ScaNN searcher (built with --dense-index exact, or fewer than "
                    f"{SCANN_MIN_KEYS} keys); use search 'exact' or {DENSE_REBUILD_HINT}")
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
            hidden_size=hidden_size, verify_checksums=verify_checksums)
        return cls(Path(datastore_path) / DENSE_DIR, manifest, datastore, search)

    def search(self, queries: np.ndarray, top_n: int) -> tuple[np.ndarray, np.ndarray]:
        """(key indices int64 [B, n], inner products float32 [B, n]) of unit queries [B, d],
        best first; rows may hold fewer than ``top_n`` hits, padded with index -1."""
        return self.searcher.search(np.ascontiguousarray(queries, dtype=np.float32), top_n)


class ExactSearcher:
    """Inner product against every key. Holds the keys as float32 (4 x dims bytes per key):
    meant for small stores and as the oracle."""

    def __init__(self, keys: np.ndarray) -> None:
        self.keys = np.asarray(keys, dtype=np.float32)

    def search(self, queries: np.ndarray, top_n: int) -> tuple[np.ndarray, np.ndarray]:
        scores = queries @ self.keys.T
        n = min(top_n, scores.shape[1])
        if n < scores.shape[1]:
            top = np.argpartition(-scores, n - 1, axis=1)[:, :n]
        else:
            top = np.broadcast_to(np.arange(n), (len(queries), n))
        top_scores = np.take_along_axis(scores, top, axis=1)
        order = np.argsort(-top_scores, axis=1, kind="stable")
        return (np.take_along_axis(top, order, axis=1).astype(np.int64),
                np.take_along_axis(top_scores, order, axis=1))


class ScannSearcher:
    def __init__(self, directory: Path) -> None:
        from scann.scann_ops.py import scann_ops_pybind

        # ScaNN records absolute asset paths, which the build's rename (and any copy of the
        # datastore) invalidates: point them into this directory.
        assets = re.sub(r'asset_path: "(?:[^"]*/)?([^"/]+)"',
                        lambda m: f'asset_path: "{directory / m.group(1)}"',
                        (directory / "scann_assets.pbtxt").read_text(encoding="utf-8"))
        self.searcher = scann_ops_pybind.ScannSearcher(
            scann_ops_pybind.scann_pybind.ScannNumpy(str(directory), assets), None)

    def search(self, queries: np.ndarray, top_n: int) -> tuple[np.ndarray, np.ndarray]:
        indices, scores = self.searcher.search_batched(queries, final_num_neighbors=top_n)
        return np.asarray(indices, dtype=np.int64), np.asarray(scores, dtype=np.float32)


def scann_settings(num_keys: int, top_n: int = 64) -> dict[str, Any]:
    """Tree + asymmetric hashing + exact re-ranking, sized to the store (ScaNN's own guidance:
    about sqrt(n) leaves, a few percent of them searched)."""
    leaves = max(16, int(num_keys ** 0.5))
    return {
        "num_leaves": leaves,
        "num_leaves_to_search": max(8, leaves // 16),
        "training_sample_size": min(num_keys, 250_000),
        "reorder": max(4 * top_n, 256),
    }


def build_scann(keys: np.ndarray, directory: Path, settings: dict[str, Any]) -> None:
    from scann.scann_ops.py import scann_ops_pybind

    searcher = (
        scann_ops_pybind.builder(np.asarray(keys, dtype=np.float32), 10, "dot_product")
        .tree(num_leaves=settings["num_leaves"],
              num_leaves_to_search=settings["num_leaves_to_search"],
              training_sample_size=settings["training_sample_size"])
        .score_ah(2, anisotropic_quantization_threshold=0.2)
        .reorder(settings["reorder"])
        .build()
    )
    directory.mkdir()
    searcher.serialize(str(directory))


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
    verify_checksums: bool = True,
) -> tuple[Datastore, DenseManifest]:
    """Start-up checks: the datastore and its dense index are complete, intact and were built
    from the model being served (same hidden size and weights, and forward passes in ``dtype``,
    the served dtype: a torch.dtype or its name)."""
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
    return datastore, manifest


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
        if entry is None or not file.is_file():
            raise DatastoreError(f"{file} is missing; {DENSE_REBUILD_HINT}")
        if file.stat().st_size != entry["bytes"]:
            raise DatastoreError(
                f"{file} has {file.stat().st_size} bytes, the manifest records "
                f"{entry['bytes']}; {DENSE_REBUILD_HINT}")
        file_dtype, file_shape = read_npy_header(file)
        if file_dtype.name != dtype or list(file_shape) != shape:
            raise DatastoreError(
                f"{file} holds {file_dtype.name} {list(file_shape)}, expected {dtype} {shape}; "
                f"{DENSE_REBUILD_HINT}")
        if verify_checksums and file_sha256(file) != entry["sha256"]:
            raise DatastoreError(f"{file} is corrupt (sha256 differs); {DENSE_REBUILD_HINT}")


def check_dense_replaceable(path: Path, overwrite: bool) -> None:
    if (path / MANIFEST_FILE).exists() and not overwrite:
        raise DatastoreError(
            f"{path} already holds a dense index; pass --overwrite to replace it")


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
    rng = np.random.default_rng(seed)
    sample_rows = np.sort(rng.choice(num_keys, size=min(fit_samples, num_keys), replace=False))
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
        settings = None
        if scann and num_keys >= SCANN_MIN_KEYS:
            if progress is not False:
                print(f"building the ScaNN searcher over {num_keys:,} keys", file=sys.stderr)
            settings = scann_settings(num_keys)
            build_scann(keys, tmp / SCANN_DIR, settings)
        del keys
        files = (KEYS_FILE, POSITIONS_FILE, MEAN_FILE, INV_STD_FILE, COMPONENTS_FILE)
        manifest = DenseManifest(
            model_name=model_name, model_fingerprint=model_fingerprint,
            hidden_size=hidden_size, layer=layer, dtype=dtype, dims=dims,
            explained_variance=projection.explained_variance, num_keys=num_keys,
            num_fit_samples=num_fit_samples, tokens_sha256=tokens_sha256,
            files={name: describe_file(tmp / name) for name in files}, scann=settings)
        (tmp / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
    return manifest


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
        files = [f for f in sorted(model_dir.glob(pattern)) if f.name not in NOT_WEIGHT_FILES]
        if files:
            locations: dict[str, Path] = {}
            for file in files:
                with _open_weights(file) as (names, _):
                    locations.update(dict.fromkeys(names, file))
            return locations
    return {}


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
