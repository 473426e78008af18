"""The plugin patches only the vLLM it was written against; on any other it stays out of the way."""

from __future__ import annotations

import logging
import os
import sys
from types import SimpleNamespace

import pytest

from helpers import patched_by_register, vllm_patches_undone

pytestmark = pytest.mark.e2e  # imports vLLM (about 12 s), starts no engine

vllm = pytest.importorskip("vllm")

from vllm_retrieval_spec import plugin  # noqa: E402
from vllm_retrieval_spec.patches import vllm_cpu  # noqa: E402


def test_accepts_the_installed_vllm_also_once_patched(undo_register):
    # vLLM calls register() in every process; the check must then still see vLLM's originals.
    assert plugin.vllm_incompatibility() is None
    plugin.register()
    assert plugin.vllm_incompatibility() is None


def test_what_register_patches_is_put_back(monkeypatch):
    """conftest's ``undo_register``: after ``register()`` on the real vLLM, every class and
    module it patches holds exactly what it held before (nothing replaced, nothing left added),
    and the plugin's registered flag and warned-once variable are as they were."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    owners = list({id(owner): owner for owner, _ in patched_by_register()}.values())
    assert GPUModelRunner in owners and Worker in owners
    before = [dict(vars(owner)) for owner in owners]
    flags = (plugin._registered, os.environ.get(plugin._WARNED_ENV))
    original_propose = GPUModelRunner.__dict__["propose_draft_token_ids"]
    monkeypatch.delenv(plugin.DISABLE_ENV, raising=False)
    with vllm_patches_undone():
        plugin._registered = False  # patch again, also where vLLM has loaded the plugin already
        plugin.register()
        assert GPUModelRunner.__dict__["propose_draft_token_ids"] is not original_propose
        assert "rsd_drafting_stats" in Worker.__dict__
    assert GPUModelRunner.__dict__["propose_draft_token_ids"] is original_propose
    absent = object()
    for owner, saved in zip(owners, before):
        now = vars(owner)
        changed = [name for name in {*saved, *now}
                   if saved.get(name, absent) is not now.get(name, absent)]
        assert changed == [], f"{owner.__name__}: {changed} left patched"
    assert (plugin._registered, os.environ.get(plugin._WARNED_ENV)) == flags


def test_names_another_vllm_version(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    assert plugin.vllm_incompatibility().startswith(
        "found vLLM 0.33.0. vllm-retrieval-spec supports vLLM 0.32.*")


def test_names_a_changed_signature(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def changed(self, scheduler_output, sampled_token_ids):
        pass

    monkeypatch.setattr(GPUModelRunner, "propose_draft_token_ids", changed)
    assert plugin.vllm_incompatibility().startswith(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids has parameters "
        "('self', 'scheduler_output', 'sampled_token_ids')")


def test_a_module_that_cannot_import_is_a_reason_only_where_it_is_patched(monkeypatch):
    # Before: an ImportError here escaped register() and broke vLLM's start-up for everyone.
    import importlib

    real_import = importlib.import_module
    failing = set()

    def import_module(name, *args):
        if name in failing:
            raise ImportError(f"no {name} here")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", import_module)
    flash_attn = "vllm.v1.attention.backends.flash_attn"
    failing |= {flash_attn, f"{flash_attn}.FlashAttentionImpl"}
    monkeypatch.setattr(plugin, "_platform", lambda: "cpu")
    assert plugin.vllm_incompatibility() is None
    monkeypatch.setattr(plugin, "_platform", lambda: "accelerator")
    assert plugin.vllm_incompatibility().startswith(
        f"cannot import {flash_attn} (ImportError: no {flash_attn} here). vllm-retrieval-spec "
        "supports vLLM 0.32.*")


def test_on_another_vllm_nothing_is_patched_and_only_our_methods_fail(undo_register, monkeypatch,
                                                                       caplog):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    calls = []

    def create_speculative_config(self, target_model_config, target_parallel_config):
        calls.append((self.speculative_config, target_model_config, target_parallel_config))
        return "vLLM's own config"

    monkeypatch.setattr(EngineArgs, "create_speculative_config", create_speculative_config)
    # Whatever register() would change is put back after the test.
    create_engine_config = EngineArgs.create_engine_config
    monkeypatch.setattr(EngineArgs, "create_engine_config", create_engine_config)
    propose = GPUModelRunner.propose_draft_token_ids
    monkeypatch.setattr(GPUModelRunner, "propose_draft_token_ids", propose)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.delenv(plugin._WARNED_ENV, raising=False)

    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    warnings = [r.getMessage() for r in caplog.records if r.name == plugin.__name__]
    assert warnings == ["vllm-retrieval-spec is inactive, vLLM runs unpatched: found vLLM "
                        "0.33.0. vllm-retrieval-spec supports vLLM 0.32.*; install that "
                        "version, or set VLLM_RSD_DISABLE=1 to run vLLM without this plugin"]
    assert GPUModelRunner.propose_draft_token_ids is propose
    assert EngineArgs.create_engine_config is create_engine_config

    # vLLM's own methods, and no speculation at all, reach vLLM unchanged.
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    for options in (ngram, None):
        engine_args = SimpleNamespace(speculative_config=options)
        assert EngineArgs.create_speculative_config(engine_args, "model", "parallel") == \
            "vLLM's own config"
    assert calls == [(ngram, "model", "parallel"), (None, "model", "parallel")]
    # Ours fail with the reason instead of vLLM's list of its own method names.
    engine_args = SimpleNamespace(speculative_config={"method": "rest",
                                                      "num_speculative_tokens": 4})
    with pytest.raises(plugin.IncompatibleVllmError,
                       match=r"speculative_config method 'rest' is unavailable: found vLLM "
                             r"0.33.0"):
        EngineArgs.create_speculative_config(engine_args, "model", "parallel")
    assert len(calls) == 2

    # vLLM's engine and worker processes load the plugin again: they do not warn again.
    caplog.clear()
    monkeypatch.setattr(plugin, "_registered", False)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    assert not [r for r in caplog.records if r.name == plugin.__name__]


def test_expand_batch_to_tokens_replacement():
    import torch

    original = pytest.importorskip("vllm.v1.sample.rejection_sampler").expand_batch_to_tokens
    expand = vllm_cpu.expand_batch_to_tokens(original)
    cu = torch.tensor([3, 5, 9], dtype=torch.int32)
    temperature = expand(torch.tensor([-1.0, 0.8, 0.5]), cu, 9, replace_from=-1, replace_to=1)
    assert temperature.tolist() == pytest.approx([1, 1, 1, 0.8, 0.8, 0.5, 0.5, 0.5, 0.5])
    top_k = expand(torch.tensor([5, 0, 7], dtype=torch.int32), cu, 9)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [5, 5, 5, 0, 0, 7, 7, 7, 7]
    assert expand(torch.tensor([2.0]), torch.tensor([0]), 0).numel() == 0


def test_top_k_of_a_step_without_draft_tokens():
    import torch

    original = pytest.importorskip("vllm.v1.sample.rejection_sampler").apply_top_k_top_p
    apply = vllm_cpu.without_empty_batches(original)
    empty = torch.empty(0, 8)
    assert apply(empty, torch.empty(0, dtype=torch.int64), None) is empty
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    masked = apply(logits.clone(), torch.tensor([2]), None)
    assert masked.tolist() == [[-float("inf"), 3.0, -float("inf"), 2.0]]


def test_observe_batch_hands_served_store_keys_only_to_drafters_that_ask():
    """Each row's ``extra_args["served_store_key"]`` (any value, as its str; None: no key)."""
    from unittest import mock

    from vllm_retrieval_spec.contract import Capabilities, Drafter
    from vllm_retrieval_spec.patches.drafter import with_drafts_before_sampling

    requests = {"a": SimpleNamespace(num_prompt_tokens=3, sampling_params=SimpleNamespace(
                    extra_args={"served_store_key": "tenant-1"}, max_tokens=5)),
                "b": SimpleNamespace(num_prompt_tokens=4, sampling_params=SimpleNamespace(
                    extra_args=None, max_tokens=None)),
                "c": SimpleNamespace(num_prompt_tokens=5, sampling_params=SimpleNamespace(
                    extra_args={"served_store_key": 7}, max_tokens=16))}
    sample = with_drafts_before_sampling(lambda runner, logits, metadata: "sampled")
    seen = []
    for keys in (True, False):
        drafter = mock.create_autospec(Drafter, instance=True)
        drafter.capabilities = Capabilities(served_store_keys=keys)
        drafter.observe_batch.side_effect = lambda *args: seen.append(args)
        runner = SimpleNamespace(drafter=drafter, requests=requests,
                                 input_batch=SimpleNamespace(req_ids=["a", "b", "c"]))
        assert sample(runner, None, None) == "sampled"
        drafter.draft_before_sampling.assert_not_called()
    # And how many tokens each may reach, prompt included (None: max_model_len alone).
    # No prompt came as embeddings: every token id is known (None).
    assert seen == [(["a", "b", "c"], None, ["tenant-1", None, "7"], [8, None, 21], None),
                    (["a", "b", "c"], None, None, [8, None, 21], None)]
    # vLLM's own drafters are left alone.
    runner = SimpleNamespace(drafter=SimpleNamespace(), requests=requests,
                             input_batch=SimpleNamespace(req_ids=["a"]))
    assert sample(runner, None, None) == "sampled"



