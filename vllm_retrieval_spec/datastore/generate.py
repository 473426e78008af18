"""In-distribution corpora: the target model's own answers to task-like prompts.

DReSD (arXiv 2502.15572) found a datastore of the target model's own responses the strongest
lever for retrieval drafting: the drafts then continue the way this model writes. The corpus is a
jsonl of chat conversations (``{"messages": [user, assistant]}``) that ``build-datastore`` renders
with the model's chat template, so stored tokens match what the model sees at serving time.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from vllm_retrieval_spec.atomic import atomic_path
from vllm_retrieval_spec.datastore.format import DatastoreError, make_output_dir


def answer_conversations(model: str, conversations: list[list[dict[str, str]]], *,
                         max_tokens: int, temperature: float = 0.0, seed: int = 0,
                         dtype: str = "float32") -> list[str]:
    """``model``'s answer to every conversation (batched by vLLM, with a progress bar).

    float32 by default: our benchmarks serve in float32 (see README), and answers generated in
    another dtype would continue differently from what is served.
    """
    from vllm import LLM, SamplingParams

    from vllm_retrieval_spec.bench.tasks import MAX_MODEL_LEN

    if not conversations:
        raise ValueError("no prompts to answer")
    llm = LLM(model=model, enforce_eager=True, seed=seed, dtype=dtype,
              max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    try:
        results = llm.chat(conversations, params, use_tqdm=True)
    finally:
        # Left to interpreter exit, the engine process can keep the CLI waiting forever.
        llm.llm_engine.engine_core.shutdown()
    return [result.outputs[0].text for result in results]


def generate_corpus(model: str, conversations: list[list[dict[str, str]]], output: str | Path, *,
                    max_tokens: int, temperature: float = 0.0, seed: int = 0,
                    dtype: str = "float32", overwrite: bool = False) -> int:
    """Answer every conversation with ``model``; write them to ``output`` as a chat jsonl
    (an existing file only with ``overwrite``: it may hold hours of answers).

    The file appears only when complete. Returns the number of conversations written.
    """
    output = Path(output)
    check_corpus_output(output, overwrite)
    answers = answer_conversations(model, conversations, max_tokens=max_tokens,
                                   temperature=temperature, seed=seed, dtype=dtype)
    with atomic_path(output) as temporary, open(temporary, "w") as f:
        for messages, answer in zip(conversations, answers):
            f.write(json.dumps({"messages": [*messages,
                                             {"role": "assistant", "content": answer}]}) + "\n")
    print(f"wrote {len(answers)} conversations to {output}", file=sys.stderr)
    return len(answers)


def check_corpus_output(output: Path, overwrite: bool) -> None:
    """Before any answer is generated: a bad path found afterwards costs them all, and
    atomic_path would replace a directory (and everything in it) with the corpus file."""
    if output.is_dir():
        raise DatastoreError(f"{output} is a directory; give the path of the .jsonl file to write")
    if output.exists() and not overwrite:
        raise DatastoreError(f"{output} exists; pass --overwrite to replace it")
    make_output_dir(output.parent, output)
    if not os.access(output.parent, os.W_OK):
        raise DatastoreError(f"cannot write into {output.parent}; choose another output")
