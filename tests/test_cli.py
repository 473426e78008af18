"""The CLI's own spellings, without starting anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_retrieval_spec import cli
from vllm_retrieval_spec.bench import commands


@pytest.fixture
def exec_argv(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(cli.os, "execve", lambda path, argv, env: calls.append(argv))
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
    assert calls[0][5:7] == ["--speculative-config", config]


def test_served_model_name_is_what_the_user_typed(exec_argv, monkeypatch):
    calls, model = exec_argv
    # A model fetched offline is served from its cache folder ...
    monkeypatch.setattr(cli, "resolve_model", lambda name: "/cache/models/" + name)
    cli.main(["serve", "SmolLM2-135M-Instruct", "--port", "8001"])
    assert calls[0][3:] == ["--model", "/cache/models/SmolLM2-135M-Instruct", "--port", "8001",
                            "--served-model-name", "SmolLM2-135M-Instruct"]
    # ... and a name the user gives wins.
    cli.main(["serve", "SmolLM2-135M-Instruct", "--served-model-name=smol"])
    assert calls[1][3:] == ["--model", "/cache/models/SmolLM2-135M-Instruct",
                            "--served-model-name=smol"]


def test_each_server_gets_its_own_metrics_directory(monkeypatch, tmp_path):
    """The multiprocess metrics directory goes to the server's environment, not the caller's:
    a process that starts several servers (tests, scripts) must not hand later ones the first
    one's directory, whose counters would then add up across servers."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    envs = []
    monkeypatch.setattr(cli.os, "execve", lambda path, argv, env: envs.append(env))
    cli.main(["serve", str(tmp_path)])
    cli.main(["serve", str(tmp_path)])
    first, second = (Path(env["PROMETHEUS_MULTIPROC_DIR"]) for env in envs)
    assert first != second and first.is_dir() and second.is_dir()
    assert "PROMETHEUS_MULTIPROC_DIR" not in cli.os.environ
    # One the user chose is kept.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    cli.main(["serve", str(tmp_path)])
    assert envs[2]["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path)


def test_a_server_start_removes_the_metrics_directories_of_exited_servers(monkeypatch,
                                                                         tmp_path):
    """The exec leaves no process to remove a server's metrics directory when it exits: the
    next start on this host removes those whose server's pid is dead (and only those)."""
    from vllm_retrieval_spec.datastore.journal import this_host

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setattr(cli.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    exited = subprocess.Popen(["true"])
    exited.wait()
    names = {"exited": f"{this_host()}-{exited.pid}-abc", "alive": f"{this_host()}-1-abc",
             "other host": f"otherhost-{exited.pid}-abc", "unnamed": "x1y2z3"}
    for name in names.values():
        (tmp_path / "tmp" / f"vllm-rsd-metrics-{name}").mkdir()
        (tmp_path / "tmp" / f"vllm-rsd-metrics-{name}" / "counter_1.db").write_bytes(b"1")
    envs = []
    monkeypatch.setattr(cli.os, "execve", lambda path, argv, env: envs.append(env))
    cli.main(["serve", str(tmp_path)])
    new = Path(envs[0]["PROMETHEUS_MULTIPROC_DIR"])
    assert new.name.startswith(f"vllm-rsd-metrics-{this_host()}-{os.getpid()}-")
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == sorted(
        [new.name] + [f"vllm-rsd-metrics-{names[k]}" for k in ("alive", "other host",
                                                                 "unnamed")])


@pytest.mark.parametrize("argv, message", [
    (["--speculative-model", "rest", "--speculative-config", "{}"], "not both"),
    (["--datastore", "ds/x"], "--datastore goes with --speculative-model"),
    (["--speculative-model", "rest", "--speculative-options", "[1]"], "must be a JSON object"),
    # Before: a JSONDecodeError traceback.
    (["--speculative-model", "rest", "--speculative-options", "{top_n: 4}"],
     r"^error: --speculative-options is not JSON \(Expecting property name"),
    # Before: the JSON's method and num_speculative_tokens silently won over the flags.
    (["--speculative-model", "rest", "--num-speculative-tokens", "6", "--speculative-options",
      '{"method": "dresd", "num_speculative_tokens": 4}'],
     r"^error: --speculative-options gives method, num_speculative_tokens, which flags give "
     r"too \(--speculative-model, --num-speculative-tokens\); give each once$"),
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


def test_speculative_model_takes_every_registered_method(exec_argv, monkeypatch):
    """A method added to config.METHODS is served without touching the CLI
    (docs/adding-a-method.md)."""
    from vllm_retrieval_spec.config import METHODS, PldConfig

    calls, model = exec_argv
    monkeypatch.setitem(METHODS, "toy", PldConfig)
    cli.main(["serve", model, "--speculative-model", "toy"])
    assert json.loads(calls[0][calls[0].index("--speculative-config") + 1])["method"] == "toy"


def test_fetch_model_refuses_a_name_it_cannot_fetch(capsys):
    """An unknown name is no folder: it must not be printed as one, with success."""
    with pytest.raises(SystemExit, match="cannot fetch 'NoSuchModel' offline.*SmolLM2"):
        cli.main(["fetch-model", "NoSuchModel"])
    assert capsys.readouterr().out == ""


def test_fetch_model_refuses_a_path_that_holds_no_model(tmp_path, capsys):
    """Before: any existing path was printed as the model's folder, with success."""
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "notes.txt").write_text("")
    for path, reason in ((folder, "no config.json"), (tmp_path / "notes.txt", "a file"),
                         (folder, "no safetensors or PyTorch weights")):
        with pytest.raises(SystemExit, match=rf"^error: {path} is not a model folder "
                                             rf"\({reason}\); give a folder holding config.json "
                                             r"and its weights, or one of \['SmolLM2"):
            cli.main(["fetch-model", str(path)])
        assert capsys.readouterr().out == ""
        (folder / "config.json").write_text("{}")
    # Files that match the weight patterns but hold none are no weights (as for vLLM's loader).
    (folder / "training_args.bin").write_bytes(b"")
    with pytest.raises(SystemExit, match="no safetensors or PyTorch weights"):
        cli.main(["fetch-model", str(folder)])
    (folder / "model.safetensors").write_bytes(b"")
    cli.main(["fetch-model", str(folder)])
    assert capsys.readouterr().out == f"{folder}\n"


def test_bench_refuses_more_engines_than_memory_holds_before_starting_any(monkeypatch, tmp_path):
    import psutil

    from vllm_retrieval_spec.bench import throughput

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


def test_bench_checks_its_methods_before_fetching_the_model(monkeypatch):
    from vllm_retrieval_spec import assets

    monkeypatch.setattr(assets, "model_path",
                        lambda name: pytest.fail("the model was fetched before the check"))
    with pytest.raises(SystemExit, match="error: unknown method 'nope'"):
        cli.main(["bench", "--methods", "ngram,nope"])


@pytest.mark.parametrize("sampling", [["--top-p", "0.9"], ["--top-k", "5"]])
def test_bench_sampling_options_need_a_temperature(tmp_path, sampling):
    with pytest.raises(SystemExit, match="error: --top-p and --top-k need --temperature above 0"):
        cli.main(["bench", "--model", str(tmp_path), "--methods", "plain", *sampling])


@pytest.mark.parametrize("argv, message", [
    (["bench", "--prompts", "0"], "argument --prompts: must be 1 or more, got 0"),
    (["bench", "-k", "-2"], "argument -k: must be 1 or more, got -2"),
    (["bench", "--prompt-offset", "-1"], "argument --prompt-offset: must be 0 or more, got -1"),
    (["bench", "--top-p", "0"], "argument --top-p: must be above 0 and at most 1, got 0"),
    (["bench", "--top-p", "1.5"], "argument --top-p: must be above 0 and at most 1, got 1.5"),
    (["build-datastore", "x", "-o", "y", "--batch-size", "0"],
     "argument --batch-size: must be 1 or more, got 0"),
    # Before: "overlap 256 must be in [0, window=4)", of an overlap no flag sets, and with
    # sources only once the datastore was built.
    (["build-datastore", "x", "-o", "y", "--dense", "--dense-window", "256"],
     "argument --dense-window: must be 257 or more, got 256"),
    (["generate-corpus", "-o", "x", "--max-tokens", "many"],
     "argument --max-tokens: 'many' is not an integer"),
    (["generate-corpus", "-o", "x", "--temperature", "-1"],
     "argument --temperature: must be 0.0 or more, got -1"),
    (["generate-corpus", "-o", "x", "--temperature", "nan"],
     "argument --temperature: must be 0.0 or more, got nan"),
])
def test_counts_below_their_least_are_refused_by_the_parser(capsys, argv, message):
    # Before: a batch of 0 silently tokenised one document at a time, 0 prompts ran none.
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["build-datastore", "x", "-o", "y", "--dense"],
                                  ["generate-corpus", "-o", "x"]])
def test_a_dtype_vllm_does_not_know_is_refused_by_the_parser(capsys, argv):
    # Before: vLLM's pydantic traceback once the model was converted (and, building a datastore
    # from sources with --dense, once the whole corpus was tokenised).
    with pytest.raises(SystemExit) as exit:
        cli.main([*argv, "--dtype", "float33"])
    assert exit.value.code == 2
    assert "argument --dtype: invalid choice: 'float33'" in capsys.readouterr().err


def test_the_dtypes_offered_are_vllms():
    import typing

    from vllm.config.model import ModelDType

    assert cli.DTYPES == typing.get_args(ModelDType)


@pytest.mark.parametrize("model", ["empty-folder", "SmolLM2-135M"])
def test_build_datastore_with_a_model_without_a_tokenizer(tmp_path, model):
    # An empty folder, or a typo of the offline model's name (looked up on the unreachable hub).
    (tmp_path / "empty-folder").mkdir()
    (tmp_path / "doc.txt").write_text("hello")
    model = str(tmp_path / model) if model == "empty-folder" else model
    with pytest.raises(SystemExit, match=rf"^error: cannot load a tokenizer from '{model}' "
                                         r"\(.*\); give a model folder or one of \['SmolLM2"):
        cli.main(["build-datastore", str(tmp_path / "doc.txt"), "-o", str(tmp_path / "ds"),
                  "--model", model])
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("case, message", [
    ("missing source", r"^error: source .*typo\.txt does not exist$"),
    ("built output", r"^error: .*ds already holds a datastore; pass overwrite=True"),
    ("no sources", r"^error: give sources to build a datastore from, or --dense"),
])
def test_build_datastore_checks_its_arguments_before_the_model(monkeypatch, tmp_path, case,
                                                               message):
    # Before: the offline model was fetched and converted (half a minute) first.
    monkeypatch.setattr(cli, "resolve_model", lambda model: pytest.fail("model resolved"))
    (tmp_path / "doc.txt").write_text("hello")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "manifest.json").write_text("{}")
    sources = {"missing source": [str(tmp_path / "typo.txt")],
               "built output": [str(tmp_path / "doc.txt")], "no sources": []}[case]
    with pytest.raises(SystemExit, match=message):
        cli.main(["build-datastore", *sources, "-o", str(tmp_path / "ds")])