def test_the_drafter_hears_where_each_row_s_token_ids_begin_and_never_reads_the_rest():
    """vLLM writes no token id into its row for prompt positions given as embeddings
    (``prompt_embeds``, or embedding parts of a prompt: ``is_token_ids`` False there): they
    keep an earlier request's tokens. The drafter hears, per row, the first position from which
    every id is known, and a finished request's row comes with ``UNKNOWN_TOKEN`` before it."""
    from unittest import mock

    import numpy as np

    from vllm_retrieval_spec.contract import UNKNOWN_TOKEN, Capabilities, Drafter
    from vllm_retrieval_spec.patches.drafter import (
        telling_finished_requests, with_drafts_before_sampling)

    def state(prompt_len, embeds=None, is_token_ids=None):
        return SimpleNamespace(num_prompt_tokens=prompt_len, prompt_embeds=embeds,
                               prompt_is_token_ids=is_token_ids, prompt_token_ids=None,
                               sampling_params=SimpleNamespace(
                                   extra_args=None, max_tokens=None, eos_token_id=None))

    # Row 0 an earlier request's leftovers (9s) under a 4-position embedded prompt; row 1 ids
    # only; row 2 a mixed prompt (ids, an embedding, ids).
    requests = {"embeds": state(4, embeds=object()), "ids": state(2),
                "mixed": state(4, embeds=object(), is_token_ids=[True, False, True, True])}
    token_ids = np.array([[9, 9, 9, 9, 5, 6], [1, 2, 3, 0, 0, 0], [7, 9, 8, 7, 4, 0]])
    is_token_ids = np.array([[False] * 4 + [True] * 2, [True] * 6, [True, False] + [True] * 4])
    batch = SimpleNamespace(req_ids=["embeds", "ids", "mixed"], token_ids_cpu=token_ids,
                            is_token_ids=is_token_ids, num_tokens_no_spec=np.array([6, 3, 5]),
                            req_id_to_index={"embeds": 0, "ids": 1, "mixed": 2},
                            req_prompt_embeds={0: object(), 2: object()})
    drafter = mock.create_autospec(Drafter, instance=True)
    drafter.capabilities = Capabilities()
    runner = SimpleNamespace(drafter=drafter, requests=requests, input_batch=batch)
    with_drafts_before_sampling(lambda runner, logits, metadata: None)(runner, None, None)
    assert drafter.observe_batch.call_args.args[4] == [4, 0, 2]
    # A batch without embedded prompts: None, and no request is asked.
    batch.req_prompt_embeds = {}
    with_drafts_before_sampling(lambda runner, logits, metadata: None)(runner, None, None)
    assert drafter.observe_batch.call_args.args[4] is None

    told = {}
    drafter.observe_finished.side_effect = lambda req_ids, tokens: told.update(
        {r: t.tolist() for r, t in tokens.items()})
    telling_finished_requests(lambda *args: None)(runner, SimpleNamespace(
        finished_req_ids={"embeds", "ids", "mixed"}))
    unknown = UNKNOWN_TOKEN
    assert told == {"embeds": [unknown] * 4 + [5, 6], "ids": [1, 2, 3],
                    "mixed": [unknown, unknown, 8, 7, 4]}
    assert token_ids[0, 0] == 9  # vLLM's row itself is left alone


