"""REST (arXiv 2311.08252): drafts from the longest context suffix found in a token datastore,
its occurrences' continuations voted in a trie."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_retrieval_spec.config import RestConfig
from vllm_retrieval_spec.datastore.suffix_array import SuffixArrayDatastore
from vllm_retrieval_spec.drafting.tree import TrieSelection
from vllm_retrieval_spec.drafting.trie import TrieDrafter
from vllm_retrieval_spec.sources.base import Vote
from vllm_retrieval_spec.sources.suffix_array import SuffixArraySource


def make_drafter(config: RestConfig, vllm_config: Any,
                 report: Callable[..., None] | None = None) -> TrieDrafter:
    # The front-end already checked checksums and the tokenizer; here only sizes.
    datastore = SuffixArrayDatastore.from_path(config.store.datastore, verify_checksums=False)
    match = config.match
    # Every occurrence of the same suffix is equally good evidence: one vote each.
    source = SuffixArraySource(lambda row: datastore, match.min_match_len, match.max_match_len,
                               match.max_occurrences, Vote())
    return TrieDrafter([source], TrieSelection(config.trie, config.drafting.min_draft_len))