@pytest.mark.parametrize("option, message", [
    (["--pca-dims", "1000"], r"^error: PCA dims 1000 is out of range: must be in \[1, 8\]"),
    (["--pca-dims", "4", "--dense-window", "4096"],
     r"^error: a dense window of 4096 tokens is longer than the model's 2048 positions"),
])
def test_dense_options_are_checked_before_the_sources_are_built(monkeypatch, tmp_path, option,
                                                                 message):
    # Before: the corpus was tokenised and the datastore written, then the dense index refused,
    # and the same command run again refused the datastore it had written.
    monkeypatch.setattr(cli, "load_tokenizer", lambda model: pytest.fail("corpus tokenised"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8, "max_position_embeddings": 2048}')
    (tmp_path / "doc.txt").write_text("hello")
    with pytest.raises(SystemExit, match=message):
        cli.main(["build-datastore", str(tmp_path / "doc.txt"), "-o", str(tmp_path / "ds"),
                  "--model", str(model), "--dense", *option])
    assert not (tmp_path / "ds").exists()


def test_a_models_tokenizer_is_loaded_once(monkeypatch):
    # bench loads it for its prompts and again for its warm-up text.
    import transformers

    loads = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda model: loads.append(model) or object())
    cli.load_tokenizer.cache_clear()
    try:
        assert cli.load_tokenizer("a") is cli.load_tokenizer("a")
        cli.load_tokenizer("b")
        assert loads == ["a", "b"]
    finally:
        cli.load_tokenizer.cache_clear()


