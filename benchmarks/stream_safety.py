"""Stream safety of DReSD's search ahead on a GPU (ARCHITECTURE.md, "Streams on a GPU").

A stand-in for vLLM's steps: a long "forward" (a chain of matmuls) writes the hidden states on a
stream of its own, the sampled rows are gathered there and handed over
(``AheadProjection.hand_over``) while the forward is still running, and a pool thread projects
them with the Triton kernel and searches them on the host (``AheadProjection.queries``), as
DReSD's search ahead does. The engine thread enqueues the next step's forward without waiting
for the search, as vLLM does. Each step's queries and neighbours must equal the synchronous ones
(forward, synchronise, project, search): ``equal``. The same steps without the worker's wait
and without ``record_stream`` are reported as ``unsafe_*``, not asserted: whether they race
depends on timing. The unsafe steps run first, so that the blocks they read too early cannot
hold the right states from an earlier run.

torch (and Triton on a GPU) only, no vLLM: ``run(device, tiny)`` is what
``benchmarks/gpu_check.py`` calls. On CPU there are no streams (``equal`` must hold trivially)
and ``tiny`` runs in a second (``--device cpu --tiny``).

    python -m benchmarks.stream_safety --device cuda

Without the package installed (the lent GPU machine), ``kernels/`` must be importable as
``vllm_retrieval_spec.kernels`` beside the rest of the package:

    repo=$PWD && mkdir -p /tmp/pkg && cp -r vllm_retrieval_spec /tmp/pkg/
    ln -s "$repo/kernels" /tmp/pkg/vllm_retrieval_spec/kernels && ln -s "$repo/benchmarks" /tmp/pkg/
    cd /tmp && PYTHONPATH=/tmp/pkg python3 -m benchmarks.stream_safety --device cuda

(benchmarks/README.md, at ``benchmarks.kernel_timing``, says why the repository stays off the
path.)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from vllm_retrieval_spec.drafting.streams import AheadProjection, CudaStreams
from vllm_retrieval_spec.kernels.projection import project

#: Largest difference between two unit queries that counts as equal (the same kernel on the
#: same states gives identical ones).
TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class Shapes:
    hidden: int
    dims: int
    tokens: int  # the forward's rows; ``rows`` of them are sampled
    layers: int
    rows: int
    keys: int
    top_n: int
    steps: int


TINY = Shapes(hidden=64, dims=16, tokens=32, layers=4, rows=4, keys=1024, top_n=8, steps=4)
#: An 8B-class hidden size; the forward (4096 tokens through 32 matmuls of 4096 x 4096) takes
#: milliseconds on an H100, far longer than a pool thread takes to pick up its task.
FULL = Shapes(hidden=4096, dims=256, tokens=4096, layers=32, rows=8, keys=16384, top_n=32,
              steps=8)


class UnsafeStreams(CudaStreams):
    """The hand-over without its ordering: the worker neither waits for the forward nor holds
    the states' block."""

    def worker_waits(self, event: Any) -> None:
        pass

    def hold_for_worker(self, tensor: Any) -> None:
        pass


