"""Option groups: the options of one part of a method (how it drafts, how its trie chooses, one
candidate source). A method's config composes the groups it uses (``config.methods``); users
still pass every option flat, under the field names below, as for vLLM's own methods.

Each group checks its own values (``check``); checks across groups belong to the method.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Longest draft a method accepts (vLLM's own drafters go as far).
MAX_SPECULATIVE_TOKENS = 64
#: How a dense index is searched (see datastore.dense).
DENSE_SEARCH_BACKENDS = ("auto", "exact", "scann")
#: Whether hybrid drafting searches the dense index too.
HYBRID_DENSE_MODES = ("auto", "on", "off")
#: Who drafts from what the engine has served: nobody, every request, or the requests that name
#: the same key (see README's note on the timing side channel).
SERVED_STORE_MODES = ("off", "shared", "per_request")
#: The options that take one of a few strings, named in a type error too: YAML reads an
#: unquoted on / off as a bool, and ``"tree": true`` is natural to write.
CHOICES = {"tree": ("off", "on"), "search": DENSE_SEARCH_BACKENDS, "dense": HYBRID_DENSE_MODES,
           "served_store": SERVED_STORE_MODES}
#: A tree branch is drafted while its estimated acceptance is at least this many times the cost
#: of verifying a token. Replay of prompts 20-39 (hybrid, k = 24, four tasks, at the CPU's
#: 0.055): thresholds 0.25 / 0.3 / 0.4 gave 1.028 / 1.031 / 1.030 the chain's modelled speedup
#: (geometric mean), 0.05-0.2 less than 1 (benchmarks/results/tuning/tree-tuning.md).
TREE_COST_FACTOR = 5.5


class ConfigError(ValueError):
    """A speculative_config option is missing, unknown or out of range."""


@dataclass(frozen=True, kw_only=True)
class DraftingOptions:
    """What every method shares: how long drafts may be, when drafting is skipped, and when
    drafts are made. Options without a default come from the platform (``PlatformDefaults``)
    unless the user sets them."""

    num_speculative_tokens: int
    #: A request whose drafting takes longer than this (ms) gets no draft that step; the event
    #: is counted. 0 = no budget; none with tensor parallelism, whose ranks must draft alike.
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
    #: (``drafting.overlap.greedy_sampled``).
    draft_before_sampling: bool
    #: At most this many precomputed drafts per request and step; the likeliest first.
    precompute_max_drafts: int = 32

    def check(self, method: str) -> None:
        check_range(method, self, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        check_range(method, self, "precompute_max_drafts", 1, 4096)
        check_range(method, self, "draft_budget_ms", 0.0, 1e4)
        check_range(method, self, "draft_token_cost", 0.0, 1.0)
        check_range(method, self, "disable_by_batch_size", 0, 1 << 20)
        check_range(method, self, "min_draft_len", 1, MAX_SPECULATIVE_TOKENS)
        check_range(method, self, "inject_faults", 0.0, 1.0)


@dataclass(frozen=True, kw_only=True)
class TrieOptions:
    """How a method that votes retrieved continuations in a trie chooses its draft
    (``drafting.tree``)."""

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
    #: together (``verification``); "off": the best chain alone.
    tree: str = "off"
    #: A node beside the chain joins the tree while its estimated probability of being
    #: accepted stays at or above this. Unset: ``TREE_COST_FACTOR`` x ``draft_token_cost``, what
    #: verifying one more token costs on this platform, scaled by how much the trie's estimates
    #: overstate a branch's chances (the method sets it once, at start-up).
    tree_min_prob: float | None = None

    def check(self, method: str) -> None:
        check_range(method, self, "min_prefix_prob", 0.0, 1.0)
        check_range(method, self, "prior_weight", 0.0, 1e6)
        check_choice(method, self, "tree", CHOICES["tree"])
        check_range(method, self, "tree_min_prob", 0.0, 1.0)


@dataclass(frozen=True, kw_only=True)
class MatchOptions:
    """Exact suffix matches (REST's suffix array, PLD's context, hybrid's stores): context
    suffixes from ``max_match_len`` down to ``min_match_len`` tokens are tried."""

    min_match_len: int = 2
    max_match_len: int = 16
    #: At most this many occurrences' continuations are counted in the trie.
    max_occurrences: int = 64

    def check(self, method: str) -> None:
        check_range(method, self, "min_match_len", 1, 64)
        check_range(method, self, "max_match_len", self.min_match_len, 64)
        check_range(method, self, "max_occurrences", 1, 4096)


@dataclass(frozen=True, kw_only=True)
class DatastoreOptions:
    """A datastore on disk (``vllm-rsd build-datastore``)."""

    #: Directory written by ``vllm-rsd build-datastore``.
    datastore: str = ""
    #: Re-hash every datastore file at start-up (seconds for 50 M tokens).
    verify_checksums: bool = True

    def check(self, method: str) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class DenseSearchOptions:
    """How a dense index is searched (DReSD, and hybrid's dense sources)."""

    #: Nearest neighbours retrieved per step, before the next-token filter.
    top_n: int = 32
    #: "exact" (matmul over all keys), "scann", or "auto" (ScaNN where the store has a searcher).
    search: str = "auto"

    def check(self, method: str) -> None:
        check_range(method, self, "top_n", 1, 4096)
        check_choice(method, self, "search", CHOICES["search"])


@dataclass(frozen=True, kw_only=True)
class ContextOptions:
    """Hybrid's source of the request's own context (``sources.context``), and how far it is
    trusted alone."""

    #: Context suffixes from ``context_max_match_len`` down to ``context_min_match_len``. Down
    #: to one token: when nothing longer matches, the continuations of the last token's earlier
    #: occurrences still draft (vLLM's ``suffix`` does the same), and ``max_spec_factor`` keeps
    #: such drafts to two tokens. Replay at 0.05 of a forward per draft token (hybrid, k = 24,
    #: no datastore; benchmarks/results/tuning/one-token-matches.md): against ``suffix``'s
    #: modelled speedup, 1.034x geometric mean over four tasks against 1.000x with two-token
    #: minimums on the tuning prompts 20-39, and 1.029x against 0.994x on prompts 40-59 of five
    #: tasks, checked after choosing. Makes precomputed drafts (``drafting.overlap``)
    #: incomplete: a sampled token seen anywhere before drafts, not only the last token's
    #: followers.
    context_min_match_len: int = 1
    context_max_match_len: int = 16
    #: Vote of one context occurrence per matched token, relative to the suffix array's.
    context_weight: float = 4.0
    #: A context match at least this long is trusted alone: the datastore and the dense
    #: sources are not searched.
    skip_datastore_match_len: int = 3

    def check(self, method: str) -> None:
        check_range(method, self, "context_min_match_len", 1, 64)
        check_range(method, self, "context_max_match_len", self.context_min_match_len, 64)
        check_range(method, self, "context_weight", 0.0, 1e6)
        check_range(method, self, "skip_datastore_match_len", 1, 65)


@dataclass(frozen=True, kw_only=True)
class DenseOptions:
    """Hybrid's source of the datastore's dense index (``sources.dense``)."""

    #: Search the datastore's dense index too: "auto" (when it has one), "on" (it must), "off".
    dense: str = "auto"
    #: Total vote of the dense neighbours when all ``top_n`` pass the filter with similarity 1.
    #: High because it is divided by ``top_n`` and only neighbours that pass the filter vote.
    dense_weight: float = 32.0

    def check(self, method: str) -> None:
        check_range(method, self, "dense_weight", 0.0, 1e6)
        check_choice(method, self, "dense", CHOICES["dense"])


@dataclass(frozen=True, kw_only=True)
class ServedOptions:
    """Hybrid's store of what the engine has served (``datastore.served``,
    ``sources.suffix_array``)."""

    #: "shared" drafts every request from every finished request's tokens; "per_request":
    #: each request names the store it is drafted from and stored in
    #: (``SamplingParams.extra_args["served_store_key"]``, the OpenAI server's ``vllm_xargs``),
    #: so requests learn only from requests with the same key, and a request without one
    #: neither; "off" never stores any.
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
    #: Directory the served store lives in (``datastore.served_saver``), shared by every
    #: replica given it; "" = memory only. Every finished request is appended to this
    #: replica's journal there, and loaded by every replica at start-up.
    served_datastore: str = ""
    #: The journal is written and fsynced this often (ms), and other replicas' journals read
    #: as often: a crash loses at most this long's requests.
    served_flush_ms: float = 1000.0
    #: A snapshot compacts the journals this often (minutes).
    served_save_minutes: float = 10.0
    #: With ``served_datastore``: requests older than this (hours) are dropped from memory and
    #: leave the next snapshot; 0 = no age limit.
    served_max_age_hours: float = 720.0

    def check(self, method: str) -> None:
        check_choice(method, self, "served_store", CHOICES["served_store"])
        check_range(method, self, "served_max_tokens", 1, 1 << 31)
        check_range(method, self, "served_weight", 0.0, 1e6)
        check_range(method, self, "served_flush_ms", 1.0, 60_000.0)
        check_range(method, self, "served_save_minutes", 0.01, 1e6)
        check_range(method, self, "served_max_age_hours", 0.0, 1e6)
        check_range(method, self, "served_max_keys", 1, 1 << 16)


@dataclass(frozen=True, kw_only=True)
class ServedDenseOptions:
    """Hybrid's dense half of the served store (``datastore.served_dense``): DReSD neighbours
    among what this engine generated, projected as the datastore's dense index is, or by a
    projection fitted on the first ``served_dense_fit_states`` served states when there is
    none. Searched, like the datastore, only when the context match is shorter than
    ``skip_datastore_match_len``; ``top_n`` neighbours, filtered by the token just emitted,
    share ``served_dense_weight`` x similarity / ``top_n``."""

    #: Needs served_store "shared". Off by default: in replay (prompts 20-39) it raised
    #: hybrid's modelled speedup by 0.4-2.3% on four tasks
    #: (benchmarks/results/tuning/served-dense-tuning.md).
    served_dense: bool = False
    #: 8 beat 32 and 128 in that replay (code-edit 3.29 against 3.21 and 3.19; the others
    #: within 1%).
    served_dense_weight: float = 8.0
    #: Keys kept (the oldest overwritten first): about 480 bytes each (``datastore.served_dense``).
    served_dense_max_keys: int = 200_000
    #: 256 beat 1024 in replay (served-dense-tuning.md): the projection is ready sooner.
    served_dense_fit_states: int = 256

    def check(self, method: str) -> None:
        check_range(method, self, "served_dense_max_keys", 1, 1 << 28)
        check_range(method, self, "served_dense_weight", 0.0, 1e6)
        # At least the projection's width (64 dims) to fit it.
        check_range(method, self, "served_dense_fit_states", 64, 1 << 24)


def check_range(method: str, options: object, name: str, low: float, high: float) -> None:
    value = getattr(options, name)
    if not low <= value <= high:
        raise ConfigError(
            f"speculative_config[{name!r}]={value!r} is out of range for method "
            f"{method!r}: must be in [{low}, {high}]"
        )


def check_choice(method: str, options: object, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(options, name)
    if value not in choices:
        raise ConfigError(f"speculative_config[{name!r}]={value!r} is not one of {list(choices)} "
                          f"for method {method!r}")
