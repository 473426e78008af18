"""The offline replay that tunes drafting rules: it drives the proposers' own code as vLLM's step
does, and counts forwards and step costs as the engine would."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.peers import NgramPeer, SuffixPeer
from benchmarks.replay import (
    PLAIN_STEP_NS, CudaGraphs, Replay, Request, StepCosts, build_proposer, cuda_graphs,
    expand_grid, fake_vllm_config, main, measured_step_costs, piecewise_step_costs,
    replay_config, replay_fleet)
from vllm_retrieval_spec.config import VLLM_CPU_DEFAULTS, parse_speculative_config
from vllm_retrieval_spec.contract import Capabilities, MethodDrafter
from vllm_retrieval_spec.drafting.tree import TreeDraft
from vllm_retrieval_spec.proposers.base import RetrievalProposer

#: Nothing but the method's drafts: no acceptance cap, no minimum length, no padding.
EXACT = {"num_speculative_tokens": 3, "min_draft_len": 1, "adaptive_draft_len": False,
         "pad_drafts": False}
#: The output repeats the prompt from its last token on: PLD's drafts are always right.
REPEATING = {"prompt": list(range(5, 25)) + [5], "output": list(range(6, 25))}


def replay(proposer, records, costs=StepCosts(0.0), batch=1):
    run = Replay(proposer, costs, batch=batch, trace=True)
    return run.run(records), run.trace


def with_method(method: MethodDrafter, **options) -> RetrievalProposer:
    """Our proposer around a hand-made method, as the plugin would build it."""
    config = parse_speculative_config({"method": "pld", **EXACT, **options}, VLLM_CPU_DEFAULTS)
    return RetrievalProposer(fake_vllm_config(config), method)


class Scripted(MethodDrafter):
    """A method whose draft after ``context`` is ``draft(context)``."""

    def __init__(self, draft, trees: bool = False) -> None:
        self.make = draft
        self.capabilities = Capabilities(trees=trees)

    def draft(self, row, context, max_len):
        return self.make(context)


def test_replay_counts_forwards_as_the_engine_would():
    result, trace = replay(build_proposer({"method": "pld", **EXACT}, VLLM_CPU_DEFAULTS),
                           [REPEATING], StepCosts(0.1))
    # The prefill samples 6; each step then accepts its 3 tokens and adds one; the last step
    # samples the last 2 tokens (23 24), and its draft (5 6 7) is never verified.
    assert trace == [[[7, 8, 9]], [[11, 12, 13]], [[15, 16, 17]], [[19, 20, 21]],
                     [[23, 24, 5]], [[5, 6, 7]]]
    assert result["tokens_per_forward"] == round(19 / 6, 3)
    assert result["mean_draft_len"] == 3.0
    # 19 tokens in 6 forwards, 5 of them verifying 3 tokens at 0.1 of a step each.
    assert result["modeled_speedup"] == round(19 / (6 + 5 * 3 * 0.1), 3)
    # Nothing repeats: no draft, one token per forward.
    never, trace = replay(build_proposer({"method": "pld", **EXACT}, VLLM_CPU_DEFAULTS),
                          [{"prompt": [1, 2], "output": list(range(10, 20))}], StepCosts(0.1))
    assert trace == [[[]]] * 10
    assert (never["tokens_per_forward"], never["mean_draft_len"], never["modeled_speedup"]) == \
        (1.0, 0.0, 1.0)


def test_a_records_max_tokens_caps_our_drafts_as_in_the_engine():
    """The output above ended at max_tokens 19: the engine drafts the step that samples 23 24
    one token (before: 23 24 5, two of them past the output) and the last step none."""
    result, trace = replay(build_proposer({"method": "pld", **EXACT}, VLLM_CPU_DEFAULTS),
                           [{**REPEATING, "max_tokens": 19}], StepCosts(0.1))
    assert trace == [[[7, 8, 9]], [[11, 12, 13]], [[15, 16, 17]], [[19, 20, 21]], [[23]], [[]]]
    assert result["tokens_per_forward"] == round(19 / 6, 3)
    assert result["modeled_speedup"] == round(19 / (6 + 13 * 0.1), 3)


def test_a_linear_cost_models_as_the_same_measured_curve():
    """1 + draft_token_cost x d a step, given as a constant or as a measured curve, models the
    same speedup: output tokens over the steps' summed cost, the prefills' forwards included
    (not tokens per forward over the cost of a decode step's mean draft)."""
    proposer = lambda: build_proposer({"method": "pld", **EXACT}, VLLM_CPU_DEFAULTS)  # noqa
    linear, _ = replay(proposer(), [REPEATING], StepCosts(0.1))
    curve, _ = replay(proposer(), [REPEATING], StepCosts(0.1, [1 + 0.1 * d for d in range(4)]))
    assert linear["modeled_speedup"] == curve["modeled_speedup"] == round(19 / 7.5, 3)


def test_replay_drafts_what_the_proposer_drafts_driven_directly():
    """The same drafts as observe_batch and propose called by hand (replay also drafts before
    sampling, the platform's default, which must not change them)."""
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    output = [4, 1, 2, 3, 5, 9, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 7, 7]
    options = {"method": "pld", "num_speculative_tokens": 4}
    _, trace = replay(build_proposer(options, VLLM_CPU_DEFAULTS),
                      [{"prompt": prompt, "output": output}])
    proposer = build_proposer({**options, "draft_before_sampling": False}, VLLM_CPU_DEFAULTS)
    sequence = prompt + output
    tokens = np.zeros((1, 64), dtype=np.int32)
    n, sampled, direct = len(prompt), [output[0]], []
    while True:
        n += len(sampled)
        tokens[0, :n] = sequence[:n]
        proposer.observe_batch(["0"])
        draft = proposer.propose([sampled], np.array([n], dtype=np.int32), tokens)[0]
        if proposer.has_work_after_handover:
            proposer.after_handover()
        direct.append([draft])
        if n == len(sequence):
            break
        accepted = 0
        while accepted < min(len(draft), len(sequence) - n - 1) \
                and draft[accepted] == sequence[n + accepted]:
            accepted += 1
        sampled = sequence[n:n + accepted + 1]
    assert trace == direct
    assert any(len(d[0]) for d in direct) and any(not d[0] for d in direct)


def test_a_tree_accepts_its_longest_root_path_along_the_output():
    # root -> 5 -> 6 -> 7, and root -> 8 -> 9: the first branch is wrong after 5.
    tree = TreeDraft(np.array([5, 6, 7, 8, 9]), np.array([-1, 0, 1, -1, 3]), 3, 0.5)

    def verify(output):
        record = {"prompt": [1], "output": [0, *output]}
        return Request("0", record, np.asarray([1, 0, *output]), done=1,
                       draft=tree.tokens.tolist(), tree=tree).verify()

    assert verify([8, 9, 1, 1]) == ([8, 9, 1], 4)
    assert verify([5, 6, 2, 1]) == ([5, 6, 2], 1)
    assert verify([5, 6, 7, 1]) == ([5, 6, 7, 1], 2)
    assert verify([1, 1, 1, 1]) == ([1], -1)
    assert verify([8, 9]) == ([8, 9], 3)  # the output ends: its last token is the bonus

    # A tree after the first output token, the truth's next 2 tokens as a chain after that.
    output = [8, 9, 30, 31, 32, 33]
    sequence = [1, *output]
    tree = TreeDraft(np.array([5, 6, 9, 7]), np.array([-1, 0, -1, 2]), 2, 0.5)

    def draft(context):
        if len(context) == 2:
            return tree
        return np.asarray(sequence[len(context):len(context) + 2], dtype=np.int32)

    result, trace = replay(with_method(Scripted(draft, trees=True), num_speculative_tokens=4),
                           [{"prompt": [1], "output": output}])
    # The tree accepts 9 (node 2); its child 7 is not 30, the bonus; then 31 32 and 33.
    assert trace == [[[5, 6, 9, 7]], [[31, 32]], [[]]]
    assert result["tokens_per_forward"] == round(6 / 3, 3)
    assert result["mean_draft_len"] == (4 + 2) / 2
    # Measured costs: a tree config runs every step PIECEWISE, which adds 0.5 to the chain's
    # full graph: the tree step (4 nodes, 2 after its leading chain) costs the tree curve, the
    # chain step (2 tokens) a piecewise chain of 3, the next capture size (4 tokens) less its
    # root, and the prefill a plain step; against the chain's draftless step (plain decoding).
    chain_curve, tree_curve = [10.0, 11.0, 12.0, 13.0, 14.0], [10.5, 11.0, 13.0, 16.0, 20.0]
    piecewise = [ms + 0.5 for ms in chain_curve]
    costs = StepCosts(0.1, chain_curve, tree_curve, piecewise,
                      CudaGraphs(4, full_at_k=False, rounded=False))
    timed, _ = replay(with_method(Scripted(draft, trees=True), num_speculative_tokens=4),
                      [{"prompt": [1], "output": output}], costs)
    assert timed["modeled_speedup"] == round(6 / (1 + 20 / 10 + 13.5 / 10), 3)
    assert (costs.units(4, tree_rows=True), costs.units(4)) == (2.0, 1.45)
    # Without CUDA graphs (a CPU curve) a tree step costs the tree curve, others the chain's.
    costs = StepCosts(0.1, chain_curve, tree_curve)
    assert (costs.units(3, tree_rows=True), costs.units(3)) == (1.6, 1.3)
    with pytest.raises(ValueError, match="needs the chain's"):
        StepCosts(0.1, None, tree_curve)
    with pytest.raises(ValueError, match="piecewise curve"):
        StepCosts(0.1, chain_curve, graphs=CudaGraphs(4))


def test_cuda_graphs_cost_a_full_graph_only_for_a_draft_of_k_tokens():
    """vLLM 0.32 replays a full graph only for a uniform batch (every row verifying k draft
    tokens); other steps run PIECEWISE, on Model Runner V1 (suffix) at k + 1 tokens whatever
    the draft, as its capture sizes are rounded to that; on V2 (ngram) at the next capture
    size."""
    chain = [10.0 + d for d in range(17)]
    piecewise = [ms + 0.5 for ms in chain]
    v1 = StepCosts(0.0, chain, None, piecewise, CudaGraphs(16))
    assert [v1.units(d) for d in (0, 3, 15, 16)] == [2.65, 2.65, 2.65, 2.6]
    v2 = StepCosts(0.0, chain, None, piecewise, CudaGraphs(16, rounded=False))
    # 1 + d tokens padded to 1, 2, 4, 8, 16, 17 (k + 1).
    assert [v2.units(d) for d in (0, 1, 2, 3, 8, 15, 16)] == [
        1.05, 1.15, 1.35, 1.35, 2.55, 2.55, 2.6]
    assert [CudaGraphs(64, rounded=False).piecewise_len(d) for d in (60, 63, 64)] == [63, 63, 64]
    assert CudaGraphs(80, rounded=False).piecewise_len(70) == 71
    assert cuda_graphs(SuffixPeer({}, 1024)) == CudaGraphs(24)
    assert cuda_graphs(NgramPeer({"num_speculative_tokens": 5}, 1024)) == CudaGraphs(
        5, rounded=False)
    # Ours run PIECEWISE unless told otherwise (patches.engine_args.piecewise_cuda_graphs).
    for trees in (False, True):
        ours = with_method(Scripted(lambda context: np.zeros(2, dtype=np.int32), trees=trees),
                           num_speculative_tokens=6)
        assert cuda_graphs(ours) == CudaGraphs(6, full_at_k=False, rounded=False)
    assert cuda_graphs(ours, "PIECEWISE") == CudaGraphs(6, full_at_k=False, rounded=False)
    with pytest.raises(ValueError, match="trees run PIECEWISE only"):
        cuda_graphs(ours, "FULL_AND_PIECEWISE")
    chains = with_method(Scripted(lambda context: np.zeros(2, dtype=np.int32)),
                         num_speculative_tokens=6)
    assert cuda_graphs(chains, "FULL_AND_PIECEWISE") == CudaGraphs(6)
    assert cuda_graphs(SuffixPeer({}, 1024), "PIECEWISE") == CudaGraphs(
        24, full_at_k=False, rounded=False)
    with pytest.raises(ValueError, match="'FULL' is not modelled"):
        cuda_graphs(chains, "FULL")


def test_a_config_names_the_cudagraph_mode_its_gpu_curves_are_read_in(tmp_path):
    """vLLM's suffix at its default mode computes 25 tokens a step; set PIECEWISE, only what
    each draft needs: on a curve where tokens cost, it models faster."""
    def curve(path, per_token):
        path.write_text(json.dumps({"rows": [
            {"context_tokens": 512, "draft_len": d, "ms_per_step_median": 10.0 + per_token * d}
            for d in (0, 64)]}))
        return str(path)

    chain, tree = curve(tmp_path / "chain.json", 0.1), curve(tmp_path / "tree.json", 0.2)
    record = {"prompt": [1, 2], "output": list(range(100, 160))}
    records = [record, record]
    default = replay_config({"method": "suffix"}, records, VLLM_CPU_DEFAULTS,
                            verify_cost=chain, tree_verify_cost=tree)
    piecewise = replay_config({"method": "suffix", "cudagraph_mode": "PIECEWISE"}, records,
                              VLLM_CPU_DEFAULTS, verify_cost=chain, tree_verify_cost=tree)
    assert default["tokens_per_forward"] == piecewise["tokens_per_forward"]
    assert piecewise["modeled_speedup"] > default["modeled_speedup"]
    with pytest.raises(ValueError, match="cudagraph_mode needs a GPU's curves"):
        replay_config({"method": "suffix", "cudagraph_mode": "PIECEWISE"}, records,
                      VLLM_CPU_DEFAULTS, verify_cost=chain)


def test_the_piecewise_curve_is_measured_else_the_modes_difference_at_no_draft(tmp_path):
    def curve(path, table, piecewise=None):
        path.write_text(json.dumps({"rows": [
            {"context_tokens": 512, "draft_len": d, "ms_per_step_median": ms,
             **({"piecewise_ms_median": piecewise[d]} if piecewise else {})}
            for d, ms in table.items()]}))
        return str(path)

    chain = curve(tmp_path / "chain.json", {0: 7.0, 4: 8.0})
    tree = curve(tmp_path / "tree.json", {0: 7.5, 4: 9.5})
    chain_ms, tree_ms = measured_step_costs(chain, 2), measured_step_costs(tree, 2)
    assert piecewise_step_costs(chain, chain_ms, tree_ms) == [7.5, 7.75, 8.0]
    assert piecewise_step_costs(chain, chain_ms, None) is None
    measured = curve(tmp_path / "measured.json", {0: 7.0, 4: 8.0}, {0: 7.2, 4: 8.4})
    assert piecewise_step_costs(measured, chain_ms, tree_ms) == pytest.approx([7.2, 7.5, 7.8])


def test_expand_grid():
    configs = expand_grid({"method": "hybrid", "x": 0}, {"x": [1, 2], "y": ["a", "b"]})
    assert configs == [{"method": "hybrid", "x": x, "y": y} for x in (1, 2) for y in "ab"]
    assert expand_grid({"method": "pld"}, {}) == [{"method": "pld"}]


def test_replay_learns_from_served_records_in_order():
    """The second of two identical requests is drafted from the first one's prompt and output
    once the first finished, as the engine's served store would; not while both
    decode."""
    record = {"prompt": [1, 2], "output": list(range(100, 130))}
    options = {"method": "hybrid", "num_speculative_tokens": 8, "pad_drafts": False}
    result, trace = replay(build_proposer(options, VLLM_CPU_DEFAULTS), [record, record])
    assert trace[:30] == [[[]]] * 30  # nothing repeats within the first
    # "1 2 100" matches 3 tokens of the store: 2 x 3 drafted (max_spec_factor), then k, up to
    # the stored request's end.
    assert trace[30:] == [[list(range(101, 107))], [list(range(108, 116))],
                          [list(range(117, 125))], [list(range(126, 130))], [[]]]
    assert result["tokens_per_forward"] == round(60 / (30 + 5), 3)
    assert result["stats"]["served_store_requests"] == 2  # each as it finished
    together, trace = replay(build_proposer(options, VLLM_CPU_DEFAULTS), [record, record],
                             batch=2)
    assert trace == [[[], []]] * 30
    assert together["tokens_per_forward"] == 1.0


#: Dealt to two replicas: the first serves A then C, the second B (longer than A) then A again.
FLEET = [{"prompt": [1, 2], "output": list(range(100, 130))},
         {"prompt": [3, 4], "output": list(range(200, 240))},
         {"prompt": [5, 6], "output": list(range(300, 305))},
         {"prompt": [1, 2], "output": list(range(100, 130))}]


def fleet_traces(make_drafter, directory):
    runs = [Replay(make_drafter(), StepCosts(0.0), trace=True) for _ in range(2)]
    return replay_fleet(runs, FLEET, directory), [run.trace for run in runs]


def test_a_fleet_of_hybrids_drafts_from_what_another_replica_served(tmp_path):
    """The second replica drafts A from the first replica's journal, as a replica tailing the
    fleet's served_datastore does: A finished there (its 30 steps) before B (40) did here."""
    options = {"method": "hybrid", "num_speculative_tokens": 8, "pad_drafts": False}
    result, (first, second) = fleet_traces(
        lambda: build_proposer(options, VLLM_CPU_DEFAULTS), tmp_path)
    assert first == [[[]]] * 35  # A, then C: nothing repeats
    # As a single replica's second A (test_replay_learns_from_served_records_in_order).
    assert second == [[[]]] * 40 + [[list(range(101, 107))], [list(range(108, 116))],
                                     [list(range(117, 125))], [list(range(126, 130))], [[]]]
    assert result["tokens_per_forward"] == round(105 / (30 + 5 + 40 + 5), 3)
    assert sorted(p.name for p in tmp_path.glob("journal-*")) == \
        ["journal-replica-0.0.sealed", "journal-replica-1.0.sealed"]


def test_a_fleet_of_vllm_suffix_learns_per_replica(tmp_path):
    """vLLM's suffix keeps what its own replica served: the second replica's A is drafted from
    nothing; the same records on one replica draft the second A from the first."""
    result, (_, second) = fleet_traces(lambda: SuffixPeer({}, 1024), tmp_path)
    assert second == [[[]]] * 70
    assert result["tokens_per_forward"] == 1.0
    alone = replay_config({"method": "suffix"}, FLEET, VLLM_CPU_DEFAULTS)
    assert alone["tokens_per_forward"] > 1.0


def test_one_replica_replays_as_one_drafter_does():
    options = {"method": "hybrid", "num_speculative_tokens": 8, "pad_drafts": False}

    def counted(summary):  # the drafting times are wall times
        return {k: v for k, v in summary.items() if not k.startswith("draft_us")}

    fleet = replay_config(options, FLEET, VLLM_CPU_DEFAULTS, replicas=1)
    alone, _ = replay(build_proposer(options, VLLM_CPU_DEFAULTS), FLEET,
                      StepCosts(VLLM_CPU_DEFAULTS.draft_token_cost))
    assert counted(fleet) == counted(alone)
    assert fleet["tokens_per_forward"] > 1.0


def test_suffix_peer_replays_vllms_suffix_decoding():
    """vLLM's own suffix proposer learns responses across requests too: a repeated request is
    drafted from the first one's response, as many tokens as match (max_spec_factor 1) while
    match and draft fit the tree's depth (24)."""
    record = {"prompt": [1, 2], "output": list(range(100, 160))}
    peer = SuffixPeer({}, max_model_len=1024)
    assert peer.k == 24
    result, trace = replay(peer, [record, record])
    assert trace[:60] == [[[]]] * 60
    second = [d for [d] in trace[60:-1]]
    assert [len(d) for d in second] == [1, 3, 7, 12, 12, 12, 6]
    assert all(d == list(range(d[0], d[0] + len(d))) for d in second)  # all accepted
    assert result["tokens_per_forward"] == round(120 / (60 + 8), 3)
    with pytest.raises(ValueError, match="unknown suffix option"):
        SuffixPeer({"max_tree_depth": 8}, 1024)


def test_suffix_peer_drafts_as_deep_as_its_configured_tree():
    """As vLLM's SpeculativeConfig: without num_speculative_tokens, suffix drafts up to the
    tree depth it is given, not up to the default depth's."""
    from vllm.config import SpeculativeConfig

    deep = SuffixPeer({"suffix_decoding_max_tree_depth": 48}, 1024)
    assert deep.k == deep.proposer.num_speculative_tokens == deep.proposer.max_tree_depth == 48
    vllm_k = SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=48)
    assert vllm_k.num_speculative_tokens == 48
    given = SuffixPeer({"suffix_decoding_max_tree_depth": 48, "num_speculative_tokens": 8}, 1024)
    assert given.k == 8


