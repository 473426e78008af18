"""The plugin refuses a vLLM whose wrapped internals changed, and patches exactly once."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e  # imports vLLM (about 12 s), starts no engine

vllm = pytest.importorskip("vllm")

from vllm_retrieval_spec import plugin  # noqa: E402


def test_accepts_the_installed_vllm_also_once_patched():
    # vLLM calls register() in every process; the check must then still see vLLM's originals.
    plugin.check_vllm_compatibility()
    plugin.register()
    plugin.check_vllm_compatibility()


def test_rejects_another_vllm_version(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(plugin.IncompatibleVllmError,
                       match=r"found vLLM 0.33.0. vllm-retrieval-spec supports vLLM 0.32.\*"):
        plugin.check_vllm_compatibility()


def test_rejects_a_changed_signature(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def changed(self, scheduler_output, sampled_token_ids):
        pass

    monkeypatch.setattr(GPUModelRunner, "propose_draft_token_ids", changed)
    with pytest.raises(plugin.IncompatibleVllmError,
                       match=r"GPUModelRunner.propose_draft_token_ids has parameters "
                             r"\('self', 'scheduler_output', 'sampled_token_ids'\)"):
        plugin.check_vllm_compatibility()


def test_register_is_idempotent():
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()
    wrapped = EngineArgs.create_speculative_config
    plugin.register()
    assert EngineArgs.create_speculative_config is wrapped


def test_expand_batch_to_tokens_replacement():
    import torch

    original = pytest.importorskip("vllm.v1.sample.rejection_sampler").expand_batch_to_tokens
    expand = plugin._expand_batch_to_tokens(original)
    cu = torch.tensor([3, 5, 9], dtype=torch.int32)
    temperature = expand(torch.tensor([-1.0, 0.8, 0.5]), cu, 9, replace_from=-1, replace_to=1)
    assert temperature.tolist() == pytest.approx([1, 1, 1, 0.8, 0.8, 0.5, 0.5, 0.5, 0.5])
    top_k = expand(torch.tensor([5, 0, 7], dtype=torch.int32), cu, 9)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [5, 5, 5, 0, 0, 7, 7, 7, 7]
    assert expand(torch.tensor([2.0]), torch.tensor([0]), 0).numel() == 0
