"""The throughput benchmark's bookkeeping: who runs when, and what each row is compared with."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from vllm_retrieval_spec.bench.engine import turns
from vllm_retrieval_spec.bench.results import compared_with_plain


def test_interleaved_turns_give_every_engine_every_batch_once_in_rotating_order():
    schedule = turns(num_prompts=5, batch_size=2, num_engines=3)
    assert Counter(schedule) == Counter((start, e) for start in (0, 2, 4) for e in range(3))
    # Batches in prompt order, each finished by all engines before the next starts.
    assert [start for start, _ in schedule] == [0, 0, 0, 2, 2, 2, 4, 4, 4]
    assert [e for _, e in schedule] == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert turns(0, 1, 3) == []


def test_rows_are_compared_with_plain_of_the_same_task_even_when_a_method_repeats():
    def row(method, tokens_per_s):
        return {"method": method, "tokens_per_s": tokens_per_s, "temperature": 0.0}

    plain = {"chat": (row("plain", 10.0), [[1, 2]]), "code-gen": (row("plain", 20.0), [[3]])}
    rest_a = {"chat": (row("rest", 25.0), [[1, 2]]), "code-gen": (row("rest", 30.0), [[4]])}
    rest_b = {"chat": (row("rest", 5.0), [[1, 2]])}
    rows = compared_with_plain([plain, rest_a, rest_b])
    assert [(r["method"], r["speedup"], r["outputs_equal_plain"]) for r in rows] == [
        ("plain", 1.0, True), ("plain", 1.0, True),
        ("rest", 2.5, True), ("rest", 1.5, False), ("rest", 0.5, True)]


def test_calibration_reads_cost_slope_and_the_costly_short_drafts():
    from vllm_retrieval_spec.bench.verify_cost import calibrated_options

    def rows(times):
        return [{"context_tokens": 50, "draft_len": d, "ms_per_step_median": t}
                for d, t in times.items()]

    # vLLM-CPU's shape: a lone draft token costs more than none and more than 2-8 tokens.
    cpu = calibrated_options(rows({0: 70.0, 1: 86.0, 2: 60.0, 4: 64.0, 8: 72.0}))
    assert cpu == {"draft_token_cost": round(2.0 / 70, 4), "min_draft_len": 2,
                   "draft_budget_ms": 4.9}
    # A GPU's shape: nearly flat, no anomaly.
    gpu = calibrated_options(rows({0: 10.0, 1: 10.1, 2: 10.2, 4: 10.4, 8: 10.8}))
    assert gpu == {"draft_token_cost": 0.01, "min_draft_len": 1, "draft_budget_ms": 0.7}


def test_results_interrupted_while_written_leave_no_truncated_file(tmp_path, monkeypatch):
    """A run stopped (Ctrl-C) while its results are written leaves each file whole or absent,
    and an earlier run's files of the same name as they were."""
    from vllm_retrieval_spec.bench import results as written

    rows = [{"task": "code-gen", "method": "plain", "datastore": None, "speedup": 1.0,
             "tokens_per_forward": 1.0, "outputs_equal_plain": True}]
    results = {"run": "r", "date": "2026-11-27", "machine": "cpu", "model": "m",
               "vllm": "0.32.0", "command": "vllm-rsd bench", "rows": rows,
               "plain_outputs": [{"task": "code-gen", "prompt": [1], "output": [2]}]}
    (tmp_path / "r.png").write_bytes(b"an earlier run's plot")

    def interrupted(results, path):
        path.write_bytes(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(written, "write_plot", interrupted)
    with pytest.raises(KeyboardInterrupt):
        written.write_results(results, tmp_path)
    assert (tmp_path / "r.png").read_bytes() == b"an earlier run's plot"
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == rows
    assert json.loads((tmp_path / "r.plain.jsonl").read_text()) == results["plain_outputs"][0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "r.json", "r.md", "r.plain.jsonl", "r.png"]


def test_plot_draws_every_tasks_bars(tmp_path):
    from vllm_retrieval_spec.bench.results import write_plot

    tasks = ("code-gen", "summarize", "chat")
    rows = [{"task": t, "method": m, "datastore": d, "speedup": s + i / 10,
             "tokens_per_forward": f + i / 10, "outputs_equal_plain": e}
            for i, t in enumerate(tasks)
            for m, d, s, f, e in (("plain", None, 1.0, 1.0, True), ("ngram", None, 1.4, 1.6, True),
                                  ("hybrid", "own", 1.9, 2.1, False))]
    figure = write_plot({"run": "r", "model": "m", "machine": "cpu", "vllm": "0.32.0",
                         "rows": rows}, tmp_path / "r.png")
    import matplotlib.image

    image = matplotlib.image.imread(tmp_path / "r.png")
    assert image.shape[0] > 300 and image.shape[1] > 800
    assert [t.get_text() for t in figure.legends[0].get_texts()] == ["ngram", "hybrid:own"]
    speedup, tokens_per_forward = figure.axes
    for ax, metric in ((speedup, "speedup"), (tokens_per_forward, "tokens_per_forward")):
        assert [label.get_text() for label in ax.get_xticklabels()] == list(tasks)
        # One bar per method in each task's group (centred on the task's tick), plain excepted;
        # hatched where the outputs differ from plain's.
        drawn = sorted((round(bar.get_x() + bar.get_width() / 2), round(bar.get_height(), 3),
                        bar.get_hatch()) for bar in ax.patches)
        assert drawn == sorted((tasks.index(r["task"]), round(r[metric], 3),
                                None if r["outputs_equal_plain"] else "//")
                               for r in rows if r["method"] != "plain")


def test_halves_split_the_prompts_and_compare_each_with_plain_of_the_same_half():
    from vllm_retrieval_spec.bench.results import format_halves_table, halves

    # (prompts, output tokens, seconds, forwards) per batch: 5 prompts, batches of 2, 2, 1.
    plain = halves([(2, 40, 4.0, 40), (2, 40, 4.0, 40), (1, 20, 2.0, 20)])
    learner = halves([(2, 40, 4.0, 40), (2, 40, 2.0, 10), (1, 20, 0.5, 5)])
    # The batch starting at prompt 2 (of 5) is in the first half, since 2 < 2.5.
    assert plain == {"first_half": {"prompts": 4, "tokens_per_s": 10.0,
                                    "tokens_per_forward": 1.0},
                     "second_half": {"prompts": 1, "tokens_per_s": 10.0,
                                     "tokens_per_forward": 1.0}}
    assert learner["second_half"] == {"prompts": 1, "tokens_per_s": 40.0,
                                      "tokens_per_forward": 4.0}

    def row(method, by_half):
        return {"task": "chat", "method": method, "tokens_per_s": 10.0, "temperature": 0.0,
                **by_half}

    rows = compared_with_plain([{"chat": (row("plain", plain), [[1]])},
                                {"chat": (row("hybrid", learner), [[1]])}])
    assert rows[1]["first_half"]["speedup"] == 1.333 and rows[1]["second_half"]["speedup"] == 4.0
    table = format_halves_table(rows)
    assert "| chat | hybrid |  | 1.333 | 4.0 |" in table and "| plain |" not in table


def test_hybrid_without_a_datastore_name_runs_on_the_served_store_alone():
    from vllm_retrieval_spec.bench.throughput import method_runs

    runs = method_runs(["rest", "hybrid", "hybrid:stdlib"], 8, {"stdlib": "/ds"})
    assert [(r.label, (r.speculative_config or {}).get("datastore")) for r in runs] == [
        ("plain", None), ("rest:stdlib", "/ds"), ("hybrid", None), ("hybrid:stdlib", "/ds")]


def test_method_options_for_one_row_override_the_methods():
    from vllm_retrieval_spec.bench.throughput import method_runs

    runs = method_runs(["hybrid:a", "hybrid:b"], 8, {"a": "/a", "b": "/b"},
                       {"hybrid": {"num_speculative_tokens": 24, "max_spec_factor": 1.0},
                        "hybrid:b": {"served_store": "off", "num_speculative_tokens": 8}})
    assert [(r.speculative_config["num_speculative_tokens"],
             r.speculative_config.get("served_store"), r.speculative_config["max_spec_factor"])
            for r in runs[1:]] == [(24, None, 1.0), (8, "off", 1.0)]


def test_a_bad_method_option_is_refused_before_any_engine():
    from vllm_retrieval_spec.bench.throughput import method_runs

    with pytest.raises(ValueError, match=r"unknown option\(s\) \['top_m'\] for method 'rest'"):
        method_runs(["pld", "rest:a"], 8, {"a": "/a"}, {"rest": {"top_m": 4}})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        method_runs(["hybrid"], 8, {}, {"hybrid": {"num_speculative_tokens": 0}})


def test_a_named_row_sits_beside_the_same_method_with_its_own_options():
    from vllm_retrieval_spec.bench.results import task_row
    from vllm_retrieval_spec.bench.throughput import BenchSettings, method_runs

    runs = method_runs(["hybrid", "hybrid@restarted"], 8, {},
                       {"hybrid": {"num_speculative_tokens": 24},
                        "hybrid@restarted": {"served_datastore": "/journal"}})
    assert [r.label for r in runs] == ["plain", "hybrid", "hybrid@restarted"]
    assert [r.speculative_config for r in runs[1:]] == [
        {"method": "hybrid", "num_speculative_tokens": 24},
        {"method": "hybrid", "num_speculative_tokens": 24, "served_datastore": "/journal"}]
    row = task_row(runs[2], 24, "chat", BenchSettings(), [[1, 2]], [(1, 2, 1.0, 2)], 0, 0, 0,
                   {"p50_ms": None, "p99_ms": None, "critical_p50_ms": None,
                    "critical_p99_ms": None})
    assert row["method"] == "hybrid@restarted"
    with pytest.raises(ValueError, match="'@NAME' rows are for our methods"):
        method_runs(["suffix@restarted"], 8, {})


def test_tree_rows_sit_beside_the_same_methods_chain():
    from vllm_retrieval_spec.bench.throughput import method_runs

    runs = method_runs(["hybrid", "hybrid/tree", "rest:stdlib/tree"], 8, {"stdlib": "/ds"})
    assert [r.label for r in runs] == ["plain", "hybrid", "hybrid/tree", "rest:stdlib/tree"]
    assert [r.speculative_config.get("tree") for r in runs[1:]] == [None, "on", "on"]
    assert runs[3].speculative_config["datastore"] == "/ds"
    with pytest.raises(ValueError, match="'/tree' is for rest, pld, hybrid, dresd"):
        method_runs(["ngram/tree"], 8, {})
    with pytest.raises(ValueError, match="'/tree' is for rest, pld, hybrid, dresd"):
        method_runs(["pld_plus/tree"], 8, {})
    with pytest.raises(ValueError, match="the variants are '/tree' .*, '/after-sampling' .*, "
                                         "'/served-dense' .* and '/unpadded'"):
        method_runs(["hybrid/forest"], 8, {})


def test_after_sampling_and_unpadded_rows_turn_one_option_off():
    from vllm_retrieval_spec.bench.throughput import method_runs

    runs = method_runs(["pld", "pld/after-sampling", "hybrid/unpadded"], 8, {})
    assert [r.label for r in runs] == ["plain", "pld", "pld/after-sampling", "hybrid/unpadded"]
    assert [r.speculative_config.get("precompute_drafts") for r in runs[1:]] == [None, False,
                                                                                 None]
    assert [r.speculative_config.get("draft_before_sampling") for r in runs[1:]] == [
        None, False, None]
    assert [r.speculative_config.get("pad_drafts") for r in runs[1:]] == [None, None, False]


def test_after_sampling_and_unpadded_rows_are_for_every_method_of_ours():
    """They turn drafting options off, which every method of ours takes (pld_plus too, which
    drafts no trees); vLLM's methods and plain take none."""
    from vllm_retrieval_spec.bench.throughput import method_runs

    runs = method_runs(["pld_plus/unpadded", "pld_plus/after-sampling"], 8, {})
    assert [r.speculative_config.get("pad_drafts") for r in runs[1:]] == [False, None]
    assert [r.speculative_config.get("precompute_drafts") for r in runs[1:]] == [None, False]
    for spelled in ("ngram/unpadded", "plain/after-sampling"):
        with pytest.raises(ValueError, match="variants are for our methods"):
            method_runs([spelled], 8, {})


def test_served_dense_rows_are_hybrid_with_the_dense_half():
    from vllm_retrieval_spec.bench.throughput import method_runs

    runs = method_runs(["hybrid", "hybrid/served-dense"], 24, {})
    assert [r.label for r in runs] == ["plain", "hybrid", "hybrid/served-dense"]
    assert [r.speculative_config.get("served_dense") for r in runs[1:]] == [None, True]
    with pytest.raises(ValueError, match="'/served-dense' is for hybrid"):
        method_runs(["pld/served-dense"], 8, {})


def test_rows_count_draft_tokens_per_forward_and_plain_has_none():
    from vllm_retrieval_spec.bench.results import task_row
    from vllm_retrieval_spec.bench.throughput import BenchSettings, MethodRun

    no_drafting = {"p50_ms": None, "p99_ms": None, "critical_p50_ms": None,
                   "critical_p99_ms": None}
    settings = BenchSettings()
    # Two prompts, 10 output tokens in 4 forwards (prefill included): 3 drafting steps that
    # verified 9 draft tokens, 6 of them accepted.
    hybrid = task_row(MethodRun("hybrid", {"method": "hybrid"}), 24, "chat", settings,
                     [[1] * 6, [2] * 4], [(2, 10, 0.5, 4)], 6, 3, 9, no_drafting)
    assert hybrid["draft_tokens_per_forward"] == 2.25
    assert hybrid["tokens_per_forward"] == 2.5
    assert hybrid["mean_acceptance_length"] == 3.0
    plain = task_row(MethodRun("plain"), None, "chat", settings, [[1] * 6, [2] * 4],
                    [(2, 10, 0.5, 10)], 0, 0, 0, no_drafting)
    assert plain["draft_tokens_per_forward"] is None
    assert "padded_share" not in hybrid
    padded = task_row(MethodRun("hybrid", {"method": "hybrid"}), 24, "chat", settings,
                     [[1] * 6, [2] * 4], [(2, 10, 0.5, 4)], 6, 3, 9,
                     {**no_drafting, "padded_drafts": 1, "step_ms_draft_0": 50.6,
                      "step_ms_draft_4": 43.8})
    assert padded["padded_share"] == 0.25
    assert padded["step_ms_by_draft_len"] == {0: 50.6, 4: 43.8}
    assert "tree_step_share" not in padded
    tree = task_row(MethodRun("hybrid/tree", {"method": "hybrid", "tree": "on"}), 24, "chat",
                   settings, [[1] * 6, [2] * 4], [(2, 10, 0.5, 4)], 6, 3, 9,
                   {**no_drafting, "tree_nodes_mean": 3.0, "tree_steps": 1, "padded_drafts": 1,
                    "step_ms_draft_4": 43.8,
                    "step_ms_tree_extra": 5.2})
    assert tree["tree_step_share"] == 0.25 and tree["tree_extra_ms"] == 5.2
    assert tree["step_ms_by_draft_len"] == {4: 43.8}


def test_cpu_kv_cache_is_sized_to_the_run(tmp_path):
    from vllm_retrieval_spec.bench.engine import cpu_kv_cache_bytes
    from vllm_retrieval_spec.bench.throughput import BenchSettings

    # SmolLM2-135M's shape: float32 K and V of 30 layers x 3 KV heads x 64 dims per token.
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "num_hidden_layers": 30}))
    one = cpu_kv_cache_bytes(str(tmp_path), BenchSettings(concurrency=1, max_model_len=2048))
    # 2048 tokens x 46,080 bytes, a quarter more, rounded up to whole MiB.
    assert one == 113 * 2**20
    assert cpu_kv_cache_bytes(str(tmp_path), BenchSettings(concurrency=4, max_model_len=2048)) \
        == 450 * 2**20
    # No readable config: vLLM-CPU's 1 GiB, as before.
    assert cpu_kv_cache_bytes(str(tmp_path / "missing"), BenchSettings()) == 2**30


