"""The soak test, two minutes of it: `vllm-rsd serve` with `hybrid` and its served journal
under mixed traffic, `kill -9`, a restart on the same directory (``benchmarks/soak.py``); its
memory is sampled, and judged by the benchmark's ten minutes, not here."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_two_minute_soak(model_dir, tmp_path):
    from benchmarks.soak import main

    results = main(["--model", model_dir, "--minutes", "2", "--max-requests", "600",
                    "--served-max-tokens", "30000", "--save-minutes", "0.5",
                    "--kill-within-s", "8", "--recent-s", "30", "--run-name", "soak-2min",
                    "--output-dir", str(tmp_path)])
    checks = results["checks"]
    # Behaviour only: RSS growth is a memory target, judged by the ten-minute benchmark.
    behaviour = {name: ok for name, ok in checks["passed"].items() if name != "rss_flat"}
    assert behaviour == dict.fromkeys(behaviour, True), checks
    assert checks["rss_mib_last"] > 0
    assert (tmp_path / "soak-2min.md").is_file()