def test_a_row_whose_token_vllm_discards_samples_nothing_before_sampling():
    """A greedy partial prefill has a row of logits, but vLLM discards its token
    (``discard_request_mask``): the drafter hears that it samples nothing, and that a sampled
    request samples tokens not known yet, as ``propose`` will count them."""
    from unittest import mock

    import numpy as np
    import torch

    from vllm_retrieval_spec.contract import Capabilities, Drafter
    from vllm_retrieval_spec.patches.drafter import with_drafts_before_sampling

    SamplingParams = pytest.importorskip("vllm").SamplingParams
    drafter = mock.create_autospec(Drafter, instance=True)
    drafter.capabilities = Capabilities(drafts_before_sampling=True)
    greedy = SimpleNamespace(num_prompt_tokens=2,
                             sampling_params=SamplingParams(temperature=0.0))
    runner = SimpleNamespace(
        drafter=drafter, kv_caches=[],
        requests={"g": greedy, "s": SimpleNamespace(
            num_prompt_tokens=2, sampling_params=SamplingParams(temperature=0.8)), "p": greedy},
        input_batch=SimpleNamespace(req_ids=["g", "s", "p"],
                                    num_tokens_no_spec=np.array([2, 2, 1]),
                                    token_ids_cpu=np.zeros((3, 4), dtype=np.int32)),
        # vLLM's buffer has a row per request it may hold.
        discard_request_mask=SimpleNamespace(np=np.array([False, False, True, False])))
    logits = torch.zeros(3, 10)
    logits[[0, 1, 2], [5, 6, 7]] = 1.0
    sample = with_drafts_before_sampling(lambda runner, logits, metadata: "sampled")
    assert sample(runner, logits, None) == "sampled"
    drafter.report_failure.assert_not_called()
    assert drafter.draft_before_sampling.call_args.args[:2] == ([[5], None, []], [[], [], []])

