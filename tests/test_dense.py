"""DReSD's dense index and drafting rule, without vLLM: synthetic states with real structure."""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_retrieval_spec.config import ConfigError, VLLM_CPU_DEFAULTS, parse_speculative_config
from vllm_retrieval_spec.datastore import DatastoreError, build_datastore_from_token_ids
from vllm_retrieval_spec.datastore.build import _dense_windows, build_dense_index
from vllm_retrieval_spec.datastore.dense import (
    DENSE_DIR,
    KEYS_FILE,
    DenseIndex,
    check_dense_index,
    write_dense_index,
)
from vllm_retrieval_spec.datastore.format import load_datastore
from vllm_retrieval_spec.datastore.projection import fit_projection
from vllm_retrieval_spec.drafting.overlap import last_state_rows
from vllm_retrieval_spec.model_files import model_config_json, model_fingerprint, resolve_model_dir
from vllm_retrieval_spec.sources.dense import matching_continuations

HIDDEN = 48
FINGERPRINT = "f" * 64


def clustered_states(n: int, hidden: int = HIDDEN, clusters: int = 64, seed: int = 0):
    """Points around cluster centres with per-dimension scales (what z-scoring is for); i.i.d.
    random vectors have no neighbours and tell nothing about an ANN index."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, hidden)) * 3
    labels = rng.integers(0, clusters, n)
    scales = rng.uniform(0.1, 10, hidden)
    states = (centres[labels] + rng.normal(size=(n, hidden))) * scales + rng.normal(size=hidden)
    return states.astype(np.float32), labels


def make_store(tmp_path: Path, documents, name="store") -> Path:
    path = tmp_path / name
    build_datastore_from_token_ids(documents, path, tokenizer_name="t",
                                   tokenizer_fingerprint="0" * 64, vocab_size=1000,
                                   progress=False)
    return path


def index_store(path: Path, states: np.ndarray, positions: np.ndarray, **kwargs):
    options = dict(model_name="m", model_fingerprint=FINGERPRINT, layer=30, dtype="float32",
                   dims=16, progress=False)
    return write_dense_index(load_datastore(path), states, positions, **{**options, **kwargs})


@pytest.fixture(scope="module")
def clustered_store(tmp_path_factory):
    """8192 tokens in one document; the state at position p is clustered by label."""
    tmp_path = tmp_path_factory.mktemp("dense")
    n = 8192
    states, labels = clustered_states(n + 1)
    path = make_store(tmp_path, [labels.tolist()])
    index_store(path, states[:n], np.arange(n))
    return path, states[:n]


def test_fit_projection_is_pca_of_zscored_states():
    states, _ = clustered_states(4000)
    projection = fit_projection(torch.from_numpy(states), 8)
    components = projection.components
    np.testing.assert_allclose(components.T @ components, np.eye(8), atol=1e-5)
    z = (states - projection.mean) * projection.inv_std
    np.testing.assert_allclose(z.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(z.std(0, ddof=1), 1, atol=1e-3)
    # The first component carries the most variance of any direction tried.
    first = np.var(z @ components[:, 0])
    rng = np.random.default_rng(1)
    for _ in range(20):
        v = rng.normal(size=HIDDEN)
        assert np.var(z @ (v / np.linalg.norm(v))) <= first + 1e-3
    assert 0 < projection.explained_variance < 1
    assert fit_projection(torch.from_numpy(states), HIDDEN).explained_variance == \
        pytest.approx(1.0)


def test_streamed_fit_equals_a_direct_float64_fit(tmp_path):
    states, _ = clustered_states(1000)
    states[:, 5] = 3.0  # a constant dimension: its std is floored, its z-scores are 0
    rows = np.sort(np.random.default_rng(3).choice(len(states), 700, replace=False))
    sample = states[rows].astype(np.float64)
    mean = sample.mean(0)
    std = np.maximum(sample.std(0, ddof=1), 1e-6)
    z = (sample - mean) / std
    eigenvalues, eigenvectors = np.linalg.eigh(z.T @ z / (len(sample) - 1))
    top = np.argsort(eigenvalues)[::-1][:6]
    np.save(tmp_path / "states.npy", states)
    # An array, a tensor and a memory map; 100 rows per chunk, so 7 chunks are accumulated.
    for source in (states, torch.from_numpy(states), np.load(tmp_path / "states.npy",
                                                               mmap_mode="r")):
        projection = fit_projection(source, 6, rows, chunk_bytes=8 * HIDDEN * 100)
        np.testing.assert_allclose(projection.mean, mean, rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(projection.inv_std, 1 / std, rtol=1e-6)
        # Eigenvectors are defined up to their sign.
        signs = np.sign(np.sum(projection.components * eigenvectors[:, top], axis=0))
        np.testing.assert_allclose(projection.components, eigenvectors[:, top] * signs,
                                   atol=1e-6)
        assert projection.explained_variance == pytest.approx(
            eigenvalues[top].sum() / eigenvalues.clip(0).sum(), rel=1e-9)


@pytest.mark.parametrize("dims", [0, HIDDEN + 1])
def test_pca_dims_out_of_range(dims):
    states, _ = clustered_states(100)
    with pytest.raises(DatastoreError, match=rf"PCA dims {dims} is out of range: must be in "
                                             rf"\[1, {HIDDEN}\]"):
        fit_projection(torch.from_numpy(states), dims)


def test_exact_self_retrieval(clustered_store):
    path, states = clustered_store
    index = DenseIndex.from_path(path, search="exact")
    rows = np.random.default_rng(2).choice(len(states), 500, replace=False)
    neighbours, scores = index.search(index.projection(torch.from_numpy(states[rows])), 10)
    ranks = [list(n).index(r) + 1 if r in n else np.inf for n, r in zip(neighbours, rows)]
    mrr = float(np.mean(1 / np.asarray(ranks)))
    assert mrr > 0.99
    assert np.all(np.diff(scores, axis=1) <= 1e-6)  # best first
    assert np.all(scores[:, 0] > 0.99)  # a key against its own query: cosine ~1 (float16 keys)


def test_scann_recall_against_exact(clustered_store):
    path, states = clustered_store
    exact = DenseIndex.from_path(path, search="exact")
    scann = DenseIndex.from_path(path, search="scann")
    assert scann.search_backend == "scann"
    queries = exact.projection(torch.from_numpy(states[:300] + 0.5))
    truth, _ = exact.search(queries, 10)
    found, _ = scann.search(queries, 10)
    recall = np.mean([len(set(t) & set(f)) / 10 for t, f in zip(truth, found)])
    assert recall > 0.9


def test_manifest_records_the_build(clustered_store):
    path, states = clustered_store
    manifest = json.loads((path / DENSE_DIR / "manifest.json").read_text())
    assert manifest["hidden_size"] == HIDDEN and manifest["dims"] == 16
    assert manifest["num_keys"] == len(states) and manifest["layer"] == 30
    assert manifest["dtype"] == "float32" and 0 < manifest["explained_variance"] < 1
    assert manifest["scann"] is not None
    keys = np.load(path / DENSE_DIR / KEYS_FILE, mmap_mode="r")
    assert keys.dtype == np.float16 and keys.shape == (len(states), 16)
    # Each key is a position (8 bytes) plus its float16 vector: no copies of continuations.
    assert manifest["files"]["positions.npy"]["bytes"] - 128 == 8 * len(states)


def test_wrong_hidden_size_fails(clustered_store):
    path, _ = clustered_store
    with pytest.raises(DatastoreError, match=f"hidden size {HIDDEN} .* has hidden size 576"):
        DenseIndex.from_path(path, hidden_size=576)


def test_other_model_fails(clustered_store):
    path, _ = clustered_store
    with pytest.raises(DatastoreError, match="was built from another model"):
        DenseIndex.from_path(path, expected_model_fingerprint="0" * 64)


def test_index_of_another_dtype_fails(clustered_store):
    path, _ = clustered_store
    # Built as float32 (index_store), served as torch.float32 or named so: accepted.
    check_dense_index(path, dtype=torch.float32)
    check_dense_index(path, dtype="float32")
    with pytest.raises(DatastoreError, match=(
            r"dense index .*dense was built from float32 forward passes, but the model is served "
            r"in bfloat16: its keys would not match the served hidden states. Serve in float32 "
            r"\(dtype='float32', --dtype float32\), or rebuild the index in bfloat16: "
            r"`vllm-rsd build-datastore --dense --overwrite --dtype bfloat16 -o .*store "
            r"--model MODEL`")):
        check_dense_index(path, dtype=torch.bfloat16)


TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4, "num_hidden_layers": 1,
               "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 8,
               "vocab_size": 3, "torch_dtype": "float32"}


def tiny_weights(norm):
    return {"model.embed_tokens.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "model.layers.0.input_layernorm.weight": torch.full((4,), 2.0),
            "model.norm.weight": torch.tensor(norm, dtype=torch.float32)}


def save_tiny_model(path: Path, norm=(1.0, 0.5, 0.25, 2.0), fmt="safetensors", shards=1):
    """A model folder as transformers saves one: one weight file, or shards and their index."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    weights = tiny_weights(norm)
    names = sorted(weights)
    prefix, suffix = ("model", ".safetensors") if fmt == "safetensors" else ("pytorch_model",
                                                                             ".bin")
    files = ([f"{prefix}{suffix}"] if shards == 1 else
             [f"{prefix}-{i + 1:05d}-of-{shards:05d}{suffix}" for i in range(shards)])
    weight_map = {name: files[i % shards] for i, name in enumerate(names)}
    for file in files:
        part = {name: weights[name] for name in names if weight_map[name] == file}
        if fmt == "safetensors":
            save_file(part, str(path / file))
        else:
            torch.save(part, path / file)
    if shards > 1:
        (path / f"{prefix}{suffix}.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def expected_fingerprint(norm):
    """The recorded formula: config numbers, then the final norm as float32 bytes."""
    keys = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "vocab_size")
    digest = hashlib.sha256(json.dumps({k: TINY_CONFIG[k] for k in keys}, sort_keys=True).encode())
    digest.update(np.asarray(norm, dtype=np.float32).tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("fmt, shards", [("safetensors", 1), ("safetensors", 2), ("bin", 1),
                                         ("bin", 3)])
def test_model_fingerprint_of_any_weight_format(tmp_path, fmt, shards):
    model = save_tiny_model(tmp_path / "model", fmt=fmt, shards=shards)
    if fmt == "bin":
        # Saved by trainers beside the weights, and not loadable as weights: skipped.
        torch.save(argparse.Namespace(lr=0.1), model / "training_args.bin")
    assert model_fingerprint(model) == expected_fingerprint((1.0, 0.5, 0.25, 2.0))


def test_model_fingerprint_tells_final_norms_apart(tmp_path):
    one = save_tiny_model(tmp_path / "one", norm=(1.0, 0.5, 0.25, 2.0))
    other = save_tiny_model(tmp_path / "other", norm=(1.0, 0.5, 0.25, 2.5))
    assert model_fingerprint(one) != model_fingerprint(other)
    assert model_fingerprint(other) == expected_fingerprint((1.0, 0.5, 0.25, 2.5))


def test_model_without_weights_fails(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    with pytest.raises(DatastoreError, match=r"has no safetensors or PyTorch \(.bin, .pt\) "
                                             r"weights with a final norm weight"):
        model_fingerprint(model)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache at HF_HUB_CACHE."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub reads the variable once, at import.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_hub_id_resolves_through_the_local_cache(hub_cache):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub_cache / "models--org--tiny"
    snapshot = save_tiny_model(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert resolve_model_dir("org/tiny").resolve() == snapshot.resolve()
    assert model_config_json("org/tiny") == TINY_CONFIG
    assert model_fingerprint("org/tiny") == expected_fingerprint((1.0, 0.5, 0.25, 2.0))


def test_uncached_hub_id_fails(tmp_path, hub_cache):
    message = (r"model 'org/absent' is not a folder, and not in the local Hugging Face cache "
               r"\(.*hub\) either; the dense index reads the model's config and weights without "
               r"downloading anything: download it first \(`hf download org/absent`\) or pass "
               r"the folder of a local copy")
    with pytest.raises(DatastoreError, match=message):
        model_fingerprint("org/absent")
    # The build checks the model before it loads the datastore or starts an engine.
    with pytest.raises(DatastoreError, match=message):
        build_dense_index(tmp_path / "no-datastore", "org/absent")
    with pytest.raises(DatastoreError, match=r"model folder /.*/nowhere does not exist"):
        model_fingerprint(tmp_path / "nowhere")


def test_a_killed_dense_builds_states_are_named_before_the_engine_starts(tmp_path, monkeypatch,
                                                                        capsys):
    # 4 x hidden size bytes a token, left inside the datastore by a build killed mid-forward.
    from test_atomic import dead_pid
    from vllm_retrieval_spec.datastore import build

    path = make_store(tmp_path, [[1, 2, 3, 4]])
    killed = path / f"dense.states.tmp-{dead_pid()}"
    killed.write_bytes(bytes(2**20))

    def no_engine(*args):
        raise RuntimeError("no engine in this test")

    monkeypatch.setattr(build, "_hidden_state_engine", no_engine)
    with pytest.raises(RuntimeError, match="no engine"):
        build_dense_index(path, save_tiny_model(tmp_path / "model"), dims=4)
    assert f"note: {killed} (1.0 MiB) was left by process" in capsys.readouterr().err
    assert killed.is_file()


@pytest.mark.parametrize("rope, scaled", [
    ({}, False),
    ({"rope_scaling": None}, False),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}, False),  # transformers 5
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, True),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, True),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "yarn", "factor": 4.0}}}, True),
])
def test_a_window_longer_than_the_models_positions_is_refused_before_any_engine(tmp_path, rope,
                                                                               scaled):
    # Before: vLLM's pydantic traceback ("User-specified max_model_len (2048) is greater than
    # the derived max_model_len ...") once vLLM had been imported and the engine configured.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "hidden_size": 8, "max_position_embeddings": 1024, **rope}))
    if not scaled:
        message = (r"^a dense window of 2048 tokens is longer than the model's 1024 positions "
                   r"\(max_position_embeddings\); give --dense-window 1024 or less$")
    else:
        # Scaled rope may hold more: vLLM judges, and here the datastore is looked at next.
        message = r"no-datastore does not exist"
    with pytest.raises(DatastoreError, match=message):
        build_dense_index(tmp_path / "no-datastore", model, dims=4, window=2048)


