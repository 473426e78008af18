"""benchmarks/gpu_check.py, the one command a lent GPU machine runs, from its ``--tiny`` run on
CPU under Triton's interpreter: every section is there and its checks hold, and each step-cost
curve turns into a file that replay's ``measured_step_costs`` reads. Its times mean nothing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu_check import (
    HOST_PROFILE_TOP,
    PROFILE_TOP,
    TINY_PLAN,
    Report,
    StepCostRun,
    leading_chain_len,
    main,
    node_depths,
    sections_list,
    step_cost_section,
    verify_tree,
)
from vllm_retrieval_spec.kernels import tree_attention
from vllm_retrieval_spec.verification import core

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_verify_trees_put_their_chain_first_and_match_the_verifier():
    assert verify_tree(0) == [] and verify_tree(1) == [-1]
    assert verify_tree(2) == [-1, -1]
    assert verify_tree(8) == [-1, 0, 1, 2, -1, 4, 0, 6]
    for n in (2, 3, 4, 8, 16, 32, 64):
        parents = verify_tree(n)
        assert len(parents) == n and core.valid_tree(np.array(parents))
        assert leading_chain_len(parents) == (n + 1) // 2 == max(node_depths(parents))
    # The device has only the package's kernels: these copies must agree with the product's.
    for parents in ([], [-1], [-1, 0, 1], [-1, -1, 1], verify_tree(64)):
        assert leading_chain_len(parents) == core.leading_chain_len(np.array(parents, int))
        assert node_depths(parents) == core.tree_depths(np.array(parents, int)).tolist()


def test_a_failing_section_is_recorded_and_the_run_goes_on(tmp_path):
    report = Report(tmp_path / "r.json", {"run": "r", "date": "d", "command": "c",
                                          "device": {"device": "cpu", "torch": "t",
                                                     "triton": "t", "transformers": "t"}})

    def fails(result, save):
        result["rows"] = [1]
        save()
        raise RuntimeError("boom")

    report.section("first", fails)
    assert json.loads((tmp_path / "r.json").read_text())["sections"]["first"]["rows"] == [1]
    report.section("second", lambda result, save: result.update(ok=True))
    sections = json.loads((tmp_path / "r.json").read_text())["sections"]
    assert sections["first"]["ok"] is False and "RuntimeError: boom" in sections["first"]["error"]
    assert sections["second"]["ok"] is True and not report.ok
    assert "boom" in (tmp_path / "r.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]


def test_a_failing_configuration_is_recorded_and_the_others_measured(monkeypatch):
    pytest.importorskip("transformers")

    def measure(self, model, caches, shape, batch, context, n):
        if n == 2:
            raise RuntimeError("out of memory")
        return timed_row(context, n), lambda: timed_row(context, n)

    monkeypatch.setattr(StepCostRun, "measure", measure)
    result = {}
    step_cost_section(TINY_PLAN, time.monotonic() + 600, result, lambda: None)
    # 2 batches x 2 contexts x 2 shapes failed at n = 2 (its first round; the later one
    # skipped it); every other length was measured, in both rounds.
    assert len(result["errors"]) == 8 and result["ok"] is False
    assert {e["round"] for e in result["errors"]} == {0}
    assert all("out of memory" in e["error"] and e["draft_len"] == 2 for e in result["errors"])
    assert all([r["draft_len"] for r in b["rows"]] == [0, 1, 4, 0, 1, 4]
               for b in result["blocks"])
    assert all(r["round_medians"] == [1.0, 1.0] for b in result["blocks"] for r in b["rows"])
    assert result["truncated"] is False


def timed_row(context: int, n: int, ms: float = 1.0) -> dict:
    return {"context_tokens": context, "draft_len": n, "ms_per_step_median": ms,
            "ms_per_step": [ms], "eager_ms_median": ms, "timing": "eager"}


def test_rounds_go_over_the_curve_and_each_row_keeps_every_repeat(monkeypatch):
    """A slow spell of the host lands in a round of every row of a curve, not in all the
    repeats of a few (the H200's piecewise tree curve). A later round replays what the first
    captured; the diagnostics beside the curve are the first round's."""
    pytest.importorskip("transformers")
    from dataclasses import replace

    calls = []

    def measure(self, model, caches, shape, batch, context, n):
        calls.append((shape, n, "first"))

        def again():
            calls.append((shape, n, "again"))
            return {"timing": "cuda-graph", "ms_per_step": [110.0 + n, 111.0 + n],
                    "ms_per_step_median": 110.5 + n}

        return {"context_tokens": context, "draft_len": n, "ms_per_step": [10.0 + n, 11.0 + n],
                "ms_per_step_median": 10.5 + n, "timing": "cuda-graph",
                "eager_ms_median": 50.0}, again

    monkeypatch.setattr(StepCostRun, "measure", measure)
    plan = replace(TINY_PLAN, contexts=(32,), batches=(1,), draft_lens=(0, 4), repeats=4)
    result = {}
    step_cost_section(plan, time.monotonic() + 600, result, lambda: None)
    assert calls == [(shape, n, which) for shape in ("chain", "tree")
                     for which in ("first", "again") for n in (0, 4)]
    chain = next(b["rows"] for b in result["blocks"] if b["shape"] == "chain")
    assert chain[1] == {"context_tokens": 32, "draft_len": 4, "timing": "cuda-graph",
                        "ms_per_step": [14.0, 15.0, 114.0, 115.0], "ms_per_step_median": 64.5,
                        "round_medians": [14.5, 114.5], "eager_ms_median": 50.0}


def test_a_later_round_joins_its_repeats_to_its_rows():
    from benchmarks.gpu_check import add_round

    row = {"ms_per_step": [3.0, 1.0], "ms_per_step_median": 2.0, "round_medians": [2.0],
           "timing": "cuda-graph-piecewise", "graph_vs_eager_max_abs": 0.5,
           "host_ms_mean": {"eager": 9.0, "cuda-graph-piecewise": 4.0}}
    add_round(row, {"ms_per_step": [5.0, 7.0], "ms_per_step_median": 6.0,
                    "timing": "cuda-graph-piecewise",
                    "host_ms_mean": {"cuda-graph-piecewise": 7.0}})
    assert row == {"ms_per_step": [3.0, 1.0, 5.0, 7.0], "ms_per_step_median": 4.0,
                   "round_medians": [2.0, 6.0], "timing": "cuda-graph-piecewise",
                   "graph_vs_eager_max_abs": 0.5,
                   "host_ms_mean": {"eager": 9.0, "cuda-graph-piecewise": 5.5}}


def test_the_summary_lists_rows_whose_rounds_disagree():
    section = {"truncated": False, "errors": [], "timing": "t.", "method": "m.", "blocks": [
        {"model": "8B", "shape": "tree", "batch": 1, "rows": [
            {"context_tokens": 512, "draft_len": 8, "ms_per_step_median": 9.3,
             "round_medians": [9.2, 16.3, 9.3]},
            {"context_tokens": 512, "draft_len": 16, "ms_per_step_median": 9.4,
             "round_medians": [9.4, 9.5, 11.0]}]}]}
    lines = gpu_check._step_cost_lines(section)
    assert "| 8 | 9.3 |" in lines and "| 16 | 9.4 |" in lines
    assert "Rounds 1.2x apart or more (round medians, ms): tree 512 n 8: 9.2 / 16.3 / 9.3." in lines


def test_repeats_split_evenly_into_rounds():
    from dataclasses import replace

    assert replace(TINY_PLAN, repeats=6, rounds=3).repeats_per_round == 2
    with pytest.raises(ValueError, match="repeats \\(5\\) must be a multiple of rounds \\(3\\)"):
        replace(TINY_PLAN, repeats=5, rounds=3)


def test_the_deadline_stops_the_step_cost_loop():
    pytest.importorskip("transformers")
    result = {}
    step_cost_section(TINY_PLAN, time.monotonic(), result, lambda: None)
    assert result["truncated"] is True and result["ok"] is False
    assert all(not b["rows"] for b in result["blocks"])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("gpu-check") / "gpu-check.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--tiny", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads(out.read_text()), out


def test_tiny_run_checks_the_kernels_against_their_references(tiny_run):
    result, _ = tiny_run
    sections = result["sections"]
    assert list(sections) == ["kernels", "paged_kernel", "stream_safety", "step_cost",
                              "tree_profile"]
    assert result["tiny"] is True and "interpreter" in result["device"]["device"]
    kernels = [c["kernel"] for c in sections["kernels"]["checks"]]
    assert kernels.count("tree_mask") == 4 and kernels.count("tree_attention") == 3
    assert kernels.count("projection") == 2
    paged = sections["paged_kernel"]["checks"]
    assert all(c["untouched_equal"] for c in paged)
    # Five cases, then one tree at each launch a rule makes (4 multiprocessors planned for:
    # 2 programs, 3 splits of 70 tokens with 32 tokens a split at the least, or one), each
    # recorded as the kernel launched it.
    assert [c["case"] for c in paged[5:]] == ["verify-4 @70, splits 1, rows 16",
                                             "verify-4 @70, splits 1, rows 32",
                                             "verify-4 @70, splits 3, rows 16",
                                             "verify-4 @70, splits 3, rows 32"]
    assert [c["launch"] for c in paged[7:]] == [
        {"block_m": 16, "row_blocks": 1, "block_l": 32, "splits": 3, "chunk": 32},
        {"block_m": 32, "row_blocks": 1, "block_l": 32, "splits": 3, "chunk": 32}]
    assert all(c["sweep"] for c in paged[5:]) and not any(c["sweep"] for c in paged[:5])
    # No device times on CPU, so no rule is fitted and the trees launch as the kernel does.
    assert "launch_rule" not in sections["paged_kernel"]
    assert sections["step_cost"]["tree_launch"] == "the kernel's defaults"
    # Every tree computes its rows after its leading chain, or all of them in the first case.
    assert paged[0]["first"] == [0] and paged[1]["first"] == [32, 16, 1, 1]
    assert paged[4]["contexts"] == [17, 40] and paged[4]["rows_computed"] == 32 + 32
    for section in ("kernels", "paged_kernel"):
        assert sections[section]["ok"] is True
        for c in sections[section]["checks"]:
            assert c["ok"] and c["max_abs_err"] <= c["tolerance"], c
    stream = sections["stream_safety"]
    assert stream.get("skipped") == "benchmarks/stream_safety.py missing" or stream["ok"], stream


def test_tiny_run_profiles_a_chain_and_a_tree_step(tiny_run):
    result, out = tiny_run
    profile = result["sections"]["tree_profile"]
    assert profile["ok"] is True
    assert (profile["model"], profile["context_tokens"], profile["draft_len"]) == (
        "tiny", min(TINY_PLAN.contexts), max(TINY_PLAN.draft_lens))
    for kind in ("chain", "tree"):
        kernels = profile[kind]["kernels"]
        assert 0 < len(kernels) <= PROFILE_TOP
        times = [k["us"] for k in kernels]
        assert times == sorted(times, reverse=True) and profile[kind]["total_us"] >= sum(times)
        host = profile[kind]["host"]["functions"]
        assert 0 < len(host) <= HOST_PROFILE_TOP
        assert [f["self_us"] for f in host] == sorted((f["self_us"] for f in host),
                                                      reverse=True)
    # The tree's eager forward issues the paged kernel (interpreted here) from every layer.
    assert profile["tree"]["host"]["us_per_call"] > profile["chain"]["host"]["us_per_call"]
    assert "| kernel | us | calls |" in out.with_suffix(".md").read_text()


def test_sections_are_named_from_the_list():
    assert sections_list("step_cost, tree_profile") == ("step_cost", "tree_profile")
    for bad in ("step-cost", ",", "kernels,nope"):
        with pytest.raises(argparse.ArgumentTypeError, match="sections are kernels, "):
            sections_list(bad)


def test_tiny_run_measures_every_curve(tiny_run):
    result, _ = tiny_run
    step_cost = result["sections"]["step_cost"]
    assert step_cost["ok"] is True and step_cost["truncated"] is False
    plan = TINY_PLAN
    curves = {(b["model"], b["shape"], b["batch"]): b["rows"] for b in step_cost["blocks"]}
    assert set(curves) == {("tiny", shape, batch) for shape in ("chain", "tree")
                           for batch in plan.batches}
    for (_, shape, _), rows in curves.items():
        assert [(r["context_tokens"], r["draft_len"]) for r in rows] == [
            (c, n) for c in plan.contexts for n in plan.draft_lens]
        for row in rows:
            assert len(row["ms_per_step"]) == plan.repeats and row["ms_per_step_median"] > 0
            assert row["timing"] == "eager" and len(row["round_medians"]) == plan.rounds == 2
            # The tree rows of a step (SDPA's leading chain, the kernel's others) against the
            # reference, at the longest draft.
            checked = shape == "tree" and row["draft_len"] == max(plan.draft_lens)
            assert ("tree_rows_ok" in row) == checked
            assert row.get("tree_rows_ok", True) is True
            if shape == "tree":
                assert row["rows_recomputed"] == row["draft_len"] // 2
                assert ("trees_build_ms_median" in row) == (row["draft_len"] >= 2)


def test_extracted_curves_are_what_replay_reads(tiny_run, tmp_path):
    from benchmarks.replay import measured_step_costs

    result, out = tiny_run
    assert main(["--extract", "tiny", "tree", "2", "--results", str(out)]) == 0
    extracted = out.with_name("gpu-check-tiny-tree-b2.json")
    rows = next(b["rows"] for b in result["sections"]["step_cost"]["blocks"]
                if (b["shape"], b["batch"]) == ("tree", 2))
    costs = measured_step_costs(str(extracted), 6)
    # Replay reads the shortest context: its lengths as measured, 5 and 6 along the last slope.
    measured = {r["draft_len"]: r["ms_per_step_median"] for r in rows
                if r["context_tokens"] == 32}
    assert len(costs) == 7
    assert [costs[n] for n in measured] == pytest.approx(list(measured.values()))
    at_64 = tmp_path / "c64.json"
    assert main(["--extract", "tiny", "chain", "1", "--results", str(out), "--context", "64",
                 "--out", str(at_64)]) == 0
    chain_64 = json.loads(at_64.read_text())
    assert {r["context_tokens"] for r in chain_64["rows"]} == {64}
    assert measured_step_costs(str(at_64), 4)[0] == chain_64["rows"][0]["ms_per_step_median"]
    with pytest.raises(SystemExit, match="no tree curve of tiny at batch 3"):
        main(["--extract", "tiny", "tree", "3", "--results", str(out)])


def test_tiny_run_writes_a_summary(tiny_run):
    _, out = tiny_run
    summary = out.with_suffix(".md").read_text()
    assert "## kernels: ok=True" in summary and "## paged_kernel: ok=True" in summary
    assert "### tiny, batch 2: ms per verify step (median)" in summary
    assert "| n | chain 32 | tree 32 | chain 64 | tree 64 |" in summary


class InstalledKernels:
    """Hugging Face's ``kernels`` distribution, installed under ``site``."""

    version = "0.19.1"

    def __init__(self, site: Path):
        self.site = site

    def locate_file(self, path: str) -> Path:
        return self.site / path


def installed_kernels(monkeypatch, site: Path | None) -> None:
    """Hugging Face's ``kernels`` installed under ``site``, or not installed (None)."""
    real = gpu_check.importlib.metadata.distribution

    def distribution(name: str):
        if name != "kernels":
            return real(name)
        if site is None:
            raise gpu_check.importlib.metadata.PackageNotFoundError(name)
        return InstalledKernels(site)

    monkeypatch.setattr(gpu_check.importlib.metadata, "distribution", distribution)


def test_the_repository_hiding_hugging_faces_kernels_is_refused_before_any_section(
        monkeypatch, tmp_path, capsys):
    # pytest puts the repository's root on the path, as the device command must not.
    installed_kernels(monkeypatch, tmp_path / "site-packages")
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--tiny", "--out", str(tmp_path / "out" / "x.json")])
    assert stop.value.code == 2
    assert (f"{REPO_ROOT / 'kernels'} hides Hugging Face's kernels 0.19.1, which transformers "
            "imports" in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_kernels_found_where_they_are_installed_or_not_installed_are_not_refused(monkeypatch):
    installed_kernels(monkeypatch, None)
    assert gpu_check.hidden_kernels_package() is None
    installed_kernels(monkeypatch, REPO_ROOT)
    assert gpu_check.hidden_kernels_package() is None


def test_full_run_needs_a_gpu(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr
    assert not list(tmp_path.iterdir())



def test_a_piecewise_capture_runs_attention_between_the_pieces():
    """vLLM runs tree steps as piecewise CUDA graphs, attention eager between them; here a
    stand-in for the graph checks the split and the replay's order on CPU, a tree's kernel
    under the interpreter (what a graph records is checked on the device only)."""
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    run = subprocess.run([sys.executable, "-c", PIECEWISE_CHECK], capture_output=True,
                         text=True, timeout=600, cwd=REPO_ROOT,
                         env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.strip().endswith("piecewise ok")


PIECEWISE_CHECK = """
import torch

from benchmarks.gpu_check import (
    TINY, TINY_PLAN, Caches, build_model, capture_pieces, prefill, verify_forward, verify_tree)

events = []


class Graph:
    def __init__(self):
        self.index = events.count("begin")

    def capture_begin(self, pool=None):
        assert pool == "pool"
        events.append("begin")

    def capture_end(self):
        events.append("end")

    def replay(self):
        events.append(f"replay {self.index}")


plan = TINY_PLAN
with torch.inference_mode():
    model = build_model(TINY, plan)
    caches = Caches.allocate(TINY, 2, 64 + 1 + 4, plan)
    prefill(model, caches, 64, plan)
    forward = verify_forward(model, caches, verify_tree(4), 2, 32, plan)
    assert forward.step.trees is not None
    eager = forward().clone()
    pieces, logits = capture_pieces(forward, "pool", Graph)
    assert forward.step.pieces is None
    # A piece before each layer's attention, one after the last.
    assert len(pieces.graphs) == TINY.layers + 1 == len(pieces.attention) + 1
    assert events == ["begin", "end"] * (TINY.layers + 1), events
    # Outside a capture the stand-in ran every op: the logits are the eager ones.
    torch.testing.assert_close(logits, eager)
    outputs = [out.clone() for _, out in pieces.attention]
    for _, out in pieces.attention:
        out.zero_()
    events.clear()
    pieces.replay()
    assert events == [f"replay {i}" for i in range(TINY.layers + 1)], events
    # Each layer's attention, run again, wrote the buffer its next piece reads.
    for (_, out), expected in zip(pieces.attention, outputs):
        torch.testing.assert_close(out, expected)
    torch.testing.assert_close(forward(), eager)
print("piecewise ok")
"""


def test_each_model_starts_with_graphs_of_its_own(monkeypatch):
    """A capture that fails stops graphs for the later forwards of its shape: of its model
    only, so that one model's failure does not leave the other's curves eager."""
    pytest.importorskip("transformers")
    from dataclasses import replace

    from benchmarks.gpu_check import TINY

    states = []

    def measure(self, model, caches, shape, batch, context, n):
        states.append((self.model_name, shape, set(self.graph_shapes)))
        # As a failed capture does.
        self.graph_shapes.discard(shape)
        return timed_row(context, n), lambda: timed_row(context, n)

    monkeypatch.setattr(StepCostRun, "measure", measure)
    init = StepCostRun.__init__

    def with_graphs(self, *args, **kwargs):
        # As on a GPU: every shape is captured until a capture fails.
        init(self, *args, **kwargs)
        self.graph_shapes.update({"chain", "tree"})

    monkeypatch.setattr(StepCostRun, "__init__", with_graphs)
    plan = replace(TINY_PLAN, models=(TINY, replace(TINY, name="tiny-2")), contexts=(32,),
                   batches=(1,), draft_lens=(0, 1), repeats=1, rounds=1)
    step_cost_section(plan, time.monotonic() + 600, {}, lambda: None)
    # Per model: chain at n = 0 and 1, then tree at n = 0 and 1.
    seen = [{"chain", "tree"}, {"tree"}, {"tree"}, set()]
    assert states == [(name, shape, graphs) for name in ("tiny", "tiny-2")
                      for shape, graphs in zip(("chain", "chain", "tree", "tree"), seen)]


def test_each_shape_keeps_its_own_graph_mode_and_the_other_beside_it(monkeypatch):
    """A chain's curve is its full graph's, with its piecewise time beside it at batch 1 (the
    mode of vLLM's steps whose rows do not all verify num_speculative_tokens); a tree's is
    piecewise, the full graph's beside it; a mode that fails to capture is left for the later
    forwards of its shape, and the other mode is the curve's."""
    pytest.importorskip("transformers")
    import torch

    from benchmarks import gpu_check
    from benchmarks.gpu_check import TINY, Caches, build_model, capture_pieces
    from vllm_retrieval_spec.kernels.paged_tree_attention import (
        paged_tree_attention_reference,
    )

    def time_graph(forward, eager_logits, repeats, capture=None, replayer=None, host=None):
        if capture is capture_pieces:
            if forward.step.trees is None and len(forward.step.parents) == 2:
                raise RuntimeError("capture failed")
            return [2.0] * repeats, 0.5, "replay pieces"
        return [1.0] * repeats, 0.25, "replay whole"

    monkeypatch.setattr(gpu_check, "time_graph", time_graph)
    # The tree rows' kernel needs Triton's interpreter, which this process has not got: the
    # reference computes them (the modes are under test here, not the kernel).
    monkeypatch.setattr(gpu_check, "paged_tree_attention", paged_tree_attention_reference)
    plan = TINY_PLAN
    result = {"graph_errors": {}}
    run = StepCostRun(plan, result, time.monotonic() + 600, {"chain", "tree"},
                      {"chain", "tree"}, "tiny")
    with torch.inference_mode():
        model = build_model(TINY, plan)
        caches = Caches.allocate(TINY, 2, 64, plan)
        measured = {(shape, batch, n): run.measure(model, caches, shape, batch, 32, n)
                    for shape in ("chain", "tree") for batch in (1, 2) for n in (1, 2, 4)}
    rows = {key: row for key, (row, _) in measured.items()}
    # A later round replays what the row's timing replayed.
    assert measured["chain", 1, 2][1].args == ("replay whole", "cuda-graph")
    assert measured["tree", 2, 4][1].args == ("replay pieces", "cuda-graph-piecewise")
    chain = rows["chain", 1, 1]
    assert (chain["timing"], chain["ms_per_step_median"], chain["piecewise_ms_median"],
            chain["graph_vs_eager_max_abs"]) == ("cuda-graph", 1.0, 2.0, 0.5)
    assert "piecewise_ms_median" not in rows["chain", 2, 1]
    # The chain of 2 failed to capture piecewise: no piecewise time from then on.
    assert ["piecewise_ms_median" in rows["chain", 1, n] for n in (1, 2, 4)] == [
        True, False, False]
    assert list(result["graph_errors"]) == ["tiny chain cuda-graph-piecewise"]
    tree = rows["tree", 1, 4]
    assert (tree["timing"], tree["ms_per_step_median"], tree["full_graph_ms_median"]) == (
        "cuda-graph-piecewise", 2.0, 1.0)
    assert "piecewise_ms_median" not in tree


def test_a_curve_that_mixes_timings_is_not_extracted(tmp_path):
    """After a capture failed part way through a curve, its later rows were timed eagerly:
    replay must not take them for one curve; a context timed one way still extracts."""

    def row(context, n, ms, timing):
        return {"context_tokens": context, "draft_len": n, "ms_per_step_median": ms,
                "ms_per_step": [ms], "eager_ms_median": 20.0, "timing": timing}

    rows = [row(512, 0, 6.0, "cuda-graph"), row(512, 1, 6.1, "cuda-graph"),
            row(2048, 0, 6.5, "cuda-graph"), row(2048, 1, 20.0, "eager")]
    results = tmp_path / "r.json"
    results.write_text(json.dumps({
        "date": "d", "command": "c", "device": {"device": "gpu"},
        "sections": {"step_cost": {"dtype": "torch.bfloat16", "blocks": [
            {"model": "m", "shape": "chain", "batch": 1, "rows": rows}]}}}))
    with pytest.raises(SystemExit, match="mixes timings"):
        main(["--extract", "m", "chain", "1", "--results", str(results)])
    assert main(["--extract", "m", "chain", "1", "--results", str(results), "--context",
                 "512"]) == 0
    extracted = json.loads((tmp_path / "r-m-chain-b1-c512.json").read_text())
    assert extracted["timing"] == ["cuda-graph"] and len(extracted["rows"]) == 2


def test_the_short_context_paged_case_fails_a_kernel_blind_to_the_tree(monkeypatch):
    """Over thousands of context tokens a kernel that attended only each node itself, not its
    ancestors, stays within bfloat16's tolerance; over a few dozen it does not."""
    import dataclasses

    import torch

    from benchmarks import gpu_check
    from vllm_retrieval_spec.kernels.paged_tree_attention import (
        paged_tree_attention_reference,
    )

    def self_only(query, key, value, key_cache, value_cache, block_table, trees, scale,
                  output=None, splits=None, block_m=None):
        eye = torch.eye(trees.max_nodes, dtype=torch.int8).expand(len(trees), -1, -1)
        return paged_tree_attention_reference(query, key, value, key_cache, value_cache,
                                              block_table, dataclasses.replace(trees, mask=eye),
                                              scale, output=output)

    monkeypatch.setattr(gpu_check, "paged_tree_attention", self_only)
    plan = dataclasses.replace(TINY_PLAN, dtype=torch.bfloat16, attention_shape=(32, 8, 128),
                               split_contexts=())
    result = {}
    gpu_check.paged_section(plan, result, lambda: None)
    short = result["checks"][-1]
    assert short["case"] == "two trees, short contexts"
    assert not short["ok"] and short["max_abs_err"] > 5 * short["tolerance"]


def sweep_row(context, nodes, splits, block_m, us, plan):
    rows = nodes - leading_chain_len(verify_tree(nodes))
    launch = gpu_check.paged_launch(1, rows, *plan.attention_shape[:2], context, plan.dtype,
                                    132, splits=splits, block_m=block_m)
    return {"sweep": True, "ok": True, "contexts": [context], "nodes": [nodes],
            "launch": dataclasses.asdict(launch), "us": us}


GPU_SHAPED = dataclasses.replace(TINY_PLAN, dtype=torch.bfloat16, attention_shape=(32, 8, 128),
                                 split_contexts=(512, 2048), split_nodes=(64,),
                                 split_block_ms=(64,), split_min_tokens=(256, 1024))


def test_the_launch_rule_is_the_one_whose_launches_took_least_time(monkeypatch):
    monkeypatch.setattr(tree_attention, "MIN_SPLIT_TOKENS", 1024)
    monkeypatch.setattr(tree_attention, "BLOCK_M", 64)
    plan, sms = GPU_SHAPED, 132
    # A 64-node tree of Llama-3-8B computes the 32 nodes after its leading chain: 2 row blocks
    # x 8 kv heads, 16 splits at most on 132 SMs. 256 tokens a split: 2 splits at 512, 8 at
    # 2048; 1024: 1 and 2.
    assert gpu_check.sweep_launches(plan, sms) == [
        (512, 64, 1, 64), (512, 64, 2, 64), (2048, 64, 1, 64), (2048, 64, 2, 64),
        (2048, 64, 8, 64)]
    times = {(512, 1): 23.0, (512, 2): 15.0, (2048, 1): 60.0, (2048, 2): 40.0, (2048, 8): 20.0}
    checks = [sweep_row(c, 64, n, 64, us, plan) for (c, n), us in times.items()]
    rule = gpu_check.fit_launch_rule(checks, plan, sms)
    assert rule["chosen"] == {"block_m": 64, "min_split_tokens": 256}
    assert rule["us"] == 15.0 + 20.0 and rule["defaults_us"] == 23.0 + 40.0
    # Each tree's time over its fastest launch's, summed: the fastest at each context, and
    # the kernel's own 23 / 15 + 40 / 20.
    assert rule["slowdown"] == 2.0 and rule["defaults_slowdown"] == round(23 / 15 + 2, 4)
    assert rule["trees"] == [[512, 64], [2048, 64]]
    # Less than RULE_MARGIN per tree better than the kernel's own rule, the kernel's own is
    # kept (2.0 against 1 + 40 / 39.5).
    times[512, 2], times[2048, 8] = 23.0, 39.5
    checks = [sweep_row(c, 64, n, 64, us, plan) for (c, n), us in times.items()]
    assert gpu_check.fit_launch_rule(checks, plan, sms)["chosen"] == {
        "block_m": 64, "min_split_tokens": 1024}
    # A rule with an untimed (or failed) launch is not a candidate; with none left, no rule.
    assert gpu_check.fit_launch_rule(checks[:1], plan, sms) is None
    failed = [{**c, "ok": c["launch"]["splits"] != 8} for c in checks]
    assert [r["min_split_tokens"] for r in gpu_check.fit_launch_rule(failed, plan, sms)[
        "rules"]] == [1024]


def test_a_fitted_rule_launches_the_later_sections_trees(monkeypatch, tmp_path):
    seen = {}

    def paged(plan, result, save):
        result.update(ok=True, launch_rule={
            "chosen": {"block_m": 32, "min_split_tokens": 128}, "us": 10.0, "slowdown": 1.0,
            "trees": [[70, 4]], "defaults": {"block_m": 16, "min_split_tokens": 1024},
            "defaults_us": 20.0, "defaults_slowdown": 2.0})

    def step_cost(plan, deadline, result, save, keep=None):
        seen["step_cost"] = plan.tree_launch
        result["ok"] = True

    monkeypatch.setattr(gpu_check, "paged_section", paged)
    monkeypatch.setattr(gpu_check, "step_cost_section", step_cost)
    monkeypatch.setattr(gpu_check, "interpreting", lambda: True)
    gpu_check.run_all(TINY_PLAN, tmp_path / "r.json", 10.0, [], ("paged_kernel", "step_cost"))
    assert dict(seen["step_cost"]) == {"block_m": 32, "min_split_tokens": 128}
    assert "Launch rule fitted: {'block_m': 32, 'min_split_tokens': 128}, slowdown 1.0 over 1 " \
        "swept trees, 10.0 us" in (tmp_path / "r.md").read_text()
    gpu_check.run_all(TINY_PLAN, tmp_path / "r.json", 10.0, [], ("step_cost",))
    assert seen["step_cost"] == ()


def _leaf() -> None:
    pass


def _three_leaves() -> None:
    for _ in range(3):
        _leaf()


def test_a_host_profile_counts_each_function_per_call():
    profile = gpu_check.host_profile(_three_leaves, 4, False)
    functions = {f["function"]: f for f in profile["functions"]}
    assert functions["tests/test_gpu_check.py:" + str(_leaf.__code__.co_firstlineno)
                     + "(_leaf)"]["calls"] == 3.0
    caller = functions["tests/test_gpu_check.py:" + str(_three_leaves.__code__.co_firstlineno)
                       + "(_three_leaves)"]
    assert caller["calls"] == 1.0 and caller["cumulative_us"] >= caller["self_us"]
    times = [f["self_us"] for f in profile["functions"]]
    assert times == sorted(times, reverse=True) and profile["us_per_call"] > 0


def test_the_profile_takes_the_model_the_step_cost_section_built(monkeypatch, tmp_path):
    """Building Llama-3-8B again for tree_profile took 19 s of device time."""
    pytest.importorskip("transformers")
    from vllm_retrieval_spec.kernels.paged_tree_attention import paged_tree_attention_reference

    def measure(self, model, caches, shape, batch, context, n):
        return timed_row(context, n), lambda: timed_row(context, n)

    def reference(*args, splits=None, block_m=None, min_split_tokens=None, **kwargs):
        # In this process Triton compiles for a GPU; the kernel's own test runs interpreted.
        return paged_tree_attention_reference(*args, **kwargs)

    built = []
    build = gpu_check.build_model
    monkeypatch.setattr(gpu_check, "build_model",
                        lambda shape, plan: built.append(shape.name) or build(shape, plan))
    monkeypatch.setattr(StepCostRun, "measure", measure)
    monkeypatch.setattr(gpu_check, "paged_tree_attention", reference)
    monkeypatch.setattr(gpu_check, "interpreting", lambda: True)
    out = tmp_path / "r.json"
    gpu_check.run_all(TINY_PLAN, out, 600.0, [], ("step_cost", "tree_profile"))
    profile = json.loads(out.read_text())["sections"]["tree_profile"]
    assert built == ["tiny"] and profile["ok"] is True
    assert profile["tree"]["host"]["functions"] and "syncs" not in profile["tree"]
    gpu_check.run_all(TINY_PLAN, out, 600.0, [], ("tree_profile",))
    assert built == ["tiny", "tiny"]

    def fails(forward, plan):
        raise RuntimeError("capture failed")

    # A device run is one chance: the kernels' times stand without the host's.
    monkeypatch.setattr(gpu_check, "host_times", fails)
    gpu_check.run_all(TINY_PLAN, out, 600.0, [], ("tree_profile",))
    profile = json.loads(out.read_text())["sections"]["tree_profile"]
    assert profile["ok"] is True and profile["tree"]["kernels"]
    assert "capture failed" in profile["tree"]["host_error"]
    assert "tree: host times failed:" in out.with_suffix(".md").read_text()