def test_the_drafting_timer_counts_what_the_engine_waits_for_as_critical():
    from vllm_retrieval_spec.metrics import DraftingTimer

    timer = DraftingTimer(capacity=1)
    for waited in (False, True):
        timer.add_before(3_000_000)
        timer.record(1_000_000)
        timer.add_after(2_000_000, 2_000_000 if waited else 0)
    # Before: the critical part was the handover alone (1 ms), though sampling waits for the
    # drafts made before it.
    assert (timer.last_critical_ns(), timer.last_total_ns()) == (6_000_000, 6_000_000)
    summary = timer.summary()
    assert summary["steps"] == 2 and summary["p50_ms"] == 6.0
    assert sorted([summary["critical_p50_ms"], summary["critical_p99_ms"]]) == \
        pytest.approx([5.0, 5.98])


def test_drafting_before_sampling_and_after_the_handover_on_cpu_is_critical(monkeypatch):
    """On vLLM-CPU nothing runs beside our drafting: the part the engine waits for, as the
    ``vllm_rsd:drafting_critical_seconds`` series hears it, is all of it."""
    import time
    from unittest import mock

    import numpy as np
    import torch

    from vllm_retrieval_spec.contract import Capabilities, Drafter
    from vllm_retrieval_spec.patches.drafter import (
        after_handover, timed_with_hidden_states, with_drafts_before_sampling)

    SamplingParams = pytest.importorskip("vllm").SamplingParams
    drafter = mock.create_autospec(Drafter, instance=True)
    drafter.capabilities = Capabilities(drafts_before_sampling=True)
    drafter.has_work_after_handover = True
    drafter.draft_before_sampling.side_effect = lambda *args: time.sleep(0.003)
    drafter.after_handover.side_effect = lambda *args: time.sleep(0.002)
    runner = SimpleNamespace(
        drafter=drafter, kv_caches=[], device=torch.device("cpu"),
        requests={"g": SimpleNamespace(num_prompt_tokens=2,
                                       sampling_params=SamplingParams(temperature=0.0))},
        input_batch=SimpleNamespace(req_ids=["g"], num_tokens_no_spec=np.array([2]),
                                    token_ids_cpu=np.zeros((1, 4), dtype=np.int32)),
        discard_request_mask=SimpleNamespace(np=np.array([False])))
    with_drafts_before_sampling(lambda *args: None)(runner, torch.zeros(1, 10), None)
    timed_with_hidden_states(lambda *args: [[1]])(runner, None, [[5]], None, None, None, None,
                                                  None, None, None)
    after_handover(lambda *args: None)(runner)
    drafter.report_failure.assert_not_called()
    # The step's drafting is heard once the work after the handover is done, all of it
    # critical.
    (observed,) = drafter.observe_drafting_time.call_args_list
    critical_s, total_s = observed.args
    assert critical_s == total_s and critical_s >= 0.005
    timer = runner._rsd_drafting_timer
    assert timer.last_critical_ns() == timer.last_total_ns()