NEITHER_OR_BOTH = 'expected an object with either "prompt" .* or "messages"'


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", "messages": []}', NEITHER_OR_BOTH),
    ('{"text": "a"}', NEITHER_OR_BOTH),
    ('{"prompt": ""}', '"prompt" must be a non-empty string'),
    ('{"messages": [{"role": "user"}]}', '"messages" must be a non-empty list'),
    ('not json', "not a JSON object"),
    ('[1]', "not a JSON object"),
])
def test_bad_prompts_file_lines_are_named(tmp_path, line, message):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(SystemExit, match=rf"error: {prompts}:3: {message}"):
        cli.main(["bench", "--model", str(tmp_path), "--methods", "plain", "--prompts-file",
                  str(prompts)])


def test_prompts_files_are_tasks_named_after_the_file(tmp_path):
    from vllm_retrieval_spec.bench.tasks import file_requests

    (tmp_path / "a").mkdir()
    for path in (tmp_path / "code-gen.jsonl", tmp_path / "mine.jsonl", tmp_path / "a/mine.jsonl"):
        path.write_text('{"prompt": "x"}\n{"messages": [{"role": "user", "content": "y"}]}\n')
    assert file_requests(tmp_path / "mine.jsonl", 1, 1) == [[{"role": "user", "content": "y"}]]
    for files in (["code-gen.jsonl"], ["mine.jsonl", "a/mine.jsonl"]):
        args = ["--prompts-file", *" --prompts-file ".join(
            str(tmp_path / f) for f in files).split(" ")]
        with pytest.raises(SystemExit, match="file names must differ from each other and from "
                                             "the tasks"):
            cli.main(["bench", "--model", str(tmp_path), "--methods", "plain", "--tasks",
                      "code-gen", *args])
    with pytest.raises(SystemExit, match=r"unknown task\(s\) \['nope'\]"):
        cli.main(["bench", "--model", str(tmp_path), "--methods", "plain", "--tasks", "nope"])


