"""Handing hidden states to DReSD's search thread (``drafting.streams``), without a GPU: the CUDA
calls are a fake that logs them, on CPU tensors; and the stream-safety benchmark on CPU."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch

from test_dense import _decode_with_states, clustered_store, dresd_proposer  # noqa: F401
from vllm_retrieval_spec.datastore.dense import DenseIndex
from vllm_retrieval_spec.drafting.streams import AheadProjection
from vllm_retrieval_spec.kernels.projection import project_reference

HIDDEN, DIMS = 12, 4


class FakeEvent:
    def __init__(self, log: list, name: str, blocking: bool) -> None:
        self.log = log
        self.name = name
        self.blocking = blocking

    def record(self, stream: str) -> None:
        self.log.append(("record", self.name, stream))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class FakeStreams:
    """``CudaStreams``' calls, logged in order; events are named e1, e2, ... as made."""

    def __init__(self, device: torch.device, log: list) -> None:
        self.device = device
        self.log = log
        self.made = 0

    def event(self, blocking: bool = False) -> FakeEvent:
        self.made += 1
        return FakeEvent(self.log, f"e{self.made}", blocking)

    def record_current(self, event: FakeEvent) -> None:
        event.record("vllm")

    def hold_for_worker(self, tensor: torch.Tensor) -> None:
        self.log.append(("hold", tuple(tensor.shape)))

    def worker_waits(self, event: FakeEvent) -> None:
        self.log.append(("wait", event.name))

    @contextlib.contextmanager
    def on_worker(self):
        self.log.append("on worker")
        yield
        self.log.append("off worker")

    def record_worker(self, event: FakeEvent) -> None:
        event.record("worker")

    def pinned(self, numel: int) -> torch.Tensor:
        self.log.append(("pinned", numel))
        return torch.empty(numel)


def statistics(seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(HIDDEN, generator=generator), torch.rand(HIDDEN, generator=generator) + 0.5,
            torch.linalg.qr(torch.randn(HIDDEN, DIMS, generator=generator)).Q.contiguous())


def faked(log: list) -> AheadProjection:
    params = statistics()

    def project(states):
        log.append("project")
        return project_reference(states, *params)

    return AheadProjection(project, make_streams=lambda device: FakeStreams(device, log))


def expected(states: torch.Tensor) -> np.ndarray:
    return project_reference(states, *statistics()).numpy()


def test_the_worker_waits_for_the_forward_then_reads_the_copy_once_it_landed():
    log: list = []
    projector = faked(log)
    states = torch.randn(3, HIDDEN)
    handed = projector.hand_over(states)
    # On the engine thread: the event on vLLM's stream, and the states held for the worker's.
    assert log == [("record", "e1", "vllm"), ("hold", (3, HIDDEN))]
    del log[:]
    with projector.queries(handed) as queries:
        # Waited before projecting; the copy's event recorded on the worker's stream after the
        # projection and waited for before the queries are read.
        assert log == [("wait", "e1"), "on worker", "project", ("pinned", 3 * DIMS),
                       ("record", "e2", "worker"), "off worker", ("synchronize", "e2")]
        np.testing.assert_allclose(queries, expected(states), rtol=1e-6, atol=1e-6)


