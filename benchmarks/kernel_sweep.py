"""The launch choices of the Triton kernels, timed on a GPU: the measurements behind their
defaults (tree attention's rows per program and context splits, the projection's hidden splits).

Each row is one shape; ``us`` maps a choice to its median time (Triton's ``do_bench``), and
``default`` is what the kernel picks by itself. Needs CUDA, like ``kernel_timing``; ``--quick``
runs a few small shapes on CPU under ``TRITON_INTERPRET=1`` (the times then mean nothing).

    python -m benchmarks.kernel_sweep --run-name kernels-h200-sweep
"""

from __future__ import annotations

import sys

import torch

from benchmarks.kernel_timing import (
    ATTENTION_SHAPES,
    HIDDEN_SIZES,
    Timer,
    projection_statistics,
    retrieval_tree,
    run_command,
)

ROWS_PER_PROGRAM = (16, 32, 64, 128)
SPLITS = (1, 2, 4, 8, 16, 32)
CONTEXTS = (512, 2048, 32768)
NODES = (16, 64, 128)
PROJECTION_BATCHES = (1, 16, 256, 4096)


def attention_rows(device: torch.device, timer: Timer, shapes: tuple, contexts: tuple,
                   nodes_list: tuple, rows_per_program: tuple, splits_list: tuple) -> list[dict]:
    from vllm_retrieval_spec.kernels.tree_attention import _attend, tree_mask_triton

    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    for model, heads, kv_heads, head_dim in shapes:
        for context in contexts:
            k_ctx, v_ctx = (torch.randn(context, kv_heads, head_dim, generator=g,
                                        device=device).to(dtype) for _ in range(2))
            for nodes in nodes_list:
                parents = torch.tensor(retrieval_tree(nodes), device=device)
                mask = tree_mask_triton(parents)
                q, k_tree, v_tree = (torch.randn(nodes, h, head_dim, generator=g,
                                                 device=device).to(dtype)
                                     for h in (heads, kv_heads, kv_heads))
                args = (q, k_ctx, v_ctx, k_tree, v_tree, mask.view(torch.int8), head_dim ** -0.5)
                us = {"default": round(timer(lambda: _attend(*args, None)), 1)}
                for block_m in rows_per_program:
                    # A split shorter than 256 tokens (4 key tiles) is never worth timing.
                    for splits in (s for s in splits_list if s == 1 or s * 256 <= context):
                        us[f"rows{block_m}-splits{splits}"] = round(
                            timer(lambda: _attend(*args, splits, block_m)), 1)
                rows.append({"kernel": "tree_attention", "model": model,
                             "dtype": str(dtype).removeprefix("torch."), "context": context,
                             "nodes": nodes, "us": us})
                _progress(rows[-1])
    return rows


def projection_rows(device: torch.device, timer: Timer, hidden_sizes: tuple, batches: tuple,
                    splits_list: tuple) -> list[dict]:
    from vllm_retrieval_spec.kernels.projection import project_triton

    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for hidden in hidden_sizes:
        mean, inv_std, components = projection_statistics(hidden, g)
        for batch in batches:
            x = torch.randn(batch, hidden, generator=g, device=device).to(torch.bfloat16)
            args = (x, mean, inv_std, components)
            us = {"default": round(timer(lambda: project_triton(*args)), 1)}
            for splits in splits_list:
                us[f"splits{splits}"] = round(timer(lambda: project_triton(*args, splits=splits)),
                                              1)
            rows.append({"kernel": "projection", "dtype": "bfloat16", "hidden": hidden,
                         "batch": batch, "us": us})
            _progress(rows[-1])
    return rows


def _progress(row: dict) -> None:
    best = min(row["us"], key=row["us"].get)
    print(f"{row} best={best}", file=sys.stderr, flush=True)


def markdown(result: dict) -> str:
    lines = [f"# {result['run']}", "",
             f"{result['date']}, {result['machine']}, torch {result['torch']}, "
             f"triton {result['triton']}. Median microseconds per call; `default` is the "
             "kernel's own choice, **bold** the fastest.", "", f"`{result['command']}`", ""]
    for kernel, keys in (("tree_attention", ("model", "context", "nodes")),
                         ("projection", ("hidden", "batch"))):
        rows = [r for r in result["rows"] if r["kernel"] == kernel]
        if not rows:
            continue
        choices = list(dict.fromkeys(c for r in rows for c in r["us"]))
        lines += [f"## {kernel}", "", "| " + " | ".join((*keys, *choices)) + " |",
                  "|" + "---|" * (len(keys) + len(choices))]
        for r in rows:
            best = min(r["us"].values())
            cells = [str(r[k]) for k in keys] + [
                "" if c not in r["us"] else f"**{r['us'][c]}**" if r["us"][c] == best
                else str(r["us"][c]) for c in choices]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def measure(device: torch.device, timer: Timer, quick: bool) -> tuple[list[dict], dict]:
    if quick:
        return (attention_rows(device, timer, ATTENTION_SHAPES[:1], (300,), (8,), (16, 32),
                               (1, 2))
                + projection_rows(device, timer, (300,), (3,), (1, 2))), {}
    return (attention_rows(device, timer, ATTENTION_SHAPES, CONTEXTS, NODES, ROWS_PER_PROGRAM,
                           SPLITS)
            + projection_rows(device, timer, HIDDEN_SIZES, PROJECTION_BATCHES,
                              (1, 2, 4, 8, 16, 32))), {}


def main(argv: list[str] | None = None) -> int:
    return run_command("benchmarks.kernel_sweep",
                       __doc__.split("\n\n")[0], argv, measure, markdown)


if __name__ == "__main__":
    sys.exit(main())