def test_engine_output_goes_to_the_log_and_the_bar_to_the_terminal(tmp_path, capfd):
    import subprocess

    log = tmp_path / "run.log"
    with commands.engine_output_to(log) as terminal:
        # vLLM's engine processes inherit file descriptors 1 and 2.
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('engine says\\n'); "
                        "print('engine logs')"], check=True)
        terminal.write("progress\n")
    print("after", file=sys.stderr)
    print("result")
    out, err = capfd.readouterr()
    assert (out, err) == ("result\n", "progress\nafter\n")
    assert sorted(log.read_text().splitlines()) == ["engine logs", "engine says"]


def test_tasks_short_of_the_prompts_asked_for_are_named(tmp_path, capsys):
    commands.check_prompt_counts({"chat": 80, "mine": 20}, 40, 60)
    assert capsys.readouterr().err == ("warning: task 'mine' has 20 prompts from offset 60 on, "
                                       "fewer than the 40 asked for; its rows use 20\n")
    commands.check_prompt_counts({"chat": 80}, None, 0)
    assert capsys.readouterr().err == ""
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    with pytest.raises(SystemExit, match="error: task 'mine' has 0 prompts from offset 2 on, "
                                         "fewer than the 3 asked for"):
        cli.main(["bench", "--model", str(tmp_path), "--methods", "plain", "--prompts-file",
                  str(prompts), "--prompts", "3", "--prompt-offset", "2"])


def test_served_purge_removes_a_keys_requests(tmp_path, capsys):
    import numpy as np

    from vllm_retrieval_spec.datastore.journal import TokenizerFacts
    from vllm_retrieval_spec.datastore.served import KeyedServedStores
    from vllm_retrieval_spec.datastore.served_saver import ServedDirectory

    def replica():
        return ServedDirectory(tmp_path, KeyedServedStores(100, 4, background=False),
                               TokenizerFacts("t", "f" * 64, 100), flush_s=1, compact_s=60,
                               background=False)

    served = replica()
    for key, request_id in (("x", "1"), ("y", "2")):
        digest = served.key_of(key)
        served.record(digest, request_id, served.stores.add(digest, request_id, np.arange(3)))
    served.close()
    cli.main(["served", "purge", str(tmp_path), "--key", "x"])
    out = capsys.readouterr().out
    assert "1 request(s) removed from the files" in out
    # Before: the output said a stopped server's segments sealed in the last 30 s wait,
    # whether any did or not; now it names those that hold purged requests.
    (sealed,) = tmp_path.glob("journal-*.sealed")
    assert f"still held by {sealed.name}" in out
    os.utime(sealed, (time.time() - 60, time.time() - 60))
    cli.main(["served", "purge", str(tmp_path), "--key", "x"])
    assert "0 request(s) removed" in (out := capsys.readouterr().out)
    assert "no file holds them any more" in out and not sealed.exists()
    after = replica()
    assert after.stores.get(after.key_of("x")) is None
    assert after.stores.get(after.key_of("y")).num_documents == 1
    with pytest.raises(SystemExit, match="not a served store"):
        cli.main(["served", "purge", str(tmp_path / "nowhere")])
    # Before: a file given for the directory was a NotADirectoryError traceback.
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit, match="a-file is not a served store"):
        cli.main(["served", "purge", str(tmp_path / "a-file")])
    with pytest.raises(SystemExit, match="--older-than must be 0 or more"):
        cli.main(["served", "purge", str(tmp_path), "--older-than", "-1"])


@pytest.mark.parametrize("option, value", [("--older-than", "nan"), ("--older-than", "inf"),
                                           ("--wait", "nan")])