def test_missing_dense_index(tmp_path):
    path = make_store(tmp_path, [[1, 2, 3]])
    with pytest.raises(DatastoreError, match="has no dense index .* method 'dresd' needs; "
                                             "rebuild it with `vllm-rsd build-datastore --dense`"):
        DenseIndex.from_path(path)


@pytest.mark.parametrize("entry", [{"bytes": "152"}, {"shape": 11}, None])
def test_a_dense_manifest_file_entry_of_the_wrong_type(tmp_path, entry):
    """A hand-edited dense/manifest.json is a one-line 'rebuild it', not a TypeError."""
    states, labels = clustered_states(100)
    path = make_store(tmp_path, [labels.tolist()])
    index_store(path, states[:99], np.arange(99))
    manifest = path / "dense" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"]["keys.npy"] = None if entry is None else {**data["files"]["keys.npy"], **entry}
    manifest.write_text(json.dumps(data))
    with pytest.raises(DatastoreError, match=r"dense/manifest.json is unusable \(its 'files' "
                                             r"must map names to .*\); rebuild it with"):
        DenseIndex.from_path(path)


def test_small_store_has_no_scann_searcher(tmp_path):
    states, labels = clustered_states(100)
    path = make_store(tmp_path, [labels.tolist()])
    index_store(path, states[:99], np.arange(99))
    assert DenseIndex.from_path(path).search_backend == "exact"
    with pytest.raises(DatastoreError, match="has no ScaNN searcher"):
        DenseIndex.from_path(path, search="scann")


