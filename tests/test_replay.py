"""The offline replay that tunes drafting rules: its accounting must match the engine's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.replay import (
    CHOICE_CEILINGS, OracleGap, ceiling_select, draft_factory, expand_grid, longest_accepted,
    main, oracle_factory, replay)
from vllm_retrieval_spec.config import VLLM_CPU_DEFAULTS, parse_speculative_config
from vllm_retrieval_spec.datastore import build_datastore_from_token_ids


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
    never = replay([record], lambda r: lambda c, n: np.empty(0, np.int32), k=4,
                   draft_token_cost=0.0)
    assert never["tokens_per_forward"] == 1.0 and never["mean_draft_len"] == 0


def test_a_tree_accepts_its_longest_root_path_along_the_output():
    from benchmarks.replay import accepted_length
    from vllm_retrieval_spec.drafting.tree import TreeDraft

    # root -> 5 -> 6 -> 7, and root -> 8 -> 9: the first branch is wrong after 5.
    tree = TreeDraft(np.array([5, 6, 7, 8, 9]), np.array([-1, 0, 1, -1, 3]), 3, 0.5)
    assert accepted_length(tree, [8, 9, 1, 1, 1]) == 2
    assert accepted_length(tree, [5, 6, 2, 1, 1]) == 2
    assert accepted_length(tree, [5, 6, 7, 1, 1]) == 3
    assert accepted_length(tree, [1, 1, 1, 1, 1]) == 0
    assert accepted_length(tree, [8]) == 1  # the output ends
    assert accepted_length(np.array([5, 6, 0]), [5, 6, 7]) == 2

    output = [8, 9, 30, 31, 32, 33]
    record = {"prompt": [1], "output": output}
    # A drafter always offering that tree after the prompt's first output token, a chain
    # of the truth's next 2 tokens otherwise.
    sequence = record["prompt"] + output

    def draft(context, n):
        if len(context) == 2:
            return TreeDraft(np.array([5, 6, 9, 7]), np.array([-1, 0, -1, 2]), 2, 0.5)
        return np.asarray(sequence[len(context):len(context) + 2], dtype=np.int32)

    # output[0] by the prefill; then the tree accepts 9 (node 2), its child 7 does not match
    # 30: bonus 30; then chains of 2 accept 31 32 + 33 (the bonus).
    result = replay([record], lambda r: draft, k=4, draft_token_cost=0.0)
    assert result["tokens_per_forward"] == round(6 / 3, 3)
    assert result["mean_draft_len"] == round((4 + 2) / 2, 2)


def test_expand_grid():
    configs = expand_grid({"method": "hybrid", "x": 0}, {"x": [1, 2], "y": ["a", "b"]})
    assert configs == [{"method": "hybrid", "x": 1, "y": "a"}, {"method": "hybrid", "x": 1, "y": "b"},
                       {"method": "hybrid", "x": 2, "y": "a"}, {"method": "hybrid", "x": 2, "y": "b"}]
    assert expand_grid({"method": "pld"}, {}) == [{"method": "pld"}]


def test_longest_accepted_is_the_longest_prefix_of_the_truth_any_candidate_starts_with():
    candidates = np.array([[1, 2, 9, -1], [1, 2, 3, 8], [4, 1, 2, 3]], dtype=np.int32)
    truth = np.array([1, 2, 3, 4], dtype=np.int32)
    np.testing.assert_array_equal(longest_accepted(candidates, np.array([3, 4, 4]), truth),
                                  [1, 2, 3])
    # A candidate counts only up to its length.
    np.testing.assert_array_equal(longest_accepted(candidates, np.array([3, 2, 4]), truth),
                                  [1, 2])
    assert len(longest_accepted(candidates[:0], np.zeros(0, np.int32), truth)) == 0


def test_oracle_is_a_ceiling_for_hybrid(tmp_path):
    # The corpus continues "5 6" with "7 8 9" once and "7 7 7" twice: hybrid votes for the
    # majority, the oracle takes whichever the truth starts with.
    documents = [[5, 6, 7, 8, 9], [5, 6, 7, 7, 7], [5, 6, 7, 7, 7]]
    build_datastore_from_token_ids(documents, tmp_path / "ds", tokenizer_name="t",
                                   tokenizer_fingerprint="0" * 64, vocab_size=100,
                                   progress=False)
    config = parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 3,
                                       "datastore": str(tmp_path / "ds"), "min_draft_len": 1,
                                       "context_min_match_len": 2, "min_match_len": 2},
                                           VLLM_CPU_DEFAULTS)
    record = {"prompt": [1, 5], "output": [6, 7, 8, 9, 2, 5, 6, 7, 8, 9]}
    oracle = replay([record], oracle_factory(config), k=3, draft_token_cost=0.0)
    hybrid = replay([record], draft_factory(config), k=3, draft_token_cost=0.0)
    # Prefill -> "6"; "7 8 9" from the datastore plus the bonus "2"; "5" and "6" with no
    # draft (no 2-token match); "7 8 9" from the context, where "5 6" occurred before:
    # 5 forwards for 10 tokens.
    assert oracle["tokens_per_forward"] == 2.0
    assert hybrid["tokens_per_forward"] < oracle["tokens_per_forward"]
    with pytest.raises(ValueError, match="hybrid"):
        oracle_factory(parse_speculative_config({"method": "pld", "num_speculative_tokens": 3},
                                                VLLM_CPU_DEFAULTS))


@pytest.mark.parametrize("documents, options, missed, missed_steps", [
    # "5 6" goes on "7 8 9" once and "7 7 7" twice: the majority is drafted and "7" accepted
    # where the oracle's "7 8 9" had 3 (then "9", none, none and "7 8 9" from the context).
    ([[5, 6, 7, 8, 9], [5, 6, 7, 7, 7], [5, 6, 7, 7, 7]], {"max_spec_factor": 0},
     {"wrong_choice": 2, "too_short": 0, "no_draft": 0}, {"wrong_choice": 1}),
    # One continuation, but a 2-token match allows one draft token: "7" twice, not "7 8 9".
    ([[5, 6, 7, 8, 9]], {"max_spec_factor": 0.5},
     {"wrong_choice": 0, "too_short": 4, "no_draft": 0}, {"too_short": 2}),
    # An even split under min_prefix_prob: nothing drafted where the oracle had "7 8 9".
    ([[5, 6, 7, 8, 9], [5, 6, 4, 4, 4]], {"max_spec_factor": 0, "min_prefix_prob": 0.9},
     {"wrong_choice": 0, "too_short": 0, "no_draft": 9}, {"no_draft": 4}),
])
def test_oracle_gap_puts_each_missed_token_down_to_its_cause(tmp_path, documents, options,
                                                             missed, missed_steps):
    build_datastore_from_token_ids(documents, tmp_path / "ds", tokenizer_name="t",
                                   tokenizer_fingerprint="0" * 64, vocab_size=100,
                                   progress=False)
    config = parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 3,
                                       "datastore": str(tmp_path / "ds"), "min_draft_len": 1,
                                       "context_min_match_len": 2, "min_match_len": 2,
                                       "served_store": "off", **options}, VLLM_CPU_DEFAULTS)
    record = {"prompt": [1, 5], "output": [6, 7, 8, 9, 2, 5, 6, 7, 8, 9]}
    oracle = replay([record], oracle_factory(config), k=3, draft_token_cost=0.0)
    gap = OracleGap()
    observed = replay([record], draft_factory(config, gap=gap), k=3, draft_token_cost=0.0)
    plain = replay([record], draft_factory(config), k=3, draft_token_cost=0.0)
    # Observing changes nothing: the walk is hybrid's own.
    for key in ("tokens_per_forward", "mean_draft_len"):
        assert observed[key] == plain[key]
    assert gap.missed == missed
    assert gap.missed_steps == {**dict.fromkeys(OracleGap.CAUSES, 0), **missed_steps}
    assert gap.oracle_accepted - gap.accepted == sum(missed.values())
    summary = gap.summary()
    assert summary["oracle_accepted_per_step"] == round(gap.oracle_accepted / gap.steps, 3)
    # The oracle's own walk is at least as good as hybrid's.
    assert oracle["tokens_per_forward"] >= plain["tokens_per_forward"]


def test_oracle_gap_takes_hybrid_configs_only():
    with pytest.raises(ValueError, match="oracle-gap takes hybrid"):
        draft_factory(parse_speculative_config({"method": "pld", "num_speculative_tokens": 3},
                                               VLLM_CPU_DEFAULTS), gap=OracleGap())


@pytest.mark.parametrize("candidates, ahead, max_depth, drafts", [
    # The majority "7 7 7" is drafted; the truth "7 8 9" starts with the same token. The length
    # ceilings keep the chain's one right token.
    ([[7, 7, 7], [7, 7, 7], [7, 8, 9]], [7, 8, 9], 3,
     {"first_token": [7, 7, 7], "choice": [7, 8, 9], "choice_and_length": [7, 8, 9],
      "length": [7], "length_heaviest": [7]}),
    # The truth starts with the minority's token: first_token redraws below it.
    ([[5, 6, 0], [5, 6, 0], [8, 9, 1]], [8, 9, 1], 3,
     {"first_token": [8, 9, 1], "choice": [8, 9, 1], "choice_and_length": [8, 9, 1],
      "length": [5], "length_heaviest": [5]}),
    # A length cap of 2 (max_spec_factor x match): only choice_and_length drafts past it.
    ([[5, 6, 0], [5, 6, 0], [8, 9, 1]], [8, 9, 1], 2,
     {"first_token": [8, 9], "choice": [8, 9], "choice_and_length": [8, 9, 1],
      "length": [5], "length_heaviest": [5]}),
    # The chain is right as far as the cap; the heaviest path goes on past it, and right.
    ([[5, 6, 0], [5, 6, 0], [8, 9, 1]], [5, 6, 0], 2,
     {"first_token": [5, 6], "choice": [5, 6], "choice_and_length": [5, 6, 0],
      "length": [5, 6], "length_heaviest": [5, 6, 0]}),
    # No candidate beats the chain: the choice ceilings draft the chain, the length ceilings
    # its first token (min_draft_len 1).
    ([[5, 6, 0], [5, 6, 0], [8, 9, 1]], [4, 4, 4], 3,
     {"first_token": [5, 6, 0], "choice": [5, 6, 0], "choice_and_length": [5, 6, 0],
      "length": [5], "length_heaviest": [5]}),
])
def test_choice_ceilings_choose_knowing_the_continuation(candidates, ahead, max_depth, drafts):
    config = parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 3,
                                       "min_draft_len": 1}, VLLM_CPU_DEFAULTS)
    args = (np.asarray(candidates, dtype=np.int32), np.full(len(candidates), 3, np.int32),
            np.ones(len(candidates)), 3, config, max_depth)
    assert {ceiling: ceiling_select(ceiling, np.asarray(ahead, np.int32))(*args).tolist()
            for ceiling in CHOICE_CEILINGS} == drafts


def test_length_ceilings_keep_drafts_long_enough_to_be_drafted():
    # With min_draft_len 2 a 1-token draft would be dropped: a chain wrong from its first token
    # is cut to 2 tokens, not to none.
    config = parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 3,
                                       "min_draft_len": 2}, VLLM_CPU_DEFAULTS)
    args = (np.asarray([[5, 6, 0], [5, 6, 0]], dtype=np.int32), np.full(2, 3, np.int32),
            np.ones(2), 3, config)
    for ceiling in ("length", "length_heaviest"):
        assert ceiling_select(ceiling, np.asarray([4, 4, 4], np.int32))(*args).tolist() == [5, 6]
        assert ceiling_select(ceiling, np.asarray([5, 6, 0], np.int32))(*args).tolist() == \
            [5, 6, 0]


def test_choice_ceilings_are_replayed_beside_the_config(tmp_path, capsys):
    documents = [[5, 6, 7, 8, 9], [5, 6, 7, 7, 7], [5, 6, 7, 7, 7]]
    build_datastore_from_token_ids(documents, tmp_path / "ds", tokenizer_name="t",
                                   tokenizer_fingerprint="0" * 64, vocab_size=100,
                                   progress=False)
    records = tmp_path / "run.plain.jsonl"
    records.write_text(json.dumps({"task": "code-gen", "prompt": [1, 5],
                                   "output": [6, 7, 8, 9, 2, 5, 6, 7, 8, 9]}) + "\n")
    config = {"method": "hybrid", "num_speculative_tokens": 3, "datastore": str(tmp_path / "ds"),
              "min_draft_len": 1, "context_min_match_len": 2, "min_match_len": 2,
              "max_spec_factor": 0}
    main([str(records), "--configs", json.dumps([config]), "--choice-ceilings"])
    lines = capsys.readouterr().out.splitlines()
    rows = {row.get("ceiling"): row for row in map(json.loads, lines)}
    assert set(rows) == {None, *CHOICE_CEILINGS}
    # The majority "7 7 7" after "5 6" costs hybrid a token the choice ceiling gets.
    assert rows["choice"]["tokens_per_forward"] > rows[None]["tokens_per_forward"]
    with pytest.raises(ValueError, match="ceiling must be one of"):
        ceiling_select("best", np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="choice-ceilings takes hybrid configs with tree off"):
        draft_factory(parse_speculative_config({**config, "tree": "on"}, VLLM_CPU_DEFAULTS),
                      ceiling="choice")
    with pytest.raises(SystemExit):
        main([str(records), "--configs", json.dumps([config]), "--choice-ceilings", "--oracle"])


def test_replay_learns_from_served_records_in_order():
    """The second of two identical requests is drafted from the first one's output, as the
    engine's served store would; with the store off nothing is learnt."""
    from benchmarks.replay import ServedReplay

    record = {"prompt": [1, 2], "output": list(range(100, 130))}
    config = parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 8},
                                      VLLM_CPU_DEFAULTS)
    factory = draft_factory(config)
    assert isinstance(factory, ServedReplay)
    first = replay([record], factory, k=8, draft_token_cost=0.0)
    assert first["tokens_per_forward"] == 1.0  # nothing repeats within the record
    assert factory.store.num_tokens == 32  # prompt and output (served_prompts)
    second = replay([record], factory, k=8, draft_token_cost=0.0)
    assert second["tokens_per_forward"] > 3.0


