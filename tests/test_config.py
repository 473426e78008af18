"""Option validation: every bad value names the option and what is allowed."""

import dataclasses

import pytest

from vllm_retrieval_spec.config import (
    ACCELERATOR_DEFAULTS,
    VLLM_CPU_DEFAULTS,
    ConfigError,
    RestConfig,
    config_from_dict,
    misspelt_method,
    parse_speculative_config,
)
from vllm_retrieval_spec.config.methods import spec_factor_for

GOOD = {"method": "rest", "num_speculative_tokens": 8, "datastore": "/some/dir"}


def test_parses_and_round_trips():
    config = parse_speculative_config({**GOOD, "max-occurrences": 32, "min_prefix_prob": 0},
                                      VLLM_CPU_DEFAULTS)
    assert isinstance(config, RestConfig)
    assert config.match.max_occurrences == 32 and config.trie.min_prefix_prob == 0.0
    assert config_from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_speculative_tokens": 0}, r"'num_speculative_tokens'\]=0 is out of range .*\[1, 64\]"),
        ({"num_speculative_tokens": 65}, r"'num_speculative_tokens'\]=65 is out of range"),
        ({"num_speculative_tokens": "8"}, r"'num_speculative_tokens'\]='8' has type str; expected int"),
        ({"num_speculative_tokens": True}, r"has type bool; expected int"),
        # A bool for an on/off choice (YAML reads an unquoted on as true): the choices named.
        ({"tree": True}, r"'tree'\]=True has type bool; expected str, one of \['off', 'on'\]$"),
        ({"max_occurrences": 0}, r"'max_occurrences'\]=0 is out of range"),
        ({"min_match_len": 5, "max_match_len": 4}, r"'max_match_len'\]=4 is out of range .*\[5, 64\]"),
        ({"min_prefix_prob": 1.5}, r"'min_prefix_prob'\]=1.5 is out of range"),
        ({"tree": "yes"}, r"'tree'\]='yes' is not one of \['off', 'on'\] for method 'rest'$"),
        ({"tree_min_prob": -0.1}, r"'tree_min_prob'\]=-0.1 is out of range"),
        ({"min_prefix_prob": float("nan")}, r"must be finite"),
        ({"datastore": ""}, r"'datastore'\] is required for method 'rest'"),
        ({"typo_option": 1}, r"unknown option\(s\) \['typo_option'\] for method 'rest'; allowed: \["),
    ],
)
def test_bad_values_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_speculative_config({**GOOD, **change}, VLLM_CPU_DEFAULTS)


def test_missing_k_and_unknown_method():
    with pytest.raises(ConfigError, match=r"'num_speculative_tokens'\] is required"):
        parse_speculative_config({"method": "rest", "datastore": "d"}, VLLM_CPU_DEFAULTS)
    with pytest.raises(ConfigError, match=r"'method'\]='resst' is not a retrieval method \(did you mean 'rest'\?\); choose one of \['dresd', 'hybrid', 'pld', 'pld_plus', 'rest'\]"):
        parse_speculative_config({**GOOD, "method": "resst"}, VLLM_CPU_DEFAULTS)


@pytest.mark.parametrize("method", ["rest", "pld_plus"])
def test_platform_supplies_the_defaults_the_user_leaves_out(method):
    options = {**GOOD, "method": method}
    if method == "pld_plus":
        del options["datastore"]
    cpu = parse_speculative_config(options, VLLM_CPU_DEFAULTS)
    gpu = parse_speculative_config(options, ACCELERATOR_DEFAULTS)
    assert (cpu.drafting.min_draft_len, cpu.drafting.disable_by_batch_size,
            cpu.drafting.draft_token_cost) == (3, 6, 0.055)
    assert (gpu.drafting.min_draft_len, gpu.drafting.disable_by_batch_size,
            gpu.drafting.draft_token_cost) == (1, 0, 0.0068)
    if method == "pld_plus":
        assert (cpu.min_similarity, gpu.min_similarity) == (0.7, 0.0)
    # What the user sets wins, on every platform; the worker gets back exactly this config.
    mine = parse_speculative_config({**options, "min_draft_len": 2}, ACCELERATOR_DEFAULTS)
    assert mine.drafting.min_draft_len == 2 and mine.drafting.disable_by_batch_size == 0
    assert config_from_dict(mine.to_dict()) == mine


