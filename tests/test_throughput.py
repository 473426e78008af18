"""The throughput benchmark's bookkeeping: who runs when, and what each row is compared with."""

from __future__ import annotations

from collections import Counter

from vllm_retrieval_spec.benchmarks.throughput import compared_with_plain, turns


def test_interleaved_turns_give_every_engine_every_batch_once_in_rotating_order():
    schedule = turns(num_prompts=5, batch_size=2, num_engines=3)
    assert Counter(schedule) == Counter((start, e) for start in (0, 2, 4) for e in range(3))
    # Batches in prompt order, each finished by all engines before the next starts.
    assert [start for start, _ in schedule] == [0, 0, 0, 2, 2, 2, 4, 4, 4]
    assert [e for _, e in schedule] == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert turns(0, 1, 3) == []


def test_rows_are_compared_with_plain_of_the_same_task_even_when_a_method_repeats():
    def row(method, tokens_per_s):
        return {"method": method, "tokens_per_s": tokens_per_s}

    plain = {"chat": (row("plain", 10.0), [[1, 2]]), "code-gen": (row("plain", 20.0), [[3]])}
    rest_a = {"chat": (row("rest", 25.0), [[1, 2]]), "code-gen": (row("rest", 30.0), [[4]])}
    rest_b = {"chat": (row("rest", 5.0), [[1, 2]])}
    rows = compared_with_plain([plain, rest_a, rest_b])
    assert [(r["method"], r["speedup"], r["outputs_equal_plain"]) for r in rows] == [
        ("plain", 1.0, True), ("plain", 1.0, True),
        ("rest", 2.5, True), ("rest", 1.5, False), ("rest", 0.5, True)]
