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
from typing import Any


def generate_corpus(model: str, conversations: list[list[dict[str, str]]], output: str | Path, *,
                    max_tokens: int, temperature: float = 0.0, seed: int = 0,
                    engine_kwargs: dict[str, Any] | None = None) -> int:
    """Answer every conversation with ``model`` (batched by vLLM); write them to ``output``.

    The file appears only when complete. Returns the number of conversations written.
    """
    from vllm import LLM, SamplingParams

    output = Path(output)
    if not conversations:
        raise ValueError("no prompts to answer")
    llm = LLM(model=model, enforce_eager=True, seed=seed, **(engine_kwargs or {}))
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    try:
        results = llm.chat(conversations, params, use_tqdm=True)
    finally:
        # Left to interpreter exit, the engine process can keep the CLI waiting forever.
        llm.llm_engine.engine_core.shutdown()
    temporary = output.with_name(f"{output.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "w") as f:
            for messages, result in zip(conversations, results):
                answer = {"role": "assistant", "content": result.outputs[0].text}
                f.write(json.dumps({"messages": [*messages, answer]}) + "\n")
        temporary.replace(output)
    finally:
        temporary.unlink(missing_ok=True)
    print(f"wrote {len(results)} conversations to {output}", file=sys.stderr)
    return len(results)
