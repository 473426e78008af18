"""The patches that wire tree verification into vLLM's step (``patches.trees``), around fake
runners and verifiers: when the verifier is made, and that each wrapper calls it at its point
of the step with what vLLM passes there. Imports ``vllm.platforms`` and ``SamplingParams`` only
(no engine)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from vllm import SamplingParams

from vllm_retrieval_spec.contract import Capabilities, Drafter
from vllm_retrieval_spec.patches import trees


def runner(drafts_trees: bool = True, kv_caches: tuple = ("layer 0's cache",)):
    drafter = mock.create_autospec(Drafter, instance=True)
    drafter.capabilities = Capabilities(trees=drafts_trees)
    return SimpleNamespace(drafter=drafter, kv_caches=list(kv_caches))


@pytest.fixture
def made(monkeypatch):
    """The platform's verifiers ``tree_verifier`` made, in order; the platform is vLLM-CPU
    unless a test sets ``platform.cpu`` False."""
    import vllm.platforms

    from vllm_retrieval_spec.verification import cpu, cuda

    made = []
    platform = SimpleNamespace(cpu=True)
    monkeypatch.setattr(vllm.platforms, "current_platform",
                        SimpleNamespace(is_cpu=lambda: platform.cpu))
    monkeypatch.setattr(cpu, "cpu_tree_verifier", lambda r: made.append("cpu") or "cpu's")
    monkeypatch.setattr(cuda, "cuda_tree_verifier", lambda r: made.append("cuda") or "cuda's")
    return SimpleNamespace(verifiers=made, platform=platform)


@pytest.mark.parametrize("cpu, expected", [(True, "cpu's"), (False, "cuda's")])
def test_the_platforms_verifier_is_made_once_per_runner(made, cpu, expected):
    made.platform.cpu = cpu
    r = runner()
    assert trees.tree_verifier(r) == expected
    assert trees.tree_verifier(r) == expected
    assert made.verifiers == [expected[:-2]]


def test_no_verifier_without_a_tree_drafter_or_before_the_kv_cache(made):
    assert trees.tree_verifier(runner(drafts_trees=False)) is None
    assert trees.tree_verifier(runner(kv_caches=())) is None
    # vLLM's own drafters draft no trees.
    assert trees.tree_verifier(SimpleNamespace(drafter=SimpleNamespace(),
                                               kv_caches=["cache"])) is None
    assert made.verifiers == []


def test_a_new_kv_cache_gets_a_new_verifier(made):
    # vLLM initializes the cache again (e.g. after profiling): the old verifier saw old caches.
    r = runner()
    r._rsd_tree_verifier = "the previous cache's"
    initialize = trees.with_tree_verifier(lambda self, *args: ("initialized", args))
    assert initialize(r, "kv_cache_config", False, None) == \
        ("initialized", ("kv_cache_config", False, None))
    assert r._rsd_tree_verifier == "cpu's" and made.verifiers == ["cpu"]


class Verifier:
    """Records the calls the wrappers make; ``step`` is None in a step without trees."""

    def __init__(self, step=None):
        self.step, self.calls = step, []

    def begin_step(self, *args):
        self.calls.append(("begin_step", *args))

    def attend(self, impl, query, key, value, kv_cache, metadata, output):
        self.calls.append(("attend", impl, output.tolist(), metadata))

    def walk(self, logits, num_draft_tokens, draft_token_ids, sample_nodes):
        self.calls.append(("walk", logits.tolist(), num_draft_tokens, draft_token_ids,
                           sample_nodes.metadata, sample_nodes.topk_topp_sampler))
        return "walks"

    def accept(self, walks, sampled):
        self.calls.append(("accept", walks, sampled))


def test_a_tree_is_verified_for_requests_whose_params_allow_it():
    """Greedy and plainly sampled requests' trees are verified (False: by the argmax), the
    others' as chains; a request vLLM no longer holds has no tree."""
    requests = {name: SimpleNamespace(sampling_params=SamplingParams(**params)) for name, params
                in {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.8, "top_k": 5},
                    "min_p": {"temperature": 0.8, "min_p": 0.1},
                    "penalised": {"temperature": 0.0, "repetition_penalty": 1.1},
                    "chain": {"temperature": 0.0}}.items()}
    drafted = dict.fromkeys(["greedy", "sampled", "min_p", "penalised", "gone"], "a tree")
    assert trees.tree_samples(requests, drafted) == {"greedy": False, "sampled": True}