def test_served_purge_refuses_numbers_that_are_no_time(tmp_path, option, value):
    # Before: --older-than nan or inf was a ValueError or OverflowError traceback once the store
    # was opened, and --wait nan did not wait.
    unit = "hours" if option == "--older-than" else "seconds"
    with pytest.raises(SystemExit, match=rf"^error: {option} must be 0 or more {unit}, "
                                         rf"got {value}$"):
        cli.main(["served", "purge", str(tmp_path), option, value])


def _replica_serving(directory, keys, replica=None):
    """A server (no threads) that served one request of each key, its journal flushed."""
    import numpy as np

    from vllm_retrieval_spec.datastore.journal import TokenizerFacts
    from vllm_retrieval_spec.datastore.served import KeyedServedStores
    from vllm_retrieval_spec.datastore.served_saver import ServedDirectory

    served = ServedDirectory(directory, KeyedServedStores(100, 4, background=False),
                             TokenizerFacts("t", "f" * 64, 100), flush_s=1, compact_s=60,
                             background=False, replica=replica)
    for request_id, key in enumerate(keys, 1):
        digest = served.key_of(key)
        served.record(digest, str(request_id),
                      served.stores.add(digest, str(request_id), np.arange(3)))
    served.writer.flush()
    return served


def _stopped_replica_with_two_keys(directory):
    _replica_serving(directory, ("x", "y")).close()


def test_served_purge_waits_for_a_stopped_servers_segment_to_settle(tmp_path, capsys,
                                                                   monkeypatch):
    from vllm_retrieval_spec.datastore import journal, served_saver

    monkeypatch.setattr(journal, "SETTLE_S", 0.3)
    monkeypatch.setattr(served_saver, "SETTLE_S", 0.3)
    monkeypatch.setattr(cli, "WAIT_POLL_S", 0.05)
    _stopped_replica_with_two_keys(tmp_path)
    (sealed,) = tmp_path.glob("journal-*.sealed")
    # Before: the segment the stopped server sealed just now kept the request until the
    # command was run again; --wait compacts again once it settled.
    cli.main(["served", "purge", str(tmp_path), "--key", "x", "--wait", "10"])
    out = capsys.readouterr().out
    assert f"still held by {sealed.name} (waiting up to 10 s)" in out
    assert out.endswith("no file holds them any more\n") and not sealed.exists()


def test_served_purge_waits_without_snapshots_while_a_writer_may_still_append(
        tmp_path, capsys, monkeypatch):
    from vllm_retrieval_spec.datastore import journal, served_saver
    from vllm_retrieval_spec.datastore.served_saver import list_snapshots

    monkeypatch.setattr(journal, "SETTLE_S", 0.1)
    monkeypatch.setattr(served_saver, "SETTLE_S", 0.1)
    monkeypatch.setattr(cli, "WAIT_POLL_S", 0.02)
    # A server on another host, its segment open: its pid means nothing here.
    _replica_serving(tmp_path, ("x",), replica="otherhost-1-a")
    (segment,) = tmp_path.glob("journal-*")
    with pytest.raises(SystemExit, match=f"still held by {segment.name} "):
        cli.main(["served", "purge", str(tmp_path), "--key", "x", "--wait", "0.5"])
    # Before: a snapshot every SETTLE_S of the wait, none of which could delete the segment.
    assert [p.name[:19] for p in list_snapshots(tmp_path)] == ["snapshot-0000000001"]
    # Once its writer has been still past every heartbeat, it is a dead server's.
    old = time.time() - journal.FOREIGN_SEGMENT_S - 1
    os.utime(segment, (old, old))
    cli.main(["served", "purge", str(tmp_path), "--key", "x", "--wait", "5"])
    assert capsys.readouterr().out.endswith("no file holds them any more\n")
    assert not segment.exists()


def test_served_purge_fails_naming_what_still_holds_the_requests_when_the_wait_ends(
        tmp_path, capsys):
    _stopped_replica_with_two_keys(tmp_path)
    (sealed,) = tmp_path.glob("journal-*.sealed")
    with pytest.raises(SystemExit, match=f"error: after 0.1 s the purged requests are still "
                                         f"held by {sealed.name} "):
        cli.main(["served", "purge", str(tmp_path), "--key", "x", "--wait", "0.1"])
    with pytest.raises(SystemExit, match="--wait must be 0 or more seconds"):
        cli.main(["served", "purge", str(tmp_path), "--wait", "-1"])


