"""The in-distribution corpus, as a user makes it with the CLI: the model's own greedy answers
(`vllm-rsd generate-corpus`) become a loadable datastore (`build-datastore`, `inspect`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_retrieval_spec.cli import main

pytestmark = pytest.mark.e2e


def test_generated_answers_become_a_datastore(model_dir, tokenizer, tmp_path, plain_outputs,
                                              capsys):
    from vllm_retrieval_spec.bench.tasks import task_conversations
    from vllm_retrieval_spec.datastore import load_datastore

    # plain_outputs is requested so that the shared plain engine is already gone.
    corpus = tmp_path / "own.jsonl"
    main(["generate-corpus", "--model", model_dir, "--task", "code-gen", "--prompts", "2",
          "--prompt-offset", "100", "--max-tokens", "16", "-o", str(corpus)])
    records = [json.loads(line) for line in corpus.read_text().splitlines()]
    assert [r["messages"][:-1] for r in records] == task_conversations("code-gen", 2, 100)
    answers = [r["messages"][-1] for r in records]
    assert all(a["role"] == "assistant" and a["content"].strip() for a in answers)
    assert not list(tmp_path.glob("*.tmp-*"))

    main(["build-datastore", str(corpus), "-o", str(tmp_path / "ds"), "--model", model_dir])
    tokens = np.asarray(load_datastore(tmp_path / "ds").tokens)
    answer = tokenizer(answers[0]["content"], add_special_tokens=False)["input_ids"][:4]
    windows = np.lib.stride_tricks.sliding_window_view(tokens, len(answer))
    assert (windows == answer).all(axis=1).any(), "the answer's tokens are in the datastore"

    capsys.readouterr()
    main(["inspect", str(tmp_path / "ds"), "--verify"])
    out = capsys.readouterr().out
    manifest = json.loads(out[:out.index("\n}\n") + 2])
    assert manifest["num_documents"] == 2 and manifest["num_tokens"] == len(tokens)
    sizes = sum((tmp_path / "ds" / name).stat().st_size for name in manifest["files"])
    assert out.rstrip().endswith(f"{sizes / 2**20:10.1f} MiB  (checksums verified)")