def test_hybrid_needs_a_datastore_only_without_a_served_store():
    hybrid = {"method": "hybrid", "num_speculative_tokens": 24}
    config = parse_speculative_config(hybrid, VLLM_CPU_DEFAULTS)
    assert (config.store.datastore, config.served.served_store,
            config.served.served_prompts) == ("", "shared", True)
    with pytest.raises(ConfigError, match=r"'datastore'\] is required for method 'hybrid'"):
        parse_speculative_config({**hybrid, "served_store": "off"}, VLLM_CPU_DEFAULTS)
    with pytest.raises(ConfigError,
                       match=r"'served_store'\]='per_user' .*\['off', 'shared', 'per_request'\] "
                             r"for method 'hybrid'$"):
        parse_speculative_config({**hybrid, "served_store": "per_user"}, VLLM_CPU_DEFAULTS)
    with pytest.raises(ConfigError, match=r"'served_datastore'\] needs served_store 'shared' "
                                          r"or 'per_request': with 'off' nothing is stored"):
        parse_speculative_config({**hybrid, "datastore": "d", "served_store": "off",
                                  "served_datastore": "s"}, VLLM_CPU_DEFAULTS)
    assert parse_speculative_config({**hybrid, "served_store": "per_request",
                                     "served_datastore": "s"},
                                    VLLM_CPU_DEFAULTS).served.served_datastore == "s"
    journaled = {**hybrid, "served_datastore": "s"}
    with pytest.raises(ConfigError, match=r"'served_flush_ms'\]=0.0 is out of range"):
        parse_speculative_config({**journaled, "served_flush_ms": 0}, VLLM_CPU_DEFAULTS)
    with pytest.raises(ConfigError, match=r"'served_max_age_hours'\]=-1.0 is out of range"):
        parse_speculative_config({**journaled, "served_max_age_hours": -1}, VLLM_CPU_DEFAULTS)
    with pytest.raises(ConfigError, match=r"'served_max_keys'\]=0 is out of range"):
        parse_speculative_config({**hybrid, "served_store": "per_request", "served_max_keys": 0},
                                 VLLM_CPU_DEFAULTS)
    keyed = parse_speculative_config({**hybrid, "served_store": "per_request"},
                                     VLLM_CPU_DEFAULTS)
    assert (keyed.served.served_store, keyed.served.served_max_keys,
            keyed.store.datastore) == ("per_request", 64, "")
    with pytest.raises(ConfigError, match=r"'dense'\]='on' needs a 'datastore'"):
        parse_speculative_config({**hybrid, "dense": "on"}, VLLM_CPU_DEFAULTS)
    with pytest.raises(ConfigError, match=r"'served_max_tokens'\]=0 is out of range"):
        parse_speculative_config({**hybrid, "served_max_tokens": 0}, VLLM_CPU_DEFAULTS)


# ------------------------------------------------- start-up checks against the served model

@pytest.fixture
def model_config(tmp_path):
    """What ``validate_against_model`` reads of vLLM's model config: a tokenizer on disk."""
    from types import SimpleNamespace

    from helpers import make_tokenizer

    make_tokenizer().save_pretrained(tmp_path / "tokenizer")
    return SimpleNamespace(tokenizer=str(tmp_path / "tokenizer"), tokenizer_revision=None,
                           trust_remote_code=False)


def served_config(directory):
    return parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 8,
                                     "served_datastore": str(directory)}, VLLM_CPU_DEFAULTS)


