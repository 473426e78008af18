"""Handing the forward's hidden states to a search thread on a GPU (ARCHITECTURE.md, "Streams
on a GPU").

DReSD projects the states vLLM will sample in a pool thread while vLLM computes the logits
(``DenseSearches.search_ahead``). On a GPU the engine thread and the worker issue work on
different streams, with two hazards:

- Read before write: the states are handed over once the forward is enqueued, not done. The
  engine thread records an event on vLLM's stream (the current one at the hand-over) and the
  worker's stream waits on it before projecting. Projecting on vLLM's stream in the engine
  thread would be as correct, but would put the projection's kernels ahead of the logits on
  vLLM's stream and their launches (Triton's, from Python) on the engine thread; with the
  event, the engine thread only records it, and the GPU overlaps the projection with the logits.
- Overwrite before read: what is handed over is the gather of the sampled rows
  (``output[logits_indices]``), a block of the caching allocator, not a buffer vLLM reuses;
  freed, the block could go to vLLM's next forward while the worker's kernels still read it.
  ``record_stream`` on the worker's stream keeps the allocator from handing it out until the
  work that stream had when the block was freed is done. (A view of a buffer vLLM reuses would
  need a copy on vLLM's stream first: hand over a tensor of its own.)

The queries come back through pinned host buffers, one per hand-over in flight, reused and
grown when a step has more rows: a non-blocking copy on the worker's stream, then the worker
waits for that copy's event alone. A buffer is reused only once its search is done, so a search
still running past the draft budget never has the next step's copy land in its queries.

CPU tensors take none of this: they are projected in the worker, without a CUDA call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np


class CudaStreams:
    """The CUDA calls of a hand-over on one device. The worker gets a stream of its own: a pool
    thread's current stream is the default one, and waiting on an event there would hold back
    whatever else is issued on it."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.worker = torch.cuda.Stream(device)

    def event(self, blocking: bool = False) -> Any:
        return self.torch.cuda.Event(blocking=blocking)

    def record_current(self, event: Any) -> None:
        """On the engine thread: ``event`` completes when vLLM's stream has done the work
        enqueued so far (the forward and the gather of the states)."""
        event.record(self.torch.cuda.current_stream(self.device))

    def hold_for_worker(self, tensor: Any) -> None:
        tensor.record_stream(self.worker)

    def worker_waits(self, event: Any) -> None:
        self.worker.wait_event(event)

    def on_worker(self) -> Any:
        # Also makes the stream's device current in this thread (a pool thread starts on
        # device 0), which Triton launches on.
        return self.torch.cuda.stream(self.worker)

    def record_worker(self, event: Any) -> None:
        event.record(self.worker)

    def pinned(self, numel: int) -> Any:
        return self.torch.empty(numel, dtype=self.torch.float32, pin_memory=True)


def cuda_streams(device: Any) -> CudaStreams | None:
    """The streams for states on ``device``: None (nothing to order, no CUDA call) off CUDA."""
    return CudaStreams(device) if device.type == "cuda" else None


class Slot:
    """One hand-over's events and pinned host buffer, reused once its search is done."""

    def __init__(self, streams: CudaStreams) -> None:
        self.streams = streams
        #: vLLM's stream has written the states.
        self.written = streams.event()
        #: The queries are in ``host``. Blocking: the worker sleeps until the forward and the
        #: projection are done instead of spinning a core for a forward's length each step.
        self.copied = streams.event(blocking=True)
        self.host: Any = None  # pinned float32, flat

    def host_rows(self, shape: tuple[int, int]) -> Any:
        numel = shape[0] * shape[1]
        if self.host is None or self.host.numel() < numel:
            # Doubled, so that a batch growing row by row reallocates a few times only.
            grown = 0 if self.host is None else 2 * self.host.numel()
            self.host = self.streams.pinned(max(numel, grown))
        return self.host[:numel].view(shape)


class Handed(NamedTuple):
    states: Any
    slot: Slot | None  # None for CPU states


class AheadProjection:
    """Projects hidden states the engine thread hands over (``hand_over``) in a worker thread
    (``queries``)."""

    def __init__(self, project: Callable[[Any], Any],
                 make_streams: Callable[[Any], CudaStreams | None] = cuda_streams) -> None:
        #: [m, H] states -> float32 unit queries [m, d] on the states' device.
        self.project = project
        self.make_streams = make_streams
        #: Per device: its streams and the slots not in use (None: a device without streams).
        self.devices: dict[Any, tuple[CudaStreams, list[Slot]] | None] = {}
        self.lock = threading.Lock()

    def hand_over(self, states: Any) -> Handed:
        """On the engine thread, right after the forward that wrote ``states`` was enqueued."""
        slot = self._acquire(states.device)
        if slot is None:
            return Handed(states, None)
        slot.streams.record_current(slot.written)
        slot.streams.hold_for_worker(states)
        return Handed(states, slot)

    @contextmanager
    def queries(self, handed: Handed) -> Iterator[np.ndarray]:
        """In the worker: the unit queries float32 [m, d], valid inside the block (on a GPU they
        are the slot's pinned buffer, reused once the block is left)."""
        states, slot = handed
        if slot is None:
            yield self.project(states).numpy()
            return
        streams = slot.streams
        try:
            streams.worker_waits(slot.written)
            with streams.on_worker():
                queries = self.project(states)
                host = slot.host_rows(tuple(queries.shape))
                host.copy_(queries, non_blocking=True)
                streams.record_worker(slot.copied)
            slot.copied.synchronize()
            yield host.numpy()
        finally:
            self._release(slot)

    def _acquire(self, device: Any) -> Slot | None:
        with self.lock:
            if device not in self.devices:
                streams = self.make_streams(device)
                self.devices[device] = None if streams is None else (streams, [])
            entry = self.devices[device]
            if entry is None:
                return None
            streams, free = entry
            return free.pop() if free else Slot(streams)

    def _release(self, slot: Slot) -> None:
        with self.lock:
            _, free = self.devices[slot.streams.device]
            free.append(slot)