def test_host_buffers_are_reused_and_grown_never_shared_by_two_searches():
    log: list = []
    projector = faked(log)
    small, large = torch.randn(2, HIDDEN), torch.randn(5, HIDDEN)
    with projector.queries(projector.hand_over(small)):
        pass
    del log[:]
    # The next step reuses the slot: its events, its buffer.
    with projector.queries(projector.hand_over(small)) as queries:
        np.testing.assert_allclose(queries, expected(small), rtol=1e-6, atol=1e-6)
    assert not any(entry[0] == "pinned" for entry in log if isinstance(entry, tuple))
    assert ("record", "e1", "vllm") in log
    # More rows: the buffer grows once, then holds fewer rows again as they come.
    del log[:]
    with projector.queries(projector.hand_over(large)) as queries:
        np.testing.assert_allclose(queries, expected(large), rtol=1e-6, atol=1e-6)
    with projector.queries(projector.hand_over(small)):
        pass
    assert [entry for entry in log if entry[0] == "pinned"] == [("pinned", 5 * DIMS)]
    # A search still running (past the budget) keeps its slot: the next step's copy goes to
    # another buffer, with events of its own, and leaves the first search's queries alone.
    del log[:]
    running = projector.queries(projector.hand_over(large))
    first = running.__enter__()
    with projector.queries(projector.hand_over(small)) as second:
        np.testing.assert_allclose(second, expected(small), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(first, expected(large), rtol=1e-6, atol=1e-6)
    running.__exit__(None, None, None)
    assert ("record", "e3", "vllm") in log and ("pinned", 2 * DIMS) in log


def test_a_batch_growing_row_by_row_reallocates_its_host_buffer_a_few_times_only():
    log: list = []
    projector = faked(log)
    for rows in range(1, 9):
        states = torch.randn(rows, HIDDEN)
        with projector.queries(projector.hand_over(states)) as queries:
            np.testing.assert_allclose(queries, expected(states), rtol=1e-6, atol=1e-6)
    # Doubled when outgrown: 1, 2, 4 and 8 rows.
    assert [entry[1] for entry in log if entry[0] == "pinned"] == [DIMS, 2 * DIMS, 4 * DIMS,
                                                                   8 * DIMS]


def test_the_worker_sleeps_until_the_copy_lands():
    """The worker waits for the copy on a blocking event: it sleeps instead of spinning a core
    for a forward's length each step."""
    projector = faked([])
    assert projector.hand_over(torch.randn(2, HIDDEN)).slot.copied.blocking


def test_a_failed_search_gives_its_slot_back():
    log: list = []
    projector = faked(log)
    states = torch.randn(2, HIDDEN)
    with pytest.raises(RuntimeError), projector.queries(projector.hand_over(states)):
        raise RuntimeError("search failed")
    del log[:]
    with projector.queries(projector.hand_over(states)):
        pass
    assert log[0] == ("record", "e1", "vllm") and ("pinned", 2 * DIMS) not in log


def test_cpu_states_make_no_cuda_call(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CUDA call for CPU tensors")

    for name in ("Stream", "Event", "current_stream", "stream", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    monkeypatch.setattr(torch.Tensor, "record_stream", no_cuda)
    params = statistics()
    projector = AheadProjection(lambda states: project_reference(states, *params))
    states = torch.randn(3, HIDDEN)
    # Handed over on one thread, projected on another, as DReSD does.
    handed = projector.hand_over(states)
    out = {}

    def worker():
        with projector.queries(handed) as queries:
            out["queries"] = queries.copy()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    np.testing.assert_allclose(out["queries"], expected(states), rtol=1e-6, atol=1e-6)


def test_dresd_searching_ahead_through_streams_drafts_as_searching_after_sampling(clustered_store, monkeypatch):
    """Step after step, DReSD's search ahead through the (fake) streams makes the drafts that
    searching after sampling makes, each step's search after the wait and the copy's event,
    through one slot reused."""
    path, states = clustered_store
    tokens = np.asarray(DenseIndex.from_path(path).tokens)
    at = np.concatenate([np.arange(90, 120), np.arange(3000, 3030)])
    truth = tokens[at]
    options = {"min_prefix_prob": 0.0, "draft_budget_ms": 0}
    after = dresd_proposer(path, **options, precompute_drafts=False)
    ahead = dresd_proposer(path, **options, precompute_drafts=True)
    log: list = []
    ahead.method.searches.projector.make_streams = lambda device: FakeStreams(device, log)
    search = ahead.method.index.search
    monkeypatch.setattr(ahead.method.index, "search",
                        lambda q, n: log.append("search") or search(q, n))
    drafts = _decode_with_states(ahead, truth, at, states, before_sampling=False)
    assert drafts == _decode_with_states(after, truth, at, states, before_sampling=False)
    assert sum(map(len, drafts)) > 20, "the text must draft for this test to mean anything"
    # Each step's states have their own number of rows: "hold" is compared without them.
    calls = [entry[:1] if entry[0] == "hold" else entry for entry in log
             if entry != "search" and not (isinstance(entry, tuple) and entry[0] == "pinned")]
    assert calls == len(drafts) * [
        ("record", "e1", "vllm"), ("hold",), ("wait", "e1"), "on worker",
        ("record", "e2", "worker"), "off worker", ("synchronize", "e2")]
    searched = [i for i, entry in enumerate(log) if entry == "search"]
    assert len(searched) == len(drafts)
    assert all(log[i - 1] == ("synchronize", "e2") for i in searched)


def test_stream_safety_benchmark_runs_on_cpu():
    from benchmarks.stream_safety import run

    result = run("cpu", tiny=True)
    assert result["equal"] and result["steps_differed"] == 0 and not result["streams"]
    assert result["shapes"]["steps"] > 0