def test_a_method_asked_for_twice_is_refused():
    from vllm_retrieval_spec.bench.throughput import method_runs

    # Before: two rows alike in the table and the JSON, and the plot drew only the last one's
    # bar (one bar per label). "rest" names the only datastore, so it is "rest:stdlib" too.
    with pytest.raises(ValueError, match=r"^ngram asked for more than once"):
        method_runs(["ngram", "pld", "ngram"], 8, {})
    with pytest.raises(ValueError, match=r"^rest:stdlib asked for more than once"):
        method_runs(["rest", "rest:stdlib"], 8, {"stdlib": "/ds"})
    # "plain" is always the first row, however often it is named.
    assert [r.label for r in method_runs(["plain", "hybrid", "hybrid@b", "plain"], 8, {})] == [
        "plain", "hybrid", "hybrid@b"]


class FakeLLM:
    """vllm.LLM as MethodEngine uses it: every request answers [7, 7], one forward a token."""

    def __init__(self, model, speculative_config=None, **kwargs):
        from types import SimpleNamespace

        self.calls = []
        self.prompts = []
        step = SimpleNamespace(outputs=[SimpleNamespace(new_token_ids=[7])])
        self.core = SimpleNamespace(get_output=lambda: step, shutdown=lambda: None)
        self.llm_engine = SimpleNamespace(
            engine_core=self.core, vllm_config=SimpleNamespace(speculative_config=None))

    def generate(self, prompts, params, use_tqdm=False):
        from types import SimpleNamespace

        self.calls.append(params)
        self.prompts += [p["prompt_token_ids"] for p in prompts]
        for _ in range(2 * len(prompts)):
            self.core.get_output()  # as MethodEngine's ForwardCounter wraps it
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, 7],
                                                         spec_decode_metrics=None)])
                for _ in prompts]