def test_on_a_gpu_the_work_after_the_handover_that_outlasts_the_forward_is_critical(
        monkeypatch):
    """The drafts made ahead run beside the forward and stop once it is done, but the step
    waits for what runs past it (the draft under way). On a clock only the stand-ins advance:
    the handover takes 0.5 ms, the forward ends 3 ms after it, during a draft that ends 1.5 ms
    later."""
    import time
    from unittest import mock

    import torch

    from vllm_retrieval_spec.contract import Capabilities, Drafter
    from vllm_retrieval_spec.patches.drafter import after_handover, timed_with_hidden_states

    now = [0]
    monkeypatch.setattr(time, "perf_counter_ns", lambda: now[0])
    forward_ends = [None]

    class Event:  # on the stream of a forward launched when it is recorded
        def record(self, stream):
            forward_ends[0] = now[0] + 3_000_000

        def query(self):
            return now[0] >= forward_ends[0]

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: None)

    def make_drafts_ahead(forward_done):
        while not forward_done():
            now[0] += 1_000_000 if now[0] < 2_000_000 else 2_500_000

    drafter = mock.create_autospec(Drafter, instance=True)
    drafter.capabilities = Capabilities()
    drafter.has_work_after_handover = True
    drafter.after_handover.side_effect = make_drafts_ahead
    runner = SimpleNamespace(drafter=drafter, kv_caches=[], device=torch.device("cuda", 0),
                             input_batch=SimpleNamespace(req_ids=["g"]))

    def propose(*args):
        now[0] += 500_000
        return [[1]]

    timed_with_hidden_states(propose)(runner, None, [[5]], None, None, None, None, None, None,
                                      None)
    after_handover(lambda *args: None)(runner)
    drafter.report_failure.assert_not_called()
    # Drafts at 0.5-1.5, 1.5-2.5 and 2.5-5 ms; the forward, done at 3.5, was last seen running
    # at 2.5: that draft is waited for, all of it (when the forward ended between two looks is
    # not known). Before: the critical part was the handover alone (0.5 ms) on a GPU.
    (observed,) = drafter.observe_drafting_time.call_args_list
    assert observed.args == (0.003, 0.005)


def test_finished_requests_are_told_with_their_tokens_in_the_batch():
    """Before vLLM removes them: each finished request's row, every token sampled (those of
    steps vLLM called no propose for included); one not in the batch (preempted) has none."""
    from unittest import mock

    import numpy as np

    from vllm_retrieval_spec.contract import Drafter
    from vllm_retrieval_spec.patches.drafter import telling_finished_requests

    seen = []
    drafter = mock.create_autospec(Drafter, instance=True)
    drafter.observe_finished.side_effect = lambda req_ids, tokens: seen.append(
        (req_ids, {r: t.tolist() for r, t in tokens.items()}))
    runner = SimpleNamespace(drafter=drafter, requests={}, input_batch=SimpleNamespace(
        req_id_to_index={"b": 0, "a": 1}, num_tokens_no_spec=np.array([2, 3]),
        token_ids_cpu=np.array([[7, 8, 0, 0], [1, 2, 3, 0]])))
    update = telling_finished_requests(lambda runner, output: "updated")
    assert update(runner, SimpleNamespace(finished_req_ids={"a", "gone"})) == "updated"
    assert seen == [({"a", "gone"}, {"a": [1, 2, 3]})]


def test_finished_requests_are_told_through_the_token_that_stopped_them():
    """A request's row holds what its last step accepted after its EOS or stop token; vLLM's
    scheduler cut that from the output, and the served store is told the tokens served: through
    the first such token of the output (one in the prompt does not count), none where the
    request ignores EOS and has no stop token."""
    from unittest import mock

    import numpy as np

    from vllm_retrieval_spec.contract import Drafter
    from vllm_retrieval_spec.patches.drafter import telling_finished_requests

    def request(prompt_len, eos, stop_token_ids):
        return SimpleNamespace(num_prompt_tokens=prompt_len, sampling_params=SimpleNamespace(
            eos_token_id=eos, stop_token_ids=stop_token_ids))

    seen = {}
    drafter = mock.create_autospec(Drafter, instance=True)
    drafter.observe_finished.side_effect = lambda req_ids, tokens: seen.update(
        {r: t.tolist() for r, t in tokens.items()})
    runner = SimpleNamespace(
        drafter=drafter,
        requests={"eos": request(3, 2, []), "stop": request(2, None, [8, 9]),
                  "ignores_eos": request(2, None, None)},
        input_batch=SimpleNamespace(
            req_id_to_index={"eos": 0, "stop": 1, "ignores_eos": 2, "unknown": 3},
            num_tokens_no_spec=np.array([7, 6, 5, 3]),
            token_ids_cpu=np.array([[2, 5, 6, 7, 2, 9, 9], [1, 2, 3, 9, 8, 4, 0],
                                    [1, 2, 2, 2, 8, 0, 0], [1, 2, 2, 0, 0, 0, 0]])))
    telling_finished_requests(lambda *args: None)(runner, SimpleNamespace(
        finished_req_ids={"eos", "stop", "ignores_eos", "unknown"}))
    assert seen == {"eos": [2, 5, 6, 7, 2], "stop": [1, 2, 3, 9], "ignores_eos": [1, 2, 2, 2, 8],
                    "unknown": [1, 2, 2]}
    drafter.report_failure.assert_not_called()