@pytest.mark.parametrize("method", ["dresd", "hybrid"])
def test_scann_asked_of_an_index_without_one_fails_in_the_front_end(tmp_path, method):
    # It failed only in the worker, once vLLM had started the engine (DenseIndex.from_path).
    from types import SimpleNamespace

    from helpers import make_tokenizer
    from vllm_retrieval_spec.config.model import validate_against_model
    from vllm_retrieval_spec.datastore.format import tokenizer_fingerprint

    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    model = save_tiny_model(tmp_path / "model")
    states, labels = clustered_states(100, clusters=8)
    path = tmp_path / "store"
    build_datastore_from_token_ids([(labels % 8).tolist()], path, tokenizer_name="t",
                                   tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                                   vocab_size=len(tokenizer), progress=False)
    index_store(path, states[:99], np.arange(99), model_fingerprint=model_fingerprint(model))
    model_config = SimpleNamespace(
        tokenizer=str(tmp_path / "tokenizer"), tokenizer_revision=None, trust_remote_code=False,
        model=str(model), dtype=torch.float32, get_hidden_size=lambda: HIDDEN)

    def config(search):
        return parse_speculative_config({"method": method, "num_speculative_tokens": 4,
                                         "datastore": str(path), "search": search},
                                        VLLM_CPU_DEFAULTS)

    for search in ("auto", "exact"):
        validate_against_model(config(search), model_config)
    with pytest.raises(DatastoreError, match=r"dense has no ScaNN searcher \(built with "
                                             r"--dense-index exact, or fewer than 4096 keys\); "
                                             r"use search 'exact'"):
        validate_against_model(config("scann"), model_config)


def test_rebuilt_token_stream_invalidates_the_index(tmp_path):
    states, labels = clustered_states(100)
    path = make_store(tmp_path, [labels.tolist()])
    index_store(path, states[:99], np.arange(99))
    rebuilt = make_store(tmp_path, [labels[::-1].tolist()], name="other")
    (path / "tokens.npy").write_bytes((rebuilt / "tokens.npy").read_bytes())
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["tokens.npy"] = json.loads(
        (rebuilt / "manifest.json").read_text())["files"]["tokens.npy"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatastoreError, match="built for another token stream"):
        DenseIndex.from_path(path)


def test_truncated_keys_fail(tmp_path):
    states, labels = clustered_states(100)
    path = make_store(tmp_path, [labels.tolist()])
    index_store(path, states[:99], np.arange(99))
    keys = path / DENSE_DIR / KEYS_FILE
    keys.write_bytes(keys.read_bytes()[:-2])
    with pytest.raises(DatastoreError, match="keys.npy has .* bytes, the manifest records"):
        DenseIndex.from_path(path)


