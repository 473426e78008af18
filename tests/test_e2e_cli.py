"""README's main job and the benchmark, run as a user runs them: `vllm-rsd demo` from an empty
cache, `vllm-rsd bench` on the user's own prompts, `vllm-rsd calibrate`."""

from __future__ import annotations

import json

import pytest

from vllm_retrieval_spec.cli import main

pytestmark = pytest.mark.e2e

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_demo_from_an_empty_cache(model_dir, tmp_path, monkeypatch, capfd):
    """Everything but the converted model is made anew: the stdlib datastore included (a warm
    cache once hid a crash in building it)."""
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "SmolLM2-135M-Instruct").symlink_to(model_dir)
    monkeypatch.setenv("VLLM_RSD_CACHE", str(cache))
    main(["demo", "--prompts", "1", "--max-tokens", "16"])
    out, err = capfd.readouterr()

    assert (cache / "datastores" / "stdlib" / "manifest.json").is_file()
    results = json.loads((cache / "demo" / "demo.json").read_text())
    assert [(r["method"], r["datastore"]) for r in results["rows"]] == [
        ("plain", None), ("ngram", None), ("suffix", None), ("rest", "stdlib"),
        ("hybrid", "stdlib")]
    assert all(r["outputs_equal_plain"] and r["output_tokens"] == 16 for r in results["rows"])
    assert (cache / "demo" / "demo.png").read_bytes().startswith(PNG_SIGNATURE)
    # A result, not a log: the table once, where the results went, vLLM's output in its log.
    assert out.count("| task | method |") == 1
    assert f"results: {cache / 'demo' / 'demo.json'} and {cache / 'demo' / 'demo.md'}" in out
    assert f"plot: {cache / 'demo' / 'demo.png'}" in out
    # (vLLM's logger in this process holds pytest's sys.stdout, not file descriptor 1, so only
    # its engine processes' lines can be checked here.)
    assert "(EngineCore pid=" not in out + err
    assert "(EngineCore pid=" in (cache / "demo" / "demo.log").read_text()


def test_bench_on_a_prompts_file_beside_suffix(model_dir, tokenizer, tmp_path, capsys):
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(json.dumps({"prompt": "def fibonacci(n):"}) + "\n"
                       + json.dumps({"messages": messages}) + "\n")
    main(["bench", "--model", model_dir, "--methods", "suffix", "--prompts-file", str(prompts),
          "--max-tokens", "16", "--output-dir", str(tmp_path), "--run-name", "mine",
          "--sequential"])
    results = json.loads((tmp_path / "mine.json").read_text())
    assert [(r["task"], r["method"], r["prompts"]) for r in results["rows"]] == [
        ("mine", "plain", 2), ("mine", "suffix", 2)]
    assert results["rows"][1]["outputs_equal_plain"]
    # The raw prompt is tokenised as it is, the chat rendered with the model's template.
    records = [json.loads(line)
               for line in (tmp_path / "mine.plain.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == [
        tokenizer("def fibonacci(n):")["input_ids"],
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)]
    # What replay caps our drafts by, as the engine did.
    assert [r["max_tokens"] for r in records] == [16, 16]
    assert (tmp_path / "mine.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "![speedup and tokens per forward](mine.png)" in (tmp_path / "mine.md").read_text()


def test_calibrate_writes_the_options_it_measured(model_dir, tmp_path):
    output = tmp_path / "calibration.json"
    main(["calibrate", "--model", model_dir, "--contexts", "50", "--lengths", "0,2,4,8",
          "--repeats", "1", "--max-tokens", "8", "-o", str(output)])
    written = json.loads(output.read_text())
    assert [(r["context_tokens"], r["draft_len"]) for r in written["steps"]] == [
        (50, 0), (50, 2), (50, 4), (50, 8)]
    assert all(r["ms_per_step_median"] > 0 for r in written["steps"])
    assert set(written["options"]) == {"draft_token_cost", "min_draft_len", "draft_budget_ms"}
    # The options are valid speculative_config values.
    from vllm_retrieval_spec.config import VLLM_CPU_DEFAULTS, parse_speculative_config

    parse_speculative_config({"method": "pld", "num_speculative_tokens": 8,
                              **written["options"]}, VLLM_CPU_DEFAULTS)
