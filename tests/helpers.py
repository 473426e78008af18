"""Helpers the test modules share: plain functions and constants (fixtures are in conftest.py).

Test modules import them as ``from helpers import ...`` (pytest puts tests/ on the path, as for
tree_oracle_proposer); no test module imports another test module, or conftest.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from vllm_retrieval_spec.bench.tasks import MAX_MODEL_LEN

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# --- Proposers without vLLM ----------------------------------------------------------------------

VOCAB = 100


def vllm_config(options: dict, max_model_len: int = 64, hidden_size: int = 16):
    """What a proposer reads of vLLM's config, for the method ``options`` describe."""
    from vllm_retrieval_spec.config import PLUGIN_KEY, VLLM_CPU_DEFAULTS, parse_speculative_config

    # No padding and no time budget unless a test asks for them: both follow this machine's
    # timings (tests/test_step_cost.py drives padding with a clock of its own), and a busy
    # machine must not change what a test drafts.
    config = parse_speculative_config({"pad_drafts": False, "draft_budget_ms": 0, **options},
                                      VLLM_CPU_DEFAULTS)
    return SimpleNamespace(
        additional_config={PLUGIN_KEY: config.to_dict()},
        speculative_config=SimpleNamespace(
            num_speculative_tokens=config.drafting.num_speculative_tokens),
        model_config=SimpleNamespace(max_model_len=max_model_len,
                                     get_vocab_size=lambda: VOCAB,
                                     get_hidden_size=lambda: hidden_size),
    )


def proposer(options: dict, max_model_len: int = 64, method: Any = None,
             hidden_size: int = 16) -> Any:
    """vLLM's proposer for the method ``options`` describe (``method``: a drafter of the
    test's own instead of the method's)."""
    from vllm_retrieval_spec.proposers.base import RetrievalProposer

    return RetrievalProposer(vllm_config(options, max_model_len, hidden_size), method)


def batch(*contexts, width=64):
    """vLLM's token ids (one row per context, zero-padded to ``width``) and the rows' lengths."""
    tokens = np.zeros((len(contexts), width), dtype=np.int32)
    for i, c in enumerate(contexts):
        tokens[i, : len(c)] = c
    return tokens, np.array([len(c) for c in contexts], dtype=np.int32)


# --- Datastores ----------------------------------------------------------------------------------

WORDS = "def return import class self if else for in x y print hello world user assistant the a"
# Filler entries push the real words above 65,535, where a uint16 stream would wrap.
NUM_FILLER = 70_000
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"


def make_tokenizer(words: str = WORDS) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of ``words`` whose ids lie above 65,535, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<filler{i}>": 3 + i for i in range(NUM_FILLER)})
    vocab.update({w: len(vocab) + i for i, w in enumerate(words.split())})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def brute_force_match(
    tokens: np.ndarray, context: np.ndarray, min_len: int, max_len: int
) -> tuple[int, set[int]]:
    """REST's Algorithm 1 by scanning every position: (n, start positions) or (0, set())."""
    for n in range(min(max_len, len(context)), min_len - 1, -1):
        pattern = context[len(context) - n :].tolist()
        found = {i for i in range(len(tokens) - n + 1) if tokens[i : i + n].tolist() == pattern}
        if found:
            return n, found
    return 0, set()


# --- Kernels under Triton's interpreter ----------------------------------------------------------

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
    # A script's path starts at tests/: without the checkout's root first, the script would
    # import the installed package (another checkout's, for an editable install elsewhere).
    root = str(Path(__file__).resolve().parent.parent)
    python_path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, script, str(path)], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": python_path},
                         timeout=600)
    if run.returncode != 0:
        pytest.fail(f"interpreted kernel run failed:\n{run.stderr[-6000:]}")
    results = torch.load(path)
    assert all(results["interpreted"]), "a kernel was not run by the interpreter"
    return results


# --- End-to-end: engines and servers -------------------------------------------------------------

E2E_PROMPTS = 8
E2E_MAX_TOKENS = 32
#: Long enough answers that ``crowded_prompts`` outgrow a small KV cache.
CROWDED_MAX_TOKENS = 200
K = 8


def make_llm(model_dir: str, speculative_config: dict | None, **engine_args: Any):
    from vllm import LLM

    # float32: bfloat16 breaks exact greedy equality even for vLLM's own ngram (see README).
    return LLM(model=model_dir, speculative_config=speculative_config, enforce_eager=True,
               dtype="float32", max_model_len=MAX_MODEL_LEN, disable_log_stats=False, seed=0,
               max_num_seqs=8, **engine_args)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def greedy(max_tokens: int = E2E_MAX_TOKENS, **params: Any):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)


