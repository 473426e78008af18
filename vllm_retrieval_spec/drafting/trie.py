"""A method that votes its sources' candidates in one trie: REST, PLD, DReSD and hybrid are
each a ``TrieDrafter`` over their own list of sources (``sources/``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_retrieval_spec.contract import Capabilities, MethodDrafter
from vllm_retrieval_spec.drafting.overlap import rank_followers
from vllm_retrieval_spec.drafting.tree import TreeDraft, TrieSelection
from vllm_retrieval_spec.sources.base import Ballot, CandidateSource


class TrieDrafter(MethodDrafter):
    """Every source votes its weighted continuations (in list order, which breaks ties); the
    selection drafts the trie's best chain or tree.

    ``max_spec_factor`` (0 = off): a draft is no longer than ``max_spec_factor`` x the longest
    exact match behind it, as SuffixDecoding's ``max_spec_factor``: an n-token match predicts
    about n tokens. Dense neighbours have no match length, so a draft they voted in is not
    capped."""

    def __init__(self, sources: list[CandidateSource], selection: TrieSelection,
                 max_spec_factor: float = 0.0, capabilities: Capabilities | None = None) -> None:
        self.sources = sources
        self.selection = selection
        self.max_spec_factor = max_spec_factor
        self._stateful = [source for source in sources if source.stateful]
        self.capabilities = capabilities or Capabilities(
            precomputable=all(source.precomputable for source in sources),
            trees=selection.trie.tree == "on")

    def draft(self, row: int, context: np.ndarray, max_len: int) -> np.ndarray | TreeDraft:
        ballot = Ballot(row, context, max_len)
        for source in self.sources:
            source.vote(ballot)
        max_depth = max_len
        if self.max_spec_factor and not ballot.uncapped:
            max_depth = max(self.selection.min_draft_len,
                            int(self.max_spec_factor * ballot.longest_match))
        return self.selection.select(*ballot.arrays(), max_len, max_depth)

    def followers(self, row: int, context: np.ndarray) -> tuple[np.ndarray, bool] | None:
        """Every source's followers, the first source's most frequent first; complete when
        every source's list is."""
        if not self.capabilities.precomputable:
            return None
        found = []
        complete = True
        for source in self.sources:
            tokens, every = source.followers(row, context)
            if tokens is not None:
                found.append(tokens)
            complete = complete and every
        return rank_followers(*found), complete

    def snapshot(self, row: int) -> Any:
        if not self._stateful:
            return None
        if len(self._stateful) == 1:
            return self._stateful[0].snapshot(row)
        return tuple(source.snapshot(row) for source in self._stateful)

    def warm_up(self, max_len: int, device: Any, dtype: Any) -> None:
        # Compiles (or loads from numba's cache) every source's lookup and the trie.
        self.draft(0, np.zeros(2 * 16 + 2, dtype=np.int32), max_len)