def test_the_warm_up_is_greedy_like_every_timed_request(monkeypatch):
    import vllm
    from tqdm import tqdm

    from vllm_retrieval_spec.bench.engine import MethodEngine
    from vllm_retrieval_spec.bench.throughput import BenchSettings, MethodRun
    from vllm_retrieval_spec.verification.core import takes_argmax

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    engine = MethodEngine("model", MethodRun("plain"), BenchSettings(), [1, 2, 3],
                          tqdm(disable=True))
    engine.start_task("chat")
    engine.generate([[1, 2, 3]], 0)
    warm_up, (timed,) = engine.llm.calls
    # Before: the warm-up sampled at vLLM's default temperature 1.0, so vLLM's greedy sampling
    # and our greedy-only paths (drafting before sampling) first ran in a timed request.
    assert takes_argmax(timed) and takes_argmax(warm_up)
    assert warm_up.max_tokens == 8


@pytest.fixture
def recording_engines(monkeypatch):
    """The FakeLLMs ``vllm.LLM`` makes from now on, in order."""
    import vllm

    engines = []

    class RecordingLLM(FakeLLM):
        def __init__(self, model, **kwargs):
            super().__init__(model, **kwargs)
            engines.append(self)

        def collective_rpc(self, name, kwargs=None):
            return [dict.fromkeys(["p50_ms", "p99_ms", "critical_p50_ms", "critical_p99_ms"])]

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    return engines