def test_missing_scann_searcher_fails(clustered_store, tmp_path):
    """A manifest that records a ScaNN searcher whose directory is gone (a partial copy) is a
    one-line error, not a FileNotFoundError from inside the searcher's loader."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(clustered_store[0], copy)
    shutil.rmtree(copy / DENSE_DIR / "scann")
    with pytest.raises(DatastoreError, match=r"dense/scann has no ScaNN searcher .*use search "
                                             r"'exact' or rebuild it"):
        DenseIndex.from_path(copy)
    # Refused by the start-up check too, which runs before vLLM starts the engine; only the
    # worker's DenseIndex refused it before.
    with pytest.raises(DatastoreError, match=r"dense/scann has no ScaNN searcher"):
        check_dense_index(copy)
    check_dense_index(copy, search="exact")
    assert DenseIndex.from_path(copy, search="exact").search_backend == "exact"


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_damaged_scann_searcher_fails_at_the_start_up_check(clustered_store, tmp_path, damage):
    """The ScaNN searcher's files are recorded in the manifest and checked like the arrays.
    Before: a truncated file passed the start-up check and the worker failed with ScaNN's
    RuntimeError ("Error loading artifacts: File too short"); a flipped byte of dataset.npy
    (the exact re-ranking's vectors) searched silently with the damaged vectors."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(clustered_store[0], copy)
    file = copy / DENSE_DIR / "scann" / "dataset.npy"
    data = bytearray(file.read_bytes())
    if damage == "truncated":
        data = data[:len(data) // 2]
    else:
        data[-1] ^= 0xFF
    file.write_bytes(bytes(data))
    message = (r"scann/dataset.npy has \d+ bytes, the manifest records \d+; rebuild it"
               if damage == "truncated" else r"scann/dataset.npy is corrupt \(sha256 differs\)")
    with pytest.raises(DatastoreError, match=message):
        check_dense_index(copy)
    with pytest.raises(DatastoreError, match=message):
        DenseIndex.from_path(copy)
    # Exact search does not read the searcher's files.
    check_dense_index(copy, search="exact")


def test_keys_with_a_damaged_header_fail(tmp_path):
    """A .npy header that no longer parses (same size) is a one-line 'rebuild it', not
    numpy's ValueError."""
    states, labels = clustered_states(100)
    path = make_store(tmp_path, [labels.tolist()])
    index_store(path, states[:99], np.arange(99))
    keys = path / DENSE_DIR / KEYS_FILE
    keys.write_bytes(b"JUNK!!" + keys.read_bytes()[6:])
    with pytest.raises(DatastoreError, match=r"keys.npy is not a valid .npy file \(.*\); rebuild"):
        DenseIndex.from_path(path)


@pytest.mark.parametrize("name", ["keys.npy", "positions.npy", "mean.npy", "components.npy"])
def test_arrays_in_another_byte_order_fail(tmp_path, name):
    """An index written on a big-endian machine records the same dtype names ("float16"), and
    np.load keeps the file's byte order. Before: accepted at start-up, then torch refused the
    projection's arrays (a ValueError at the first decoding step) and numba the positions."""
    from vllm_retrieval_spec.datastore.format import describe_file

    states, labels = clustered_states(100)
    path = make_store(tmp_path, [labels.tolist()])
    index_store(path, states[:99], np.arange(99))
    file = path / DENSE_DIR / name
    native = np.load(file)
    np.save(file, native.astype(native.dtype.newbyteorder(">")))
    manifest = json.loads((path / DENSE_DIR / "manifest.json").read_text())
    manifest["files"][name] = describe_file(file)
    (path / DENSE_DIR / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatastoreError, match=rf"{name} holds big-endian {native.dtype.name} "
                                             rf"\[.*\], expected {native.dtype.name} "
                                             r"\[.*\]; rebuild it with"):
        DenseIndex.from_path(path, verify_checksums=False)


def test_inspect_verify_checks_the_dense_index(tmp_path, capsys):
    """`inspect --verify` "checks every checksum": the dense index's too. Before: a flipped
    byte in dense/keys.npy was reported as "(checksums verified)"."""
    from vllm_retrieval_spec import cli

    states, labels = clustered_states(100)
    path = make_store(tmp_path, [labels.tolist()])
    index_store(path, states[:99], np.arange(99))
    cli.main(["inspect", str(path), "--verify"])
    keys = path / DENSE_DIR / KEYS_FILE
    data = bytearray(keys.read_bytes())
    data[-1] ^= 0x01
    keys.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=r"^error: .*dense/keys.npy is corrupt \(sha256 differs"):
        cli.main(["inspect", str(path), "--verify"])
    capsys.readouterr()
    cli.main(["inspect", str(path)])  # sizes and headers only
    assert "dense/keys.npy" in capsys.readouterr().out
    keys.write_bytes(bytes(data[:-2]))
    with pytest.raises(SystemExit, match=r"^error: .*dense/keys.npy has \d+ bytes, the manifest"):
        cli.main(["inspect", str(path)])


def test_existing_index_needs_overwrite(tmp_path):
    states, labels = clustered_states(100)
    path = make_store(tmp_path, [labels.tolist()])
    index_store(path, states[:99], np.arange(99))
    with pytest.raises(DatastoreError, match="already holds a dense index"):
        index_store(path, states[:99], np.arange(99))
    index_store(path, states[:99], np.arange(99), overwrite=True, dims=8)
    assert DenseIndex.from_path(path).manifest.dims == 8
    assert sorted(p.name for p in path.iterdir()) == [
        DENSE_DIR, "manifest.json", "suffix_array.npy", "tokens.npy"]


def test_dense_windows_key_every_predicting_token():
    tokens = np.array([1, 2, 3, 4, 5, 6, 7, -1, 9, -1, 5, 6, -1], dtype=np.int32)
    windows, positions = _dense_windows(tokens, window=4, overlap=2)
    # The last token of each document predicts nothing; a one-token document gives no key.
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 10]
    assert windows == [(0, 4, 0, 4), (2, 6, 4, 6), (10, 12, 10, 11)]
    for first, stop, keep_from, keep_to in windows:
        assert stop - first <= 4 and first <= keep_from <= keep_to <= stop
        assert -1 not in tokens[first:stop]
        # A later window repeats up to `overlap` tokens of context before what it keeps.
        assert keep_from - first <= 2


