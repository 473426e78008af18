"""Typed, validated options for each drafting method.

Users pass one flat dict, as for vLLM's own methods::

    speculative_config={"method": "rest", "num_speculative_tokens": 8, "datastore": "ds/stdlib"}

``parse_speculative_config`` turns it into a frozen dataclass once, at start-up, in the process
that builds the engine config; every bad value fails there with a message that names the option
and what is allowed. The worker re-creates the same dataclass from ``additional_config``.

A few defaults are measurements of the platform vLLM runs on, not properties of a method (how
much verifying one more draft token costs, how large a batch still gains from drafts). They come
from ``PlatformDefaults``: ``VLLM_CPU_DEFAULTS`` where the forward runs on CPU cores,
``ACCELERATOR_DEFAULTS`` on a GPU; ``vllm-rsd calibrate`` measures this machine's own.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

#: Key under which our options travel in ``VllmConfig.additional_config``.
PLUGIN_KEY = "vllm_retrieval_spec"

MAX_SPECULATIVE_TOKENS = 64
#: How DReSD searches its dense index (see datastore.dense).
DENSE_SEARCH_BACKENDS = ("auto", "exact", "scann")
#: Whether hybrid drafting searches the dense index too.
HYBRID_DENSE_MODES = ("auto", "on", "off")
#: Who drafts from what the engine has served: nobody, or every request (see README's note on
#: the timing side channel).
SERVED_STORE_MODES = ("off", "shared", "per_request")


class ConfigError(ValueError):
    """A speculative_config option is missing, unknown or out of range."""


@dataclass(frozen=True, kw_only=True)
class PlatformDefaults:
    """Defaults of the options that depend on where the target model runs."""

    name: str
    #: A request whose drafting takes longer than this (ms) gets no draft that step.
    draft_budget_ms: float
    #: Verifying one more draft token costs this fraction of a forward.
    draft_token_cost: float
    #: No drafts while this many requests or more are running (0 = always draft).
    disable_by_batch_size: int
    #: Drafts are empty or at least this long.
    min_draft_len: int
    #: PLD+: occurrences less similar than this are not drafted from.
    min_similarity: float
    #: Make each request's possible next drafts before its sampled tokens are known
    #: (``drafting.overlap``).
    precompute_drafts: bool
    #: Draft for greedy requests from the step's logits, before vLLM samples.
    draft_before_sampling: bool

    def for_options(self, names: set[str]) -> dict[str, Any]:
        """The defaults among ``names`` (a method's option names)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name in names}


#: Measured on vLLM-CPU 0.32 with SmolLM2-135M (float32, 2 cores); the sources:
#: - draft_budget_ms 5: a plain step takes ~60-70 ms there and drafting normally well under
#:   1 ms, so 5 ms (7% of a step) only catches pathological lookups.
#: - draft_token_cost 0.055: REST's steps took 67.5 ms with 2.18 draft tokens against 60.2 ms
#:   plain (benchmarks/results/codegen-humaneval-stdlib.json).
#: - disable_by_batch_size 6: benchmarks/results/codegen-batch-crossover-c*: at 4 concurrent
#:   requests every method beat plain decoding (ngram 1.17x, pld 1.29x, rest 1.15x, dresd
#:   1.17x), at 8 none did (0.94x, 1.00x, 0.81x, 0.72x).
#: - min_draft_len 3: a step verifying 1 draft token took 86 ms against 71 ms for none and
#:   58-66 ms for 2-5 (verify-cost.md), so a lone draft token is the costliest draft there is;
#:   3 rather than 2 because replay of prompts 20-39 gave more tokens per forward (hybrid,
#:   summarize: 1.76 at 1, 1.79 at 2, 1.82 at 3).
#: - min_similarity 0.7 (PLD+): at the paper's 0 a draft of k tokens goes out almost every step,
#:   ~5% of a forward per drafted token; 0.7 was best replaying prompts 20-39 of three tasks.
#: - precompute_drafts off: the forward uses every core here, so precomputing is not overlapped
#:   with anything; it cut drafting's critical part by half or more but made hybrid's steps 2-7%
#:   slower on four tasks, pld's -2% to +4% (benchmarks/results/precomputed-drafts.md).
#: - draft_before_sampling on: one draft per greedy request, made before sampling instead of
#:   after it; the extra work is one argmax over the step's logits.
VLLM_CPU_DEFAULTS = PlatformDefaults(
    name="vllm-cpu", draft_budget_ms=5.0, draft_token_cost=0.055, disable_by_batch_size=6,
    min_draft_len=3, min_similarity=0.7, precompute_drafts=False, draft_before_sampling=True)

#: For GPUs, where a forward is 3-20 ms and verifying 64 tokens costs little more than one (not
#: measured by this project: no GPU with vLLM was available; run `vllm-rsd calibrate` there):
#: - draft_budget_ms 1: a tenth of a fast 10 ms step.
#: - draft_token_cost 0.01: DReSD's best greedy shape verifies 60 tokens a step on a 7 B model
#:   (arXiv 2502.15572, section 5.4) and REST verifies 64-node trees (arXiv 2311.08252), which
#:   pays only if a draft token costs about 1% of a forward or less.
#: - disable_by_batch_size 0: vLLM's own default for its drafters (never off).
#: - min_draft_len 1: the CPU's penalty on 1-token drafts comes from vLLM-CPU's kernels.
#: - min_similarity 0.0: the PLD+ paper's best threshold on an A100 (its Table 7).
#: - precompute_drafts on: the drafts are made while the host waits for the launched forward.
#: - draft_before_sampling off: reading the logits' argmax on the host before sampling would
#:   wait for the device there; the precomputed drafts already leave only a lookup.
ACCELERATOR_DEFAULTS = PlatformDefaults(
    name="accelerator", draft_budget_ms=1.0, draft_token_cost=0.01, disable_by_batch_size=0,
    min_draft_len=1, min_similarity=0.0, precompute_drafts=True, draft_before_sampling=False)


def platform_defaults(is_cpu: bool) -> PlatformDefaults:
    return VLLM_CPU_DEFAULTS if is_cpu else ACCELERATOR_DEFAULTS


@dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """Options every retrieval method shares. The ones without a default here come from the
    platform (``PlatformDefaults``) unless the user sets them."""

    method: ClassVar[str]
    proposer_class: ClassVar[str]

    num_speculative_tokens: int
    #: A request whose drafting takes longer than this (ms) gets no draft that step; the event
    #: is counted. 0 = no budget.
    draft_budget_ms: float
    #: Cap each request's draft length by its recent acceptance (``drafting.adaptive``).
    adaptive_draft_len: bool = True
    #: Verifying one more draft token costs this fraction of a forward: where adaptive drafts
    #: stop paying.
    draft_token_cost: float
    #: No drafts while this many requests or more are running (0 = always draft): a batch's
    #: forward costs more per extra token as it grows, so verification stops paying.
    disable_by_batch_size: int
    #: Drafts are empty or at least this long (capped by k): shorter ones are extended along
    #: the trie's heaviest path where the method has one, else dropped.
    min_draft_len: int
    #: Learn this engine's step time for each short draft length while one request decodes
    #: alone, and pad a draft to a longer length where that one verifies faster
    #: (``drafting.step_cost``): on some CPUs a step verifying 4 draft tokens is cheaper than
    #: one verifying none. Off with tensor parallelism (ranks would time their steps apart).
    pad_drafts: bool = True
    #: Testing aid, 0 in production: this fraction of draft attempts fails on purpose, in turn
    #: raising, drafting k + 1 tokens, drafting an id outside the vocabulary and overrunning the
    #: time budget, to show that such faults cost drafts, never the engine.
    inject_faults: float = 0.0
    #: Make each request's possible next drafts (one per accepted length and following token
    #: that can draft anything, ``drafting.overlap``) after its draft is handed to vLLM, so
    #: that drafting after sampling is a lookup. Methods whose drafts need the step's hidden
    #: states (DReSD, PLD+, hybrid with a dense index) draft after sampling as before.
    precompute_drafts: bool
    #: A greedy request's tokens sampled this step are the argmax of the step's logits along
    #: its draft, known before vLLM's sampler runs: its next draft is made then, and drafting
    #: after sampling only checks that the sampled tokens are the ones drafted for
    #: (``drafting.overlap.greedy_sampled``). Same methods as ``precompute_drafts``.
    draft_before_sampling: bool
    #: At most this many precomputed drafts per request and step; the likeliest first.
    precompute_max_drafts: int = 32

    def __post_init__(self) -> None:
        _check_range(self, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        _check_range(self, "precompute_max_drafts", 1, 4096)
        _check_range(self, "draft_budget_ms", 0.0, 1e4)
        _check_range(self, "draft_token_cost", 0.0, 1.0)
        _check_range(self, "disable_by_batch_size", 0, 1 << 20)
        _check_range(self, "min_draft_len", 1, MAX_SPECULATIVE_TOKENS)
        _check_range(self, "inject_faults", 0.0, 1.0)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **dataclasses.asdict(self)}


#: A tree branch is drafted while its estimated acceptance is at least this many times the cost
#: of verifying a token. Replay of prompts 20-39 (hybrid, k = 24, four tasks, at the CPU's
#: 0.055): thresholds 0.25 / 0.3 / 0.4 gave 1.028 / 1.031 / 1.030 the chain's modelled speedup
#: (geometric mean), 0.05-0.2 less than 1 (benchmarks/results/tuning/tree-tuning.md).
TREE_COST_FACTOR = 5.5


@dataclass(frozen=True, kw_only=True)
class TrieDraftConfig(MethodConfig):
    """Methods that vote retrieved continuations in a trie and draft its best chain."""

    #: Draft a token only while the estimated probability that the prefix is right stays
    #: at or above this (see ``drafting.tree.best_chain``). With the prior below, one lone
    #: occurrence still drafts (1/3) and a 2:1 split stops. Chosen by replaying HumanEval
    #: outputs against the stdlib datastore: each drafted token costs about 3.5% of a forward
    #: on our CPUs, so long weak drafts lose time (benchmarks/replay.py).
    min_prefix_prob: float = 0.3
    #: Pseudo-count of "no candidate is right" in that estimate.
    prior_weight: float = 2.0
    #: "on": draft a token tree of at most ``num_speculative_tokens`` nodes, the best chain
    #: and then the trie's other nodes best-first (``drafting.tree.best_tree``), verified
    #: together (``tree_verification``); "off": the best chain alone.
    tree: str = "off"
    #: A node beside the chain joins the tree while its estimated probability of being
    #: accepted stays at or above this. Unset: ``TREE_COST_FACTOR`` x ``draft_token_cost``, what
    #: verifying one more token costs on this platform, scaled by how much the trie's estimates
    #: overstate a branch's chances.
    tree_min_prob: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_range(self, "min_prefix_prob", 0.0, 1.0)
        _check_range(self, "prior_weight", 0.0, 1e6)
        _check_choice(self, "tree", ("off", "on"))
        if self.tree_min_prob is None:
            # Frozen: the derived value is set once, here, and travels in to_dict().
            object.__setattr__(self, "tree_min_prob",
                               round(TREE_COST_FACTOR * self.draft_token_cost, 4))
        _check_range(self, "tree_min_prob", 0.0, 1.0)


@dataclass(frozen=True, kw_only=True)
class VotedDraftConfig(TrieDraftConfig):
    """Methods that vote the continuations of a suffix match (REST, PLD)."""

    #: Context suffixes from ``max_match_len`` down to ``min_match_len`` tokens are tried.
    min_match_len: int = 2
    max_match_len: int = 16
    #: At most this many occurrences' continuations are counted in the trie.
    max_occurrences: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_range(self, "min_match_len", 1, 64)
        _check_range(self, "max_match_len", self.min_match_len, 64)
        _check_range(self, "max_occurrences", 1, 4096)


@dataclass(frozen=True, kw_only=True)
class RestConfig(VotedDraftConfig):
    """REST: exact suffix match in a token datastore (paper: arXiv 2311.08252)."""

    method: ClassVar[str] = "rest"
    proposer_class: ClassVar[str] = "vllm_retrieval_spec.proposers.rest.RestProposer"

    #: Directory written by ``vllm-rsd build-datastore``.
    datastore: str = ""
    #: Re-hash every datastore file at start-up (seconds for 50 M tokens).
    verify_checksums: bool = True

    def __post_init__(self) -> None:
        if not self.datastore and self.needs_datastore():
            raise ConfigError(
                f"speculative_config['datastore'] is required for method {self.method!r}: the "
                "directory written by `vllm-rsd build-datastore`"
            )
        super().__post_init__()

    def needs_datastore(self) -> bool:
        return True


@dataclass(frozen=True, kw_only=True)
class PldConfig(VotedDraftConfig):
    """PLD: n-gram lookup in the request's own context (baseline of arXiv 2412.01447)."""

    method: ClassVar[str] = "pld"
    proposer_class: ClassVar[str] = "vllm_retrieval_spec.proposers.pld.PldProposer"


@dataclass(frozen=True, kw_only=True)
class PldPlusConfig(MethodConfig):
    """PLD+ (arXiv 2412.01447, "PLD+(h)"): earlier occurrences of the last token, ranked by the
    cosine similarity of an early layer's hidden state before each occurrence with the one
    before the last token; the best one's continuation is the draft."""

    method: ClassVar[str] = "pld_plus"
    proposer_class: ClassVar[str] = "vllm_retrieval_spec.proposers.pld.PldPlusProposer"

    #: Residual stream after this many decoder layers (0 = embeddings); checked against the
    #: model's depth at start-up. The paper found layers 9-13 of 32 best for Vicuna; for
    #: SmolLM2 (30 layers) 15 beat 2-12 and 20 when replaying HumanEval, Lee-corpus and
    #: code-edit prompts 20-39 (benchmarks/replay.py).
    layer: int = 15
    #: Occurrences less similar than this are not drafted from (the paper's theta).
    min_similarity: float
    #: Only the most recent occurrences are ranked, bounding the cost per step.
    max_candidates: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_range(self, "layer", 0, 1024)
        _check_range(self, "min_similarity", -1.0, 1.0)
        _check_range(self, "max_candidates", 1, 1 << 20)


@dataclass(frozen=True, kw_only=True)
class DenseSearchConfig(TrieDraftConfig):
    """How a dense index is searched (DReSD, and hybrid's dense source)."""

    #: Nearest neighbours retrieved per step, before the next-token filter.
    top_n: int = 32
    #: "exact" (matmul over all keys), "scann", or "auto" (ScaNN where the store has a searcher).
    search: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_range(self, "top_n", 1, 4096)
        _check_choice(self, "search", DENSE_SEARCH_BACKENDS)


@dataclass(frozen=True, kw_only=True)
class HybridConfig(RestConfig, DenseSearchConfig):
    """The request's own context, the datastore's suffix array and, when the datastore has one,
    its dense index, voted in one trie (the best of all three).

    Weights make the sources comparable (``proposers.hybrid.hybrid_draft``): each occurrence of
    the context match votes ``context_weight`` x match length, the datastore's suffix matches
    share its match length, and the dense neighbours that pass the next-token filter share
    ``dense_weight`` x their similarity / ``top_n``.
    """

    method: ClassVar[str] = "hybrid"
    proposer_class: ClassVar[str] = "vllm_retrieval_spec.proposers.hybrid.HybridProposer"

    #: Context suffixes from ``context_max_match_len`` down to ``context_min_match_len``, and
    #: the stores' from ``max_match_len`` down to ``min_match_len``. Down to one token: when
    #: nothing longer matches, the continuations of the last token's earlier occurrences still
    #: draft (vLLM's ``suffix`` does the same), and ``max_spec_factor`` keeps such drafts to two
    #: tokens. Replay at 0.05 of a forward per draft token (hybrid, k = 24, no datastore;
    #: benchmarks/results/tuning/one-token-matches.md): against ``suffix``'s modelled speedup,
    #: 1.034x geometric mean over four tasks against 1.000x with two-token minimums on the
    #: tuning prompts 20-39, and 1.029x against 0.994x on prompts 40-59 of five tasks, checked
    #: after choosing. Makes precomputed drafts (``drafting.overlap``) incomplete: a sampled
    #: token seen anywhere before drafts, not only the last token's followers.
    context_min_match_len: int = 1
    min_match_len: int = 1
    context_max_match_len: int = 16
    #: Defaults below were tuned together by replaying plain outputs of prompts 20-39 of every
    #: task (code-gen, code-edit, summarize, chat) against the model's own answers to prompts
    #: 40 and up (benchmarks/results/tuning/hybrid-tuning.md); the best geometric mean of modelled
    #: speedup over the four tasks won, on a plateau: neighbours were within 1%.
    #: Lower than REST's 0.3 and a weaker prior: three sources rarely agree unanimously.
    min_prefix_prob: float = 0.2
    prior_weight: float = 1.0
    #: Vote of one context occurrence per matched token, relative to the suffix array's.
    context_weight: float = 4.0
    #: A context match at least this long is trusted alone: the datastore is not searched.
    skip_datastore_match_len: int = 3
    #: Search the datastore's dense index too: "auto" (when it has one), "on" (it must), "off".
    dense: str = "auto"
    #: Total vote of the dense neighbours when all ``top_n`` pass the filter with similarity 1.
    #: High because it is divided by ``top_n`` and only neighbours that pass the filter vote.
    dense_weight: float = 32.0
    #: Learn from what this engine serves (``datastore.served``): "shared" drafts every request
    #: from every finished request's tokens; "per_request": each request names the store it is
    #: drafted from and stored in (``SamplingParams.extra_args["served_store_key"]``, the
    #: OpenAI server's ``vllm_xargs``), so requests learn only from requests with the same key,
    #: and a request without one neither; "off" never stores any.
    served_store: str = "shared"
    #: The served store keeps at most this many tokens (oldest requests evicted first; with
    #: keys, all stores together); 12 bytes per token, and about 15 more while its index is
    #: rebuilt (``datastore.served``).
    served_max_tokens: int = 1_000_000
    #: With ``served_store: "per_request"``: at most this many keys' stores (the least recently
    #: used goes whole).
    served_max_keys: int = 64
    #: Store finished requests' prompts too, not only what the model generated: other
    #: requests' prompts share their templates and code (replay, prompts 20-39: code-edit 3.59
    #: against 3.44 modelled speedup, code-gen 1.90 against 1.88, chat and summarize +-1%).
    served_prompts: bool = True
    #: Vote of the served store's occurrences per matched token, shared among them (as the
    #: static suffix array's, whose vote is 1).
    served_weight: float = 2.0
    #: Directory the served store is saved to (a datastore, atomically, every
    #: ``served_save_minutes`` and at shutdown) and loaded from at start-up; "" = memory only.
    served_datastore: str = ""
    served_save_minutes: float = 10.0
    #: Index the served tokens' final hidden states too (``datastore.served_dense``): DReSD
    #: neighbours among what this engine generated, projected as the datastore's dense index
    #: is, or by a projection fitted on the first ``served_dense_fit_states`` served states
    #: when there is none. Searched, like the datastore, only when the context match is shorter
    #: than ``skip_datastore_match_len``; ``top_n`` neighbours, filtered by the token just
    #: emitted, share ``served_dense_weight`` x similarity / ``top_n``. Needs served_store
    #: "shared". Off by default: in replay (prompts 20-39) it raised hybrid's modelled speedup
    #: by 0.4-2.3% on four tasks (benchmarks/results/tuning/served-dense-tuning.md).
    served_dense: bool = False
    #: 8 beat 32 and 128 in that replay (code-edit 3.29 against 3.21 and 3.19; the others
    #: within 1%).
    served_dense_weight: float = 8.0
    #: Keys kept (the oldest overwritten first): about 480 bytes each (``datastore.served_dense``).
    served_dense_max_keys: int = 200_000
    #: 256 beat 1024 in replay (served-dense-tuning.md): the projection is ready sooner.
    served_dense_fit_states: int = 256
    #: Drafts are at most this many times as long as the longest exact match behind them
    #: (0 = no such cap): an n-token match predicts about n tokens. With this cap, drafts as
    #: long as 24 tokens pay, and the acceptance-based cap only costs tokens, so it is off by
    #: default (replay of prompts 20-39 at k = 24, all four tasks: factor 2 without the
    #: acceptance cap beat 0.5, 1, 1.5 and 3, with or without it;
    #: benchmarks/results/tuning/served-tuning.md).
    max_spec_factor: float = 2.0
    adaptive_draft_len: bool = False
    #: With ``tree: "on"``: total vote of the continuations of the last token's every earlier
    #: occurrence (context and served store), shared among them; they become the tree's
    #: branches beside the longest match's (0 = none). Replay (tree-tuning.md): 4 beat 1, 8
    #: and 16 at the default threshold.
    tree_branch_weight: float = 4.0

    def needs_datastore(self) -> bool:
        # With a served store hybrid drafts from the first request on without any datastore.
        return self.served_store == "off"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice(self, "served_store", SERVED_STORE_MODES)
        _check_range(self, "served_max_tokens", 1, 1 << 31)
        _check_range(self, "served_weight", 0.0, 1e6)
        _check_range(self, "served_save_minutes", 0.01, 1e6)
        _check_range(self, "max_spec_factor", 0.0, 64.0)
        _check_range(self, "tree_branch_weight", 0.0, 1e6)
        _check_range(self, "served_max_keys", 1, 1 << 16)
        _check_range(self, "served_dense_max_keys", 1, 1 << 28)
        _check_range(self, "served_dense_weight", 0.0, 1e6)
        # At least the projection's width (64 dims) to fit it.
        _check_range(self, "served_dense_fit_states", 64, 1 << 24)
        if self.served_dense and self.served_store != "shared":
            raise ConfigError(
                "speculative_config['served_dense'] needs served_store 'shared', got "
                f"{self.served_store!r}")
        if self.served_datastore and self.served_store != "shared":
            raise ConfigError(
                "speculative_config['served_datastore'] needs served_store 'shared': with "
                f"{self.served_store!r} " + ("nothing is stored to save" if self.served_store
                                             == "off" else "the stores by key are not saved"))
        if self.dense == "on" and not self.datastore:
            raise ConfigError("speculative_config['dense']='on' needs a 'datastore' with a "
                              "dense index")
        _check_range(self, "context_min_match_len", 1, 64)
        _check_range(self, "context_max_match_len", self.context_min_match_len, 64)
        _check_range(self, "context_weight", 0.0, 1e6)
        _check_range(self, "skip_datastore_match_len", 1, 65)
        _check_range(self, "dense_weight", 0.0, 1e6)
        _check_choice(self, "dense", HYBRID_DENSE_MODES)


@dataclass(frozen=True, kw_only=True)
class DresdConfig(DenseSearchConfig):
    """DReSD (arXiv 2502.15572): the last hidden state, projected (z-norm, PCA, L2), searched in
    a dense index; neighbours whose stored next token is the token just emitted vote their
    continuations."""

    method: ClassVar[str] = "dresd"
    proposer_class: ClassVar[str] = "vllm_retrieval_spec.proposers.dresd.DresdProposer"

    #: Datastore directory with a dense index (``vllm-rsd build-datastore --dense``).
    datastore: str = ""
    #: Lower than REST's 0.3: the similarity-weighted votes of a few neighbours are rarely
    #: unanimous. 0.2 beat 0.1, 0.25, 0.3 and 0.4 replaying HumanEval prompts 20-39 against the
    #: model's own answers to prompts 40-163.
    min_prefix_prob: float = 0.2
    #: Threads searching the batch's queries while drafts are voted (batch > 1).
    search_threads: int = 2
    verify_checksums: bool = True

    def __post_init__(self) -> None:
        if not self.datastore:
            raise ConfigError(
                "speculative_config['datastore'] is required for method 'dresd': a directory "
                "built with `vllm-rsd build-datastore --dense`")
        super().__post_init__()
        _check_range(self, "search_threads", 1, 64)


METHODS: dict[str, type[MethodConfig]] = {
    cls.method: cls for cls in (RestConfig, PldConfig, PldPlusConfig, HybridConfig, DresdConfig)
}


def parse_speculative_config(options: dict[str, Any], platform: PlatformDefaults
                             ) -> MethodConfig:
    """Validate a user's speculative_config dict for one of our methods; options it leaves out
    that depend on the platform come from ``platform``."""
    options = {str(k).replace("-", "_"): v for k, v in options.items()}
    method = options.pop("method", None)
    if method not in METHODS:
        raise ConfigError(
            f"speculative_config['method']={method!r} is not a retrieval method; "
            f"choose one of {sorted(METHODS)}"
        )
    cls = METHODS[method]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {unknown} for method {method!r}; allowed: {sorted(fields)}"
        )
    if "num_speculative_tokens" not in options:
        raise ConfigError(
            f"speculative_config['num_speculative_tokens'] is required for method {method!r} "
            f"(an integer in [1, {MAX_SPECULATIVE_TOKENS}])"
        )
    hints = typing.get_type_hints(cls)
    values = {name: _coerce(name, value, hints[name]) for name, value in options.items()}
    return cls(**{**platform.for_options(set(fields)), **values})


