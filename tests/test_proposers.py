"""The proposer side of vLLM's custom_class contract, with a stand-in for vLLM's config."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import helpers
from helpers import VOCAB, batch, make_tokenizer, vllm_config
from vllm_retrieval_spec.contract import MethodDrafter
from vllm_retrieval_spec.datastore import build_datastore_from_token_ids
from vllm_retrieval_spec.proposers.base import RetrievalProposer

@pytest.fixture
def datastore(tmp_path) -> str:
    # "1 2 3" is followed by "4 5 6 7" twice and by "9" once.
    documents = [[1, 2, 3, 4, 5, 6, 7], [8, 1, 2, 3, 4, 5, 6, 7, 0], [1, 2, 3, 9]]
    path = tmp_path / "ds"
    build_datastore_from_token_ids(documents, path, tokenizer_name="test",
                                   tokenizer_fingerprint="f" * 64, vocab_size=VOCAB,
                                   progress=False)
    return str(path)


def rest(datastore, max_model_len=64, **options):
    return RetrievalProposer(vllm_config({"method": "rest", "num_speculative_tokens": 4,
                                     "datastore": datastore, "min_prefix_prob": 0.0,
                                     "prior_weight": 0.0, **options}, max_model_len))


def test_rest_drafts_the_majority_continuation_capped_at_k(datastore):
    proposer = rest(datastore)
    tokens, lengths = batch([5, 5, 1, 2, 3], [7, 8, 1], [42, 43])
    drafts = proposer.propose([[3], [1], [43]], lengths, tokens)
    # Longest suffix "1 2 3": 4 5 6 7 (x2) beats 9; k=4. "8 1": 2 3 4 5. "42 43": no match.
    assert drafts == [[4, 5, 6, 7], [2, 3, 4, 5], []]


def test_rest_stops_where_the_evidence_splits(datastore):
    proposer = rest(datastore, min_prefix_prob=0.7)
    tokens, lengths = batch([1, 2, 3])
    # 2 of 3 continuations agree on "4": 0.67 < 0.7, so nothing is drafted.
    assert proposer.propose([[3]], lengths, tokens) == [[]]


def test_no_draft_for_partial_prefill_or_at_max_model_len(datastore):
    proposer = rest(datastore, max_model_len=8)
    tokens, lengths = batch([1, 2, 3], [9, 9, 9, 9, 9, 1, 2], [9, 9, 9, 9, 1, 2, 3], width=8)
    drafts = proposer.propose([[], [2], [3]], lengths, tokens)
    # Row 1 has room for 8 - 7 - 1 = 0 draft tokens; row 2 likewise; row 0 is prefilling.
    assert drafts == [[], [], []]
    tokens, lengths = batch([9, 9, 9, 1, 2, 3], width=8)
    assert proposer.propose([[3]], lengths, tokens) == [[4]]


class Scripted(MethodDrafter):
    def __init__(self, outcomes):
        self.outcomes = list(outcomes)

    def draft(self, row, context, max_len):
        outcome = self.outcomes.pop(0)
        if callable(outcome):
            return outcome()
        if isinstance(outcome, Exception):
            raise outcome
        return np.asarray(outcome, dtype=np.int32)


def test_a_failing_draft_costs_one_request_one_step(datastore, caplog):
    # Six rows: keep drafting on at that batch size.
    proposer = helpers.proposer(
        {"method": "rest", "num_speculative_tokens": 3, "datastore": datastore,
         "disable_by_batch_size": 0},
        method=Scripted([RuntimeError("boom"), [1, 2, 3, 4], [5, VOCAB], [-1], [7, 8, 9],
                         RuntimeError("again")]))
    tokens, lengths = batch(*[[1, 2]] * 6)
    drafts = proposer.propose([[2]] * 6, lengths, tokens)
    assert drafts == [[], [], [], [], [7, 8, 9], []]
    assert proposer.num_failed_drafts == 5
    assert proposer.stats() == {"failed_exception": 2, "failed_too_long": 1,
                                "failed_out_of_vocabulary": 2}
    # The first event of each kind is logged, with what happened; repeats are only counted.
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 3
    assert "raised" in errors[0] and "returned 4 tokens, more than the allowed 3" in errors[1]
    assert f"returned token ids outside [0, {VOCAB})" in errors[2]


def test_a_failing_step_costs_its_drafts_not_the_engine(datastore):
    """A method whose step bookkeeping raises (before: out of propose, into vLLM's step)."""

    class FailingOnce(Scripted):
        def observe_sampled(self, step):
            if not self.failed:
                self.failed = True
                raise RuntimeError("bookkeeping")

    method = FailingOnce([[7, 8, 9], [7, 8, 9]])
    method.failed = False
    proposer = helpers.proposer(
        {"method": "rest", "num_speculative_tokens": 3, "datastore": datastore}, method=method)
    tokens, lengths = batch([1, 2])
    assert proposer.propose([[2]], lengths, tokens) == [[]]
    assert proposer.stats()["failed_exception"] == 1
    assert proposer.propose([[2]], lengths, tokens) == [[7, 8, 9]]


def test_rest_drafts_trees_for_the_rows_vllm_verifies_as_trees(datastore):
    # "1 2 3" is followed by "4 5 6 7" (then the end, or 0) twice and by "9" once.
    proposer = rest(datastore, num_speculative_tokens=6, min_prefix_prob=0.5, tree="on",
                    tree_min_prob=0.3)
    tokens, lengths = batch([1, 2, 3], [5, 1, 2, 3], [8, 1])
    proposer.observe_batch(["a", "b", "c"], [True, False, True])
    drafts = proposer.propose([[3], [3], [1]], lengths, tokens)
    # Row a: the chain 4 5 6 7 (2/3 each), then the branches of 1/3: 9 after 3, 0 after 7.
    assert drafts[0][:4] == [4, 5, 6, 7]
    parents = proposer.trees["a"].parents.tolist()
    assert parents[:4] == [-1, 0, 1, 2]
    assert sorted(zip(drafts[0][4:], parents[4:])) == [(0, 3), (9, -1)]
    # Row b (a sampled request) gets the chain; row c's continuations agree: a chain, which
    # vLLM verifies as one.
    assert drafts[1:] == [[4, 5, 6, 7], [2, 3, 4, 5, 6, 7]]
    assert list(proposer.trees) == ["a"]
    proposer.observe_batch(["a"], None)
    tokens, lengths = batch([1, 2, 3])
    assert proposer.propose([[3]], lengths, tokens) == [[4, 5, 6, 7]]
    assert proposer.trees == {}


def test_a_tree_with_parents_out_of_order_costs_its_draft(datastore, caplog):
    from vllm_retrieval_spec.drafting.tree import TreeDraft

    proposer = helpers.proposer(
        {"method": "rest", "num_speculative_tokens": 4, "datastore": datastore},
        method=Scripted([lambda: TreeDraft(np.array([1, 2, 3]), np.array([-1, 2, 0]), 1, 0.5)]))
    proposer.observe_batch(["a"], [True])
    tokens, lengths = batch([1, 2])
    assert proposer.propose([[2]], lengths, tokens) == [[]]
    assert proposer.stats() == {"failed_bad_tree": 1}
    assert "not in topological order" in caplog.text


class DraftClock:
    """The drafting guard's clock (``perf_counter_ns``): it moves only when a drafter says it
    took time, so a busy machine (a preempted fast draft, a GC pause) changes no outcome."""

    def __init__(self):
        self.ns = 0

    def perf_counter_ns(self):
        return self.ns


@pytest.fixture
def clock(monkeypatch):
    from vllm_retrieval_spec.drafting import guard

    clock = DraftClock()
    monkeypatch.setattr(guard, "time", SimpleNamespace(perf_counter_ns=clock.perf_counter_ns,
                                                       sleep=time.sleep))
    return clock


class Slow(MethodDrafter):
    """Takes 20 ms of the guard's clock to draft after a 9, no time otherwise."""

    def __init__(self, clock):
        self.clock = clock

    def draft(self, row, context, max_len):
        if context[-1] == 9:
            self.clock.ns += 20_000_000
        return np.asarray([1], dtype=np.int32)


def test_a_draft_over_its_time_budget_is_dropped(datastore, caplog, clock):
    proposer = helpers.proposer(
        {"method": "rest", "num_speculative_tokens": 3, "datastore": datastore,
         "draft_budget_ms": 10.0, "min_draft_len": 1}, method=Slow(clock))
    tokens, lengths = batch([1, 9], [1, 2], [1, 9])
    assert proposer.propose([[9], [2], [9]], lengths, tokens) == [[], [1], []]
    assert proposer.stats() == {"failed_over_budget": 2}
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "over its 10.0 ms budget" in errors[0]



def test_tensor_parallel_ranks_drop_no_draft_by_their_own_clock(datastore, clock):
    # Every rank drafts, and each verifies the tree its own drafter made: a time budget would
    # drop a draft on a rank that happened to be slow and not on the others, and that rank
    # would verify the tokens as a chain while the others attend to them as a tree.
    config = vllm_config({"method": "rest", "num_speculative_tokens": 3, "datastore": datastore,
                          "draft_budget_ms": 10.0, "min_draft_len": 1})
    config.parallel_config = SimpleNamespace(world_size=2)
    proposer = RetrievalProposer(config, Slow(clock))
    tokens, lengths = batch([1, 9], [1, 2], [1, 9])
    assert proposer.propose([[9], [2], [9]], lengths, tokens) == [[1], [1], [1]]
    assert proposer.stats() == {}


def test_prometheus_series_count_lookups_and_forwards(datastore):
    from prometheus_client import REGISTRY

    def value(name, **labels):
        return REGISTRY.get_sample_value(f"vllm_rsd:{name}", {"method": "rest", **labels}) or 0

    names = ("lookups_total", "empty_lookups_total", "target_forwards_total",
             "output_tokens_total")
    before = {name: value(name) for name in names}
    proposer = rest(datastore)
    tokens, lengths = batch([1, 2, 3], [42, 43], [1, 2])
    # A drafted row (3 tokens sampled), an empty lookup (1 sampled), a prefill (nothing).
    proposer.propose([[5, 6, 3], [43], []], lengths, tokens)
    # Published once the drafts are handed over, off the critical path.
    assert {name: value(name) for name in names} == before
    proposer.after_handover()
    after = {name: value(name) for name in names}
    assert {name: after[name] - before[name] for name in names} == {
        "lookups_total": 2, "empty_lookups_total": 1, "target_forwards_total": 2,
        "output_tokens_total": 4}


def test_prometheus_series_count_a_tensor_parallel_engines_steps_once(datastore):
    """Every rank drafts the same drafts for the same requests, and ``/metrics`` sums the
    series of every process: before, an engine of 2 ranks counted every lookup, forward,
    token, failed draft and drafting time twice. The first rank counts (vLLM's output rank)."""
    from prometheus_client import REGISTRY

    series = {"lookups_total": {}, "target_forwards_total": {}, "output_tokens_total": {},
              "drafting_seconds_count": {}, "failed_drafts_total": {"kind": "exception"}}

    def values():
        return {name: REGISTRY.get_sample_value(f"vllm_rsd:{name}",
                                                {"method": "rest", **labels}) or 0
                for name, labels in series.items()}

    counted = {}
    for rank in (0, 1):
        config = vllm_config({"method": "rest", "num_speculative_tokens": 4,
                              "datastore": datastore, "min_prefix_prob": 0.0,
                              "prior_weight": 0.0})
        config.parallel_config = SimpleNamespace(world_size=2, rank=rank, tensor_parallel_size=2)
        before = values()
        proposer = RetrievalProposer(config)
        tokens, lengths = batch([1, 2, 3])
        proposer.propose([[3]], lengths, tokens)
        proposer.after_handover()
        proposer.observe_drafting_time(0.001, 0.002)
        proposer.report_failure("exception", "raised in a test")
        counted[rank] = {name: value - before[name] for name, value in values().items()}
    assert counted == {0: dict.fromkeys(series, 1), 1: dict.fromkeys(series, 0)}



def test_a_tensor_parallel_engines_served_store_is_one_series():
    """Every rank keeps the same served store, and ``/metrics`` shows the gauge once per
    process: before, an engine of 2 ranks showed its store twice. The first rank reports it:
    rank 1 storing a request of another size leaves the gauge at rank 0's."""
    from prometheus_client import REGISTRY

    sizes = {}
    for rank, output in ((0, list(range(10, 20))), (1, [10, 11])):
        config = vllm_config({"method": "hybrid", "num_speculative_tokens": 4})
        config.parallel_config = SimpleNamespace(world_size=2, rank=rank, tensor_parallel_size=2)
        proposer = RetrievalProposer(config)
        try:
            tokens, lengths = batch([1, 2, *output])
            proposer.observe_batch(["a"])
            proposer.propose([[output[0]]], np.array([3], dtype=np.int32), tokens)
            proposer.propose([output[1:]], lengths, tokens)
            proposer.observe_finished({"a"})
            assert proposer.method.learning.shared.wait_indexed()
            proposer.observe_batch([])
            sizes[rank] = (proposer.stats()["served_store_tokens"],
                           REGISTRY.get_sample_value("vllm_rsd:served_store_tokens",
                                                     {"method": "hybrid"}))
        finally:
            proposer.close()
    assert sizes == {0: (12, 12), 1: (4, 12)}


@pytest.mark.parametrize("ahead", ["none", "precompute", "before_sampling"])
def test_a_request_without_room_to_draft_makes_no_lookup(ahead):
    """k = 2, max_model_len 8: after its draft of 2 is accepted a request has 7 tokens and no
    room for another (vLLM still calls propose: 6 + 2 fit). That is no draft attempt, however
    its draft was made (before: a draft made ahead counted it as a lookup that found
    nothing)."""
    from prometheus_client import REGISTRY

    from vllm_retrieval_spec.contract import Capabilities

    class Sevens(MethodDrafter):
        capabilities = Capabilities(precomputable=True)

        def draft(self, row, context, max_len):
            return np.full(max_len, 7, dtype=np.int32)

        def followers(self, row, context):
            return np.array([9], dtype=np.int32), True

    def value(name):
        return REGISTRY.get_sample_value(f"vllm_rsd:{name}_total", {"method": "pld"}) or 0

    before = {name: value(name) for name in ("lookups", "empty_lookups")}
    proposer = helpers.proposer(
        {"method": "pld", "num_speculative_tokens": 2, "min_draft_len": 1,
         "precompute_drafts": ahead == "precompute",
         "draft_before_sampling": ahead == "before_sampling"}, 8, Sevens())
    proposer.observe_batch(["r"])
    tokens, lengths = batch([1, 2, 3, 4])
    assert proposer.propose([[4]], lengths, tokens) == [[7, 7]]
    proposer.after_handover()
    proposer.observe_batch(["r"])
    if ahead == "before_sampling":
        proposer.draft_before_sampling([[7, 7, 9]], [[7, 7]], np.array([4]), tokens)
    tokens, lengths = batch([1, 2, 3, 4, 7, 7, 9])
    assert proposer.propose([[7, 7, 9]], lengths, tokens) == [[]]
    proposer.after_handover()
    assert proposer.stats().get("precomputed_used", 0) == (ahead != "none")
    assert {name: value(name) - before[name] for name in before} == {
        "lookups": 1, "empty_lookups": 0}


def test_a_method_hears_which_drafts_the_step_verified_as_trees():
    """``SampledStep.trees`` are the trees of the drafts the step verified, handed out by the
    propose before it: hybrid's served dense store keeps a tree's accepted states apart from a
    chain's, which are contiguous (before: it got the trees just handed out for the next step,
    so a tree's path verified this step was read as a chain's states, and stored)."""
    from vllm_retrieval_spec.drafting.tree import TreeDraft

    class TreeThenChain(MethodDrafter):
        def __init__(self):
            self.drafts = [TreeDraft(np.array([5, 6, 9], dtype=np.int32), np.array([-1, 0, -1]),
                                     2, 0.6), np.array([7, 7, 7], dtype=np.int32)]
            self.verified_trees = []

        def draft(self, row, context, max_len):
            return self.drafts.pop(0)

        def observe_sampled(self, step):
            self.verified_trees.append(sorted(step.trees))

    method = TreeThenChain()
    proposer = helpers.proposer({"method": "pld", "num_speculative_tokens": 3, "tree": "on",
                                 "min_draft_len": 1}, method=method)
    proposer.observe_batch(["r"], [True])
    tokens, lengths = batch([1, 2, 3])
    assert proposer.propose([[3]], lengths, tokens) == [[5, 6, 9]]
    # The target took the branch: 9, then 4.
    proposer.observe_batch(["r"], [True])
    tokens, lengths = batch([1, 2, 3, 9, 4])
    assert proposer.propose([[9, 4]], lengths, tokens) == [[7, 7, 7]]
    assert method.verified_trees == [[], ["r"]]

def test_injected_faults_cost_only_drafts(datastore):
    config = vllm_config({"method": "rest", "num_speculative_tokens": 4, "datastore": datastore,
                          "inject_faults": 1.0, "draft_budget_ms": 1.0})
    proposer = RetrievalProposer(config)
    tokens, lengths = batch([1, 2, 3])
    drafts = [proposer.propose([[3]], lengths, tokens) for _ in range(8)]
    assert drafts == [[[]]] * 8
    assert proposer.stats() == {"failed_exception": 2, "failed_too_long": 2,
                                "failed_out_of_vocabulary": 2, "failed_over_budget": 2}


def journaled_hybrid_config(tmp_path, **options):
    """vLLM's config for hybrid with a served_datastore under ``tmp_path`` (the journal checks
    the model's tokenizer, saved there too)."""
    make_tokenizer().save_pretrained(tmp_path / "tokenizer")
    config = vllm_config({"method": "hybrid", "num_speculative_tokens": 4,
                          "served_datastore": str(tmp_path / "served"), **options})
    config.model_config.tokenizer = str(tmp_path / "tokenizer")
    config.model_config.tokenizer_revision = None
    config.model_config.trust_remote_code = False
    return config


def test_a_request_vllm_finished_is_journaled_before_any_other_step(tmp_path):
    """After a burst's last request vLLM runs one empty step to say it finished
    (``observe_finished``): it is stored and journaled then, with its last step's tokens, though
    no other request comes."""
    from vllm_retrieval_spec.datastore.journal import JournalReader
    from vllm_retrieval_spec.proposers.base import RetrievalProposer

    config = journaled_hybrid_config(tmp_path, served_flush_ms=1)
    proposer = RetrievalProposer(config)
    try:
        output = list(range(10, 20))
        tokens, _ = batch([1, 2, *output], [3, 4, 5, 6])
        proposer.observe_batch(["a", "b"])
        proposer.propose([[10], [5]], np.array([3, 3], dtype=np.int32), tokens)
        proposer.propose([output[1:], [6]], np.array([12, 4], dtype=np.int32), tokens)
        proposer.after_handover()
        proposer.observe_finished({"a", "never-seen"})
        directory = proposer.method.learning.directory
        directory.writer.flush()
        journaled = JournalReader(tmp_path / "served", "", {}).poll()
        # "a" (prompt and output), not "b", which still runs.
        assert [r.tokens.tolist() for r in journaled] == [[1, 2, *output]]
        assert proposer.stats()["served_store_requests"] == 1
    finally:
        proposer.close()


def test_hybrid_learns_from_requests_that_left_the_batch(tmp_path):
    """With no datastore at all: request "a" generates 10..19; once vLLM has finished it a
    new request that reaches "10 11" is drafted its continuation. With served_datastore the
    store is journaled (closing stores and journals the requests still in a batch), and a new
    proposer starts from the journal."""
    from vllm_retrieval_spec.proposers.base import RetrievalProposer

    config = journaled_hybrid_config(tmp_path)
    proposer = RetrievalProposer(config)
    try:
        output = list(range(10, 20))
        tokens, lengths = batch([1, 2, *output])
        proposer.observe_batch(["a"])
        proposer.propose([[10]], np.array([3], dtype=np.int32), tokens)  # prefill of "a"
        proposer.propose([output[1:]], lengths, tokens)  # the rest, as one step
        tokens, lengths = batch([7, 8, 10, 11])
        proposer.observe_finished({"a"})  # it is served
        proposer.observe_batch(["b"])
        assert proposer.method.learning.shared.wait_indexed()
        assert proposer.stats()["served_store_tokens"] == 12  # prompt and output
        assert proposer.propose([[11]], lengths, tokens) == [[12, 13, 14, 15]]
        proposer.after_handover()
        from prometheus_client import REGISTRY

        # The soak test reads the store's size from /metrics (bounded by served_max_tokens).
        assert REGISTRY.get_sample_value("vllm_rsd:served_store_tokens",
                                         {"method": "hybrid"}) == 12
    finally:
        proposer.close()
    # "b" never left a batch; closing stored and journaled it.
    from vllm_retrieval_spec.datastore.journal import JournalReader

    journaled = JournalReader(tmp_path / "served", "", {}).poll()
    assert sorted(len(r.tokens) for r in journaled) == [4, 12]
    restarted = RetrievalProposer(config)
    try:
        tokens, lengths = batch([5, 13, 14])
        restarted.observe_batch(["c"])
        assert restarted.propose([[14]], lengths, tokens) == [[15, 16, 17, 18]]
    finally:
        restarted.close()


@pytest.mark.parametrize("served_prompts", [False, True])
def test_hybrid_stores_a_preempted_request_once_whole_when_vllm_finishes_it(served_prompts):
    """vLLM takes a preempted request (or a running one it did not schedule this step) out of
    its batch and puts it back later with its prompt and output (recomputed): absent from a
    batch is not finished. It is stored once vLLM finishes it, once, as vLLM returned it."""
    from vllm_retrieval_spec.proposers.base import RetrievalProposer

    proposer = RetrievalProposer(vllm_config({"method": "hybrid", "num_speculative_tokens": 4,
                                              "served_prompts": served_prompts,
                                              "precompute_drafts": False}))
    try:
        store = proposer.method.learning.shared
        # "a": prompt 1 2 3, it samples 10, then 11; "b" decodes beside it.
        tokens, _ = batch([1, 2, 3, 10, 11], [5, 6, 30])
        proposer.observe_batch(["a", "b"])
        proposer.propose([[10], [30]], np.array([4, 3]), tokens)
        proposer.observe_batch(["a", "b"])
        proposer.propose([[11], []], np.array([5, 3]), tokens)
        # "a" preempted: "b" decodes alone, in row 0.
        tokens, _ = batch([5, 6, 30, 31])
        proposer.observe_batch(["b"])
        proposer.propose([[31]], np.array([4]), tokens)
        proposer.after_handover()
        assert store.num_documents == 0
        # "a" back in row 1, its prompt and output recomputed: it samples 12, then 13.
        tokens, _ = batch([5, 6, 30, 31, 32], [1, 2, 3, 10, 11, 12, 13])
        proposer.observe_batch(["b", "a"])
        proposer.propose([[32], [12]], np.array([5, 6]), tokens)
        proposer.observe_batch(["b", "a"])
        proposer.propose([[], [13]], np.array([5, 7]), tokens)
        proposer.after_handover()
        assert store.num_documents == 0
        proposer.observe_finished({"a"})
        prompt = [1, 2, 3] if served_prompts else []
        assert [d.tolist() for d in store.documents()] == [prompt + [10, 11, 12, 13]]
    finally:
        proposer.close()


def test_hybrid_stores_the_tokens_of_steps_vllm_drafted_nothing_for():
    """vLLM may call no ``propose`` for a step (``_input_fits_in_drafter``: within k tokens of
    max_model_len, before our patch of it); its runner still writes the steps' tokens to its
    batch. A request that finished then is stored with them: its tokens in vLLM's batch, handed
    to ``observe_finished``."""
    from vllm_retrieval_spec.proposers.base import RetrievalProposer

    proposer = RetrievalProposer(vllm_config({"method": "hybrid", "num_speculative_tokens": 4,
                                              "precompute_drafts": False}, max_model_len=12))
    try:
        # "a": prompt 1 2 3, it samples 10, then 11 (7 tokens: a 4-token draft still fits).
        sequence = [1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 17, 18]
        tokens, _ = batch(sequence[:4], width=12)
        proposer.observe_batch(["a"])
        proposer.propose([[10]], np.array([4]), tokens)
        tokens[0, 4] = 11
        proposer.observe_batch(["a"])
        proposer.propose([[11]], np.array([5]), tokens)
        proposer.after_handover()
        # Past 12 - 4 tokens vLLM samples (one token a step) without calling propose.
        for n in range(6, 13):
            proposer.observe_batch(["a"])
            tokens[0, n - 1] = sequence[n - 1]
        proposer.observe_finished({"a"}, {"a": tokens[0, :12]})
        stored = [d.tolist() for d in proposer.method.learning.shared.documents()]
        assert stored == [sequence]
    finally:
        proposer.close()


def test_hybrid_per_request_stores_learn_only_within_a_key():
    """``served_store: "per_request"``: "a" (key "x") generates 10..19; after it left, a request
    with key "x" is drafted its continuation, one with key "y" or with no key is not; a request
    without a key is not stored."""
    from vllm_retrieval_spec.proposers.base import RetrievalProposer

    proposer = RetrievalProposer(vllm_config({"method": "hybrid", "num_speculative_tokens": 4,
                                           "served_store": "per_request",
                                           "precompute_drafts": False}))
    try:
        assert proposer.capabilities.served_store_keys
        output = list(range(10, 20))
        tokens, lengths = batch([1, 2, *output], [3, 4, 30, 31])
        proposer.observe_batch(["a", "anonymous"], None, ["x", None])
        proposer.propose([[10], [30]], np.array([3, 3], dtype=np.int32), tokens)
        proposer.propose([output[1:], [31]], lengths, tokens)
        proposer.observe_finished({"a", "anonymous"})  # served
        proposer.observe_batch(["b", "c", "d"], None, ["x", "y", None])
        assert proposer.method.learning.keyed.get("x").wait_indexed()
        # Prompt and output of "a"; "anonymous" finished too but named no store.
        stats = proposer.stats()
        assert (stats["served_store_tokens"], stats["served_store_requests"],
                stats["served_store_keys"]) == (12, 1, 1)
        tokens, lengths = batch([7, 8, 10, 11], [7, 8, 10, 11], [7, 8, 10, 11])
        drafts = proposer.propose([[11], [11], [11]], lengths, tokens)
        assert drafts == [[12, 13, 14, 15], [], []]
    finally:
        proposer.close()


@pytest.mark.parametrize("path", ["after_sampling", "before_sampling", "precomputed"])
def test_a_prompt_given_as_embeddings_is_neither_drafted_from_nor_stored(path):
    """vLLM's row under a prompt given as embeddings holds an earlier request's tokens (here
    another tenant's: 50..55). ``observe_batch``'s ``known_from`` says where the request's own
    ids begin: its drafts come from its own output only, however they are made, and its store
    keeps its output only (before, "b" was drafted [51, 52], and its store kept the leftovers)."""
    options = {"method": "hybrid", "num_speculative_tokens": 3, "served_store": "per_request",
               "served_prompts": True, "min_draft_len": 1,
               "precompute_drafts": path == "precomputed",
               "draft_before_sampling": path == "before_sampling"}
    proposer = RetrievalProposer(vllm_config(options))
    try:
        # "b" (tenant "y"): 6 prompt positions as embeddings, then it samples 50, 60, 50.
        tokens, _ = batch([50, 51, 52, 53, 54, 55, 50, 60, 50])
        drafts = []
        for n in (7, 8, 9):
            proposer.observe_batch(["b"], None, ["y"], None, [6])
            sampled = [[int(tokens[0, n - 1])]]
            if path == "before_sampling":
                proposer.draft_before_sampling(sampled, [[]], np.array([n - 1]), tokens)
            drafts += proposer.propose(sampled, np.array([n]), tokens)
            proposer.after_handover()
        # From its own output: 50 was followed by 60, never by the leftovers' 51.
        assert drafts == [[], [], [60, 50]]
        proposer.observe_finished({"b"})
        store = proposer.method.learning.keyed.get("y")
        assert store.wait_indexed()
        assert [d.tolist() for d in store.documents()] == [[50, 60, 50]]
    finally:
        proposer.close()
