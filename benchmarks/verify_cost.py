"""What a decoding step costs when it verifies a draft of d tokens, on this machine.

One engine whose proposer drafts ``d`` copies of token 0 (``<|endoftext|>``, which the model next
to never predicts mid-text) at every step, so nothing is accepted and every step emits one token:
the time per step is the cost of verifying d draft tokens. ``d`` is read from a file at every
step, so all lengths share one engine and are measured in turns (repeats interleave, which
spreads this machine's drifts over all lengths). The time per step includes the prompt's prefill
divided by ``--max-tokens``, the same for every d of one context length.

    python -m vllm_retrieval_spec.benchmarks.verify_cost --run-name verify-cost
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: The file the engine's proposer reads the draft length from (inherited by vLLM's processes).
LENGTH_FILE_ENV = "VLLM_RSD_VERIFY_COST_LENGTH_FILE"


class RejectedDraftProposer:
    """vLLM's ``custom_class`` contract: drafts the current length of token 0 for every row."""

    def __init__(self, vllm_config: Any) -> None:
        self.path = Path(os.environ[LENGTH_FILE_ENV])

    def load_model(self, model: Any) -> None:
        pass

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any,
                token_ids_cpu: Any, slot_mappings: Any = None) -> list[list[int]]:
        length = int(self.path.read_text())
        return [[0] * length if sampled else [] for sampled in sampled_token_ids]


def measure(model: str, contexts: list[int], lengths: list[int], repeats: int,
            max_tokens: int) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_retrieval_spec.benchmarks.tasks import task_prompts

    length_file = Path(tempfile.mkdtemp()) / "draft-length"
    length_file.write_text("0")
    os.environ[LENGTH_FILE_ENV] = str(length_file)
    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=2048, seed=0,
              speculative_config={"method": "custom_class",
                                  "model": f"{__name__}.RejectedDraftProposer",
                                  "num_speculative_tokens": max(lengths)})
    # News articles, concatenated: ordinary text, as long as needed.
    text = [t for p in task_prompts("summarize", AutoTokenizer.from_pretrained(model), 4)
            for t in p]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    times: dict[tuple[int, int], list[float]] = {}
    try:
        llm.generate([{"prompt_token_ids": text[:50]}], params, use_tqdm=False)  # warm-up
        for _ in range(repeats):
            for context in contexts:
                for length in lengths:
                    length_file.write_text(str(length))
                    start = time.perf_counter()
                    llm.generate([{"prompt_token_ids": text[:context]}], params, use_tqdm=False)
                    elapsed_ms = (time.perf_counter() - start) * 1e3 / max_tokens
                    times.setdefault((context, length), []).append(round(elapsed_ms, 1))
                    print(f"[verify-cost] context {context}, draft {length}: "
                          f"{elapsed_ms:.1f} ms/step", file=sys.stderr)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return [{"context_tokens": c, "draft_len": d, "ms_per_step_median": statistics.median(v),
             "ms_per_step": v} for (c, d), v in sorted(times.items())]


def main(argv: list[str] | None = None) -> None:
    from vllm_retrieval_spec.benchmarks.throughput import MODEL_NAME, _machine

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL_NAME)
    parser.add_argument("--contexts", default="50,700", help="prompt lengths in tokens")
    parser.add_argument("--lengths", default="0,1,2,3,4,5,6,7,8", help="draft lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32, help="steps per measurement")
    parser.add_argument("--run-name", default="verify-cost")
    parser.add_argument("--output-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    from vllm_retrieval_spec.cli import resolve_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = measure(resolve_model(args.model), [int(c) for c in args.contexts.split(",")],
                   [int(d) for d in args.lengths.split(",")], args.repeats, args.max_tokens)
    import vllm

    results = {"run": args.run_name, "date": datetime.date.today().isoformat(),
               "machine": _machine(), "model": MODEL_NAME, "vllm": vllm.__version__,
               "command": " ".join(["python -m vllm_retrieval_spec.benchmarks.verify_cost"]
                                   + (argv if argv is not None else sys.argv[1:])),
               "rows": rows}
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / f"{args.run_name}.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# {args.run_name}", "", f"{results['date']}, {results['machine']}, {MODEL_NAME}, "
             f"vLLM {results['vllm']}", "", f"`{results['command']}`", "",
             "| context tokens | draft tokens | ms per step (median) | runs |", "|---|---|---|---|"]
    lines += [f"| {r['context_tokens']} | {r['draft_len']} | {r['ms_per_step_median']} | "
              f"{r['ms_per_step']} |" for r in rows]
    (output / f"{args.run_name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
