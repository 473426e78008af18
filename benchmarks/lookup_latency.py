"""Latency of one REST lookup (longest suffix match + continuations) on a large datastore.

Builds the datastore once if it is missing: installed Python sources (site-packages) tokenised
with the SmolLM2 tokenizer, or, without that tokenizer, a synthetic Zipf stream of repeated
phrases. Contexts come from held-out data (the standard library, or the same synthetic process
with another seed), so match lengths look like a real decoding step's. Prints p50/p99 (and what
was measured); with --output-dir also writes lookup-latency-<N>M.json and .md there.

    python -m benchmarks.lookup_latency --tokens 50000000 --output-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import itertools
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from vllm_retrieval_spec.assets import cache_dir
from vllm_retrieval_spec.bench.report import (
    markdown_table, module_command, results_document, write_report)
from vllm_retrieval_spec.cli import int_at_least
from vllm_retrieval_spec.datastore import (
    SuffixArrayDatastore,
    build_datastore_from_token_ids,
    tokenizer_fingerprint,
)
from vllm_retrieval_spec.datastore.corpus import CorpusStats, iter_documents

VOCAB = 49_152


def tokenizer_dir() -> Path:
    """The cached SmolLM2's folder (``vllm-rsd fetch-model`` makes it), whose tokenizer builds a
    Python datastore when it is there."""
    return cache_dir() / "models" / "SmolLM2-135M-Instruct"


def python_documents(tokenizer, num_tokens: int) -> Iterator[list[int]]:
    """Installed Python sources (site-packages, sorted), tokenised, cut at ``num_tokens``."""
    site = Path(np.__file__).parents[1]
    documents = iter_documents([site], tokenizer, CorpusStats())
    made = 0
    while made < num_tokens:
        batch = list(itertools.islice(documents, 256))
        if not batch:
            raise SystemExit(f"only {made:,} tokens of Python in {site}; ask for fewer")
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            ids = ids[: num_tokens - made - 1]
            made += len(ids) + 1
            yield ids
            if made >= num_tokens:
                return


def held_out_python(tokenizer, num_files: int = 400) -> list[np.ndarray]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    step = max(1, len(files) // num_files)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files[::step]]
    return [np.array(x, np.int32) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def synthetic_documents(rng: np.random.Generator, num_tokens: int, doc_len: int = 2000):
    """Zipf-distributed ids; most of the stream is drawn from a bank of recurring phrases."""
    bank_rng = np.random.default_rng(0)  # the same phrases for the store and the held-out part
    bank = np.minimum(bank_rng.zipf(1.2, size=200_000), VOCAB - 1).astype(np.int32)
    made = 0
    while made < num_tokens:
        # Phrases are the bank's 8-token windows; a few are very frequent (Zipf), most rare.
        starts = ((rng.zipf(1.1, size=doc_len // 8) - 1) % (len(bank) // 8 - 1)) * 8
        doc = bank[(starts[:, None] + np.arange(8)).ravel()]
        fresh = rng.random(len(doc)) < 0.15
        doc[fresh] = np.minimum(rng.zipf(1.2, size=int(fresh.sum())), VOCAB - 1)
        doc = doc[: num_tokens - made - 1]
        made += len(doc) + 1
        yield doc


def ensure_store(path: Path, num_tokens: int, synthetic: bool, kind: str) -> None:
    if (path / "manifest.json").exists():
        return
    if synthetic:
        documents = synthetic_documents(np.random.default_rng(1), num_tokens)
        name, fingerprint, vocab_size = "synthetic-zipf", "synthetic", VOCAB
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
        documents = python_documents(tokenizer, num_tokens)
        name, fingerprint = tokenizer_dir().name, tokenizer_fingerprint(tokenizer)
        vocab_size = len(tokenizer)
    build_datastore_from_token_ids(
        documents,
        path,
        tokenizer_name=name,
        tokenizer_fingerprint=fingerprint,
        vocab_size=vocab_size,
        sources=[kind],
    )


def sample_contexts(
    documents: list[np.ndarray], rng: np.random.Generator, count: int, length: int
) -> list[np.ndarray]:
    documents = [d for d in documents if len(d) > length]
    contexts = []
    for _ in range(count):
        doc = documents[rng.integers(len(documents))]
        end = int(rng.integers(length, len(doc) + 1))
        contexts.append(doc[end - length : end])
    return contexts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int_at_least(1), default=50_000_000)
    parser.add_argument("--datastore", type=Path, help="default: a cache dir named by size")
    parser.add_argument("--synthetic", action="store_true", help="even if the tokenizer exists")
    parser.add_argument("--lookups", type=int_at_least(1), default=10_000)
    parser.add_argument("--max-occurrences", type=int_at_least(1), default=64)
    parser.add_argument("--continuation-len", type=int_at_least(1), default=10)
    parser.add_argument("--output-dir", type=Path, help="write the result there as JSON + md")
    args = parser.parse_args(argv)

    synthetic = args.synthetic or not (tokenizer_dir() / "tokenizer.json").exists()
    kind = "synthetic" if synthetic else "python"
    path = args.datastore or cache_dir() / "datastores" / \
        f"bench-{kind}-{args.tokens // 1_000_000}M"
    ensure_store(path, args.tokens, synthetic, kind)
    index = SuffixArrayDatastore.from_path(path)

    rng = np.random.default_rng(2)
    if synthetic:
        held_out = list(synthetic_documents(np.random.default_rng(3), 2_000_000))
    else:
        from transformers import AutoTokenizer

        held_out = held_out_python(AutoTokenizer.from_pretrained(tokenizer_dir()))
    warmup = sample_contexts(held_out, rng, 1_000, 64)
    contexts = sample_contexts(held_out, rng, args.lookups, 64)

    # Map every page of the store into the process, as a serving process that has run for a
    # while has; otherwise the first lookups measure page faults, not the search.
    np.asarray(index.datastore.tokens)[::1024].sum()
    np.asarray(index.datastore.suffix_array)[::1024].sum()
    options = dict(max_occurrences=args.max_occurrences, continuation_len=args.continuation_len)
    for context in warmup:
        index.lookup(context, **options)

    times = np.empty(len(contexts), dtype=np.int64)
    match_lens = np.empty(len(contexts), dtype=np.int64)
    rows = np.empty(len(contexts), dtype=np.int64)
    for i, context in enumerate(contexts):
        start = time.perf_counter_ns()
        cands, _, n = index.lookup(context, **options)
        times[i] = time.perf_counter_ns() - start
        match_lens[i] = n
        rows[i] = len(cands)

    us = times / 1e3
    print(
        f"{kind} datastore {path}: {index.datastore.manifest.num_tokens:,} tokens; "
        f"{len(contexts):,} lookups (max_occurrences={args.max_occurrences}, "
        f"continuation_len={args.continuation_len}); mean match {match_lens.mean():.2f} tokens, "
        f"mean {rows.mean():.1f} continuations"
    )
    p50, p99 = np.percentile(us, [50, 99])
    print(f"lookup latency: p50 {p50:.1f} us, p99 {p99:.1f} us, max {us.max():.1f} us")
    if args.output_dir:
        # No rows: the one measurement is the header's.
        results = results_document(
            f"lookup-latency-{args.tokens // 1_000_000}M",
            module_command("benchmarks.lookup_latency", argv), [],
            datastore=kind, datastore_tokens=int(index.datastore.manifest.num_tokens),
            lookups=len(contexts), max_occurrences=args.max_occurrences,
            continuation_len=args.continuation_len,
            mean_match_len=round(float(match_lens.mean()), 2),
            mean_continuations=round(float(rows.mean()), 1),
            lookup_us_p50=round(float(p50), 1), lookup_us_p99=round(float(p99), 1),
            lookup_us_max=round(float(us.max()), 1))
        measured = {k: v for k, v in results.items()
                    if k not in ("run", "date", "machine", "command", "rows")}
        for path in write_report(results, args.output_dir,
                                 markdown_table([(k, k) for k in measured], [measured])):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