@pytest.mark.parametrize("step, in_flight", [("a step with trees", True), (None, False)])
def test_the_tree_step_begins_after_the_inputs_are_prepared(monkeypatch, step, in_flight):
    monkeypatch.setattr(trees, "_trees_in_flight", None)
    verifier = Verifier(step)
    drafted = {"a": "a's tree"}
    r = SimpleNamespace(_rsd_tree_verifier=verifier, drafter=SimpleNamespace(trees=drafted),
                        input_batch=SimpleNamespace(req_ids=["a", "b"],
                                                    num_computed_tokens_cpu="computed"),
                        positions="positions",
                        requests={"a": SimpleNamespace(sampling_params=SamplingParams()),
                                  "b": SimpleNamespace(sampling_params=SamplingParams())})
    scheduler_output = SimpleNamespace(scheduled_spec_decode_tokens="drafts",
                                       total_num_scheduled_tokens=9)
    prepare = trees.with_tree_positions(lambda self, out, num: "prepared")
    assert prepare(r, scheduler_output, "scheduled") == "prepared"
    assert verifier.calls == [("begin_step", drafted, ["a", "b"], "drafts", "scheduled",
                               "computed", "positions", 9, {"a": True})]
    assert trees._trees_in_flight is (verifier if in_flight else None)


def test_tree_rows_are_attended_after_the_backends_attention(monkeypatch):
    def backend(impl, layer, query, key, value, kv_cache, metadata, output):
        output.fill_(1.0)
        return "attended"

    verifier = Verifier("a step with trees")
    attention = trees.with_tree_attention(backend)
    monkeypatch.setattr(trees, "_trees_in_flight", None)
    assert attention("impl", "layer", 0, 0, 0, 0, "metadata", torch.zeros(2)) == "attended"
    monkeypatch.setattr(trees, "_trees_in_flight", verifier)
    assert attention("impl", "layer", 0, 0, 0, 0, "metadata", torch.zeros(2)) == "attended"
    # The wrapper sees the backend's rows, to overwrite the tree rows of.
    assert verifier.calls == [("attend", "impl", [1.0, 1.0], "metadata")]


def test_the_walk_reads_the_logits_before_vllms_sampler_and_accepts_after(monkeypatch):
    def sample(self, logits, metadata):
        logits.fill_(0.0)      # vLLM's sampler may modify the logits in place
        return SimpleNamespace(sampled_token_ids="sampled")

    verifier = Verifier("a step with trees")
    monkeypatch.setattr(trees, "_trees_in_flight", verifier)
    # Sampled requests' nodes are drawn by the runner's own sampler, with the step's metadata.
    r = SimpleNamespace(_rsd_tree_verifier=verifier,
                        input_batch=SimpleNamespace(sampling_metadata="the step's metadata"),
                        sampler=SimpleNamespace(topk_topp_sampler="vLLM's top-k/top-p"))
    metadata = SimpleNamespace(num_draft_tokens=[1], draft_token_ids="draft ids")
    output = trees.with_tree_acceptance(sample)(r, torch.ones(2), metadata)
    assert output.sampled_token_ids == "sampled"
    assert verifier.calls == [("walk", [1.0, 1.0], [1], "draft ids", "the step's metadata",
                               "vLLM's top-k/top-p"), ("accept", "walks", "sampled")]
    assert trees._trees_in_flight is None
    # A step that speculates nothing (no metadata) is vLLM's alone.
    verifier.calls.clear()
    assert trees.with_tree_acceptance(sample)(r, torch.ones(2), None).sampled_token_ids == \
        "sampled"
    assert verifier.calls == []