def test_a_sampled_run_seeds_each_prompt_by_its_index_for_every_method(recording_engines):
    """Every engine samples a task's prompt i with seed i (its warm-up sampled too), and a
    sampled row records its sampling and compares no outputs with plain's."""
    from tqdm import tqdm

    from vllm_retrieval_spec.bench import throughput

    runs = [throughput.MethodRun("plain"), throughput.MethodRun("pld", {"method": "pld"})]
    settings = throughput.BenchSettings(temperature=0.7, top_p=0.9, top_k=20, concurrency=2)
    results = throughput._run_engines("model", runs, {"a": [[1], [2], [3]]}, [9], settings,
                                      tqdm(disable=True), [[0, 1]])
    for engine in recording_engines:
        warm_up, *timed = engine.calls
        assert (warm_up.temperature, warm_up.top_p, warm_up.top_k) == (0.7, 0.9, 20)
        assert [(p.seed, p.temperature, p.top_p, p.top_k, p.max_tokens)
                for batch in timed for p in batch] == [(i, 0.7, 0.9, 20, 128) for i in range(3)]
    rows = compared_with_plain(results)
    assert [(r["temperature"], r["top_p"], r["top_k"], r["outputs_equal_plain"])
            for r in rows] == [(0.7, 0.9, 20, None)] * 2


