"""Adaptive speculation: how long a request's drafts may be, from its recent acceptance.

If each drafted token is accepted with probability ``a`` (given its prefix was), the L-th token
of a draft is accepted with probability ``a**L`` and costs ``draft_token_cost`` of a forward to
verify. Drafting it pays while ``a**L > draft_token_cost``, so the longest draft worth sending is
``log(draft_token_cost) / log(a)``. ``a`` is estimated per request as an exponential moving
average of accepted / drafted tokens, so a request whose drafts keep failing (text the datastore
does not know) drafts one token at a time until it starts matching again, while the retrieval
rule's own evidence cut still decides within that cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class AcceptanceTracker:
    """Per-request acceptance rates and the draft-length caps they imply."""

    k: int
    draft_token_cost: float
    #: Caps never go below this (``MethodConfig.min_draft_len``).
    min_len: int = 1
    #: Weight of the newest step in the moving average.
    smoothing: float = 0.3
    #: Starting estimate: optimistic, so a new request may draft up to k at once.
    initial_rate: float = 0.9
    rates: dict[str, float] = field(default_factory=dict)

    def cap(self, req_id: str) -> int:
        return self._cap(self.rates.get(req_id, self.initial_rate))

    def cap_after(self, req_id: str, drafted: int, accepted: int) -> int:
        """What ``cap`` will say after ``update(req_id, drafted, accepted)``, without it."""
        return self._cap(self._updated_rate(req_id, drafted, accepted))

    def update(self, req_id: str, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.rates[req_id] = self._updated_rate(req_id, drafted, accepted)

    def _updated_rate(self, req_id: str, drafted: int, accepted: int) -> float:
        rate = self.rates.get(req_id, self.initial_rate)
        if drafted <= 0:
            return rate
        return (1 - self.smoothing) * rate + self.smoothing * accepted / drafted

    def _cap(self, rate: float) -> int:
        worthwhile = max_worthwhile_len(rate, self.draft_token_cost, self.k)
        return min(self.k, max(worthwhile, self.min_len))

    def forget_except(self, req_ids: set[str]) -> None:
        for req_id in self.rates.keys() - req_ids:
            del self.rates[req_id]


def too_short(draft_len: int, max_len: int, min_draft_len: int) -> bool:
    """A non-empty draft below ``min_draft_len`` (or ``max_len``, if that is smaller) costs
    more to verify than it can save on vLLM-CPU (``MethodConfig.min_draft_len``)."""
    return 0 < draft_len < min(min_draft_len, max_len)


def max_worthwhile_len(rate: float, draft_token_cost: float, k: int) -> int:
    """The longest draft whose last token still pays for its verification, in [1, k]."""
    if draft_token_cost <= 0 or rate >= 1:
        return k
    if rate <= draft_token_cost:
        return 1
    return max(1, min(k, int(math.log(draft_token_cost) / math.log(rate))))


def drafting_off(running: int, disable_by_batch_size: int) -> bool:
    """No drafts this step: ``running`` requests sampled a token, as many as
    ``disable_by_batch_size`` or more (0 = always draft). Verifying drafts for a batch this
    large costs more than they save."""
    return bool(disable_by_batch_size) and running >= disable_by_batch_size
