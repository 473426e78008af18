"""benchmarks/modelled_gpu.py: the modelled GPU table from recorded outputs and step-cost
curves, on tiny records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.modelled_gpu import chain_calibration, main


def test_the_chain_curve_is_calibrated_at_its_shortest_context_up_to_chain_lengths(tmp_path):
    # 0.1 ms a token up to 16 at context 512; beyond 16, and at 2048, far costlier steps that
    # would change every option if they were read.
    times = {**{d: 10.0 + 0.1 * d for d in (0, 1, 2, 4, 8, 16)}, 32: 30.0, 64: 60.0}
    path = tmp_path / "chain.json"
    path.write_text(json.dumps({"rows": [
        {"context_tokens": context, "draft_len": d, "ms_per_step_median": t * context / 512}
        for context in (2048, 512) for d, t in times.items()]}))
    assert chain_calibration(str(path)) == {"draft_token_cost": 0.01, "min_draft_len": 1,
                                            "draft_budget_ms": 0.7}


def write_curve(path, times):
    path.write_text(json.dumps({"rows": [
        {"context_tokens": 512, "draft_len": d, "ms_per_step_median": t}
        for d, t in times.items()]}))
    return str(path)


def test_every_method_beside_suffix_per_task(tmp_path):
    phrase = [5, 6, 7, 8, 9, 10, 11, 12]
    records = [{"task": task, "prompt": [1, 2, *phrase, 3], "output": [*phrase, 4, *phrase, 4]}
               for task in ("code-gen", "chat") for _ in range(2)]
    outputs = tmp_path / "run.plain.jsonl"
    outputs.write_text("".join(json.dumps(r) + "\n" for r in records))
    chain = write_curve(tmp_path / "chain.json",
                        {0: 10.0, 1: 10.1, 2: 10.2, 16: 11.6, 64: 16.4})
    tree = write_curve(tmp_path / "tree.json", {0: 10.0, 1: 10.2, 16: 12.0, 64: 20.0})
    main([str(outputs), "--chain-cost", chain, "--tree-cost", tree, "--run-name", "modelled",
          "--out-dir", str(tmp_path), "-k", "8", "--tree-k", "16"])
    results = json.loads((tmp_path / "modelled.json").read_text())
    assert results["modelled"] is True
    assert results["calibrated_options"] == {"draft_token_cost": 0.01, "min_draft_len": 1,
                                             "draft_budget_ms": 0.7}
    assert [(r["task"], r["method"]) for r in results["rows"]] == [
        (task, method) for task in ("chat", "code-gen")
        for method in ("ngram", "suffix", "suffix/piecewise", "pld", "hybrid", "hybrid/tree")]
    for row in results["rows"]:
        assert row["prompts"] == 2 and row["tokens_per_forward"] >= 1.0 and row["draft_us_p50"] > 0
        # Drafting adds to the steps' time; ours make drafts ahead (the accelerator's default).
        assert 0 < row["modeled_speedup_with_drafting"] <= row["modeled_speedup"]
        assert (row["ahead_used"] is None) == row["method"].startswith(("ngram", "suffix"))
        if row["method"] == "suffix":
            assert row["vs_suffix"] == 1.0
    # The repeated phrase is drafted from the context: pld beats a step per token.
    pld = next(r for r in results["rows"] if r["method"] == "pld")
    assert pld["tokens_per_forward"] > 1.5 and pld["modeled_speedup"] > 1.2
    page = (tmp_path / "modelled.md").read_text()
    assert "Modelled, not measured" in page and "| chat | hybrid/tree |" in page
    assert "| with drafting |" in page and "| ahead used |" in page
    assert '"min_draft_len": 1' in page
    suffix = {r["task"]: r["modeled_speedup"] for r in results["rows"] if r["method"] == "suffix"}
    assert "| method | chat | code-gen |" in page
    assert (f"| suffix | {suffix['chat']:.2f}x (1.00) | {suffix['code-gen']:.2f}x (1.00) |"
            in page)


def test_a_datastore_adds_rest_and_hybrid_with_it(tmp_path, code_datastore, tokenizer):
    import sysconfig

    # Two stretches of json/encoder.py, in the datastore: drafted from it, not from a context.
    source = Path(sysconfig.get_paths()["stdlib"], "json", "encoder.py").read_text()
    ids = tokenizer.encode(source)
    records = [{"task": "code-gen", "prompt": [1, 2, 3], "output": ids[start:start + 150]}
               for start in (0, 600)]
    outputs = tmp_path / "run.plain.jsonl"
    outputs.write_text("".join(json.dumps(r) + "\n" for r in records))
    chain = write_curve(tmp_path / "chain.json", {0: 10.0, 2: 10.2, 16: 11.6, 64: 16.4})
    main([str(outputs), "--chain-cost", chain, "--tree-cost", chain, "--run-name", "m",
          "--out-dir", str(tmp_path), "-k", "8", "--tree-k", "16",
          "--datastore", code_datastore])
    rows = {r["method"]: r for r in json.loads((tmp_path / "m.json").read_text())["rows"]}
    name = Path(code_datastore).name
    assert list(rows) == ["ngram", "suffix", "suffix/piecewise", "pld", f"rest:{name}", "hybrid",
                          "hybrid/tree", f"hybrid:{name}", f"hybrid:{name}/tree"]
    assert rows[f"hybrid:{name}/tree"]["config"]["datastore"] == code_datastore
    assert rows[f"hybrid:{name}"]["tokens_per_forward"] > rows["hybrid"]["tokens_per_forward"]


def test_a_tree_curve_is_required(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x.jsonl"), "--chain-cost", "c.json", "--run-name", "x"])
