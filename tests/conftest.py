"""Shared fixtures (helper functions are in helpers.py). End-to-end tests share one engine per
configuration for the whole session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import (CODE_STOP, CROWDED_MAX_TOKENS, E2E_PROMPTS, K, MAX_MODEL_LEN, generate_ids,
                     greedy, greedy_json, make_llm, shutdown, vllm_patches_undone)

# The CPU worker refuses to start without a KV-cache size; 1 GiB holds our short requests.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Lets tests read worker-side state with LLM.collective_rpc(callable); tests only.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


@pytest.fixture(scope="session")
def model_dir() -> str:
    from vllm_retrieval_spec.assets import model_path

    return str(model_path())


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def code_datastore(model_dir, tokenizer, tmp_path_factory) -> str:
    """A small REST datastore: a few standard-library packages (about a million tokens)."""
    import sysconfig
    from pathlib import Path

    from vllm_retrieval_spec.datastore.build import build_datastore

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [str(stdlib / name) for name in ("json", "email", "unittest", "logging",
                                               "argparse.py", "collections", "functools.py")]
    output = tmp_path_factory.mktemp("datastores") / "stdlib-small"
    build_datastore(sources, output, tokenizer, tokenizer_name="SmolLM2-135M-Instruct",
                    progress=False)
    return str(output)


@pytest.fixture(scope="session")
def dense_datastore(model_dir, tokenizer, code_prompts, plain_outputs, tmp_path_factory) -> str:
    """DReSD's datastore, built as a user would (`vllm-rsd build-datastore ... --dense`): the
    model's own answers to the first half of the test prompts (in-distribution, DReSD's best
    case) and the json package (text the model has not produced), about 12 k tokens."""
    import json
    import sysconfig

    from vllm_retrieval_spec.cli import main

    directory = tmp_path_factory.mktemp("dense")
    corpus = directory / "answers.jsonl"
    half = len(code_prompts) // 2
    corpus.write_text("".join(
        json.dumps({"text": tokenizer.decode(prompt + output)}) + "\n"
        for prompt, output in zip(code_prompts[:half], plain_outputs[:half])))
    output = directory / "answers-and-json"
    main(["build-datastore", str(corpus), str(Path(sysconfig.get_paths()["stdlib"]) / "json"),
          "-o", str(output), "--model", model_dir, "--dense"])
    return str(output)


@pytest.fixture(scope="session")
def code_prompts(tokenizer) -> list[list[int]]:
    from vllm_retrieval_spec.bench.tasks import task_prompts

    return task_prompts("code-gen", tokenizer, E2E_PROMPTS)


@pytest.fixture(scope="session")
def eos_prompts(tokenizer) -> list[list[int]]:
    """Questions whose greedy answers end at the EOS within ``E2E_MAX_TOKENS`` (8-23 tokens)."""
    from vllm_retrieval_spec.bench.tasks import render

    return [render([{"role": "user", "content": question}], tokenizer) for question in (
        "What is the capital of France? Answer in one word.", "Name a color.", "What is 2 + 2?")]


@pytest.fixture(scope="session")
def json_prompts(tokenizer) -> list[list[int]]:
    """Requests for records that ``helpers.PEOPLE_SCHEMA`` describes."""
    from vllm_retrieval_spec.bench.tasks import render

    return [render([{"role": "user", "content": question}], tokenizer) for question in (
        "List five people with their name, age and city as JSON.",
        "Give me a JSON object describing three people (name, age, city).")]


@pytest.fixture(scope="session")
def crowded_prompts(tokenizer) -> list[list[int]]:
    """16 code-edit prompts (97-248 tokens; about 4,200 tokens with their answers at
    ``CROWDED_MAX_TOKENS``): more than a KV cache of ``MAX_MODEL_LEN`` tokens holds at once."""
    from vllm_retrieval_spec.bench.tasks import task_prompts

    return task_prompts("code-edit", tokenizer, 16)


@pytest.fixture(scope="session")
def near_limit_prompts(code_prompts) -> list[list[int]]:
    """A prompt K - 2 tokens short of max_model_len (code prompts end to end) and a code prompt:
    while the first runs, vLLM would call no drafter for the batch."""
    tokens = [t for prompt in code_prompts for t in prompt]
    long = (tokens * (MAX_MODEL_LEN // len(tokens) + 1))[:MAX_MODEL_LEN - K + 2]
    return [long, code_prompts[1]]


@pytest.fixture(scope="session")
def plain_runs(model_dir, code_prompts, near_limit_prompts, crowded_prompts, eos_prompts,
               json_prompts) -> dict[str, list[list[int]]]:
    """Plain greedy decoding of the code prompts one request at a time ("code"; "stop": to
    ``CODE_STOP``), of ``near_limit_prompts`` and of ``crowded_prompts`` together, and one at a
    time of ``eos_prompts`` and (held to a JSON schema) ``json_prompts``; the engine is gone
    before others start."""
    llm = make_llm(model_dir, None)
    try:
        return {"code": [generate_ids(llm, [p], greedy())[0] for p in code_prompts],
                "stop": [generate_ids(llm, [p], greedy(stop=[CODE_STOP]))[0]
                         for p in code_prompts],
                "near_limit": generate_ids(llm, near_limit_prompts, greedy()),
                "crowded": generate_ids(llm, crowded_prompts, greedy(CROWDED_MAX_TOKENS)),
                "eos": [generate_ids(llm, [p], greedy())[0] for p in eos_prompts],
                "json": [generate_ids(llm, [p], greedy_json())[0] for p in json_prompts]}
    finally:
        shutdown(llm)


@pytest.fixture(scope="session")
def plain_outputs(plain_runs) -> list[list[int]]:
    return plain_runs["code"]


@pytest.fixture
def undo_register():
    """For a test that calls ``plugin.register()`` on the real vLLM: whatever it patched is put
    back after the test (``helpers.vllm_patches_undone``), so later tests run as they would
    have without it."""
    with vllm_patches_undone():
        yield