#: A stop string every code prompt's greedy answer reaches within ``E2E_MAX_TOKENS`` tokens (its
#: function's return annotation).
CODE_STOP = "->"


#: A JSON schema for guided decoding: lists of records repeat their keys, which drafts find.
PEOPLE_SCHEMA = {"type": "object", "required": ["people"], "properties": {"people": {
    "type": "array", "items": {"type": "object", "required": ["name", "age", "city"],
                               "properties": {"name": {"type": "string"},
                                              "age": {"type": "integer"},
                                              "city": {"type": "string"}}}}}}


def greedy_json(max_tokens: int = 64):
    """Greedy decoding held to ``PEOPLE_SCHEMA`` by vLLM's structured outputs."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=PEOPLE_SCHEMA))


def generate_ids(llm, prompts: list[list[int]], params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def spec_counters(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters so far: drafts, their tokens, and accepted draft
    tokens."""
    names = {"vllm:spec_decode_num_drafts": "drafts",
             "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    values = dict.fromkeys(names.values(), 0.0)
    for metric in llm.get_metrics():
        if metric.name in names:
            values[names[metric.name]] += metric.value
    return values


def wait_for(condition, what: str, timeout_s: float = 120.0):
    """``condition()``'s first truthy value, asked every half second: work an engine does in
    the background (a snapshot, a journal read) takes longer on a loaded machine than any fixed
    sleep allows for."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.5)
    return value


def served_tokens(prompts: list[list[int]], outputs: list[list[int]]) -> int:
    """What the served store holds once each request is stored: its prompt and its output."""
    return sum(len(prompt) + len(output) for prompt, output in zip(prompts, outputs))


def stats_once_stored(llm, requests: int) -> dict[str, float]:
    """The drafter's stats once its served store holds ``requests`` requests: the last one is
    stored when vLLM's next step (an empty one, after the generate call returned) says it
    finished."""
    return wait_for(lambda: (s := llm.collective_rpc("rsd_drafting_stats")[0])[
        "served_store_requests"] == requests and s, f"{requests} requests stored")


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


def assert_drafting_series(metrics: dict[str, float], method: str) -> None:
    """Our series, made in the worker process, reached the server's ``/metrics`` beside vLLM's
    own, and say drafts were accepted (more output tokens than target forwards)."""
    label = f'{{method="{method}"}}'
    assert metrics[f"vllm_rsd:lookups_total{label}"] > 0
    assert metrics[f"vllm_rsd:target_forwards_total{label}"] > 0
    assert (metrics[f"vllm_rsd:output_tokens_total{label}"]
            > metrics[f"vllm_rsd:target_forwards_total{label}"])
    assert metrics[f"vllm_rsd:drafting_seconds_count{label}"] > 0
    assert any(name.startswith("vllm:spec_decode_num_drafts_total") for name in metrics)


# --- The plugin's patches of vLLM ----------------------------------------------------------------

_ABSENT = object()


def patched_by_register() -> list[tuple[Any, str]]:
    """(class or module, attribute name) of everything ``plugin.register()`` may replace or add
    on vLLM: its inventory (``plugin.PATCHES``, ``plugin.ADDED``)."""
    import importlib

    from vllm_retrieval_spec import plugin

    owners = []
    for path in dict.fromkeys([*(patch.target for patch in plugin.PATCHES), *plugin.ADDED]):
        module_name, owner_name, name = path.rsplit(".", 2)
        try:  # a function of a module
            owner = importlib.import_module(f"{module_name}.{owner_name}")
        except ImportError:  # a method of a class
            owner = getattr(importlib.import_module(module_name), owner_name)
        owners.append((owner, name))
    return owners


@contextlib.contextmanager
def vllm_patches_undone() -> Iterator[None]:
    """On leaving the block, everything ``plugin.register()`` may have patched on vLLM is as it
    was on entering it, and so are the plugin's ``_registered`` flag and its warned-once
    environment variable. Attributes are read from the class's or module's ``__dict__``, so a
    classmethod goes back as the descriptor it was, and one that was absent is deleted."""
    from vllm_retrieval_spec import plugin

    saved = [(owner, name, vars(owner).get(name, _ABSENT))
             for owner, name in patched_by_register()]
    registered = plugin._registered
    warned = os.environ.get(plugin._WARNED_ENV)
    try:
        yield
    finally:
        for owner, name, value in saved:
            if value is not _ABSENT:
                setattr(owner, name, value)
            elif name in vars(owner):
                delattr(owner, name)
        plugin._registered = registered
        if warned is None:
            os.environ.pop(plugin._WARNED_ENV, None)
        else:
            os.environ[plugin._WARNED_ENV] = warned