def test_a_served_store_of_another_tokenizer_fails_in_the_front_end(model_config, tmp_path):
    from vllm_retrieval_spec.config.model import validate_against_model
    from vllm_retrieval_spec.datastore import DatastoreError
    from vllm_retrieval_spec.datastore.journal import TokenizerFacts, store_facts

    directory = tmp_path / "served"
    # Nothing there yet, or a directory this model's replicas wrote: it starts.
    validate_against_model(served_config(directory), model_config)
    directory.mkdir()
    store_facts(directory, TokenizerFacts("other-model", "0" * 64, 1000), keyed=False)
    with pytest.raises(DatastoreError, match=r"holds tokens of another tokenizer \('other-model', "
                                             r"fingerprint 0+; the model's is [0-9a-f]{64}\): "
                                             r"give this model a directory of its own"):
        validate_against_model(served_config(directory), model_config)


def test_a_store_saved_before_the_journal_of_another_tokenizer_fails_in_the_front_end(
        model_config, tmp_path):
    from vllm_retrieval_spec.config.model import validate_against_model
    from vllm_retrieval_spec.datastore import DatastoreError
    from vllm_retrieval_spec.datastore.build import build_datastore_from_token_ids

    directory = tmp_path / "served"
    build_datastore_from_token_ids([[1, 2, 3]], directory, tokenizer_name="other-model",
                                   tokenizer_fingerprint="0" * 64, vocab_size=1000,
                                   progress=False)
    with pytest.raises(DatastoreError, match=r"was built with another tokenizer: it records "
                                             r"tokenizer 'other-model'"):
        validate_against_model(served_config(directory), model_config)


def test_a_served_datastore_that_is_a_file_fails_in_the_front_end(model_config, tmp_path):
    # It failed in the worker, once vLLM had started the engine, as a FileExistsError.
    from vllm_retrieval_spec.config.model import validate_against_model

    path = tmp_path / "served.jsonl"
    path.write_text("")
    with pytest.raises(ConfigError, match=r"\['served_datastore'\]='.*served.jsonl' exists and is "
                                          r"not a directory: give a directory \(one that does "
                                          r"not exist yet is created\)$"):
        validate_against_model(served_config(path), model_config)


@pytest.mark.parametrize("method", ["rest", "pld", "dresd", "hybrid"])
def test_a_costly_draft_token_leaves_tree_min_prob_a_probability(method):
    # draft_token_cost may be up to 1, but 5.5 x 0.5 = 2.75 once failed the derived
    # tree_min_prob's own range check, naming an option the user never set.
    options = {**GOOD, "method": method, "draft_token_cost": 0.5}
    if method == "pld":
        del options["datastore"]
    config = parse_speculative_config(options, VLLM_CPU_DEFAULTS)
    assert (config.drafting.draft_token_cost, config.trie.tree_min_prob) == (0.5, 1.0)
    assert config_from_dict(config.to_dict()) == config


def test_null_leaves_tree_min_prob_unset():
    # Its type is float | None, yet null once failed as "has type NoneType; expected float or
    # NoneType"; unset, it is derived from draft_token_cost.
    config = parse_speculative_config({**GOOD, "tree_min_prob": None}, VLLM_CPU_DEFAULTS)
    assert config.trie.tree_min_prob == 0.3025
    with pytest.raises(ConfigError, match=r"'num_speculative_tokens'\]=None has type NoneType; "
                                          r"expected int$"):
        parse_speculative_config({**GOOD, "num_speculative_tokens": None}, VLLM_CPU_DEFAULTS)


@pytest.mark.parametrize("cost, factor", [(0.0, 8.0), (0.0025, 8.0), (0.003, 7.0),
                                          (0.005, 4.0), (0.01, 2.0), (0.055, 2.0), (1.0, 2.0)])
def test_hybrid_caps_drafts_by_what_a_draft_token_costs(cost, factor):
    # Unset, max_spec_factor follows draft_token_cost: 0.02 / cost, between 2 and 8.
    config = parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 24,
                                       "draft_token_cost": cost}, ACCELERATOR_DEFAULTS)
    assert config.max_spec_factor == factor
    assert config_from_dict(config.to_dict()) == config


@pytest.mark.parametrize("factor", [0.0, 3.0])
def test_a_max_spec_factor_given_is_kept(factor):
    config = parse_speculative_config({"method": "hybrid", "num_speculative_tokens": 24,
                                       "draft_token_cost": 0.001, "max_spec_factor": factor},
                                      VLLM_CPU_DEFAULTS)
    assert config.max_spec_factor == factor


