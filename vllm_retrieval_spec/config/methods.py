"""One frozen config per method, composed of the option groups it uses (``config.options``).

Users pass one flat dict, as for vLLM's own methods::

    speculative_config={"method": "rest", "num_speculative_tokens": 8, "datastore": "ds/stdlib"}

``parse_speculative_config`` turns it into the method's config once, at start-up, in the process
that builds the engine config; every bad value fails there with a message that names the option
and what is allowed. The worker re-creates the same config from ``additional_config``
(``to_dict`` and ``config_from_dict``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_retrieval_spec.config.options import (
    CHOICES,
    MAX_SPECULATIVE_TOKENS,
    TREE_COST_FACTOR,
    ConfigError,
    ContextOptions,
    DatastoreOptions,
    DenseOptions,
    DenseSearchOptions,
    DraftingOptions,
    MatchOptions,
    ServedDenseOptions,
    ServedOptions,
    TrieOptions,
    check_range,
)
from vllm_retrieval_spec.config.platform import PlatformDefaults

#: Key under which our options travel in ``VllmConfig.additional_config``.
PLUGIN_KEY = "vllm_retrieval_spec"

_GROUPS = (DraftingOptions, TrieOptions, MatchOptions, DatastoreOptions, DenseSearchOptions,
           ContextOptions, DenseOptions, ServedOptions, ServedDenseOptions)


@dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """A method's options: its option groups (fields typed with a group) and options of its
    own (any other field). Option names are unique across a method's groups, so the flat dict
    a user passes maps onto them one to one."""

    method: ClassVar[str]
    #: The method's module: its ``make_drafter(config, vllm_config, report)`` builds the
    #: method's ``contract.MethodDrafter`` in the worker.
    module: ClassVar[str]
    #: This method's defaults for options of its groups, where they differ from the group's.
    DEFAULTS: ClassVar[dict[str, Any]] = {}

    drafting: DraftingOptions

    def __post_init__(self) -> None:
        trie = getattr(self, "trie", None)
        if trie is not None and trie.tree_min_prob is None:
            # Frozen: the derived value is set once, here, and travels in to_dict(). At most 1
            # (a probability): past draft_token_cost 1 / TREE_COST_FACTOR no branch pays.
            object.__setattr__(self, "trie", dataclasses.replace(trie, tree_min_prob=min(
                1.0, round(TREE_COST_FACTOR * self.drafting.draft_token_cost, 4))))
        self.check_own()
        for name in self._groups():
            getattr(self, name).check(self.method)

    @property
    def drafts_trees(self) -> bool:
        """Whether this config drafts token trees (``"tree": "on"``)."""
        trie = getattr(self, "trie", None)
        return trie is not None and trie.tree == "on"

    def check_own(self) -> None:
        """Checks of the method's own options and across its groups."""

    @classmethod
    @functools.cache
    def _groups(cls) -> dict[str, type]:
        """Field name -> option group class, in field order."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)
                if hints[f.name] in _GROUPS}

    @classmethod
    @functools.cache
    def option_types(cls) -> dict[str, Any]:
        """Every flat option name -> its type hint."""
        groups = cls._groups()
        names: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in groups:
                names.update(typing.get_type_hints(groups[f.name]))
            else:
                names[f.name] = typing.get_type_hints(cls)[f.name]
        return names

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> MethodConfig:
        """The config of flat ``options`` (every required one present)."""
        values = {**cls.DEFAULTS, **options}
        kwargs: dict[str, Any] = {}
        groups = cls._groups()
        for f in dataclasses.fields(cls):
            if f.name in groups:
                group = groups[f.name]
                kwargs[f.name] = group(**{g.name: values[g.name]
                                          for g in dataclasses.fields(group) if g.name in values})
            elif f.name in values:
                kwargs[f.name] = values[f.name]
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        flat: dict[str, Any] = {"method": self.method}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flat.update(dataclasses.asdict(value) if f.name in self._groups()
                        else {f.name: value})
        return flat


def _require_datastore(method: str, path: str, built_with: str) -> None:
    if not path:
        raise ConfigError(f"speculative_config['datastore'] is required for method {method!r}: "
                          f"{built_with}")


@dataclass(frozen=True, kw_only=True)
class RestConfig(MethodConfig):
    """REST: exact suffix match in a token datastore (paper: arXiv 2311.08252)."""

    method: ClassVar[str] = "rest"
    module: ClassVar[str] = "vllm_retrieval_spec.proposers.rest"

    trie: TrieOptions
    match: MatchOptions
    store: DatastoreOptions

    def check_own(self) -> None:
        _require_datastore(self.method, self.store.datastore,
                           "the directory written by `vllm-rsd build-datastore`")


@dataclass(frozen=True, kw_only=True)
class PldConfig(MethodConfig):
    """PLD: n-gram lookup in the request's own context (baseline of arXiv 2412.01447)."""

    method: ClassVar[str] = "pld"
    module: ClassVar[str] = "vllm_retrieval_spec.proposers.pld"

    trie: TrieOptions
    match: MatchOptions


