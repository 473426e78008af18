"""The kernel timing benchmark's rows, from its ``--quick`` run on CPU under Triton's
interpreter (its times mean nothing there; the GPU figures are in benchmarks/results/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.kernel_timing import (
    chain,
    depth,
    projection_bytes,
    retrieval_tree,
    tree_attention_bytes,
)

#: Where ``python -m benchmarks.<tool>`` runs from.
REPO_ROOT = Path(__file__).resolve().parents[1]


def test_tree_shapes_are_topological_with_the_stated_depth():
    assert chain(4) == [-1, 0, 1, 2] and depth(chain(4)) == 4
    tree = retrieval_tree(12, roots=2, branch_every=5)
    assert tree == [-1, -1, 1, 2, 3, 3, 5, 6, 7, 8, 8, 10]
    assert all(-1 <= p < i for i, p in enumerate(tree))
    assert depth(tree) == 9 and depth([]) == 0


def test_floor_bytes_count_every_input_once_and_the_output():
    # bfloat16 hidden states (2 bytes), float32 statistics, components and output.
    assert projection_bytes(3, 10, 4, torch.bfloat16) == 3 * 10 * 2 + (2 * 10 + 40 + 12) * 4
    # q and out: 2 nodes x 4 heads x 8; k and v: (5 + 2) tokens x 2 kv heads x 8; mask 2 x 2.
    assert tree_attention_bytes(5, 2, 4, 2, 8, torch.float16) == \
        (2 * 2 * 4 * 8 + 2 * 7 * 2 * 8) * 2 + 4


def run_quick(module: str, out) -> tuple[dict, str]:
    """A benchmark's ``--quick`` run under Triton's interpreter: its JSON and markdown."""
    pytest.importorskip("triton")
    run = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--quick",
         "--run-name", "quick", "--out-dir", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((out / "quick.json").read_text()), (out / "quick.md").read_text()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernel-timing")
    return (*run_quick("kernel_timing", out), out)


def test_quick_run_checks_every_kernel_against_its_reference(quick_run):
    result, table, out = quick_run
    kernels = [row["kernel"] for row in result["rows"]]
    assert kernels.count("projection") == 4  # 2 batches x 2 dtypes
    assert kernels.count("tree_attention") == 2 and kernels.count("tree_mask") == 2
    for row in result["rows"]:
        if row["kernel"] == "tree_mask":
            assert row["equal_reference"] is True
        else:
            assert row["max_abs_err"] < 1e-4, row
            assert row["floor_us"] > 0 and row["triton_us"] > 0
    assert result["command"] == ("python -m benchmarks.kernel_timing "
                                 f"--quick --run-name quick --out-dir {out}")
    assert "## Tree attention" in table and "| SmolLM2-135M | float32 | 48 | tree-20 |" in table


def test_full_run_needs_a_gpu(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_timing", "--run-name", "x", "--out-dir",
         str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr
    assert not list(tmp_path.iterdir())


def test_quick_sweep_times_every_choice_and_the_default(tmp_path):
    result, table = run_quick("kernel_sweep", tmp_path)
    attention, projection = result["rows"]
    # 300 context tokens: 2 splits would be 150 tokens each, below the 256 worth timing.
    assert list(attention["us"]) == ["default", "rows16-splits1", "rows32-splits1"]
    assert list(projection["us"]) == ["default", "splits1", "splits2"]
    assert all(t > 0 for row in (attention, projection) for t in row["us"].values())
    assert result["command"].startswith("python -m benchmarks.kernel_sweep")
    assert "| model | context | nodes | default | rows16-splits1 | rows32-splits1 |" in table