def test_suffix_peer_replays_vllms_suffix_decoding():
    """vLLM's suffix method learns responses across requests too: a repeated request is drafted
    from the first one's response, up to the tree depth."""
    from benchmarks.replay import SuffixDecodingReplay

    record = {"prompt": [1, 2], "output": list(range(100, 160))}
    peer = SuffixDecodingReplay()
    assert peer.num_speculative_tokens == 24
    first = replay([record], peer, k=24, draft_token_cost=0.0)
    second = replay([record], peer, k=24, draft_token_cost=0.0)
    assert first["tokens_per_forward"] == 1.0
    assert second["tokens_per_forward"] > 5.0


def test_measured_step_costs_model_each_step_by_its_draft_length(tmp_path):
    from benchmarks.replay import measured_step_costs

    rows = [{"context_tokens": c, "draft_len": d, "ms_per_step_median": t}
            for c, table in ((50, {0: 50.0, 1: 60.0, 2: 45.0, 4: 45.0, 8: 55.0}),
                             (400, {0: 99.0, 8: 99.0}))
            for d, t in table.items()]
    path = tmp_path / "verify-cost.json"
    path.write_text(json.dumps({"rows": rows}))
    # The shortest context; linear between measured lengths, along the last two beyond them.
    assert measured_step_costs(str(path), 10) == [50.0, 60.0, 45.0, 45.0, 45.0, 47.5, 50.0,
                                                  52.5, 55.0, 57.5, 60.0]
    output = list(range(100, 120))
    record = {"prompt": [1, 2, 3], "output": output}

    def two_wrong(context, n):  # a 2-token draft, never accepted
        return np.zeros(2, dtype=np.int32)

    result = replay([record], lambda r: two_wrong, k=2, draft_token_cost=0.5,
                    step_costs=measured_step_costs(str(path), 2))
    # 20 forwards (prefill + 19 steps of one token), each step at 45 / 50 of a plain one.
    assert result["tokens_per_forward"] == 1.0
    assert result["modeled_speedup"] == round(20 / (1 + 19 * 0.9), 3)
    path.write_text(json.dumps({"rows": rows[1:2]}))
    with pytest.raises(ValueError, match="needs the step time with no draft"):
        measured_step_costs(str(path), 4)


