"""Benchmark tasks: prompts rendered with the model's chat template, as token ids.

Rendering once, outside vLLM, gives every method byte-identical inputs.
"""

from __future__ import annotations

from typing import Any

from vllm_retrieval_spec.assets import humaneval_prompts

TASKS = ("code-gen",)


def code_gen_messages(n: int | None, offset: int = 0) -> list[list[dict[str, str]]]:
    """HumanEval problems as chat requests to complete the function."""
    return [
        [{"role": "user", "content": "Complete the following Python function.\n\n"
                                     f"```python\n{problem['prompt']}```"}]
        for problem in humaneval_prompts(n, offset)
    ]


def task_conversations(task: str, n: int | None, offset: int = 0) -> list[list[dict[str, str]]]:
    """The chat requests of ``task`` (``n=None``: all from ``offset`` on)."""
    if task == "code-gen":
        return code_gen_messages(n, offset)
    raise ValueError(f"unknown task {task!r}; choose one of {list(TASKS)}")


def task_prompts(task: str, tokenizer: Any, n: int | None, offset: int = 0) -> list[list[int]]:
    """Prompt token ids for ``task``."""
    conversations = task_conversations(task, n, offset)
    return [
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        for messages in conversations
    ]