def test_ngram_peer_replays_vllms_ngram_proposer():
    """vLLM's own n-gram proposer drafts from the request's context only: a repeated phrase is
    drafted (k tokens after the longest 2..4-gram match); nothing is learned across requests."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    record = {"prompt": prompt, "output": [4, 5, 6, 7, 8, 9, 50, 51]}
    peer = NgramPeer({"num_speculative_tokens": 3}, max_model_len=1024)
    result, trace = replay(peer, [record, record])
    # After the prefill samples 4: "2 3 4" matched, "5 6 7" drafted and accepted, bonus 8; then
    # "9 1 2" drafted after "7 8", 9 accepted, bonus 50.
    assert [d for [d] in trace[:3]] == [[5, 6, 7], [9, 1, 2], []]
    assert trace[:len(trace) // 2] == trace[len(trace) // 2:]
    assert result["tokens_per_forward"] == round(16 / 8, 3)
    with pytest.raises(ValueError, match="unknown ngram option"):
        NgramPeer({"n": 3}, 1024)


def test_measured_step_costs_model_each_step_by_its_draft_length(tmp_path):
    rows = [{"context_tokens": c, "draft_len": d, "ms_per_step_median": t}
            for c, table in ((50, {0: 50.0, 1: 60.0, 2: 45.0, 4: 45.0, 8: 55.0}),
                             (400, {0: 99.0, 8: 99.0}))
            for d, t in table.items()]
    path = tmp_path / "verify-cost.json"
    path.write_text(json.dumps({"rows": rows}))
    # The shortest context; linear between measured lengths, along the last two beyond them.
    curve = measured_step_costs(str(path), 10)
    assert curve == [50.0, 60.0, 45.0, 45.0, 45.0, 47.5, 50.0, 52.5, 55.0, 57.5, 60.0]
    # A 2-token draft every step, never accepted: 20 forwards (the prefill and 19 steps of one
    # token), each step at 45 / 50 of one without a draft.
    record = {"prompt": [1, 2, 3], "output": list(range(100, 120))}
    proposer = with_method(Scripted(lambda context: np.zeros(2, dtype=np.int32)),
                           num_speculative_tokens=2)
    result, _ = replay(proposer, [record], StepCosts(0.5, curve[:3]))
    assert result["tokens_per_forward"] == 1.0
    assert result["modeled_speedup"] == round(20 / (1 + 19 * 0.9), 3)
    path.write_text(json.dumps({"rows": rows[1:2]}))
    with pytest.raises(ValueError, match="needs the step time with no draft"):
        measured_step_costs(str(path), 4)


class SlowAhead:
    """vLLM's ngram, whose drafting takes 3 us a step on ``clock`` (5 ms more the first time,
    a one-time set-up) and whose drafts made ahead after the handover take 1 ms more."""

    def __init__(self, clock: list[int]) -> None:
        self.peer = NgramPeer({"num_speculative_tokens": 2}, max_model_len=1024)
        self.clock = clock
        self.set_up = False
        self.has_work_after_handover = True

    def __getattr__(self, name):
        return getattr(self.peer, name)

    def propose(self, *args):
        self.clock[0] += 3_000 if self.set_up else 5_003_000
        self.set_up = True
        return self.peer.propose(*args)

    def after_handover(self) -> None:
        self.clock[0] += 1_000_000


def test_the_drafting_a_step_waits_for_is_added_to_a_measured_curves_steps(monkeypatch):
    """Drafts made after the handover overlap the next forward: only the rest of drafting
    (``draft_us_critical_mean``) is added to each step's time, in the curve's milliseconds."""
    clock = [0]
    monkeypatch.setattr("benchmarks.replay.time.perf_counter_ns", lambda: clock[0])
    record = {"prompt": [1, 2, 3], "output": list(range(100, 120))}
    # Nothing repeats: 20 forwards of one token, each a plain step of 0.5 ms.
    result, _ = replay(SlowAhead(clock), [record], StepCosts(0.0, [0.5, 0.6, 0.7]))
    assert result["tokens_per_forward"] == 1.0 and result["modeled_speedup"] == 1.0
    assert (result["draft_us_critical_mean"], result["draft_us_p50"]) == (3.0, 1003.0)
    # The first step's drafting is left out (a fresh drafter's one-time set-up).
    assert result["modeled_speedup_with_drafting"] == round(20 / (20 + 19 * 0.003 / 0.5), 3)
    # The modelled cost has no milliseconds to add them to.
    assert "modeled_speedup_with_drafting" not in replay(SlowAhead(clock), [record])[0]


def test_padding_learns_the_step_costs_and_pads_where_longer_is_cheaper():
    """The proposer's own padding, timed by replay's clock: it learns each length's cost as
    the engine would from its steps, then pads an empty draft to 3 tokens, the shortest of the
    cheapest."""
    costs = StepCosts(0.0, [50.0, 60.0, 60.0, 45.0, 45.0, 60.0, 60.0, 60.0, 60.0])
    record = {"prompt": [1, 2], "output": list(range(100, 220))}  # padding is never right
    options = {"method": "pld", "num_speculative_tokens": 8, "min_draft_len": 3}
    plain, trace = replay(build_proposer({**options, "pad_drafts": False}, VLLM_CPU_DEFAULTS),
                          [record], costs)
    assert trace == [[[]]] * 120 and plain["modeled_speedup"] == 1.0
    proposer = build_proposer(options, VLLM_CPU_DEFAULTS)
    padded, trace = replay(proposer, [record], costs)
    # The clock's steps are the curve's times: each is 50 ms x cost / cost without a draft.
    assert PLAIN_STEP_NS == 50_000_000
    stats = proposer.stats()
    assert {n: stats[f"step_ms_draft_{n}"] for n in (0, 3, 4, 8)} == \
        {0: 50.0, 3: 45.0, 4: 45.0, 8: 60.0}
    lengths = [len(d) for [d] in trace]
    assert set(lengths[-40:]) == {3}
    assert padded["tokens_per_forward"] == 1.0
    verified = lengths[:-1]  # the last draft is never verified
    assert padded["modeled_speedup"] == round(
        120 / (1 + sum(costs.units(n) for n in verified)), 3)
    assert padded["modeled_speedup"] > 1.0


class FakeStates:
    """Random hidden states per position of a record, the same for every layer."""

    hidden_size = 8
    vocab_size = 1000

    def __call__(self, record, layer=None):
        n = len(record["prompt"]) + len(record["output"])
        return np.random.default_rng(n).standard_normal((n, self.hidden_size)).astype(np.float32)


def test_pld_plus_gets_the_states_of_its_accepted_tokens():
    """PLD+ drafts from the states vLLM's runner hands it (``record_hidden_states``): at every
    step, those of every context position but the last, as from the whole sequence."""
    from vllm_retrieval_spec.proposers.hidden_states import unit_rows
    from vllm_retrieval_spec.proposers.pld_plus import pld_plus_draft

    record = {"prompt": [1, 2, 3, 1, 4, 5, 1, 2, 6, 1],
              "output": [4, 5, 1, 2, 3, 1, 4, 5, 1, 2, 6, 7, 1, 2, 3]}
    states = FakeStates()
    proposer = build_proposer({"method": "pld_plus", **EXACT, "min_similarity": -1.0},
                              VLLM_CPU_DEFAULTS, states)
    seen = []
    propose = proposer.propose

    def spy(sampled, num_tokens, tokens):
        drafts = propose(sampled, num_tokens, tokens)
        seen.append((tokens[0, :num_tokens[0]].copy(), drafts[0]))
        return drafts

    proposer.propose = spy
    result = Replay(proposer, StepCosts(0.0), states).run([record])
    truth = unit_rows(states(record))
    for context, draft in seen:
        expected = pld_plus_draft(context, truth[:len(context) - 1], 3, proposer.config)
        assert draft == expected.tolist()
    assert result["tokens_per_forward"] > 1.0
    with pytest.raises(ValueError, match="needs --model"):
        build_proposer({"method": "pld_plus", **EXACT}, VLLM_CPU_DEFAULTS)


def test_main_writes_a_fleet_per_platform_and_size_as_results(tmp_path, capsys):
    records = tmp_path / "run.plain.jsonl"
    records.write_text("".join(json.dumps({"task": "chat", **r}) + "\n" for r in FLEET))
    main([str(records), "--configs", json.dumps([{"method": "suffix"}, {"method": "hybrid"}]),
          "--replicas", "1,2", "--platform", "vllm-cpu", "--platform", "accelerator",
          "--run-name", "fleet", "--output-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "fleet.json").read_text())["rows"]
    assert [(r["platform"], r["replicas"], r["config"]["method"]) for r in rows] == [
        (p, n, m) for p in ("vllm-cpu", "accelerator") for n in (1, 2)
        for m in ("suffix", "hybrid")]
    assert [r["vs_first_config"] for r in rows[::2]] == [1.0] * 4
    assert all(r["vs_first_config"] > 1.0 for r in rows[3::4])  # hybrid, 2 replicas
    assert len(capsys.readouterr().out.splitlines()) == 8
    # The second replica drafts A from the first's (test_a_fleet_of_hybrids_drafts_...).
    assert '| chat | {"num_speculative_tokens": 8, "method": "hybrid"} | accelerator | 2 | ' \
        f'{round(105 / 80, 3)} |' in (tmp_path / "fleet.md").read_text()


def test_main_prints_one_line_per_task_and_config(tmp_path, capsys):
    records = tmp_path / "run.plain.jsonl"
    records.write_text("".join(json.dumps({"task": task, **REPEATING}) + "\n"
                               for task in ("code-gen", "chat")))
    main([str(records), "--configs", json.dumps([{"method": "pld", **EXACT}]),
          "--grid", '{"num_speculative_tokens": [2, 3]}'])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["task"], r["config"]["num_speculative_tokens"]) for r in rows] == \
        [("chat", 2), ("code-gen", 2), ("chat", 3), ("code-gen", 3)]
    assert rows[-1]["tokens_per_forward"] == round(19 / 6, 3)