def test_matching_continuations_filter_by_emitted_token():
    #                0  1  2  3   4  5  6  7  8   9
    tokens = np.array([5, 7, 8, 9, -1, 5, 7, 3, 5, 6], dtype=np.int32)
    positions = np.array([0, 5, 8, 2], dtype=np.int64)
    neighbours = np.array([0, 3, 1, 2, -1], dtype=np.int64)
    scores = np.array([0.9, 0.8, 0.7, -0.5, 0.0], dtype=np.float32)
    cands, lengths, weights = matching_continuations(tokens, positions, neighbours, scores, 7, 4)
    # Key 0 (position 0) and key 1 (position 5) predicted 7; key 3 (position 2) predicted 9.
    assert lengths.tolist() == [2, 3]
    assert cands.tolist() == [[8, 9, -1, -1], [3, 5, 6, -1]]
    np.testing.assert_allclose(weights, [0.9, 0.7])
    cands, lengths, weights = matching_continuations(tokens, positions, neighbours, scores, 6, 4)
    assert len(cands) == 1 and lengths[0] == 0 and weights[0] == 0  # end of stream; score < 0
    # A NaN similarity (a NaN hidden state's) votes nothing, as a negative one.
    scores[0] = np.nan
    _, _, weights = matching_continuations(tokens, positions, neighbours, scores, 7, 4)
    np.testing.assert_allclose(weights, [0.0, 0.7])


def test_dresd_draft_votes_by_similarity(tmp_path):
    documents = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7]]
    path = make_store(tmp_path, documents)
    states = np.eye(12, HIDDEN, dtype=np.float32)  # keys never searched here
    index_store(path, states, np.arange(12), dims=4)
    index = DenseIndex.from_path(path)
    config = parse_speculative_config({"method": "dresd", "num_speculative_tokens": 3,
                                       "datastore": str(path), "min_prefix_prob": 0.0},
                                           VLLM_CPU_DEFAULTS)
    # Keys at positions 0 (doc 1), 5 (doc 2), 10 (doc 3) all predicted token 2.
    neighbours = np.array([0, 5, 10], dtype=np.int64)
    draft = dresd_draft(index, neighbours, np.array([0.5, 0.5, 0.9], dtype=np.float32), 2, 3,
                        config)
    assert draft.tolist() == [3, 4]  # 3 has 1.0 of the vote against 6's 0.9
    draft = dresd_draft(index, neighbours, np.array([0.3, 0.3, 0.9], dtype=np.float32), 2, 3,
                        config)
    assert draft.tolist() == [6, 7]
    assert dresd_draft(index, neighbours, np.ones(3, dtype=np.float32), 9, 3, config).size == 0


def test_last_state_rows():
    num_drafts = [3, 0, 2, 4]
    # Row blocks: 4, 1, 3, 5 rows; accepted counts 2, 1, 0 (partial prefill), 5.
    sampled = [[1, 2], [3], [], [4, 5, 6, 7, 8]]
    assert last_state_rows(sampled, num_drafts) == [1, 4, -1, 12]
    assert last_state_rows([[1], [2]], [0, 0]) == [0, 1]
    # Row 0 drafted a tree: its 2 sampled tokens are node 2 (accepted) and the bonus, so the
    # bonus came from node 2's state, row 0 + 1 + 2; row 3's tree accepted nothing: its root.
    assert last_state_rows(sampled, num_drafts, {0: 2, 3: -1}) == [3, 4, -1, 8]


@pytest.mark.parametrize("options, message", [
    ({}, r"'datastore'\] is required for method 'dresd'"),
    ({"datastore": "x", "search": "faiss"}, r"'search'\]='faiss' is not one of"),
    ({"datastore": "x", "top_n": 0}, r"'top_n'\]=0 is out of range"),
])
def test_dresd_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        parse_speculative_config({"method": "dresd", "num_speculative_tokens": 4, **options},
                                 VLLM_CPU_DEFAULTS)


def make_proposer(config):
    from types import SimpleNamespace

    from vllm_retrieval_spec.config import PLUGIN_KEY
    from vllm_retrieval_spec.proposers.base import RetrievalProposer

    k = config.drafting.num_speculative_tokens
    return RetrievalProposer(SimpleNamespace(
        additional_config={PLUGIN_KEY: config.to_dict()},
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 1000,
                                     get_hidden_size=lambda: HIDDEN)))


def dresd_draft(index, neighbours, scores, emitted, max_len, config):
    """DReSD's draft for a context ending in ``emitted`` from ``neighbours`` in ``index``."""
    from vllm_retrieval_spec.drafting.tree import TrieSelection
    from vllm_retrieval_spec.drafting.trie import TrieDrafter
    from vllm_retrieval_spec.sources.dense import DenseSource

    trie = TrieDrafter([DenseSource(index, lambda row: (neighbours, scores))],
                       TrieSelection(config.trie, config.drafting.min_draft_len))
    return trie.draft(0, np.array([emitted], dtype=np.int32), max_len)


def hybrid_draft(store, context, max_len, config, index, query):
    """Hybrid's draft from the context, ``store`` and ``index`` searched with ``query`` (an
    array, a function returning one, or None)."""
    from vllm_retrieval_spec.proposers.hybrid import hybrid_trie
    from vllm_retrieval_spec.sources.dense import searched

    def neighbours(row):
        return searched(index, query() if callable(query) else query, config.search.top_n)

    return hybrid_trie(config, store, index, dense_neighbours=neighbours).draft(0, context, max_len)


def dresd_proposer(path, **options):
    return make_proposer(parse_speculative_config(
        {"method": "dresd", "num_speculative_tokens": 4, "datastore": str(path), **options},
        VLLM_CPU_DEFAULTS))


def test_dresd_neither_projects_nor_searches_when_drafting_is_off(clustered_store, monkeypatch):
    path, states = clustered_store
    proposer = dresd_proposer(path, min_prefix_prob=0.0, disable_by_batch_size=2)
    calls = []
    projection, search = proposer.method.index.projection, proposer.method.index.search
    monkeypatch.setattr(proposer.method.index, "projection",
                        lambda s: calls.append("project") or projection(s))
    monkeypatch.setattr(proposer.method.index, "search",
                        lambda q, n: calls.append("search") or search(q, n))
    token_ids = np.asarray(proposer.method.index.tokens[:16].reshape(1, 16).repeat(2, 0))
    # Two requests sampled: at the cut-off, so no drafts, and no work for them either.
    proposer.record_last_hidden_states(torch.from_numpy(states[:2]), [0, 1])
    assert proposer.propose([[1], [1]], np.array([16, 16]), token_ids) == [[], []]
    assert calls == []
    # One request sampled (the other is prefilling): below the cut-off, it drafts.
    proposer.record_last_hidden_states(torch.from_numpy(states[:2]), [0, -1])
    proposer.propose([[1], []], np.array([16, 16]), token_ids)
    assert calls == ["project", "search"]


