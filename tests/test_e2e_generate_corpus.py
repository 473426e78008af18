"""The in-distribution corpus: the model's own greedy answers become a loadable datastore."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.e2e


def test_generated_answers_become_a_datastore(model_dir, tokenizer, tmp_path, plain_outputs):
    from vllm_retrieval_spec.benchmarks.tasks import task_conversations
    from vllm_retrieval_spec.datastore import build_datastore, load_datastore
    from vllm_retrieval_spec.datastore.generate import generate_corpus

    # plain_outputs is requested so that the shared plain engine is already gone.
    conversations = task_conversations("code-gen", 2, offset=100)
    corpus = tmp_path / "own.jsonl"
    assert generate_corpus(model_dir, conversations, corpus, max_tokens=16,
                           engine_kwargs={"dtype": "float32", "max_model_len": 2048}) == 2
    records = [json.loads(line) for line in corpus.read_text().splitlines()]
    assert [r["messages"][:-1] for r in records] == conversations
    answers = [r["messages"][-1] for r in records]
    assert all(a["role"] == "assistant" and a["content"].strip() for a in answers)
    assert not list(tmp_path.glob("*.tmp-*"))

    build_datastore([str(corpus)], tmp_path / "ds", tokenizer,
                    tokenizer_name="SmolLM2-135M-Instruct", progress=False)
    tokens = np.asarray(load_datastore(tmp_path / "ds").tokens)
    answer = tokenizer(answers[0]["content"], add_special_tokens=False)["input_ids"][:4]
    windows = np.lib.stride_tricks.sliding_window_view(tokens, len(answer))
    assert (windows == answer).all(axis=1).any(), "the answer's tokens are in the datastore"