def test_a_prompts_file_read_past_its_end_is_refused_without_prompts_asked_for(tmp_path):
    # Before: without --prompts (all of the file) the check was skipped, the empty task went to
    # the engines, and its rows divided by zero seconds once every other task had run.
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    with pytest.raises(SystemExit, match=r"^error: task 'mine' has 0 prompts from offset 2 on$"):
        cli.main(["bench", "--model", str(tmp_path), "--methods", "plain", "--prompts-file",
                  str(prompts), "--prompt-offset", "2"])


def test_a_prompt_without_room_for_an_output_token_is_refused_before_any_engine(monkeypatch,
                                                                                tmp_path):
    # Before: vLLM refused it (prompt length >= max_model_len) inside generate, once every
    # engine had started, and the run ended with nothing written.
    from vllm_retrieval_spec.bench import tasks, throughput

    monkeypatch.setattr(commands, "bench_prompts", lambda model, args: {
        "mine": [[1] * 10, [1] * (tasks.MAX_MODEL_LEN - 1), [1] * tasks.MAX_MODEL_LEN]})
    monkeypatch.setattr(throughput, "run_benchmark",
                        lambda *args, **kwargs: pytest.fail("an engine would have started"))
    with pytest.raises(SystemExit, match=rf"^error: task 'mine': prompt 2 has "
                                         rf"{tasks.MAX_MODEL_LEN} tokens; the engines serve "
                                         rf"{tasks.MAX_MODEL_LEN} tokens, prompt and output$"):
        cli.main(["bench", "--model", str(tmp_path), "--methods", "plain", "--sequential"])


@pytest.mark.parametrize("entry, expected", [
    ("ds/stdlib", ("stdlib", "ds/stdlib")),
    ("own=ds/stdlib", ("own", "ds/stdlib")),
    ("own=runs/k=24/ds", ("own", "runs/k=24/ds")),
    ("runs/k=24/ds", ("ds", "runs/k=24/ds")),
    ("=ds/stdlib", ("stdlib", "ds/stdlib")),
])
def test_datastore_entries_are_split_at_the_names_end(entry, expected):
    assert commands.datastore_entry(entry) == expected


def test_ctrl_c_is_one_line_not_a_traceback(monkeypatch, tmp_path, capsys):
    # Before: Ctrl-C halfway through a build printed a traceback into the tokenizer.
    from vllm_retrieval_spec.datastore import build

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "build_datastore", interrupted)
    # Not the offline model: converting it on an empty cache would print to stderr.
    monkeypatch.setattr(cli, "resolve_model", lambda model: model)
    monkeypatch.setattr(cli, "load_tokenizer", lambda model: object())
    with pytest.raises(SystemExit) as exit:
        cli.main(["build-datastore", str(tmp_path), "-o", str(tmp_path / "ds")])
    assert exit.value.code == 130
    assert capsys.readouterr().err == "vllm-rsd: interrupted; no output was left half-written\n"


def test_generate_corpus_refuses_a_task_or_offset_without_prompts(monkeypatch, tmp_path, capsys):
    # Before: an unknown task, or an offset past the task's end, was a ValueError traceback
    # (the second after importing vLLM).
    from vllm_retrieval_spec.datastore import generate

    monkeypatch.setattr(generate, "generate_corpus",
                        lambda *args, **kwargs: pytest.fail("vLLM would have started"))
    output = str(tmp_path / "corpus.jsonl")
    with pytest.raises(SystemExit) as exit:
        cli.main(["generate-corpus", "--task", "nope", "-o", output])
    assert exit.value.code == 2 and "argument --task: invalid choice: 'nope'" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"^error: task 'code-gen' has 0 prompts from offset "
                                         r"1000 on$"):
        cli.main(["generate-corpus", "--task", "code-gen", "--prompt-offset", "1000",
                  "-o", output])


def test_generate_corpus_refuses_an_existing_file_before_fetching_the_model(monkeypatch,
                                                                            tmp_path):
    from vllm_retrieval_spec import assets

    monkeypatch.setattr(assets, "model_path",
                        lambda name: pytest.fail("the model was fetched before the check"))
    output = tmp_path / "corpus.jsonl"
    output.write_text("hours of answers\n")
    with pytest.raises(SystemExit, match=r"corpus.jsonl exists; pass --overwrite to replace it"):
        cli.main(["generate-corpus", "--task", "chat", "-o", str(output)])
    assert output.read_text() == "hours of answers\n"