def test_engines_warm_up_on_no_timed_prompt(recording_engines):
    """suffix and hybrid keep what they serve: warmed up on the first timed prompt, they knew
    8 tokens of its output before it was timed (before: ``prompts``' first prompt)."""
    from tqdm import tqdm

    from vllm_retrieval_spec.bench import throughput

    prompts = {"a": [[1, 2], [3]], "b": [[4]]}
    runs = [throughput.MethodRun("plain"), throughput.MethodRun("hybrid", {"method": "hybrid"})]
    results = throughput._run_engines("model", runs, prompts, [9, 9],
                                      throughput.BenchSettings(), tqdm(disable=True), [[0, 1]])
    assert [row.get("error") for rows in results for row, _ in rows.values()] == [None] * 4
    for engine in recording_engines:
        assert engine.prompts[0] == [9, 9]
        assert sorted(engine.prompts[1:]) == [[1, 2], [3], [4]]


def test_an_engine_whose_warm_up_fails_is_shut_down(monkeypatch):
    """Its processes would otherwise outlive a run that goes on without it."""
    import vllm
    from tqdm import tqdm

    from vllm_retrieval_spec.bench.engine import MethodEngine
    from vllm_retrieval_spec.bench.throughput import BenchSettings, MethodRun

    shut_down = []

    class FailingWarmUp(FakeLLM):
        def __init__(self, model, **kwargs):
            super().__init__(model, **kwargs)
            self.core.shutdown = lambda: shut_down.append(True)

        def generate(self, prompts, params, use_tqdm=False):
            raise RuntimeError("engine died")

    monkeypatch.setattr(vllm, "LLM", FailingWarmUp)
    with pytest.raises(RuntimeError, match="engine died"):
        MethodEngine("model", MethodRun("plain"), BenchSettings(), [1, 2, 3],
                     tqdm(disable=True))
    assert shut_down == [True]