@dataclass(frozen=True, kw_only=True)
class PldPlusConfig(MethodConfig):
    """PLD+ (arXiv 2412.01447, "PLD+(h)"): earlier occurrences of the last token, ranked by the
    cosine similarity of an early layer's hidden state before each occurrence with the one
    before the last token; the best one's continuation is the draft."""

    method: ClassVar[str] = "pld_plus"
    module: ClassVar[str] = "vllm_retrieval_spec.proposers.pld_plus"

    #: Residual stream after this many decoder layers (0 = embeddings); checked against the
    #: model's depth at start-up. The paper found layers 9-13 of 32 best for Vicuna; for
    #: SmolLM2 (30 layers) 15 beat 2-12 and 20 when replaying HumanEval, Lee-corpus and
    #: code-edit prompts 20-39 (benchmarks/replay.py).
    layer: int = 15
    #: Occurrences less similar than this are not drafted from (the paper's theta).
    min_similarity: float
    #: Only the most recent occurrences are ranked, bounding the cost per step.
    max_candidates: int = 256

    def check_own(self) -> None:
        check_range(self.method, self, "layer", 0, 1024)
        check_range(self.method, self, "min_similarity", -1.0, 1.0)
        check_range(self.method, self, "max_candidates", 1, 1 << 20)


@dataclass(frozen=True, kw_only=True)
class DresdConfig(MethodConfig):
    """DReSD (arXiv 2502.15572): the last hidden state, projected (z-norm, PCA, L2), searched in
    a dense index; neighbours whose stored next token is the token just emitted vote their
    continuations."""

    method: ClassVar[str] = "dresd"
    module: ClassVar[str] = "vllm_retrieval_spec.proposers.dresd"
    #: Lower than REST's 0.3: the similarity-weighted votes of a few neighbours are rarely
    #: unanimous. 0.2 beat 0.1, 0.25, 0.3 and 0.4 replaying HumanEval prompts 20-39 against the
    #: model's own answers to prompts 40-163.
    DEFAULTS: ClassVar[dict[str, Any]] = {"min_prefix_prob": 0.2}

    trie: TrieOptions
    store: DatastoreOptions
    search: DenseSearchOptions
    #: Threads searching the batch's queries while drafts are voted (batch > 1).
    search_threads: int = 2

    def check_own(self) -> None:
        _require_datastore(self.method, self.store.datastore,
                           "a directory built with `vllm-rsd build-datastore --dense`")
        check_range(self.method, self, "search_threads", 1, 64)


#: Where verifying a draft token costs at least 1% of a forward (vLLM-CPU's 5.5% among them)
#: hybrid's drafts are capped at twice their longest match; where it costs less, a longer tail
#: pays: the cap is ``SPEC_FACTOR_COST / draft_token_cost``, at most 8. Replay (hybrid, trees
#: of 64 nodes and chains of 32, every step costing 1 + ``draft_token_cost`` x its draft
#: tokens), geometric mean of modelled speedup over the tasks: on prompts 0-9 of five tasks
#: (tuning) the best factor was 6-8 at costs 0.0005-0.003 (4-7% over 2), 3-6 at 0.005 (2-4%),
#: at 0.01 6 for chains (3%) and 3 for trees (0.6%), at 0.03 2; on prompts 20-39 of four tasks
#: (held out) the derived 8 and 4 gained 6% at 0.0015 and 3% at 0.005 over 2, within 0.9% of
#: the best (benchmarks/results/tuning/spec-factor-by-cost.md).
SPEC_FACTOR_COST = 0.02
SPEC_FACTOR_RANGE = (2.0, 8.0)


def spec_factor_for(draft_token_cost: float) -> float:
    """Hybrid's ``max_spec_factor`` where verifying a draft token costs ``draft_token_cost``
    of a forward."""
    low, high = SPEC_FACTOR_RANGE
    if draft_token_cost <= SPEC_FACTOR_COST / high:
        return high
    return float(min(high, max(low, round(SPEC_FACTOR_COST / draft_token_cost))))