def served_through_stop_strings(tokenizer, output: str, eos_after: bool = False,
                                **params) -> str:
    """What ``_as_served`` keeps of a request that answered ``output`` to a one-token prompt
    (an EOS after it where ``eos_after``), its SamplingParams ``params``: the text kept."""
    import numpy as np
    from vllm import SamplingParams

    from vllm_retrieval_spec.patches.drafter import _as_served

    sampling = SamplingParams(**params)
    sampling.update_from_tokenizer(tokenizer)
    prompt = tokenizer.encode("Hi")[:1]
    ids = tokenizer.encode(output) + [tokenizer.eos_token_id] * eos_after
    state = SimpleNamespace(req_id="r", num_prompt_tokens=1, prompt_token_ids=prompt,
                            prompt_embeds=None, sampling_params=sampling)
    served = _as_served(state, np.array(prompt + ids), lambda: tokenizer)
    assert served[:1].tolist() == prompt
    return tokenizer.decode(served[1:])


def test_finished_requests_are_told_through_the_token_that_completed_a_stop_string(tokenizer):
    """vLLM's frontend cuts the output after the token that completes its first stop string
    and aborts the request; the worker's row holds the rest of that step, and of the steps run
    before the abort arrived. The served store is told what was served."""
    said = "The sky is blue. The grass is green. The sun is hot."
    assert served_through_stop_strings(tokenizer, said, stop=["grass"]) == (
        "The sky is blue. The grass")
    # A stop string that ends inside a token: through that token; the earliest to end wins.
    assert served_through_stop_strings(tokenizer, said, stop=["sun", "gra"]) == (
        "The sky is blue. The grass")
    assert served_through_stop_strings(tokenizer, said, stop=["is", "blue"],
                                       include_stop_str_in_output=True) == "The sky is"
    # None before min_tokens output tokens counts (the first "is" is the third token).
    assert served_through_stop_strings(tokenizer, said, stop=["is"], min_tokens=4) == (
        "The sky is blue. The grass is")
    assert served_through_stop_strings(tokenizer, said, stop=["cold"]) == said
    # A long output is searched at its end only, what precedes it priming the decoder: the
    # frontend aborts the request once it sees a stop string, and only the steps in flight
    # follow (the tokens of "ant" x 600 are 600 or more).
    from vllm_retrieval_spec.patches.drafter import STOP_STRING_WINDOW

    long = " ant" * 600
    assert STOP_STRING_WINDOW < 600 <= len(tokenizer.encode(long))
    assert served_through_stop_strings(tokenizer, long + said, stop=["grass"]) == (
        long + "The sky is blue. The grass")
    assert served_through_stop_strings(tokenizer, long + said, stop=["grass"],
                                       min_tokens=610, max_tokens=700) == long + said
    assert served_through_stop_strings(tokenizer, said + long, stop=["grass"]) == said + long
    # An EOS before any stop string stops it there; one after, the stop string.
    eos = tokenizer.eos_token
    assert served_through_stop_strings(tokenizer, said, eos_after=True, stop=["cold"]) == (
        said + eos)
    assert served_through_stop_strings(tokenizer, said, eos_after=True, stop=["hot"]) == (
        said[:-1])


def test_a_request_that_cannot_be_cut_is_told_whole_and_the_others_cut():
    """No tokenizer here (a runner without a model config): the request with a stop string is
    reported as a drafting failure and told whole; the one with an EOS is still cut."""
    from unittest import mock

    import numpy as np

    from vllm_retrieval_spec.contract import Drafter
    from vllm_retrieval_spec.patches.drafter import telling_finished_requests

    seen = {}
    drafter = mock.create_autospec(Drafter, instance=True)
    drafter.observe_finished.side_effect = lambda req_ids, tokens: seen.update(
        {r: t.tolist() for r, t in tokens.items()})
    runner = SimpleNamespace(drafter=drafter, requests={
        "stop": SimpleNamespace(req_id="stop", num_prompt_tokens=1, prompt_token_ids=[1],
                                prompt_embeds=None, sampling_params=SimpleNamespace(
                                    eos_token_id=None, stop=["x"], min_tokens=0)),
        "eos": SimpleNamespace(num_prompt_tokens=1, sampling_params=SimpleNamespace(
            eos_token_id=2))}, input_batch=SimpleNamespace(
        req_id_to_index={"stop": 0, "eos": 1}, num_tokens_no_spec=np.array([4, 4]),
        token_ids_cpu=np.array([[1, 5, 6, 7], [1, 2, 3, 4]])))
    raised = []
    drafter.report_failure.side_effect = lambda *args, **kwargs: raised.append(sys.exc_info()[1])
    telling_finished_requests(lambda *args: None)(runner, SimpleNamespace(
        finished_req_ids={"stop", "eos"}))
    assert seen == {"stop": [1, 5, 6, 7], "eos": [1, 2]}
    (failure,) = drafter.report_failure.call_args_list
    assert failure.args[:2] == ("exception", "could not cut a finished request where it stopped")
    assert "model_config" in str(raised[0])