def test_warm_up_projects_states_like_the_models(clustered_store, monkeypatch):
    """On a GPU the projection is a Triton kernel compiled at its first call, one per dtype and
    for one row or more: ``load_model`` makes those calls with states on the model's device in
    its dtype, not the first requests."""
    path, _ = clustered_store
    proposer = dresd_proposer(path)
    shapes = []
    projection = proposer.method.index.projection
    monkeypatch.setattr(proposer.method.index, "projection", lambda s: shapes.append(
        (s.dtype, s.device.type, tuple(s.shape))) or projection(s))
    proposer.load_model(torch.nn.Linear(2, 2, dtype=torch.bfloat16))
    hidden = proposer.method.index.manifest.hidden_size
    assert shapes == [(torch.bfloat16, "cpu", (2, hidden)), (torch.bfloat16, "cpu", (1, hidden))]


def test_dresd_proposer_drafts_each_row_from_its_own_state(clustered_store):
    path, states = clustered_store
    proposer = dresd_proposer(path, min_prefix_prob=0.0)
    index = proposer.method.index
    tokens = index.tokens
    # Rows 0 and 2 continue the store at positions 100 and 4000 (their last token is the one
    # their state predicted); row 1 is a partial prefill.
    contexts = [tokens[90:102], tokens[:5], tokens[3990:4002]]
    width = 16
    token_ids = np.zeros((3, width), dtype=np.int32)
    for i, c in enumerate(contexts):
        token_ids[i, :len(c)] = c
    step_states = torch.from_numpy(np.stack([states[4000], states[100], states[0]]))
    proposer.record_last_hidden_states(step_states, [1, -1, 0])
    drafts = proposer.propose([[5], [], [6]], np.array([12, 5, 12]), token_ids)
    # A state's nearest key is its own position's, which predicted the row's last token: the
    # store's tokens after that are the draft.
    assert drafts[0] == tokens[102:106].tolist()
    assert drafts[2] == tokens[4002:4006].tolist()
    assert drafts[1] == []
    stats = proposer.stats()
    assert stats["search_ns"] > 0 and stats["search_wait_ns"] > 0


@pytest.mark.parametrize("tree", ["off", "on"])
def test_dresd_search_ahead_drafts_what_searching_after_sampling_drafts(clustered_store,
                                                                          monkeypatch, tree):
    """Every candidate state searched before sampling, then each row keeps its own: the same
    drafts as projecting and searching the last states after sampling, with nothing projected
    or searched after sampling."""
    path, states = clustered_store
    # No time budget: a loaded machine must not cost one side its draft.
    options = {"min_prefix_prob": 0.0, "tree": tree, "tree_min_prob": 0.05, "draft_budget_ms": 0}
    after = dresd_proposer(path, **options, precompute_drafts=False)
    ahead = dresd_proposer(path, **options, precompute_drafts=True)
    tokens = after.method.index.tokens
    # A step's candidate states: request 0 verified 3 draft tokens (4 rows), request 1 none.
    candidates = torch.from_numpy(np.stack([states[7], states[100], states[8], states[9],
                                            states[4000]]))
    contexts = [tokens[90:102], tokens[3990:4002]]
    token_ids = np.zeros((2, 16), dtype=np.int32)
    for i, c in enumerate(contexts):
        token_ids[i, :len(c)] = c
    rows = [1, 4]  # request 0 accepted 1 draft token: its last state is row 1
    ahead.search_ahead(candidates)
    calls = []
    monkeypatch.setattr(ahead.method.index, "projection", lambda s: calls.append("project"))
    ahead.record_last_hidden_states(candidates, rows)
    drafted_ahead = ahead.propose([[5, 6], [7]], np.array([12, 12]), token_ids)
    after.record_last_hidden_states(candidates, rows)
    drafted_after = after.propose([[5, 6], [7]], np.array([12, 12]), token_ids)
    assert drafted_ahead == drafted_after
    assert drafted_ahead[0] == tokens[102:106].tolist() and drafted_ahead[1]
    assert calls == [] and ahead.stats()["search_ns"] > 0
    # States other than those searched ahead (here: fewer rows) are projected and searched
    # after sampling, as without searching ahead.
    monkeypatch.undo()
    ahead.search_ahead(candidates[:3])
    ahead.record_last_hidden_states(candidates, rows)
    assert ahead.propose([[5, 6], [7]], np.array([12, 12]), token_ids) == drafted_after
    # Off without precompute_drafts.
    after.search_ahead(candidates)
    assert after.method.searches.ahead is None


def _decode_with_states(proposer, truth, at, states, before_sampling):
    """Decode ``truth`` (store tokens; ``truth[q]`` is at store position ``at[q]``) greedily
    from token 12 as the plugin drives a proposer: each step the forward's states of the rows
    vLLM samples (``search_ahead``), then, if ``before_sampling``, the step's sampled tokens
    from the logits (``draft_before_sampling``), then after sampling the state that predicted
    each row's last token (``record_last_hidden_states``), ``propose`` and, after the handover,
    ``precompute_next``. Returns the drafts."""
    drafts = []
    draft: list[int] = []
    position = 12
    sampled = [int(truth[position - 1])]
    while position < len(truth) - 5:
        base = position - len(sampled)
        verified = draft
        # The root's state (it predicted the first sampled token), then each draft token's;
        # a rejected draft token's state is one the store has nowhere near.
        rows = [states[at[base - 1]]] + [
            states[at[base + j]] if token == truth[base + j] else states[(at[base + j] + 4096)
                                                                         % len(states)]
            for j, token in enumerate(verified)]
        candidates = torch.from_numpy(np.stack(rows))
        proposer.observe_batch(["r"])
        proposer.search_ahead(candidates)
        if before_sampling:
            proposer.draft_before_sampling([sampled], [verified], np.array([base]),
                                           truth[None, :base].astype(np.int32))
        proposer.record_last_hidden_states(candidates, [len(sampled) - 1])
        draft = proposer.propose([sampled], np.array([position]),
                                 truth[None, :position].astype(np.int32))[0]
        proposer.after_handover()  # as the plugin does once the drafts are handed over
        drafts.append(draft)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == truth[position + accepted]:
            accepted += 1
        sampled = truth[position:position + accepted + 1].tolist()
        position += accepted + 1
    return drafts