@pytest.mark.parametrize("is_cpu", [True, False])
def test_timed_engines_run_as_servers_do_on_each_platform(monkeypatch, is_cpu):
    """Eagerly on vLLM-CPU (its compiled mode starts in 55-80 s, every time); on a GPU with CUDA
    graphs, the calibration's in PIECEWISE mode as our methods serve, in the model's dtype
    (before: eager and float32 everywhere, which timed a launch-bound forward no GPU server
    runs, and so set a GPU user's draft_token_cost from it)."""
    import vllm
    from tqdm import tqdm
    from vllm.platforms import current_platform

    from vllm_retrieval_spec.bench import verify_cost
    from vllm_retrieval_spec.bench.engine import MethodEngine
    from vllm_retrieval_spec.bench.throughput import BenchSettings, MethodRun

    started = []

    class RecordingLLM(FakeLLM):
        def __init__(self, model, **kwargs):
            super().__init__(model, **kwargs)
            started.append(kwargs)

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: is_cpu)
    monkeypatch.setenv(verify_cost.LENGTH_FILE_ENV, "")  # measure sets it; restored after
    MethodEngine("model", MethodRun("plain"), BenchSettings(), [1, 2, 3], tqdm(disable=True))
    for dtype in (None, "bfloat16"):
        verify_cost.measure("model", list(range(100)), [50], [0, 2], repeats=1, max_tokens=2,
                            dtype=dtype)
    bench, calibration, bfloat16 = started
    assert bench["dtype"] == "float32"  # --dtype's default, for plain's exact outputs
    if is_cpu:
        assert bench["enforce_eager"] and calibration["enforce_eager"]
        assert "kv_cache_memory_bytes" in bench
        assert "compilation_config" not in calibration
        assert calibration["dtype"] == "float32"
    else:
        assert not {"enforce_eager", "compilation_config", "kv_cache_memory_bytes"} & set(bench)
        assert "enforce_eager" not in calibration
        assert calibration["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
        assert calibration["dtype"] == "auto"
    assert bfloat16["dtype"] == "bfloat16"


def test_calibration_times_every_run_of_a_context_alike(monkeypatch):
    """A fake engine with vLLM's prefix cache: a prompt not seen before costs 320 ms of
    prefill, every step 10 ms; the clock moves only when the engine works."""
    import time as real_time
    from types import SimpleNamespace

    import vllm

    from vllm_retrieval_spec.bench import verify_cost

    clock = [0.0]
    seen = set()

    class CachingLLM:
        def __init__(self, model, **kwargs):
            self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

        def generate(self, prompts, params, use_tqdm=False):
            prompt = tuple(prompts[0]["prompt_token_ids"])
            clock[0] += (0 if prompt in seen else 0.32) + 0.01 * params.max_tokens
            seen.add(prompt)

    monkeypatch.setenv(verify_cost.LENGTH_FILE_ENV, "")  # measure sets it; restored after
    monkeypatch.setattr(vllm, "LLM", CachingLLM)
    monkeypatch.setattr(verify_cost, "time", SimpleNamespace(perf_counter=lambda: clock[0],
                                                             sleep=real_time.sleep))
    rows = verify_cost.measure("model", list(range(1000)), [50, 700], [0, 2, 4], repeats=2,
                               max_tokens=32)
    # Before: the warm-up cached the 50-token context alone, so the first run of the 700-token
    # one (draft length 0, repeat 1) carried its whole prefill: 20 ms a step instead of 10,
    # and with --repeats 1 or 2 that went into the median and the calibrated options.
    assert {(r["context_tokens"], r["draft_len"]): r["ms_per_step"] for r in rows} == {
        (c, d): [10.0, 10.0] for c in (50, 700) for d in (0, 2, 4)}


@pytest.mark.parametrize("interleave", [True, False])
def test_a_method_that_fails_leaves_the_others_rows_and_says_why(monkeypatch, interleave):
    import torch
    import vllm
    from tqdm import tqdm

    from vllm_retrieval_spec.bench import throughput
    from vllm_retrieval_spec.bench.results import compared_with_plain, format_table, write_plot

    stats = {"p50_ms": None, "p99_ms": None, "critical_p50_ms": None, "critical_p99_ms": None}

    class FailingLLM(FakeLLM):
        """pld cannot start; rest crashes at its third request (the first of task b)."""

        def __init__(self, model, speculative_config=None, **kwargs):
            if (speculative_config or {}).get("method") == "pld":
                raise RuntimeError("pld would not start")
            super().__init__(model)
            self.method = (speculative_config or {}).get("method")

        def generate(self, prompts, params, use_tqdm=False):
            if self.method == "rest" and len(self.calls) == 3:
                raise RuntimeError("EngineDeadError")
            return super().generate(prompts, params, use_tqdm)

        def collective_rpc(self, name, kwargs=None):
            return [stats]

    monkeypatch.setattr(vllm, "LLM", FailingLLM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runs = [throughput.MethodRun("plain"), throughput.MethodRun("pld", {"method": "pld"}),
            throughput.MethodRun("rest", {"method": "rest"}),
            throughput.MethodRun("hybrid", {"method": "hybrid"})]
    settings = throughput.BenchSettings(interleave=interleave)
    prompts = {"a": [[1], [2]], "b": [[3], [4]]}
    results = throughput._run_engines("model", runs, prompts, [9], settings, tqdm(disable=True),
                                      [[0, 1, 2, 3]] if interleave else [[0], [1], [2], [3]])
    rows = compared_with_plain(results)
    # Before: the first exception ended the run, every row lost and nothing written.
    assert [(r["task"], r["method"], "speedup" in r, r.get("error")) for r in rows] == [
        ("a", "plain", True, None), ("b", "plain", True, None),
        ("a", "pld", False, "RuntimeError: pld would not start"),
        ("b", "pld", False, "RuntimeError: pld would not start"),
        ("a", "rest", True, None), ("b", "rest", False, "RuntimeError: EngineDeadError"),
        ("a", "hybrid", True, None), ("b", "hybrid", True, None)]
    assert "| b | rest |" + "  |" * 12 + " RuntimeError: EngineDeadError |" in format_table(rows)
    figure = write_plot({"run": "r", "model": "m", "machine": "cpu", "vllm": "0.32.0",
                         "rows": rows}, "/dev/null")
    assert len(figure.axes[0].patches) == 3  # rest on a, hybrid on a and b

    class PlainFails(FailingLLM):
        def generate(self, prompts, params, use_tqdm=False):
            if self.method is None and len(self.calls) == 2:
                raise RuntimeError("plain died")
            return super().generate(prompts, params, use_tqdm)

    # Plain decoding is every row's baseline: its failure still ends the run.
    monkeypatch.setattr(vllm, "LLM", PlainFails)
    with pytest.raises(RuntimeError, match="plain died"):
        throughput._run_engines("model", runs, prompts, [9], settings, tqdm(disable=True),
                                [[0, 1, 2, 3]])


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "1,2,3"], "error: calibration needs draft length 0 and at least two lengths "
                             "of 2 or more; got [1, 2, 3]"),
    (["--contexts", "50,1500"], "error: context 1500 is longer than the calibration text "
                                "(1000 tokens)"),
    (["--contexts", "50,a"], "argument --contexts: 'a' is not an integer"),
    (["--repeats", "0"], "argument --repeats: must be 1 or more, got 0"),
])
def test_verify_cost_main_checks_its_plan_before_the_engine(monkeypatch, capsys, argv, message):
    """As ``vllm-rsd calibrate`` does. Before: the lab entry point started the engine on any
    plan, and a bad one failed after every measurement (or as a ValueError traceback)."""
    from vllm_retrieval_spec import cli
    from vllm_retrieval_spec.bench import tasks, verify_cost

    monkeypatch.setattr(cli, "load_tokenizer", lambda model: None)
    monkeypatch.setattr(tasks, "task_prompts", lambda *args: [list(range(1000))])
    monkeypatch.setattr(verify_cost, "measure",
                        lambda *args, **kwargs: pytest.fail("an engine would have started"))
    with pytest.raises(SystemExit) as exit:
        verify_cost.main(["--model", "m", *argv])
    assert message in str(exit.value.code) + capsys.readouterr().err