def test_our_drafter_drafts_in_steps_near_max_model_len():
    """vLLM skips the drafter for the whole batch while any request is within k tokens of
    max_model_len; PLD+ then missed the step's states and drafted nothing for good. Ours is
    called (it caps each draft by its request's room); vLLM's own drafters are left as vLLM
    decides, and so is a step without attention metadata."""
    from unittest import mock

    from vllm_retrieval_spec.contract import Drafter
    from vllm_retrieval_spec.patches.drafter import drafting_near_the_length_limit

    fits = drafting_near_the_length_limit(lambda runner, metadata: False)
    ours = SimpleNamespace(drafter=mock.create_autospec(Drafter, instance=True))
    assert fits(ours, SimpleNamespace(max_seq_len=2047)) is True
    assert fits(ours, None) is False
    assert fits(SimpleNamespace(drafter=object()), SimpleNamespace(max_seq_len=2047)) is False


def test_storing_the_requests_the_last_step_finished_is_drafting_the_step_waits_for():
    """``observe_finished`` runs as the step starts, before its forward, on every device: hybrid
    stores the finished requests there (and settles the last step's bookkeeping first, which on
    a GPU comes before ``after_handover``). The step's drafting time, critical part and all,
    holds it."""
    import time
    from unittest import mock

    import numpy as np
    import torch

    from vllm_retrieval_spec.contract import Capabilities, Drafter
    from vllm_retrieval_spec.patches.drafter import (
        telling_finished_requests, timed_with_hidden_states)

    drafter = mock.create_autospec(Drafter, instance=True)
    drafter.capabilities = Capabilities()
    drafter.has_work_after_handover = False
    drafter.observe_finished.side_effect = lambda *args: time.sleep(0.003)
    runner = SimpleNamespace(
        drafter=drafter, device=torch.device("cpu"), requests={},
        input_batch=SimpleNamespace(req_ids=["b"], req_id_to_index={"a": 0, "b": 1},
                                    num_tokens_no_spec=np.array([2, 2]),
                                    token_ids_cpu=np.zeros((2, 4), dtype=np.int32)))
    telling_finished_requests(lambda *args: None)(runner, SimpleNamespace(finished_req_ids={"a"}))
    timed_with_hidden_states(lambda *args: [[1]])(runner, None, [[5]], None, None, None, None,
                                                  None, None, None)
    drafter.report_failure.assert_not_called()
    critical_s, total_s = drafter.observe_drafting_time.call_args.args
    assert critical_s == total_s and critical_s >= 0.003


def test_waiting_for_a_gpu_forward_to_read_the_logits_is_not_drafting(monkeypatch):
    """With ``draft_before_sampling`` on a GPU, reading the logits waits for the forward, which
    the step waits for anyway (vLLM's bookkeeping after sampling): the critical part holds the
    drafting, not that wait. On a clock that only the stand-ins advance."""
    import time
    from unittest import mock

    import numpy as np
    import torch

    from vllm_retrieval_spec.contract import Capabilities, Drafter
    from vllm_retrieval_spec.patches.drafter import (
        timed_with_hidden_states, with_drafts_before_sampling)

    now, running = [0], [True]
    monkeypatch.setattr(time, "perf_counter_ns", lambda: now[0])

    def wait_for_the_forward():
        if running[0]:
            now[0] += 5_000_000
            running[0] = False

    class Argmax:  # of logits the forward, still running, writes
        def cpu(self):
            wait_for_the_forward()
            return torch.zeros(1, dtype=torch.int64)

    class Logits:
        device = torch.device("cuda", 0)

        def argmax(self, dim):
            return Argmax()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(
        synchronize=wait_for_the_forward))
    SamplingParams = pytest.importorskip("vllm").SamplingParams
    drafter = mock.create_autospec(Drafter, instance=True)
    drafter.capabilities = Capabilities(drafts_before_sampling=True)
    drafter.has_work_after_handover = False
    drafter.draft_before_sampling.side_effect = lambda *args: now.__setitem__(0, now[0] + 1_000_000)
    runner = SimpleNamespace(
        drafter=drafter, kv_caches=[], device=torch.device("cuda", 0),
        requests={"g": SimpleNamespace(num_prompt_tokens=2,
                                       sampling_params=SamplingParams(temperature=0.0))},
        input_batch=SimpleNamespace(req_ids=["g"], num_tokens_no_spec=np.array([2]),
                                    token_ids_cpu=np.zeros((1, 4), dtype=np.int32)),
        discard_request_mask=SimpleNamespace(np=np.array([False])))
    with_drafts_before_sampling(lambda *args: None)(runner, Logits(), None)
    timed_with_hidden_states(lambda *args: [[1]])(runner, None, [[5]], None, None, None, None,
                                                  None, None, None)
    drafter.report_failure.assert_not_called()
    assert drafter.observe_drafting_time.call_args.args == (0.001, 0.001)


