"""PLD (the baseline of arXiv 2412.01447): drafts from the request's own context.

The longest context suffix (``max_match_len`` down to ``min_match_len`` tokens) that occurred
earlier in the same request is found by a compiled backwards scan; the continuations of its most
recent occurrences are voted in the weighted trie, like REST's, and the best chain is drafted.
vLLM's ``ngram`` instead drafts k tokens after one occurrence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_retrieval_spec.config import PldConfig
from vllm_retrieval_spec.drafting.tree import TrieSelection
from vllm_retrieval_spec.drafting.trie import TrieDrafter
from vllm_retrieval_spec.sources.base import Vote
from vllm_retrieval_spec.sources.context import ContextSource


def make_drafter(config: PldConfig, vllm_config: Any = None,
                 report: Callable[..., None] | None = None) -> TrieDrafter:
    match = config.match
    source = ContextSource(match.min_match_len, match.max_match_len, match.max_occurrences,
                           Vote())
    return TrieDrafter([source], TrieSelection(config.trie, config.drafting.min_draft_len))