def test_the_platforms_draft_token_cost_gives_hybrid_its_cap():
    hybrid = {"method": "hybrid", "num_speculative_tokens": 24}
    assert parse_speculative_config(hybrid, VLLM_CPU_DEFAULTS).max_spec_factor == 2.0
    cheap = dataclasses.replace(ACCELERATOR_DEFAULTS, draft_token_cost=0.004)
    assert parse_speculative_config(hybrid, cheap).max_spec_factor == spec_factor_for(0.004) == 5


@pytest.mark.parametrize(
    "method, option, hint",
    [
        ("rest", "max_occurences", r"\('max_occurences': did you mean 'max_occurrences'\?\)"),
        ("hybrid", "num_specualtive_tokens",
         r"\('num_specualtive_tokens': did you mean 'num_speculative_tokens'\?\)"),
        ("hybrid", "Tree", r"\('Tree': did you mean 'tree'\?\)"),
        ("hybrid", "search_threads", r"\('search_threads' is an option of \['dresd'\]\)"),
        ("pld_plus", "min_prefix_prob",
         r"\('min_prefix_prob' is an option of \['dresd', 'hybrid', 'pld', 'rest'\]\)"),
    ],
)
def test_an_unknown_option_names_what_was_meant(method, option, hint):
    # Hybrid's list of allowed options is over 40 long: a typo's target, or the method an
    # option belongs to, is named before it.
    options = {"method": method, "num_speculative_tokens": 8, option: 1}
    with pytest.raises(ConfigError, match=rf"unknown option\(s\) \[{option!r}\] for method "
                                          rf"{method!r} {hint}; allowed: \["):
        parse_speculative_config(options, VLLM_CPU_DEFAULTS)


def test_a_misspelt_method_is_named_by_ours_not_vllms():
    # vLLM's own error for "hybird" lists its 40 methods and none of ours: the engine
    # arguments' patch hands a near-miss of ours that vLLM does not know to our parser.
    vllm_methods = ("ngram", "suffix", "mtp", "draft_model")
    for typo, meant in [("Hybrid", "hybrid"), ("hybird", "hybrid"), ("pld+", "pld_plus"),
                        ("PLD-plus", "pld_plus"), ("dresd ", "dresd"), ("rst", "rest")]:
        assert misspelt_method(typo, vllm_methods) == meant
        with pytest.raises(ConfigError, match=rf"is not a retrieval method \(did you mean "
                                              rf"{meant!r}\?\)"):
            parse_speculative_config({**GOOD, "method": typo}, VLLM_CPU_DEFAULTS)
    for other in ["ngram", "suffix", "draft_model", "eagle3", None, 3, "hybrid", "medusa"]:
        assert misspelt_method(other, vllm_methods) is None


def test_spec_tokens_gives_k_to_our_methods():
    # `--speculative-config '{"method": "hybrid"}' --spec-tokens 8` once failed as
    # "'num_speculative_tokens' is required": vLLM folds --spec-tokens in only after our patch
    # has read the dict. Folded in first, and cleared so that vLLM does not fold it again.
    from types import SimpleNamespace

    from vllm_retrieval_spec.patches.engine_args import with_shorthand_flags

    engine_args = SimpleNamespace(spec_model=None, spec_tokens=8)
    options = with_shorthand_flags(engine_args, {"method": "hybrid"})
    assert parse_speculative_config(options, VLLM_CPU_DEFAULTS).drafting.num_speculative_tokens == 8
    assert engine_args.spec_tokens is None
    with pytest.raises(ConfigError, match=r"--spec-tokens and --speculative-config"
                                          r"\['num_speculative_tokens'\] are mutually exclusive"):
        with_shorthand_flags(SimpleNamespace(spec_model=None, spec_tokens=8),
                             {"method": "hybrid", "num-speculative-tokens": 4})
    options = with_shorthand_flags(SimpleNamespace(spec_model="m", spec_tokens=None), GOOD)
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['model'\] for method 'rest'"):
        parse_speculative_config(options, VLLM_CPU_DEFAULTS)