def config_from_dict(data: dict[str, Any]) -> MethodConfig:
    """Inverse of ``MethodConfig.to_dict`` (the worker side of ``additional_config``): every
    option is there already, the platform's defaults included."""
    data = dict(data)
    cls = METHODS.get(data.pop("method", None))
    if cls is None:
        raise ConfigError(f"additional_config holds no retrieval method: {data}")
    return cls(**data)


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Accept JSON-typed values (the server passes JSON); reject everything else clearly."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if bool in allowed and isinstance(value, bool):
        return value
    if int in allowed and isinstance(value, int) and not isinstance(value, bool):
        return value
    if float in allowed and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"speculative_config[{name!r}]={value!r} must be finite")
        return float(value)
    if str in allowed and isinstance(value, str):
        return value
    names = " or ".join(t.__name__ for t in allowed)
    raise ConfigError(
        f"speculative_config[{name!r}]={value!r} has type {type(value).__name__}; expected {names}"
    )


def _check_range(config: MethodConfig, name: str, low: float, high: float) -> None:
    value = getattr(config, name)
    if not low <= value <= high:
        raise ConfigError(
            f"speculative_config[{name!r}]={value!r} is out of range for method "
            f"{config.method!r}: must be in [{low}, {high}]"
        )


def _check_choice(config: MethodConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise ConfigError(f"speculative_config[{name!r}]={value!r} is not one of {list(choices)}")
