"""Bad input to LLM(...) fails at start-up, before any engine process, with a clear message."""

from __future__ import annotations

import shutil

import pytest

from test_datastore import make_tokenizer
from vllm_retrieval_spec.config import ConfigError
from vllm_retrieval_spec.datastore import DatastoreError, build_datastore

pytestmark = pytest.mark.e2e


def start(model_dir, **spec):
    from vllm import LLM

    return LLM(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=2048,
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
        LLM(model=model_dir, enforce_eager=True, max_model_len=2048, enable_prefix_caching=True,
            speculative_config={"method": "pld_plus", "num_speculative_tokens": 8})


def test_pld_plus_layer_beyond_the_model(model_dir):
    from vllm import LLM

    with pytest.raises(ConfigError, match=r"'layer'\]=31 is out of range for this model: it "
                                          r"has 30 layers"):
        LLM(model=model_dir, enforce_eager=True, max_model_len=2048,
            speculative_config={"method": "pld_plus", "num_speculative_tokens": 8, "layer": 31})