def test_verify_cost_results_name_the_model_measured(monkeypatch, tmp_path):
    """The header's ``model`` is the model ``--model`` gave, not always the cached SmolLM2."""
    import json
    import sys
    from types import SimpleNamespace

    from vllm_retrieval_spec import cli
    from vllm_retrieval_spec.bench import tasks, verify_cost

    model = tmp_path / "Other-Model"
    model.mkdir()
    monkeypatch.setattr(cli, "load_tokenizer", lambda model: None)
    monkeypatch.setattr(tasks, "task_prompts", lambda *args: [list(range(1000))])
    measured = []
    monkeypatch.setattr(verify_cost, "measure", lambda m, *args: measured.append(m) or [
        {"context_tokens": 50, "draft_len": 0, "ms_per_step": [1.0], "ms_per_step_median": 1.0}])
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.32.0"))
    verify_cost.main(["--model", str(model), "--run-name", "vc", "--output-dir", str(tmp_path)])
    assert measured == [str(model)]
    assert json.loads((tmp_path / "vc.json").read_text())["model"] == str(model)


def test_a_multi_line_error_keeps_its_row_of_the_markdown_table():
    """vLLM's config errors are pydantic's, several lines long: before, the message's newline
    ended the row mid-cell and its '|' added a column, so the table broke from there on."""
    from vllm_retrieval_spec.bench.results import format_table

    error = "ValidationError: 1 validation error for SpeculativeConfig\n  Value error, a | b"
    rows = [{"task": "a", "method": "plain", "datastore": None, "speedup": 1.0},
            {"task": "a", "method": "rest", "datastore": "ds", "error": error}]
    lines = format_table(rows).split("\n")
    assert len(lines) == 4
    assert lines[3] == ("| a | rest | ds |" + "  |" * 11 + " ValidationError: 1 validation "
                        "error for SpeculativeConfig   Value error, a \\| b |")


def test_the_plot_names_each_row_as_methods_spells_it():
    """Before: the datastore went after the variant or name ('rest/tree:stdlib'), a spelling
    --methods refuses, where the run's label is 'rest:stdlib/tree'."""
    from vllm_retrieval_spec.bench.results import write_plot
    from vllm_retrieval_spec.bench.throughput import MethodRun

    runs = [MethodRun("rest", datastore="stdlib", variant="tree"),
            MethodRun("hybrid", datastore="own", name="restarted"),
            MethodRun("hybrid", datastore="own", variant="tree", name="b"),
            MethodRun("pld", variant="unpadded")]
    rows = [{"task": "chat", "method": "plain", "datastore": None, "speedup": 1.0,
             "tokens_per_forward": 1.0, "outputs_equal_plain": True}]
    rows += [{"task": "chat", "method": results_method, "datastore": run.datastore,
              "speedup": 1.5, "tokens_per_forward": 2.0, "outputs_equal_plain": True}
             for run, results_method in zip(runs, ("rest/tree", "hybrid@restarted",
                                                   "hybrid/tree@b", "pld/unpadded"))]
    figure = write_plot({"run": "r", "model": "m", "machine": "cpu", "vllm": "0.32.0",
                         "rows": rows}, "/dev/null")
    assert [t.get_text() for t in figure.legends[0].get_texts()] == [
        "rest:stdlib/tree", "hybrid:own@restarted", "hybrid:own/tree@b", "pld/unpadded"]
    assert [t.get_text() for t in figure.legends[0].get_texts()] == [r.label for r in runs]