class Scenario:
    """The weights, the steps' inputs, the projection and the keys, on ``device``."""

    def __init__(self, device: torch.device, shapes: Shapes) -> None:
        self.device = device
        self.shapes = shapes
        self.cuda = device.type == "cuda"
        dtype = torch.bfloat16 if self.cuda else torch.float32
        generator = torch.Generator(device).manual_seed(0)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=generator, device=device)

        h, d = shapes.hidden, shapes.dims
        self.weight = (randn(h, h) / h ** 0.5).to(dtype)
        # The warm-up's inputs, then each step's: no step reads another's states.
        self.inputs = [randn(shapes.tokens, h).to(dtype) for _ in range(shapes.steps + 1)]
        # The sampled rows: each sequence's last token.
        self.rows = (torch.arange(1, shapes.rows + 1, device=device)
                     * (shapes.tokens // shapes.rows) - 1)
        components = torch.linalg.qr(randn(h, d)).Q.contiguous()
        self.statistics = (randn(h) * 0.1, randn(h).abs() + 0.5, components)
        keys = np.random.default_rng(0).normal(size=(shapes.keys, d)).astype(np.float32)
        self.keys = keys / np.linalg.norm(keys, axis=1, keepdims=True)
        if self.cuda:
            torch.cuda.synchronize(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.shapes.layers):
            x = torch.tanh(x @ self.weight)
        return x

    def project(self, states: torch.Tensor) -> torch.Tensor:
        return project(states, *self.statistics)

    def search(self, queries: np.ndarray) -> np.ndarray:
        scores = queries @ self.keys.T
        return np.argsort(-scores, axis=1, kind="stable")[:, :self.shapes.top_n]

    def project_and_search(self, projector: AheadProjection,
                           handed: Any) -> tuple[np.ndarray, np.ndarray]:
        with projector.queries(handed) as queries:
            # Copied: the slot's buffer is reused once the block is left.
            return queries.copy(), self.search(queries)

    def on_forward_stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def pipelined(self, projector: AheadProjection, pool: ThreadPoolExecutor, stream: Any,
                  inputs: list[torch.Tensor]) -> tuple[list[tuple[np.ndarray, np.ndarray]],
                                                        list[int]]:
        """Every step's forward enqueued on ``stream`` and its states handed over, without
        waiting for a search; then every step's (queries, neighbours) and hand-over time
        (ns, on the engine thread)."""
        futures = []
        hand_over_ns = []
        with self.on_forward_stream(stream):
            for x in inputs:
                candidates = self.forward(x)[self.rows]
                start = time.perf_counter_ns()
                handed = projector.hand_over(candidates)
                hand_over_ns.append(time.perf_counter_ns() - start)
                futures.append(pool.submit(self.project_and_search, projector, handed))
        return [future.result() for future in futures], hand_over_ns

    def synchronous(self, stream: Any, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        with self.on_forward_stream(stream):
            candidates = self.forward(x)[self.rows]
            if self.cuda:
                torch.cuda.synchronize(self.device)
            queries = self.project(candidates).cpu().numpy()
        return queries, self.search(queries)


def compare(results: list[tuple[np.ndarray, np.ndarray]],
            reference: list[tuple[np.ndarray, np.ndarray]]) -> tuple[int, float | None]:
    """(steps that differ, the largest query difference: None where a query was not finite,
    as states read before they were written can make them)."""
    differed = 0
    worst = 0.0
    for (queries, neighbours), (ref_queries, ref_neighbours) in zip(results, reference):
        diff = float(np.abs(queries - ref_queries).max())
        worst = max(worst, diff) if math.isfinite(diff) else math.inf
        differed += not diff <= TOLERANCE or not np.array_equal(neighbours, ref_neighbours)
    return differed, worst if math.isfinite(worst) else None


def run(device: str = "cuda", tiny: bool = False) -> dict[str, Any]:
    torch_device = torch.device(device)
    shapes = TINY if tiny else FULL
    scenario = Scenario(torch_device, shapes)
    stream = torch.cuda.Stream(torch_device) if scenario.cuda else None
    safe = AheadProjection(scenario.project)
    unsafe = AheadProjection(scenario.project, make_streams=lambda d: (
        UnsafeStreams(d) if d.type == "cuda" else None))
    warm_up, steps = scenario.inputs[:1], scenario.inputs[1:]
    with ThreadPoolExecutor(2, thread_name_prefix="search") as pool:
        # Triton's compile, the streams, the slots and their pinned buffers.
        for projector in (unsafe, safe):
            scenario.pipelined(projector, pool, stream, warm_up)
        unsafe_results, _ = scenario.pipelined(unsafe, pool, stream, steps)
        if scenario.cuda:
            torch.cuda.synchronize(torch_device)
        results, hand_over_ns = scenario.pipelined(safe, pool, stream, steps)
    start = time.perf_counter()
    reference = [scenario.synchronous(stream, x) for x in steps]
    step_s = (time.perf_counter() - start) / len(steps)
    differed, worst = compare(results, reference)
    unsafe_differed, unsafe_worst = compare(unsafe_results, reference)
    return {
        "device": torch.cuda.get_device_name(torch_device) if scenario.cuda else "cpu",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "streams": scenario.cuda,
        "shapes": dataclasses.asdict(shapes),
        "equal": differed == 0,
        "steps_differed": differed,
        "max_abs_diff": worst,
        "unsafe_differed": unsafe_differed > 0,
        "unsafe_steps_differed": unsafe_differed,
        "unsafe_max_abs_diff": unsafe_worst,
        # How long a step's forward takes against what the hand-over costs the engine thread.
        "synchronous_step_ms": 1e3 * step_s,
        "hand_over_us_median": statistics.median(hand_over_ns) / 1e3,
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small shapes (seconds on CPU)")
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device} needs a CUDA GPU; --device cpu --tiny runs on CPU")
    print(json.dumps(run(args.device, args.tiny), indent=2))


if __name__ == "__main__":
    main()
