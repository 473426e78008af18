"""Peak memory and time of the dense index's PCA fit (``fit_projection``) at large hidden sizes.

For each shape N x H, random but structured float32 states (points around 64 cluster centres,
with per-dimension scales, as a model's hidden states have) are written to a temporary .npy
file, and a fresh process memory-maps it and fits the projection as ``write_dense_index`` does
(rows sampled without replacement, at most ``--fit-samples``). That process reports its peak
resident memory over what it held just before the fit (VmHWM), split into anonymous memory
(what the fit allocates; sampled from /proc/self/status every millisecond) and pages of the
memory-mapped states file (clean page cache the kernel can reclaim at any time).

    python -m benchmarks.pca_fit_memory --run-name pca-fit-memory
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

MIB = 1 << 20
#: Run again in a fresh process for each fit (also when this file is run as a script).
MODULE = "benchmarks.pca_fit_memory"
#: The repository root, where ``benchmarks`` is importable from.
REPO_ROOT = Path(__file__).resolve().parents[1]


def write_states(path: Path, num_states: int, hidden_size: int, seed: int = 0) -> None:
    """Clustered float32 states [num_states, hidden_size], written a chunk at a time."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((64, hidden_size), dtype=np.float32) * 3
    scales = rng.uniform(0.1, 10, hidden_size).astype(np.float32)
    offset = rng.standard_normal(hidden_size, dtype=np.float32)
    states = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32,
                                       shape=(num_states, hidden_size))
    step = 8192
    for start in range(0, num_states, step):
        n = min(step, num_states - start)
        noise = rng.standard_normal((n, hidden_size), dtype=np.float32)
        states[start:start + n] = (centres[rng.integers(0, 64, n)] + noise) * scales + offset
    states.flush()


def memory_status() -> dict[str, int]:
    """This process's resident memory in bytes: now (total, anonymous, file-backed) and its peak.

    The peak is VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over fork and exec,
    so a fresh child would report this parent's peak (writing the states file) if it was higher.
    """
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "peak"}
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in fields:
                status[fields[name]] = int(value.split()[0]) * 1024
    return status