def test_replay_pads_drafts_where_its_step_costs_say_longer_is_cheaper():
    # No draft costs 50, three or four draft tokens 45, more 60 (min_draft_len 3).
    costs = [50.0, 60.0, 60.0, 45.0, 45.0, 60.0, 60.0, 60.0, 60.0]
    # The output repeats the prompt: padding (the last token's earlier continuation) is right.
    record = {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 1], "output": [2, 3, 4, 5, 6, 7, 8, 1]}

    def nothing(context, n):
        return np.empty(0, dtype=np.int32)

    plain = replay([record], lambda r: nothing, k=8, draft_token_cost=0.0, min_draft_len=3,
                   step_costs=costs)
    padded = replay([record], lambda r: nothing, k=8, draft_token_cost=0.0, min_draft_len=3,
                    step_costs=costs, pad_drafts=True)
    assert plain["mean_draft_len"] == 0.0 and plain["modeled_speedup"] == 1.0
    # Padded to 3 (the first of the cheapest): 2 3 4 accepted + 5, then 6 7 8 + 1: 3 forwards.
    assert padded["tokens_per_forward"] == round(8 / 3, 3) and padded["mean_draft_len"] == 3.0
    assert padded["modeled_speedup"] == round(8 / (1 + 2 * 45 / 50), 3)