@dataclass(frozen=True, kw_only=True)
class HybridConfig(MethodConfig):
    """Every source in one trie (``proposers.hybrid``): the request's own context, what this
    engine has served, and, with a datastore, its suffix array and its dense index.

    Weights make the sources comparable: each occurrence of the context match votes
    ``context_weight`` x match length, the served store's and the datastore's suffix matches
    share ``served_weight`` and 1 x their match length, and the dense neighbours that pass the
    next-token filter share ``dense_weight`` x their similarity / ``top_n``.
    """

    method: ClassVar[str] = "hybrid"
    module: ClassVar[str] = "vllm_retrieval_spec.proposers.hybrid"
    #: Tuned together by replaying plain outputs of prompts 20-39 of every task (code-gen,
    #: code-edit, summarize, chat) against the model's own answers to prompts 40 and up
    #: (benchmarks/results/tuning/hybrid-tuning.md); the best geometric mean of modelled speedup
    #: over the four tasks won, on a plateau: neighbours were within 1%.
    DEFAULTS: ClassVar[dict[str, Any]] = {
        # Lower than REST's 0.3 and a weaker prior: several sources rarely agree unanimously.
        "min_prefix_prob": 0.2, "prior_weight": 1.0,
        # The stores' matches go down to one token too (see context_min_match_len).
        "min_match_len": 1,
        # With max_spec_factor the acceptance-based cap only costs tokens (below).
        "adaptive_draft_len": False,
    }

    trie: TrieOptions
    match: MatchOptions
    store: DatastoreOptions
    search: DenseSearchOptions
    context: ContextOptions
    dense: DenseOptions
    served: ServedOptions
    served_dense: ServedDenseOptions
    #: Drafts are at most this many times as long as the longest exact match behind them
    #: (0 = no such cap): an n-token match predicts about n tokens. With this cap, drafts as
    #: long as 24 tokens pay, and the acceptance-based cap only costs tokens, so it is off by
    #: default (replay of prompts 20-39 at k = 24, all four tasks, at the CPU's
    #: ``draft_token_cost``: factor 2 without the acceptance cap beat 0.5, 1, 1.5 and 3, with or
    #: without it; benchmarks/results/tuning/served-tuning.md). Unset: derived from
    #: ``draft_token_cost`` (``spec_factor_for``), once, at start-up.
    max_spec_factor: float | None = None
    #: With ``tree: "on"``: total vote of the continuations of the last token's every earlier
    #: occurrence (context and served store), shared among them; they become the tree's
    #: branches beside the longest match's (0 = none). Replay (tree-tuning.md): 4 beat 1, 8
    #: and 16 at the default threshold.
    tree_branch_weight: float = 4.0

    def __post_init__(self) -> None:
        if self.max_spec_factor is None:
            # Frozen: set once, here, and it travels in to_dict(), as tree_min_prob does.
            object.__setattr__(self, "max_spec_factor",
                               spec_factor_for(self.drafting.draft_token_cost))
        super().__post_init__()

    def check_own(self) -> None:
        served = self.served.served_store
        if served == "off":
            # With a served store hybrid drafts from the first request on without a datastore.
            _require_datastore(self.method, self.store.datastore,
                               "the directory written by `vllm-rsd build-datastore`")
        check_range(self.method, self, "max_spec_factor", 0.0, 64.0)
        check_range(self.method, self, "tree_branch_weight", 0.0, 1e6)
        if self.served_dense.served_dense and served != "shared":
            raise ConfigError(
                f"speculative_config['served_dense'] needs served_store 'shared', got {served!r}")
        if served == "off":
            # An option of the served store set with the store off would be silently ignored.
            for group in (self.served, self.served_dense):
                for f in dataclasses.fields(group):
                    if f.name != "served_store" and getattr(group, f.name) != f.default:
                        raise ConfigError(
                            f"speculative_config[{f.name!r}] needs served_store 'shared' or "
                            "'per_request': with 'off' nothing is stored")
        elif not self.served.served_datastore:
            # The directory's options would be silently ignored without one: the age limit
            # too, which a user may rely on to keep requests no longer than it says.
            for f in dataclasses.fields(self.served):
                if (f.name in _DIRECTORY_OPTIONS
                        and getattr(self.served, f.name) != f.default):
                    raise ConfigError(
                        f"speculative_config[{f.name!r}] needs a 'served_datastore': without "
                        "one the served store is in memory only, where requests stay until "
                        "evicted")
        # A dataclass keeps each field's default as its class attribute.
        if served == "shared" and self.served.served_max_keys != ServedOptions.served_max_keys:
            # It bounds the number of per_request stores; the shared one would ignore it.
            raise ConfigError(
                "speculative_config['served_max_keys'] needs served_store 'per_request': with "
                "'shared' there is one store, bounded by served_max_tokens")
        if served != "off" and not self.served_dense.served_dense:
            # The dense half's options would be silently ignored with it off.
            for f in dataclasses.fields(self.served_dense):
                if getattr(self.served_dense, f.name) != f.default:
                    raise ConfigError(
                        f"speculative_config[{f.name!r}] needs 'served_dense': true: without "
                        "it no served hidden states are stored")
        if self.trie.tree != "on" and self.tree_branch_weight != HybridConfig.tree_branch_weight:
            # Chains have no branches: the weight would be silently ignored.
            raise ConfigError("speculative_config['tree_branch_weight'] needs 'tree': 'on': a "
                              "chain has no branches")
        if self.dense.dense == "on" and not self.store.datastore:
            raise ConfigError("speculative_config['dense']='on' needs a 'datastore' with a "
                              "dense index")


