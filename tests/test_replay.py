"""The offline replay that tunes drafting rules: its accounting must match the engine's."""

from __future__ import annotations

import numpy as np

from vllm_retrieval_spec.benchmarks.replay import expand_grid, replay


def test_replay_counts_forwards_as_the_engine_would():
    output = list(range(100, 120))  # 20 tokens
    record = {"prompt": [1, 2, 3], "output": output}
    sequence = record["prompt"] + output

    def oracle(context, n):  # always right: k + 1 tokens per forward after the prefill
        return np.asarray(sequence[len(context):len(context) + n], dtype=np.int32)

    result = replay([record], lambda r: oracle, k=3, draft_token_cost=0.0)
    # Prefill -> output[0]; then 19 tokens in steps of 4: 5 forwards (4+4+4+4+3).
    assert result["tokens_per_forward"] == round(20 / 6, 3)

    def half_right(context, n):  # the first drafted token is right, the second wrong
        truth = sequence[len(context):len(context) + n]
        return np.asarray(truth[:1] + [0] * (len(truth) - 1), dtype=np.int32)

    result = replay([record], lambda r: half_right, k=2, draft_token_cost=0.1)
    # Each step accepts 1 and adds a bonus token: 19 tokens in 10 steps (2 x 9 + 1).
    assert result["tokens_per_forward"] == round(20 / 11, 3)
    assert result["modeled_speedup"] == round((20 / 11) / (1 + 0.1 * result["mean_draft_len"]), 3)
    never = replay([record], lambda r: lambda c, n: np.empty(0, np.int32), k=4)
    assert never["tokens_per_forward"] == 1.0 and never["mean_draft_len"] == 0


def test_expand_grid():
    configs = expand_grid({"method": "hybrid", "x": 0}, {"x": [1, 2], "y": ["a", "b"]})
    assert configs == [{"method": "hybrid", "x": 1, "y": "a"}, {"method": "hybrid", "x": 1, "y": "b"},
                       {"method": "hybrid", "x": 2, "y": "a"}, {"method": "hybrid", "x": 2, "y": "b"}]
    assert expand_grid({"method": "pld"}, {}) == [{"method": "pld"}]