@pytest.mark.parametrize("command", [["generate-corpus", "-o", "corpus.jsonl"], ["calibrate"]])
def test_a_model_without_a_tokenizer_is_refused_before_vllm(monkeypatch, tmp_path, command):
    # Before: generate-corpus and calibrate handed the folder to vLLM, whose config loading
    # ended in a traceback.
    from vllm_retrieval_spec.bench import verify_cost
    from vllm_retrieval_spec.datastore import generate

    for module, name in ((generate, "generate_corpus"), (verify_cost, "measure")):
        monkeypatch.setattr(module, name,
                            lambda *args, **kwargs: pytest.fail("vLLM would have started"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"^error: cannot load a tokenizer from '.*empty'"):
        cli.main([*command, "--model", str(tmp_path / "empty")])


@pytest.mark.parametrize("argv, message", [
    (["--contexts", "50,a"], "argument --contexts: 'a' is not an integer"),
    (["--lengths", "0,-1,2"], "argument --lengths: must be 0 or more, got -1"),
    (["--lengths", "1,2,3"], "error: calibration needs draft length 0 and at least two lengths "
                             "of 2 or more; got [1, 2, 3]"),
    (["--contexts", "50,1500"], "error: context 1500 is longer than the calibration text "
                                "(1000 tokens); give --contexts of at most that"),
    (["--contexts", "900", "--max-tokens", "1200"],
     "error: context 900 + --max-tokens 1200 is over the engine's 2048 tokens"),
])
def test_calibrate_refuses_a_plan_it_cannot_measure_before_the_engine(monkeypatch, capsys,
                                                                     argv, message):
    # Before: bad numbers were a ValueError traceback; lengths without 0 failed only after
    # every measurement; a context past the text was silently cut yet reported as asked.
    from vllm_retrieval_spec.bench import tasks, verify_cost

    monkeypatch.setattr(cli, "load_tokenizer", lambda model: None)
    monkeypatch.setattr(tasks, "task_prompts", lambda *args: [list(range(1000))])
    monkeypatch.setattr(verify_cost, "measure",
                        lambda *args, **kwargs: pytest.fail("an engine would have started"))
    with pytest.raises(SystemExit) as exit:
        cli.main(["calibrate", "--model", "m", *argv])
    assert message in str(exit.value.code) + capsys.readouterr().err


def test_calibrate_loads_the_tokenizer_and_its_text_once(monkeypatch):
    # Before: calibrate loaded both to check its plan, and measure loaded both again.
    from types import SimpleNamespace

    import transformers
    import vllm

    from vllm_retrieval_spec.bench import tasks, verify_cost

    loads, texts, prompts = [], [], []

    class RecordingLLM:
        def __init__(self, model, **kwargs):
            self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

        def generate(self, batch, params, use_tqdm=False):
            prompts.append(batch[0]["prompt_token_ids"])

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda model: loads.append(model) or object())
    monkeypatch.setattr(tasks, "task_prompts",
                        lambda *args: texts.append(args) or [list(range(1000))])
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setenv(verify_cost.LENGTH_FILE_ENV, "")  # measure sets it; restored after
    monkeypatch.setattr(verify_cost, "calibrated_options", lambda rows: {})
    cli.load_tokenizer.cache_clear()
    try:
        cli.main(["calibrate", "--model", "m", "--contexts", "50", "--lengths", "0,2,4",
                  "--repeats", "1", "--max-tokens", "4", "--verbose"])
    finally:
        cli.load_tokenizer.cache_clear()
    assert loads == ["m"] and len(texts) == 1
    assert prompts == [list(range(50))] * 4