#: Hybrid's options of a served store's directory (``served_datastore``).
_DIRECTORY_OPTIONS = ("served_flush_ms", "served_save_minutes", "served_max_age_hours")


METHODS: dict[str, type[MethodConfig]] = {
    cls.method: cls for cls in (RestConfig, PldConfig, PldPlusConfig, HybridConfig, DresdConfig)
}


def parse_speculative_config(options: dict[str, Any], platform: PlatformDefaults
                             ) -> MethodConfig:
    """Validate a user's speculative_config dict for one of our methods; options it leaves out
    that depend on the platform come from ``platform``."""
    spelt: dict[str, Any] = {}
    for key in options:
        name = str(key).replace("-", "_")
        if name in spelt:
            # One spelling's value would silently win over the other's.
            raise ConfigError(f"speculative_config sets {name!r} twice, as {spelt[name]!r} and "
                              f"{key!r}: give it once")
        spelt[name] = key
    options = {name: options[key] for name, key in spelt.items()}
    method = options.pop("method", None)
    if method not in METHODS:
        meant = misspelt_method(method, ())
        hint = f" (did you mean {meant!r}?)" if meant else ""
        raise ConfigError(
            f"speculative_config['method']={method!r} is not a retrieval method{hint}; "
            f"choose one of {sorted(METHODS)}"
        )
    cls = METHODS[method]
    types_ = cls.option_types()
    unknown = sorted(set(options) - set(types_))
    if unknown:
        hints = "".join(_unknown_option_hint(name, types_) for name in unknown)
        raise ConfigError(
            f"unknown option(s) {unknown} for method {method!r}{hints}; "
            f"allowed: {sorted(types_)}"
        )
    if "num_speculative_tokens" not in options:
        raise ConfigError(
            f"speculative_config['num_speculative_tokens'] is required for method {method!r} "
            f"(an integer in [1, {MAX_SPECULATIVE_TOKENS}])"
        )
    values = {name: _coerce(name, value, types_[name]) for name, value in options.items()}
    return cls.from_options({**platform.for_options(set(types_)), **values})


def misspelt_method(name: Any, others: Collection[str]) -> str | None:
    """The retrieval method that ``name``, a method neither ours nor one of ``others`` (vLLM's),
    most likely misspells ("Hybrid", "pld+", "hybird"), or None."""
    if not isinstance(name, str) or name in METHODS or name in others:
        return None
    normal = name.strip().lower().replace("-", "_").replace("+", "_plus")
    close = difflib.get_close_matches(normal, METHODS, n=1, cutoff=0.75)
    return close[0] if close else None


def _unknown_option_hint(name: str, allowed: dict[str, Any]) -> str:
    """What the user may have meant by ``name``: the methods that take it, else the nearest of
    ``allowed`` (hybrid takes over 40 options, too many to spot a typo's target in)."""
    methods = sorted(m for m, cls in METHODS.items() if name in cls.option_types())
    if methods:
        return f" ({name!r} is an option of {methods})"
    close = difflib.get_close_matches(name.lower(), list(allowed), n=1)
    return f" ({name!r}: did you mean {close[0]!r}?)" if close else ""


def config_from_dict(data: dict[str, Any]) -> MethodConfig:
    """Inverse of ``MethodConfig.to_dict`` (the worker side of ``additional_config``): every
    option is there already, the platform's defaults included."""
    data = dict(data)
    cls = METHODS.get(data.pop("method", None))
    if cls is None:
        raise ConfigError(f"additional_config holds no retrieval method: {data}")
    return cls.from_options(data)


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Accept JSON-typed values (the server passes JSON); reject everything else clearly."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and types.NoneType in allowed:
        # JSON's null for an option whose default is "unset" (derived at start-up).
        return None
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
    if name in CHOICES:
        names += f", one of {list(CHOICES[name])}"
    raise ConfigError(
        f"speculative_config[{name!r}]={value!r} has type {type(value).__name__}; expected {names}"
    )