def test_workers_start_after_numba_is_loaded_in_the_same_process(undo_register):
    # An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) made after one that drafted: its
    # worker rebinds vLLM-CPU's kernel overrides while llvmlite (numba) is loaded.
    pytest.importorskip("numba")
    import llvmlite.binding.ffi as ffi
    from vllm.platforms import current_platform
    from vllm.platforms.cpu import CpuPlatform

    if not current_platform.is_cpu():
        pytest.skip("vLLM-CPU's kernel overrides only")
    plugin.register()
    ffi.lib._fntab.pop("__dict__", None)
    CpuPlatform.register_triton_kernel_overrides()
    assert vars(ffi.lib) == {}


def test_drafts_are_made_ahead_until_the_forward_launched_on_a_gpu_is_done(monkeypatch):
    """On a GPU the forward runs beside the drafts made ahead: they stop once an event
    recorded on its stream after the launch completes. On vLLM-CPU they are made in full."""
    from unittest import mock

    import torch

    from vllm_retrieval_spec.contract import Drafter
    from vllm_retrieval_spec.patches.drafter import after_handover

    recorded = []

    class Event:
        done = False

        def record(self, stream):
            recorded.append(stream)

        def query(self):
            return self.done

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    answers = []
    drafter = mock.create_autospec(Drafter, instance=True)
    drafter.has_work_after_handover = True
    drafter.after_handover.side_effect = lambda forward_done: answers.append(forward_done())
    forward = after_handover(lambda runner: "launched")
    runner = SimpleNamespace(drafter=drafter, device=torch.device("cuda", 1))
    assert forward(runner) == "launched"
    Event.done = True
    assert forward(runner) == "launched"
    assert recorded == ["stream of cuda:1"] * 2 and answers == [False, True]
    copy = after_handover(lambda runner: None)
    assert copy(SimpleNamespace(drafter=drafter, device=torch.device("cpu"))) is None
    assert recorded == ["stream of cuda:1"] * 2 and answers == [False, True, False]


def test_a_drafter_hook_that_raises_costs_drafts_not_the_engine():
    """Every hook the plugin runs for our drafter around vLLM's step: a failure is reported
    (counted, logged once) and the step goes on (before: observe_batch, the hidden states and
    the work after the hand-over raised into vLLM's step)."""
    from unittest import mock

    import torch

    from vllm_retrieval_spec.contract import Capabilities, Drafter
    from vllm_retrieval_spec.patches.drafter import (
        after_handover, timed_with_hidden_states, with_drafts_before_sampling)

    drafter = mock.create_autospec(Drafter, instance=True)
    drafter.capabilities = Capabilities(aux_hidden_state_layers=(1,))
    drafter.has_work_after_handover = True
    for hook in ("observe_batch", "record_hidden_states", "after_handover"):
        getattr(drafter, hook).side_effect = RuntimeError(hook)
    runner = SimpleNamespace(
        drafter=drafter, requests={}, device=torch.device("cpu"),
        input_batch=SimpleNamespace(req_ids=["a"], num_computed_tokens_cpu=[0]))
    sample = with_drafts_before_sampling(lambda runner, logits, metadata: "sampled")
    assert sample(runner, None, None) == "sampled"
    propose = timed_with_hidden_states(lambda runner, *args: [[1]])
    scheduler_output = SimpleNamespace(num_scheduled_tokens={"a": 1},
                                       scheduled_spec_decode_tokens={})
    assert propose(runner, scheduler_output, [[5]], None, None, None, [torch.zeros(1, 2)],
                   None) == [[1]]
    assert after_handover(lambda runner: None)(runner) is None
    assert [c.args[:2] for c in drafter.report_failure.call_args_list] == [
        ("exception", "could not observe the batch or draft before sampling"),
        ("exception", "could not take hidden states"),
        ("exception", "could not finish the step's drafting")]