@pytest.mark.parametrize("method, precompute", [("dresd", False), ("dresd", True),
                                                ("hybrid", False)])
def test_dense_drafts_made_before_sampling_equal_drafting_after_it(clustered_store, monkeypatch,
                                                                   method, precompute):
    """Step after step, a greedy request's draft made before vLLM samples (from the state
    that predicted its last sampled token, known from the logits) is the draft made after
    sampling, and after sampling nothing is searched again."""

    path, states = clustered_store
    tokens = np.asarray(DenseIndex.from_path(path).tokens)
    # The store's text from position 90, then from 3000: the drafts' luck runs out there.
    at = np.concatenate([np.arange(90, 120), np.arange(3000, 3030)])
    truth = tokens[at]
    runs = {}
    for before_sampling in (False, True):
        options = {"draft_budget_ms": 0, "precompute_drafts": precompute,
                   "draft_before_sampling": before_sampling}
        proposer = dresd_proposer(path, min_prefix_prob=0.0, **options) if method == "dresd" \
            else make_proposer(hybrid_config(path, **options))
        assert proposer.capabilities.drafts_before_sampling == before_sampling
        index = proposer.method.index if method == "dresd" else proposer.method.dense
        searches = []
        search = index.search
        monkeypatch.setattr(index, "search", lambda q, n: searches.append(len(q)) or search(q, n))
        drafts = _decode_with_states(proposer, truth, at, states, before_sampling)
        runs[before_sampling] = drafts
        assert proposer.num_failed_drafts == 0
        if before_sampling:
            assert proposer.ahead.precomputed == {"used": len(drafts)}
        if method == "dresd":
            # One search a step: ahead, all candidate states at once; else the last state's.
            assert len(searches) == len(drafts)
        else:
            assert 0 < len(searches) <= len(drafts)
        monkeypatch.undo()
    assert runs[True] == runs[False]
    assert sum(map(len, runs[True])) > 20, "the text must draft for this test to mean anything"


def test_dresd_proposer_survives_states_it_cannot_project(clustered_store):
    """A row without neighbours (its state could not be projected) drafts nothing: the step
    counts one failure, the projection's, not one more per row for a ballot no source filled."""
    path, _ = clustered_store
    proposer = dresd_proposer(path, draft_budget_ms=0)
    tokens = proposer.method.index.tokens
    token_ids = np.zeros((2, 16), dtype=np.int32)
    token_ids[0, :12] = tokens[90:102]
    token_ids[1, :12] = tokens[3990:4002]
    # States of the wrong width: the projection raises.
    proposer.record_last_hidden_states(torch.zeros(2, 3), [0, 1])
    assert proposer.propose([[5], [6]], np.array([12, 12]), token_ids) == [[], []]
    assert proposer.failures.counts == {"exception": 1}


def test_dresd_search_over_budget_costs_the_draft(clustered_store, monkeypatch):
    path, states = clustered_store
    proposer = dresd_proposer(path, draft_budget_ms=10.0)
    search = proposer.method.index.search

    def slow_search(queries, top_n):
        time.sleep(0.05)
        return search(queries, top_n)

    monkeypatch.setattr(proposer.method.index, "search", slow_search)
    proposer.record_last_hidden_states(torch.from_numpy(states[:2]), [0, 1])
    token_ids = np.asarray(proposer.method.index.tokens[:16].reshape(1, 16).repeat(2, 0))
    assert proposer.propose([[1], [1]], np.array([16, 16]), token_ids) == [[], []]
    assert proposer.stats()["failed_over_budget"] == 2


def hybrid_config(path, **options):
    # Two-token minimums: these tests weigh a context match against the dense neighbours, and
    # one-token matches in the tiny stores would vote too.
    return parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 3,
                                     "datastore": str(path), "min_prefix_prob": 0.0,
                                     "prior_weight": 0.0, "context_min_match_len": 2,
                                     "min_match_len": 2, **options}, VLLM_CPU_DEFAULTS)


@pytest.fixture
def small_dense_store(tmp_path):
    """Keys at positions 0 (doc 1), 5 (doc 2) and 10 (doc 3) all predicted token 2; the search
    is replaced so that each test chooses the neighbours."""
    path = make_store(tmp_path, [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7]])
    index_store(path, np.eye(12, HIDDEN, dtype=np.float32), np.arange(12), dims=4)
    index = DenseIndex.from_path(path)
    index.calls = 0

    def search(queries, top_n):
        index.calls += 1
        return np.array([[10, 0, -1]]), np.array([[0.9, 0.6, 0.0]], dtype=np.float32)

    index.search = search
    return path, index


def test_hybrid_weighs_dense_neighbours_against_the_context(small_dense_store):
    from vllm_retrieval_spec.datastore.suffix_array import SuffixArrayDatastore

    path, index = small_dense_store
    store = SuffixArrayDatastore.from_path(path)
    query = np.zeros(4, dtype=np.float32)
    # "9 2" occurred once before, followed by "8 8": a 2-token context match, weight 2 x 1.0.
    # No suffix of the context is in the datastore. The dense neighbours that predicted 2
    # vote 6 (similarity 0.9) and 3 (0.6), times dense_weight / top_n = dense_weight / 3.
    context = np.array([9, 2, 8, 8, 9, 2], dtype=np.int32)
    config = hybrid_config(path, context_weight=1.0, dense_weight=6.0, top_n=3)
    assert hybrid_draft(store, context, 3, config, index, query).tolist() == [8, 8, 9]
    config = hybrid_config(path, context_weight=1.0, dense_weight=7.0, top_n=3)
    assert hybrid_draft(store, context, 3, config, index, query).tolist() == [6, 7]
    # Without a query (nothing sampled) or with dense_weight 0 the context alone drafts.
    assert hybrid_draft(store, context, 3, config, index, None).tolist() == [8, 8, 9]
    config = hybrid_config(path, context_weight=1.0, dense_weight=0.0, top_n=3)
    assert hybrid_draft(store, context, 3, config, index, query).tolist() == [8, 8, 9]
    # The filter: neighbours that predicted 2 say nothing after a context ending in 3.
    context = np.array([9, 3], dtype=np.int32)
    config = hybrid_config(path, dense_weight=7.0, top_n=3)
    assert hybrid_draft(store, context, 3, config, index, query).size == 0


