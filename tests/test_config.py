"""Option validation: every bad value names the option and what is allowed."""

import pytest

from vllm_retrieval_spec.config import (
    ConfigError,
    RestConfig,
    config_from_dict,
    parse_speculative_config,
)

GOOD = {"method": "rest", "num_speculative_tokens": 8, "datastore": "/some/dir"}


def test_parses_and_round_trips():
    config = parse_speculative_config({**GOOD, "max-occurrences": 32, "min_prefix_prob": 0})
    assert isinstance(config, RestConfig)
    assert config.max_occurrences == 32 and config.min_prefix_prob == 0.0
    assert config_from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_speculative_tokens": 0}, r"'num_speculative_tokens'\]=0 is out of range .*\[1, 64\]"),
        ({"num_speculative_tokens": 65}, r"'num_speculative_tokens'\]=65 is out of range"),
        ({"num_speculative_tokens": "8"}, r"'num_speculative_tokens'\]='8' has type str; expected int"),
        ({"num_speculative_tokens": True}, r"has type bool; expected int"),
        ({"max_occurrences": 0}, r"'max_occurrences'\]=0 is out of range"),
        ({"min_match_len": 5, "max_match_len": 4}, r"'max_match_len'\]=4 is out of range .*\[5, 64\]"),
        ({"min_prefix_prob": 1.5}, r"'min_prefix_prob'\]=1.5 is out of range"),
        ({"min_prefix_prob": float("nan")}, r"must be finite"),
        ({"datastore": ""}, r"'datastore'\] is required for method 'rest'"),
        ({"typo_option": 1}, r"unknown option\(s\) \['typo_option'\] for method 'rest'; allowed: \["),
    ],
)
def test_bad_values_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_speculative_config({**GOOD, **change})


def test_missing_k_and_unknown_method():
    with pytest.raises(ConfigError, match=r"'num_speculative_tokens'\] is required"):
        parse_speculative_config({"method": "rest", "datastore": "d"})
    with pytest.raises(ConfigError, match=r"'method'\]='resst' is not a retrieval method; choose one of \['dresd', 'hybrid', 'pld', 'pld_plus', 'rest'\]"):
        parse_speculative_config({**GOOD, "method": "resst"})