@pytest.mark.parametrize("option, value", [("served_max_age_hours", 24.0),
                                           ("served_flush_ms", 100.0),
                                           ("served_save_minutes", 1.0)])
def test_served_directory_options_without_a_directory_are_refused(option, value):
    # They were silently ignored: in memory, requests never age out (README's "For how long").
    options = {"method": "hybrid", "num_speculative_tokens": 8}
    with pytest.raises(ConfigError, match=rf"'{option}'\] needs a 'served_datastore'"):
        parse_speculative_config({**options, option: value}, VLLM_CPU_DEFAULTS)
    assert getattr(parse_speculative_config(
        {**options, "served_datastore": "s", option: value}, VLLM_CPU_DEFAULTS).served,
        option) == value
    # A value equal to its default is no request for anything.
    parse_speculative_config({**options, "served_max_age_hours": 720}, VLLM_CPU_DEFAULTS)


@pytest.mark.parametrize("option, value", [("served_max_tokens", 10), ("served_prompts", False),
                                           ("served_weight", 5.0), ("served_flush_ms", 10.0),
                                           ("served_dense_weight", 1.0)])
def test_served_options_with_the_served_store_off_are_refused(option, value):
    # They were silently ignored: nothing is stored with served_store "off".
    options = {"method": "hybrid", "num_speculative_tokens": 8, "datastore": "d",
               "served_store": "off"}
    with pytest.raises(ConfigError, match=rf"'{option}'\] needs served_store 'shared' or "
                                          rf"'per_request': with 'off' nothing is stored$"):
        parse_speculative_config({**options, option: value}, VLLM_CPU_DEFAULTS)
    # The defaults stay, and so does a value equal to its default.
    parse_speculative_config({**options, "served_max_keys": 64}, VLLM_CPU_DEFAULTS)


@pytest.mark.parametrize("change, message", [
    ({"served_max_keys": 8}, r"'served_max_keys'\] needs served_store 'per_request': with "
                             r"'shared' there is one store, bounded by served_max_tokens$"),
    ({"served_dense_weight": 16.0}, r"'served_dense_weight'\] needs 'served_dense': true: "
                                    r"without it no served hidden states are stored$"),
    ({"served_dense_fit_states": 1024}, r"'served_dense_fit_states'\] needs 'served_dense'"),
    ({"served_store": "per_request", "served_dense_max_keys": 10},
     r"'served_dense_max_keys'\] needs 'served_dense'"),
    ({"tree_branch_weight": 8.0}, r"'tree_branch_weight'\] needs 'tree': 'on': a chain has no "
                                  r"branches$"),
])
def test_hybrid_options_of_a_part_left_off_are_refused(change, message):
    # They were silently ignored: only per_request has keys to bound, only served_dense stores
    # served hidden states, and only trees have branches.
    hybrid = {"method": "hybrid", "num_speculative_tokens": 8}
    with pytest.raises(ConfigError, match=message):
        parse_speculative_config({**hybrid, **change}, VLLM_CPU_DEFAULTS)
    # With the part on they are kept; a value equal to its default is no request for anything.
    turned_on = {"served_max_keys": {"served_store": "per_request"},
                 "tree_branch_weight": {"tree": "on"}}
    name = [key for key in change if key != "served_store"][0]
    on = turned_on.get(name, {"served_dense": True, "served_store": "shared"})
    config = parse_speculative_config({**hybrid, **change, **on}, VLLM_CPU_DEFAULTS)
    assert config_from_dict(config.to_dict()) == config
    parse_speculative_config({**hybrid, "served_max_keys": 64, "tree_branch_weight": 4,
                              "served_dense_weight": 8}, VLLM_CPU_DEFAULTS)


def test_an_option_spelt_twice_is_refused():
    # "max-occurrences" and "max_occurrences" are one option: the last one given once won.
    with pytest.raises(ConfigError, match=r"sets 'max_occurrences' twice, as 'max-occurrences' "
                                          r"and 'max_occurrences': give it once$"):
        parse_speculative_config({**GOOD, "max-occurrences": 8, "max_occurrences": 32},
                                 VLLM_CPU_DEFAULTS)