def test_calibrate_checks_its_output_before_measuring_and_writes_it_whole(monkeypatch,
                                                                          tmp_path):
    # Before: -o was first touched after every measurement, where a directory or a path under
    # a file was a traceback that lost them all.
    from vllm_retrieval_spec.bench import tasks, verify_cost

    monkeypatch.setattr(cli, "load_tokenizer", lambda model: None)
    monkeypatch.setattr(tasks, "task_prompts", lambda *args: [list(range(1000))])
    monkeypatch.setattr(verify_cost, "measure",
                        lambda *args, **kwargs: pytest.fail("an engine would have started"))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit, match="is a directory; give the path of the .json file"):
        cli.main(["calibrate", "--model", "m", "-o", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"^error: cannot create .*a-file/options.json"):
        cli.main(["calibrate", "--model", "m", "-o", str(tmp_path / "a-file/options.json")])
    rows = [{"context_tokens": 50, "draft_len": d, "ms_per_step_median": 10.0 + d,
             "ms_per_step": [10.0 + d]} for d in (0, 2, 4)]
    monkeypatch.setattr(verify_cost, "measure", lambda *args: rows)
    output = tmp_path / "new/options.json"
    cli.main(["calibrate", "--model", "m", "-o", str(output), "--verbose"])
    assert json.loads(output.read_text())["steps"] == rows
    assert [p.name for p in output.parent.iterdir()] == ["options.json"]
    # An earlier calibration is replaced only when asked to, and before measuring.
    monkeypatch.setattr(verify_cost, "measure",
                        lambda *args, **kwargs: pytest.fail("an engine would have started"))
    with pytest.raises(SystemExit, match=rf"^error: {output} exists; pass --overwrite to replace "
                                         r"it, or give another -o$"):
        cli.main(["calibrate", "--model", "m", "-o", str(output)])
    remeasured = [{**row, "ms_per_step_median": 2 * row["ms_per_step_median"]} for row in rows]
    monkeypatch.setattr(verify_cost, "measure", lambda *args: remeasured)
    cli.main(["calibrate", "--model", "m", "-o", str(output), "--overwrite"])
    assert json.loads(output.read_text())["steps"] == remeasured


def test_bench_replaces_an_earlier_runs_results_only_when_asked(monkeypatch, tmp_path):
    """Before: a second run of the same name (the default, "bench") silently replaced the
    first's results once it had run."""
    (tmp_path / "bench.json").write_text("{}")
    monkeypatch.setattr(cli, "resolve_model",
                        lambda model: pytest.fail("the model would have been fetched"))
    with pytest.raises(SystemExit, match=rf"^error: {tmp_path / 'bench.json'} holds the results "
                                         r"of an earlier run named 'bench'; pass --overwrite to "
                                         r"replace them, or choose another --run-name$"):
        cli.main(["bench", "--methods", "plain", "--output-dir", str(tmp_path)])
    # Another name, or --overwrite, goes on to the model.
    for argv in (["--run-name", "other"], ["--overwrite"]):
        with pytest.raises(pytest.fail.Exception, match="the model would have been fetched"):
            cli.main(["bench", "--methods", "plain", "--output-dir", str(tmp_path), *argv])
    assert (tmp_path / "bench.json").read_text() == "{}"


def test_bench_refuses_a_datastore_that_is_not_one_before_any_engine(monkeypatch, tmp_path):
    # Before: plain's engine started, and the rest row failed only when its own engine did.
    from vllm_retrieval_spec.bench import throughput

    monkeypatch.setattr(commands, "bench_prompts", lambda model, args: {"mine": [[1]]})
    monkeypatch.setattr(cli, "load_tokenizer", lambda model: type("T", (), {
        "encode": staticmethod(lambda text: [1])}))
    monkeypatch.setattr(throughput, "run_benchmark",
                        lambda *args, **kwargs: pytest.fail("an engine would have started"))
    with pytest.raises(SystemExit, match=r"^error: datastore directory .*nowhere does not exist"):
        cli.main(["bench", "--model", str(tmp_path), "--methods", "rest", "--datastore",
                  str(tmp_path / "nowhere"), "--sequential", "--output-dir", str(tmp_path)])


def test_bench_refuses_two_datastores_of_one_name(tmp_path):
    # Before: the last one alone was kept, and rest:own measured b/own without a word of a/own.
    with pytest.raises(SystemExit, match=r"^error: --datastore names own more than once; give "
                                         r"each datastore its own name, as NAME=DIR$"):
        cli.main(["bench", "--model", str(tmp_path), "--methods", "rest:own",
                  "--datastore", str(tmp_path / "a/own"), "--datastore", str(tmp_path / "b/own")])


@pytest.mark.parametrize("options, message", [
    ("{bad", r"^error: --method-options is not JSON \(Expecting property name"),
    ("[1]", r"^error: --method-options must be a JSON object of objects"),
    ('{"rest": 3}', r"^error: --method-options must be a JSON object of objects"),
])
def test_bench_method_options_that_are_not_an_object_of_objects(tmp_path, options, message):
    # Before: a list or a number was an AttributeError or TypeError traceback, and bad JSON
    # an error that did not say which argument it was in.
    with pytest.raises(SystemExit, match=message):
        cli.main(["bench", "--model", str(tmp_path), "--methods", "rest",
                  "--method-options", options])


def test_bench_output_dir_that_cannot_be_a_directory_is_one_line(monkeypatch, tmp_path):
    # Before: a FileExistsError traceback when its log was opened.
    monkeypatch.setattr(commands, "bench_prompts", lambda model, args: {"mine": [[1]]})
    monkeypatch.setattr(cli, "load_tokenizer", lambda model: type("T", (), {
        "encode": staticmethod(lambda text: [1])}))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit, match=r"^error: cannot create .*a-file \(File exists"):
        cli.main(["bench", "--model", str(tmp_path), "--methods", "plain", "--output-dir",
                  str(tmp_path / "a-file")])
