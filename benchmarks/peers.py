"""vLLM's own drafting methods offline, behind the hooks ``benchmarks.replay`` calls, so that
they replay beside ours from the same records: their own proposer classes over a stand-in input
batch, not copies of them. Like vLLM, they draft past a request's max_tokens (replay's
``token_limits`` go unused)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np

from vllm_retrieval_spec.bench.throughput import NGRAM_OPTIONS, BenchSettings
from vllm_retrieval_spec.contract import Capabilities


class SuffixPeer:
    """vLLM's own ``suffix`` method: its ``SuffixDecodingProposer`` behind the hooks replay
    calls, over a stand-in input batch. Options are vLLM's speculative_config names
    (``suffix_decoding_max_tree_depth``, ...), at vLLM's defaults."""

    capabilities = Capabilities()
    has_work_after_handover = False

    def __init__(self, options: dict[str, Any], max_model_len: int) -> None:
        from vllm.config import SpeculativeConfig
        from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

        spec = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)
                if f.name.startswith("suffix_decoding_")}
        unknown = set(options) - set(spec) - {"num_speculative_tokens"}
        if unknown:
            raise ValueError(f"unknown suffix option(s) {sorted(unknown)}; allowed: "
                             f"num_speculative_tokens, {', '.join(sorted(spec))}")
        spec = {**spec, **options}
        # vLLM drafts as deep as the tree when num_speculative_tokens is not given: the tree's
        # depth as configured (SpeculativeConfig sets it after the options), not its default.
        spec.setdefault("num_speculative_tokens", spec["suffix_decoding_max_tree_depth"])
        self.k, self.max_model_len = spec["num_speculative_tokens"], max_model_len
        self.proposer = SuffixDecodingProposer(SimpleNamespace(
            speculative_config=SimpleNamespace(**spec),
            model_config=SimpleNamespace(max_model_len=max_model_len)))
        self.trees: dict[str, Any] = {}  # no trees
        self.req_ids: list[str] = []
        self.prompt_lens: dict[str, int] = {}

    def observe_batch(self, req_ids: list[str], tree_rows: Any = None, keys: Any = None,
                      token_limits: Any = None, known_from: Any = None) -> None:
        self.req_ids = req_ids
        self.prompt_lens = {r: n for r, n in self.prompt_lens.items() if r in set(req_ids)}

    def observe_finished(self, req_ids: set[str], tokens: Any = None) -> None:
        pass  # vLLM's proposer stops the requests absent from a batch itself

    def propose(self, sampled: list[list[int]], num_tokens: np.ndarray,
                token_ids: np.ndarray) -> list[list[int]]:
        for req_id, tokens, n in zip(self.req_ids, sampled, num_tokens):
            # A request's first propose follows its prefill, which sampled one token.
            self.prompt_lens.setdefault(req_id, int(n) - len(tokens))
        return self.proposer.propose(self.k, SimpleNamespace(
            req_ids=self.req_ids, num_tokens_no_spec=num_tokens, token_ids_cpu=token_ids,
            req_id_to_index={r: i for i, r in enumerate(self.req_ids)},
            num_prompt_tokens=[self.prompt_lens[r] for r in self.req_ids]), sampled)

    def stats(self, reset: bool = False) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class NgramPeer:
    """vLLM's own ``ngram`` method: its ``NgramProposer`` behind the hooks replay calls. Options
    are vLLM's (``prompt_lookup_min``, ``prompt_lookup_max``, ``num_speculative_tokens``), at
    the values ``vllm-rsd bench`` runs it with unless given."""

    capabilities = Capabilities()
    has_work_after_handover = False
    #: ``vllm-rsd bench``'s ngram, at its default k.
    DEFAULTS = {"num_speculative_tokens": BenchSettings.num_speculative_tokens, **NGRAM_OPTIONS}

    def __init__(self, options: dict[str, Any], max_model_len: int) -> None:
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer

        unknown = set(options) - set(self.DEFAULTS)
        if unknown:
            raise ValueError(f"unknown ngram option(s) {sorted(unknown)}; allowed: "
                             f"{', '.join(self.DEFAULTS)}")
        spec = {**self.DEFAULTS, **options}
        self.k, self.max_model_len = spec["num_speculative_tokens"], max_model_len
        self.proposer = NgramProposer(SimpleNamespace(
            speculative_config=SimpleNamespace(**spec),
            model_config=SimpleNamespace(max_model_len=max_model_len),
            scheduler_config=SimpleNamespace(max_num_seqs=1024),
            parallel_config=SimpleNamespace(tensor_parallel_size=1)))
        self.trees: dict[str, Any] = {}  # no trees

    def observe_batch(self, req_ids: list[str], tree_rows: Any = None, keys: Any = None,
                      token_limits: Any = None, known_from: Any = None) -> None:
        pass

    def observe_finished(self, req_ids: set[str], tokens: Any = None) -> None:
        pass

    def propose(self, sampled: list[list[int]], num_tokens: np.ndarray,
                token_ids: np.ndarray) -> list[list[int]]:
        return self.proposer.propose(self.k, sampled, num_tokens, token_ids)

    def stats(self, reset: bool = False) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass
