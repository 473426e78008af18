"""Shared fixtures. End-to-end tests share one engine per configuration for the whole session."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_retrieval_spec.bench.tasks import MAX_MODEL_LEN

# The CPU worker refuses to start without a KV-cache size; 1 GiB holds our short requests.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Lets tests read worker-side state with LLM.collective_rpc(callable); tests only.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

E2E_PROMPTS = 8
E2E_MAX_TOKENS = 32
K = 8


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


def run_interpreted(script: str, directory: Path) -> dict:
    """What ``script`` saves (``python script PATH``) when run in a fresh process with
    ``TRITON_INTERPRET=1``: Triton reads that variable when it is first imported, and this
    process's Triton must stay compiled for every other test (see test_kernels.py). The saved
    dict's ``interpreted`` lists, per kernel, whether the interpreter ran it."""
    import importlib.util

    import torch

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    path = directory / "outputs.pt"
    run = subprocess.run([sys.executable, script, str(path)], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    if run.returncode != 0:
        pytest.fail(f"interpreted kernel run failed:\n{run.stderr[-6000:]}")
    results = torch.load(path)
    assert all(results["interpreted"]), "a kernel was not run by the interpreter"
    return results


def make_llm(model_dir: str, speculative_config: dict | None):
    from vllm import LLM

    # float32: bfloat16 breaks exact greedy equality even for vLLM's own ngram (see README).
    return LLM(model=model_dir, speculative_config=speculative_config, enforce_eager=True,
               dtype="float32", max_model_len=MAX_MODEL_LEN, disable_log_stats=False, seed=0,
               max_num_seqs=8)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def greedy(max_tokens: int = E2E_MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def generate_ids(llm, prompts: list[list[int]], params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="session")
def plain_outputs(model_dir, code_prompts) -> list[list[int]]:
    """Plain greedy decoding, one request at a time; the engine is gone before others start."""
    llm = make_llm(model_dir, None)
    try:
        return [generate_ids(llm, [p], greedy())[0] for p in code_prompts]
    finally:
        shutdown(llm)


@contextlib.contextmanager
def openai_server(model_dir: str, args: list[str], log_path: Path):
    """`vllm-rsd serve` (the console script a user runs) on 127.0.0.1; yields its base URL once
    /health answers. Its output goes to ``log_path`` (a pipe nobody reads would fill up)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "vllm-rsd"), "serve", model_dir,
             "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "float32",
             "--max-model-len", str(MAX_MODEL_LEN), *args],
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, stdout=log,
            stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not server_healthy(base):
                assert server.poll() is None, log_path.read_text()[-4000:]
                assert time.monotonic() < deadline, "server did not become healthy in 300 s"
                time.sleep(2)
            yield base
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()


def server_healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def prometheus_samples(text: str) -> dict[str, float]:
    """The samples of a Prometheus text exposition, keyed by name with the labels in
    alphabetical order (multiprocess collection does not keep declaration order)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                       + "}" if sample.labels else ""): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }
