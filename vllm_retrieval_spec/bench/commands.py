"""``vllm-rsd bench``, ``calibrate`` and ``demo``: what they run. Their flags are in ``cli``,
which imports this module for its parser; the commands import ``cli`` when they run (for
``resolve_model`` and, in the demo, ``main``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


def bench_command(args: argparse.Namespace) -> None:
    """Every method of ``--methods`` on every task's prompts; a table, and results files."""
    from vllm_retrieval_spec import cli
    from vllm_retrieval_spec.bench.results import format_table, write_results
    from vllm_retrieval_spec.bench.tasks import WARMUP_TEXT
    from vllm_retrieval_spec.bench.throughput import (
        BenchSettings, check_memory_for_interleaving, method_runs, run_benchmark)
    from vllm_retrieval_spec.datastore.format import load_datastore, make_output_dir

    datastores = datastore_entries(args.datastore or [])
    for directory in datastores.values():
        # A missing or unfinished datastore would fail its rows only once the engines before
        # them had started (minutes); its manifest and sizes are checked in milliseconds.
        load_datastore(directory, verify_checksums=False)
    if args.temperature == 0 and (args.top_p != 1.0 or args.top_k):
        raise SystemExit("error: --top-p and --top-k need --temperature above 0")
    if args.output_dir and not args.overwrite:
        check_new_run(Path(args.output_dir), args.run_name)
    settings = BenchSettings(max_tokens=args.max_tokens, num_speculative_tokens=args.k,
                             concurrency=args.concurrency, interleave=not args.sequential,
                             temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    try:
        runs = method_runs(args.methods.split(","), args.k, datastores,
                           method_options(args.method_options))
        # After the checks that need no model: fetching and converting one takes half a minute.
        model = cli.resolve_model(args.model)
        if not args.sequential:
            check_memory_for_interleaving(len(runs), model, settings)
        prompts = bench_prompts(model, args)
        check_prompt_lengths(prompts, settings.max_model_len)
    except ValueError as e:
        # Bad input or too little memory: say so before any engine starts, without a traceback.
        raise SystemExit(f"error: {e}") from None
    warmup_prompt = cli.load_tokenizer(model).encode(WARMUP_TEXT)
    if args.output_dir:
        # Its log goes there from the first engine on: a file in the way is named, not a
        # traceback, before any engine starts.
        make_output_dir(Path(args.output_dir), Path(args.output_dir))
    log = Path(args.output_dir or tempfile.gettempdir()) / f"{args.run_name}.log"
    with engine_output_to(None if args.verbose else log) as terminal:
        results = run_benchmark(model, runs, prompts, warmup_prompt, settings, args.run_name,
                                args.command_line, progress_file=terminal)
    print(format_table(results["rows"]))
    if args.output_dir:
        json_path, md_path, png_path = write_results(results, args.output_dir)
        print(f"results: {json_path} and {md_path}\nplot: {png_path}")
    if not args.verbose:
        print(f"vLLM's log: {log}")


def check_new_run(output_dir: Path, run_name: str) -> None:
    """Before any engine starts: a run's results replace an earlier run's of the same name
    only when asked to, as a datastore does (``--overwrite``)."""
    earlier = output_dir / f"{run_name}.json"
    if earlier.exists():
        raise SystemExit(f"error: {earlier} holds the results of an earlier run named "
                         f"{run_name!r}; pass --overwrite to replace them, or choose another "
                         "--run-name")


@contextlib.contextmanager
def engine_output_to(log: Path | None) -> Iterator[TextIO]:
    """With a ``log``, everything written to file descriptors 1 and 2 while the block runs
    (vLLM's log, which goes to stdout, its warnings, its engine and worker processes, which
    inherit the descriptors, C++ libraries) goes to that file instead of the terminal. Yields a
    stream on the terminal's stderr for what the user should see (a progress bar)."""
    if log is None:
        yield sys.stderr
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with open(log, "w") as file, os.fdopen(os.dup(saved[2]), "w") as terminal:
        for fd in saved:
            os.dup2(file.fileno(), fd)
        try:
            yield terminal
        except BaseException:
            terminal.write(f"failed; vLLM's log: {log}\n")
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)


#: Prompts per benchmark task when ``--prompts`` is not given.
TASK_PROMPTS = 20


def method_options(text: str | None) -> dict[str, dict] | None:
    """``--method-options``: a JSON object of one object per method (or row)."""
    if not text:
        return None
    try:
        options = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--method-options is not JSON ({e})") from None
    if not (isinstance(options, dict) and all(isinstance(v, dict) for v in options.values())):
        raise ValueError('--method-options must be a JSON object of objects, e.g. '
                         '{"rest": {"max_occurrences": 32}}')
    return options


def datastore_entry(entry: str) -> tuple[str, str]:
    """``[NAME=]DIR`` -> (NAME, DIR), NAME defaulting to the directory's name. A name holds no
    '/' (it names rows, ``rest:NAME``), so the first '=' ends it and a directory may hold '='."""
    name, sep, path = entry.partition("=")
    if sep and "/" not in name:
        return name or Path(path).name, path
    return Path(entry).name, entry


def datastore_entries(entries: list[str]) -> dict[str, str]:
    """Repeated ``--datastore [NAME=]DIR`` -> {NAME: DIR}. A name given twice (two directories
    of one name, say a/own and b/own) is refused: the dict would keep the last alone, and every
    row named for it would measure that one, silently."""
    pairs = [datastore_entry(entry) for entry in entries]
    names = [name for name, _ in pairs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise SystemExit(f"error: --datastore names {', '.join(repeated)} more than once; "
                         "give each datastore its own name, as NAME=DIR")
    return dict(pairs)


def bench_prompts(model: str, args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """Task name -> prompt token ids: the named tasks, then one task per prompts file (named
    after the file)."""
    from vllm_retrieval_spec import cli
    from vllm_retrieval_spec.bench.tasks import (
        TASKS, file_requests, render, task_prompts)

    tasks = args.tasks.split(",") if args.tasks else [] if args.prompts_file else ["code-gen"]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; choose from {list(TASKS)}, or give your "
                         "own prompts with --prompts-file")
    names = [Path(f).stem for f in args.prompts_file or []]
    if len(set(names) | set(tasks)) < len(names) + len(tasks):
        raise ValueError(f"a prompts file is a task named after its file, so file names must "
                         f"differ from each other and from the tasks: {names} and {tasks}")
    files = dict(zip(names, args.prompts_file or []))
    # Read every file before the tokenizer loads, so a bad line fails at once.
    requests = {name: file_requests(f, args.prompts, args.prompt_offset)
                for name, f in files.items()}
    check_prompt_counts({name: len(batch) for name, batch in requests.items()}, args.prompts,
                        args.prompt_offset)
    tokenizer = cli.load_tokenizer(model)
    per_task = TASK_PROMPTS if args.prompts is None else args.prompts
    prompts = {t: task_prompts(t, tokenizer, per_task, args.prompt_offset) for t in tasks}
    check_prompt_counts({t: len(prompts[t]) for t in tasks}, per_task, args.prompt_offset)
    prompts.update({name: [render(r, tokenizer) for r in batch]
                    for name, batch in requests.items()})
    return prompts


def check_prompt_counts(counts: dict[str, int], asked: int | None, offset: int) -> None:
    """Refuse a task left with no prompts from ``offset`` on; warn of one with fewer than
    ``asked`` (its rows then average fewer prompts than the others'). ``asked`` None (all of a
    prompts file) still refuses an empty task: its rows would divide by no time, after every
    engine had started."""
    for name, count in counts.items():
        message = f"task {name!r} has {count} prompts from offset {offset} on"
        if asked is not None and count < asked:
            message += f", fewer than the {asked} asked for"
        if not count:
            raise ValueError(message)
        if asked is not None and count < asked:
            print(f"warning: {message}; its rows use {count}", file=sys.stderr)


def check_prompt_lengths(prompts: dict[str, list[list[int]]], max_model_len: int) -> None:
    """Refuse a prompt that leaves no room for an output token in ``max_model_len``: vLLM
    refuses it when it is generated, after every engine has started, ending the whole run."""
    for task, task_prompts in prompts.items():
        for number, prompt in enumerate(task_prompts):
            if len(prompt) >= max_model_len:
                raise ValueError(f"task {task!r}: prompt {number} has {len(prompt)} tokens; the "
                                 f"engines serve {max_model_len} tokens, prompt and output")


def calibrate_command(args: argparse.Namespace) -> None:
    """What verifying draft tokens costs here, and the speculative_config options it implies."""
    from vllm_retrieval_spec import cli
    from vllm_retrieval_spec.bench.verify_cost import (
        calibrated_options, checked_calibration_text, measure)

    model = cli.resolve_model(args.model)
    # A model vLLM cannot load would end in its traceback; its tokenizer fails in one line.
    text = checked_calibration_text(model, args.contexts, args.lengths, args.max_tokens)
    if args.output:
        _check_output_file(Path(args.output), args.overwrite)
    log = Path(tempfile.gettempdir()) / "vllm-rsd-calibrate.log"
    with engine_output_to(None if args.verbose else log) as terminal:
        rows = measure(model, text, args.contexts, args.lengths, args.repeats,
                       args.max_tokens, terminal, args.dtype)
    options = calibrated_options(rows)
    for row in rows:
        print(f"context {row['context_tokens']:5d} tokens, draft {row['draft_len']:3d} tokens: "
              f"{row['ms_per_step_median']:7.1f} ms per step")
    print("speculative_config options measured for this machine:")
    print(json.dumps(options))
    if args.output:
        from vllm_retrieval_spec.atomic import atomic_path

        with atomic_path(args.output) as temporary:
            temporary.write_text(json.dumps({"options": options, "steps": rows}, indent=1)
                                 + "\n")
        print(f"wrote {args.output}")


def _check_output_file(output: Path, overwrite: bool) -> None:
    """Before the measurements: a path found unwritable only afterwards costs them all, and
    an earlier calibration is replaced only when asked to."""
    from vllm_retrieval_spec.datastore.format import make_output_dir

    if output.is_dir():
        raise SystemExit(f"error: {output} is a directory; give the path of the .json file "
                         "to write")
    if output.exists() and not overwrite:
        raise SystemExit(f"error: {output} exists; pass --overwrite to replace it, or give "
                         "another -o")
    make_output_dir(output.parent, output)


#: The demo's comparison: plain decoding, vLLM's two drafters, REST and hybrid on the stdlib
#: datastore (hybrid also learns from what it serves).
DEMO_METHODS = "plain,ngram,suffix,rest:stdlib,hybrid:stdlib"


def demo_command(args: argparse.Namespace) -> None:
    """Model, stdlib datastore (both cached), then plain vs ngram vs suffix vs REST vs hybrid."""
    from vllm_retrieval_spec import cli
    from vllm_retrieval_spec.assets import cache_dir

    start = time.perf_counter()
    model = cli.resolve_model(cli.DEFAULT_MODEL)
    datastore = cache_dir() / "datastores" / "stdlib"
    if not (datastore / "manifest.json").exists():
        cli.main(["build-datastore", "@stdlib", "-o", str(datastore), "--model", model])
    cli.main(["bench", "--model", model, "--methods", DEMO_METHODS,
              "--datastore", f"stdlib={datastore}", "--tasks", "code-gen",
              "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens),
              "--run-name", "demo", "--output-dir", str(args.output_dir or cache_dir() / "demo"),
              "--overwrite",  # the last demo's results, the demo's to replace
              *(["--verbose"] if args.verbose else [])])
    print(f"demo finished in {time.perf_counter() - start:.0f} s")