def test_hybrid_skips_the_dense_search_after_a_long_context_match(small_dense_store):
    from vllm_retrieval_spec.datastore.suffix_array import SuffixArrayDatastore

    path, index = small_dense_store
    store = SuffixArrayDatastore.from_path(path)
    query = np.zeros(4, dtype=np.float32)
    context = np.array([8, 9, 2, 5, 8, 9, 2], dtype=np.int32)  # "8 9 2": a 3-token match
    config = hybrid_config(path, dense_weight=1000.0, top_n=3, skip_datastore_match_len=3)
    assert hybrid_draft(store, context, 3, config, index, query).tolist() == [5, 8, 9]
    assert index.calls == 0
    config = hybrid_config(path, dense_weight=1000.0, top_n=3, skip_datastore_match_len=4)
    assert hybrid_draft(store, context, 3, config, index, query).tolist() == [6, 7]
    assert index.calls == 1
    # A query given as a function is computed only for a search.
    asked = []

    def lazy_query():
        asked.append(True)
        return query

    config = hybrid_config(path, dense_weight=1000.0, top_n=3, skip_datastore_match_len=3)
    assert hybrid_draft(store, context, 3, config, index, lazy_query).tolist() == [5, 8, 9]
    assert asked == []
    config = hybrid_config(path, dense_weight=1000.0, top_n=3, skip_datastore_match_len=4)
    assert hybrid_draft(store, context, 3, config, index, lazy_query).tolist() == [6, 7]
    assert asked == [True]


def test_hybrid_dense_modes(tmp_path):
    from vllm_retrieval_spec.datastore.dense import dense_index_in_use

    plain = make_store(tmp_path, [[1, 2, 3]], name="plain")
    dense = make_store(tmp_path, [[1, 2, 3]], name="dense")
    index_store(dense, np.eye(3, HIDDEN, dtype=np.float32), np.arange(3), dims=2)
    assert dense_index_in_use(dense, "auto") and dense_index_in_use(dense, "on")
    assert not dense_index_in_use(dense, "off") and not dense_index_in_use(plain, "auto")
    with pytest.raises(DatastoreError, match=r"\['dense'\]='on' but .*plain has no dense index"):
        dense_index_in_use(plain, "on")
    with pytest.raises(ConfigError, match=r"'dense'\]='yes' is not one of \['auto', 'on', 'off'\]"):
        hybrid_config(plain, dense="yes")


def test_hybrid_proposer_queries_each_row_with_its_own_state(clustered_store, monkeypatch):
    from vllm_retrieval_spec.datastore.suffix_array import SuffixArrayDatastore
    from vllm_retrieval_spec.proposers import hybrid

    projected = []

    def counting_projection(projection, states, rows):
        projected.append(rows)
        return project_last_states(projection, states, rows)

    project_last_states = hybrid.project_last_states
    monkeypatch.setattr(hybrid, "project_last_states", counting_projection)

    path, states = clustered_store
    # Only the dense source votes: the contexts are the store's own text, so its suffix array
    # (and the context) would draft the same continuations whatever the state.
    # No time budget: a slow first projection on a busy machine must not drop the drafts.
    proposer = make_proposer(hybrid_config(
        path, num_speculative_tokens=4, context_weight=0.0, min_match_len=16,
        draft_budget_ms=0))
    projected.clear()  # the proposer's warm-up
    index, store = proposer.method.dense, SuffixArrayDatastore.from_path(path)
    tokens = index.tokens
    contexts = [tokens[90:102], tokens[:5], tokens[3990:4002]]
    token_ids = np.zeros((3, 16), dtype=np.int32)
    for i, c in enumerate(contexts):
        token_ids[i, :len(c)] = c
    proposer.record_last_hidden_states(
        torch.from_numpy(np.stack([states[4000], states[100], states[0]])), [1, -1, 0])
    drafts = proposer.propose([[5], [], [6]], np.array([12, 5, 12]), token_ids)
    for row in (0, 2):
        # The key at the state's own position is its nearest neighbour: the corpus continues.
        start = 102 if row == 0 else 4002
        assert drafts[row] == tokens[start:start + 4].tolist()
        # The other row's state would have drafted something else.
        other = index.projection(torch.from_numpy(states[4100 - row * 2000][None]))[0]
        assert hybrid_draft(store, contexts[row], 4, proposer.config, index,
                            other).tolist() != drafts[row]
    assert drafts[1] == []
    # Both rows searched; their states were projected together, once.
    assert projected == [[1, -1, 0]]
    # A step whose context match is long enough to skip the search projects nothing.
    repeat = np.array([[5, 6, 7, 8, 5, 6, 7]], dtype=np.int32)
    proposer.record_last_hidden_states(torch.from_numpy(states[:1]), [0])
    proposer.propose([[7]], np.array([7]), repeat)
    assert projected == [[1, -1, 0]]


def test_hybrid_proposer_survives_states_it_cannot_project(clustered_store):

    path, _ = clustered_store
    # No time budget: logging the first failure's traceback is slow.
    proposer = make_proposer(hybrid_config(path, num_speculative_tokens=4,
                                                           draft_budget_ms=0))
    tokens = proposer.method.dense.tokens
    token_ids = np.zeros((2, 16), dtype=np.int32)
    token_ids[0, :12] = tokens[90:102]
    token_ids[1, :12] = tokens[3990:4002]
    # States of the wrong width: the projection raises; the suffix array still drafts.
    proposer.record_last_hidden_states(torch.zeros(2, 3), [0, 1])
    drafts = proposer.propose([[5], [6]], np.array([12, 12]), token_ids)
    assert drafts[0] == tokens[102:106].tolist() and drafts[1] == tokens[4002:4006].tolist()
    # One failure for the step, not one per row.
    assert proposer.failures.counts == {"exception": 1}