class PeakAnonSampler(threading.Thread):
    """The highest anonymous resident memory seen, sampled every millisecond (torch's kernels
    release the GIL, so the sampler runs during the eigendecomposition and the matmuls)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = memory_status()["anon"]
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, memory_status()["anon"])


def fit_in_this_process(states_file: Path, dims: int, fit_samples: int,
                        chunk_bytes: int) -> dict[str, Any]:
    import torch

    from vllm_retrieval_spec.datastore import dense
    from vllm_retrieval_spec.datastore.projection import fit_projection

    states = np.load(states_file, mmap_mode="r")
    before = memory_status()
    sampler = PeakAnonSampler()
    sampler.start()
    start = time.perf_counter()
    rows = dense.fit_sample_rows(len(states), fit_samples)
    projection = fit_projection(states, dims, rows, chunk_bytes=chunk_bytes)
    fit_s = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    after = memory_status()
    return {"fit_s": round(fit_s, 1), "fit_samples": len(rows),
            "torch_threads": torch.get_num_threads(),
            "explained_variance": round(projection.explained_variance, 4),
            "rss_before_fit_mib": round(before["rss"] / MIB),
            "peak_rss_growth_mib": round((after["peak"] - before["rss"]) / MIB),
            "peak_anon_growth_mib": round((sampler.peak - before["anon"]) / MIB),
            "file_rss_growth_mib": round((after["file"] - before["file"]) / MIB)}


def measure(num_states: int, hidden_size: int, dims: int, fit_samples: int, chunk_bytes: int,
            tmp_dir: Path) -> dict[str, Any]:
    from vllm_retrieval_spec.datastore.projection import chunk_rows

    size = num_states * hidden_size * 4
    free = shutil.disk_usage(tmp_dir).free
    if free < size + (1 << 30):
        raise SystemExit(f"error: {tmp_dir} has {free / 2**30:.1f} GiB free, the states of "
                         f"{num_states} x {hidden_size} need {size / 2**30:.1f} GiB and 1 to "
                         f"spare; pass --tmp-dir or smaller --shapes")
    with tempfile.TemporaryDirectory(dir=tmp_dir) as directory:
        states_file = Path(directory) / "states.npy"
        write_states(states_file, num_states, hidden_size)
        result = subprocess.run(
            [sys.executable, "-m", MODULE, "--fit-in-this-process", str(states_file),
             "--dims", str(dims), "--fit-samples", str(fit_samples),
             "--chunk-bytes", str(chunk_bytes)],
            check=True, capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))})
    h2 = hidden_size * hidden_size * 8
    chunk = min(chunk_rows(hidden_size, chunk_bytes), fit_samples, num_states) * hidden_size * 8
    return {"num_states": num_states, "hidden_size": hidden_size, "dims": dims,
            "states_file_mib": round(size / MIB), "chunk_bytes": chunk_bytes,
            "chunk_rows": chunk_rows(hidden_size, chunk_bytes),
            # The larger of: the covariance, its eigenvectors and syevd's 2 x H^2 workspace; and
            # the Gram matrix with a chunk as float64 and as the float32 rows it was read from.
            "predicted_peak_anon_mib": round(max(4 * h2, h2 + 1.5 * chunk) / MIB),
            **json.loads(result.stdout.splitlines()[-1])}


def main(argv: list[str] | None = None) -> None:
    from vllm_retrieval_spec.cli import int_at_least

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="200000x4096,50000x4096,200000x2048",
                        help="comma-separated NUM_STATESxHIDDEN_SIZE")
    parser.add_argument("--dims", type=int_at_least(1), default=64)
    parser.add_argument("--fit-samples", type=int_at_least(1), default=1_000_000)
    parser.add_argument("--chunk-bytes", type=int, default=None,
                        help="default: the fit's own (projection.CHUNK_BYTES)")
    parser.add_argument("--tmp-dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--run-name", default="pca-fit-memory")
    parser.add_argument("--output-dir", default="benchmarks/results")
    parser.add_argument("--fit-in-this-process", type=Path, default=None,
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from vllm_retrieval_spec.datastore.projection import CHUNK_BYTES

    chunk_bytes = args.chunk_bytes or CHUNK_BYTES
    if args.fit_in_this_process is not None:
        print(json.dumps(fit_in_this_process(args.fit_in_this_process, args.dims,
                                             args.fit_samples, chunk_bytes)))
        return
    from vllm_retrieval_spec.bench.report import (
        markdown_table, module_command, results_document, write_report)

    rows = []
    for shape in args.shapes.split(","):
        num_states, hidden_size = (int(x) for x in shape.split("x"))
        rows.append(measure(num_states, hidden_size, args.dims, args.fit_samples, chunk_bytes,
                            args.tmp_dir))
        print(f"[pca-fit-memory] {json.dumps(rows[-1])}", file=sys.stderr)
    results = results_document(args.run_name, module_command(MODULE, argv), rows)
    lines = markdown_table(
        [("states", "num_states"), ("hidden size", "hidden_size"),
         ("states file MiB", "states_file_mib"), ("fit samples", "fit_samples"),
         ("chunk rows", "chunk_rows"), ("fit s", "fit_s"),
         ("peak RSS growth MiB", "peak_rss_growth_mib"),
         ("peak anonymous growth MiB", "peak_anon_growth_mib"),
         ("predicted anonymous MiB", "predicted_peak_anon_mib"),
         ("mapped file pages growth MiB", "file_rss_growth_mib")], rows)
    lines += ["", "Predicted anonymous memory: max(4 x H^2 x 8 bytes, H^2 x 8 bytes + 1.5 chunks) "
              "(the covariance, its eigenvectors and syevd's 2 x H^2 workspace at the "
              "eigendecomposition; the Gram matrix and one chunk while accumulating), whatever "
              "the number of states. The mapped file pages are the sampled rows of the states "
              "file: clean page cache, which the kernel reclaims under memory pressure. The fit "
              "that gathered the whole sample held it as float32, float64 and z-scored float64 "
              "(about n x H x 28 bytes: 21 GiB for 200000 x 4096)."]
    write_report(results, args.output_dir, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
