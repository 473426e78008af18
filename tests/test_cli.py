"""The CLI's own spellings, without starting anything."""

from __future__ import annotations

import json
import sys

import pytest

from vllm_retrieval_spec import cli


@pytest.fixture
def exec_argv(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: calls.append(argv))
    model = tmp_path / "model"
    model.mkdir()
    return calls, str(model)


def test_speculative_model_becomes_speculative_config(exec_argv):
    calls, model = exec_argv
    cli.main(["serve", model, "--speculative-model", "dresd", "--datastore", "ds/own",
              "--num-speculative-tokens", "6", "--speculative-options", '{"top_n": 16}',
              "--enforce-eager", "--port", "8001"])
    argv = calls[0]
    assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                        model]
    assert argv[5:8] == ["--enforce-eager", "--port", "8001"]
    assert argv[8] == "--speculative-config"
    assert json.loads(argv[9]) == {"method": "dresd", "num_speculative_tokens": 6, "top_n": 16,
                                   "datastore": "ds/own"}


def test_speculative_config_passes_through(exec_argv):
    calls, model = exec_argv
    config = '{"method": "pld", "num_speculative_tokens": 4}'
    cli.main(["serve", model, "--speculative-config", config])
    assert calls[0][-2:] == ["--speculative-config", config]


@pytest.mark.parametrize("argv, message", [
    (["--speculative-model", "rest", "--speculative-config", "{}"], "not both"),
    (["--datastore", "ds/x"], "--datastore goes with --speculative-model"),
    (["--speculative-model", "rest", "--speculative-options", "[1]"], "must be a JSON object"),
])
def test_speculative_model_errors(exec_argv, argv, message):
    calls, model = exec_argv
    with pytest.raises(SystemExit, match=message):
        cli.main(["serve", model, *argv])
    assert not calls


def test_unknown_speculative_model(exec_argv, capsys):
    _, model = exec_argv
    with pytest.raises(SystemExit):
        cli.main(["serve", model, "--speculative-model", "eagle"])
    assert "invalid choice: 'eagle'" in capsys.readouterr().err


def test_bench_refuses_more_engines_than_memory_holds_before_starting_any(monkeypatch, tmp_path):
    import psutil

    from vllm_retrieval_spec.benchmarks import throughput

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 1024)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: type("Memory", (), {"available": 8 * 2**30})())
    monkeypatch.setattr(throughput, "run_benchmark",
                        lambda *args: pytest.fail("an engine would have started"))
    with pytest.raises(SystemExit, match=r"4 engines alive at once need about 10.0 GiB and "
                                         r"8.0 GiB is available.*--sequential"):
        cli.main(["bench", "--model", str(model), "--methods", "ngram,pld,pld_plus"])
    # Three engines (plain, ngram, pld) fit.
    throughput.check_memory_for_interleaving(3, str(model))


def test_bench_unknown_method_is_an_error_not_a_traceback(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(SystemExit, match="error: unknown method 'nope'"):
        cli.main(["bench", "--model", str(model), "--methods", "ngram,nope"])
