"""GPU timings of the Triton kernels against torch and against their memory-traffic floor.

Both kernels run where bytes, not arithmetic, bound them: DReSD's query projection reads a few
hidden states and the PCA matrix, and tree attention reads the whole context's keys and values
for a few tens of draft nodes. So each row gives the kernel's time beside the time it would
take to move its bytes (inputs read once, output written once) at this GPU's measured copy rate
(one large device-to-device copy, bytes read plus written), and beside torch doing the same:

- projection: ``project_reference`` (z-norm, matmul, L2 norm as separate torch kernels);
- tree attention, per layer (``tree_attention_masked_triton``, the mask built once per step):
  ``scaled_dot_product_attention`` with the ancestor mask as a boolean ``attn_mask`` over
  ``[context, tree]`` keys laid out ahead of time (the concatenation and the mask are not timed,
  a generous baseline), and ``tree_attention_reference``; ``triton_with_mask_us`` is the call
  that also builds the mask from the parents (``tree_attention_triton``);
- tree mask: the mask kernel against the reference's parent walk.

Every Triton output is checked against its torch reference (``max_abs_err``). GPU times are
Triton's ``do_bench`` medians, which clear the L2 cache before each call, so small inputs are
read from DRAM as the floor assumes. Needs CUDA; the lent GPU machines have torch and Triton
but no vLLM, and nothing here imports vLLM.

    python -m benchmarks.kernel_timing --run-name kernels-h200

``--quick`` runs a few small shapes, on CPU under ``TRITON_INTERPRET=1`` too (its times then
mean nothing: tests/test_kernel_timing.py checks the rows, not the speed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

# (name, query heads, kv heads, head dim): our test model and a 7-8B model's attention.
ATTENTION_SHAPES = (("SmolLM2-135M", 9, 3, 64), ("Llama-3-8B", 32, 8, 128))
CONTEXTS = (512, 4096, 32768)
# SmolLM2-135M's hidden size and a 7-8B model's; DReSD projects to 64 dims.
HIDDEN_SIZES = (576, 4096)
PROJECTION_DIMS = 64
# 1: a decoding step; 16-256: a batch of requests; 65536: a datastore build's chunk.
PROJECTION_BATCHES = (1, 16, 256, 4096, 65536)


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def retrieval_tree(n: int, roots: int = 4, branch_every: int = 5) -> list[int]:
    """The shape REST's trie gives: a few first tokens, each continued by a chain that forks
    every ``branch_every`` nodes into a sibling of an earlier node."""
    return [-1 if i < roots else i - roots if i % branch_every == 0 else i - 1 for i in range(n)]


def depth(parents: list[int]) -> int:
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return max(depths, default=0)


TREES = (("chain-16", chain(16)), ("chain-64", chain(64)), ("tree-64", retrieval_tree(64)),
         ("tree-128", retrieval_tree(128, roots=8)))


def projection_bytes(batch: int, hidden: int, dims: int, dtype: torch.dtype) -> int:
    """Hidden states in their dtype; float32 mean, inv_std and components; float32 output."""
    return batch * hidden * dtype.itemsize + (2 * hidden + hidden * dims + batch * dims) * 4


def tree_attention_bytes(context: int, nodes: int, heads: int, kv_heads: int, head_dim: int,
                         dtype: torch.dtype) -> int:
    """q and output per (node, head); k and v per (context token or node, kv head); the int8
    ancestor mask."""
    values = 2 * nodes * heads * head_dim + 2 * (context + nodes) * kv_heads * head_dim
    return values * dtype.itemsize + nodes * nodes


@dataclass(frozen=True)
class Timer:
    """Median microseconds of a call: Triton's ``do_bench`` on CUDA (L2 cleared before each
    call), wall-clock repeats elsewhere."""

    cuda: bool
    repeats: int = 5

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3
        fn()
        times = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6


def copy_rate_gbps(device: torch.device, timer: Timer, size_mib: int) -> float:
    """Bytes read plus written per second by one device-to-device copy, in GB/s."""
    src = torch.empty(size_mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src))
    return 2 * src.numel() / us / 1e3


def _floor_fields(nbytes: int, kernel_us: float, rate_gbps: float) -> dict:
    floor_us = nbytes / rate_gbps / 1e3
    return {"bytes": nbytes, "floor_us": round(floor_us, 3),
            "achieved_gbps": round(nbytes / kernel_us / 1e3, 1),
            "floor_fraction": round(floor_us / kernel_us, 3)}


def projection_statistics(hidden: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random float32 mean, inverse std and unit-column PCA components on ``g``'s device."""
    mean = torch.randn(hidden, generator=g, device=g.device)
    inv_std = torch.rand(hidden, generator=g, device=g.device) + 0.5
    components = torch.randn(hidden, PROJECTION_DIMS, generator=g, device=g.device)
    return mean, inv_std, components / components.norm(dim=0, keepdim=True)


def projection_rows(device: torch.device, timer: Timer, rate_gbps: float,
                    hidden_sizes: tuple[int, ...], batches: tuple[int, ...],
                    dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    from vllm_retrieval_spec.kernels.projection import project_reference, project_triton

    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for hidden in hidden_sizes:
        mean, inv_std, components = projection_statistics(hidden, g)
        for dtype in dtypes:
            for batch in batches:
                x = torch.randn(batch, hidden, generator=g, device=device).to(dtype)
                err = (project_triton(x, mean, inv_std, components)
                       - project_reference(x, mean, inv_std, components)).abs().max()
                triton_us = timer(lambda: project_triton(x, mean, inv_std, components))
                torch_us = timer(lambda: project_reference(x, mean, inv_std, components))
                rows.append({
                    "kernel": "projection", "dtype": str(dtype).removeprefix("torch."),
                    "batch": batch, "hidden": hidden, "dims": PROJECTION_DIMS,
                    "triton_us": round(triton_us, 2), "torch_us": round(torch_us, 2),
                    "speedup_vs_torch": round(torch_us / triton_us, 2),
                    **_floor_fields(projection_bytes(batch, hidden, PROJECTION_DIMS, dtype),
                                    triton_us, rate_gbps),
                    "max_abs_err": float(err),
                })
                _progress(rows[-1])
    return rows


def tree_attention_rows(device: torch.device, timer: Timer, rate_gbps: float,
                        shapes: tuple, contexts: tuple[int, ...], trees: tuple,
                        dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    from torch.nn.functional import scaled_dot_product_attention

    from vllm_retrieval_spec.kernels.tree_attention import (
        tree_ancestor_mask,
        tree_attention_masked_triton,
        tree_attention_reference,
        tree_attention_triton,
        tree_mask_triton,
    )

    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for model, heads, kv_heads, head_dim in shapes:
        scale = head_dim ** -0.5
        for dtype in dtypes:
            for context in contexts:
                k_ctx, v_ctx = (torch.randn(context, kv_heads, head_dim, generator=g,
                                            device=device).to(dtype) for _ in range(2))
                for tree_name, parent_list in trees:
                    nodes = len(parent_list)
                    parents = torch.tensor(parent_list, device=device)
                    q, k_tree, v_tree = (torch.randn(nodes, h, head_dim, generator=g,
                                                     device=device).to(dtype)
                                         for h in (heads, kv_heads, kv_heads))
                    args = (q, k_ctx, v_ctx, k_tree, v_tree, parents, scale)
                    masked_args = (q, k_ctx, v_ctx, k_tree, v_tree, tree_mask_triton(parents),
                                   scale)
                    reference = tree_attention_reference(*args).float()
                    err = max((tree_attention_triton(*args).float() - reference).abs().max(),
                              (tree_attention_masked_triton(*masked_args).float()
                               - reference).abs().max())
                    # SDPA's layout: [1, heads, tokens, head_dim], keys [context, tree].
                    sdpa_q = q.transpose(0, 1).unsqueeze(0)
                    sdpa_k, sdpa_v = (torch.cat([c, t]).transpose(0, 1).unsqueeze(0)
                                      for c, t in ((k_ctx, k_tree), (v_ctx, v_tree)))
                    visible = torch.cat([torch.ones(nodes, context, dtype=torch.bool,
                                                    device=device),
                                         tree_ancestor_mask(parents)], dim=1)
                    triton_us = timer(lambda: tree_attention_masked_triton(*masked_args))
                    with_mask_us = timer(lambda: tree_attention_triton(*args))
                    sdpa_us = timer(lambda: scaled_dot_product_attention(
                        sdpa_q, sdpa_k, sdpa_v, attn_mask=visible, scale=scale,
                        enable_gqa=True))
                    reference_us = timer(lambda: tree_attention_reference(*args))
                    rows.append({
                        "kernel": "tree_attention", "dtype": str(dtype).removeprefix("torch."),
                        "model": model, "heads": heads, "kv_heads": kv_heads,
                        "head_dim": head_dim, "context": context, "tree": tree_name,
                        "nodes": nodes, "depth": depth(parent_list),
                        "triton_us": round(triton_us, 2),
                        "triton_with_mask_us": round(with_mask_us, 2),
                        "sdpa_us": round(sdpa_us, 2),
                        "reference_us": round(reference_us, 2),
                        "speedup_vs_sdpa": round(sdpa_us / triton_us, 2),
                        **_floor_fields(tree_attention_bytes(context, nodes, heads, kv_heads,
                                                             head_dim, dtype),
                                        triton_us, rate_gbps),
                        "max_abs_err": float(err),
                    })
                    _progress(rows[-1])
    return rows


def tree_mask_rows(device: torch.device, timer: Timer, trees: tuple) -> list[dict]:
    from vllm_retrieval_spec.kernels.tree_attention import tree_ancestor_mask, tree_mask_triton

    rows = []
    for tree_name, parent_list in trees:
        parents = torch.tensor(parent_list, device=device)
        equal = bool(torch.equal(tree_mask_triton(parents), tree_ancestor_mask(parents)))
        rows.append({"kernel": "tree_mask", "tree": tree_name, "nodes": len(parent_list),
                     "depth": depth(parent_list),
                     "triton_us": round(timer(lambda: tree_mask_triton(parents)), 2),
                     "torch_us": round(timer(lambda: tree_ancestor_mask(parents)), 2),
                     "equal_reference": equal})
        _progress(rows[-1])
    return rows


def _progress(row: dict) -> None:
    print(" ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr, flush=True)


def markdown(result: dict) -> str:
    lines = [f"# {result['run']}", "",
             f"{result['date']}, {result['machine']}, torch {result['torch']}, "
             f"triton {result['triton']}. Device-to-device copy: "
             f"{result['copy_gbps']:.0f} GB/s (read + written); floor = bytes / that rate.",
             "", f"`{result['command']}`", ""]
    tables = (
        ("projection", "Projection (z-norm, PCA to 64 dims, L2)",
         ("dtype", "hidden", "batch", "triton_us", "torch_us", "speedup_vs_torch", "floor_us",
          "floor_fraction", "achieved_gbps", "max_abs_err")),
        ("tree_attention", "Tree attention (context + ancestor-masked tree)",
         ("model", "dtype", "context", "tree", "triton_us", "triton_with_mask_us", "sdpa_us",
          "reference_us",
          "speedup_vs_sdpa", "floor_us", "floor_fraction", "achieved_gbps", "max_abs_err")),
        ("tree_mask", "Tree mask", ("tree", "nodes", "depth", "triton_us", "torch_us",
                                    "equal_reference")),
    )
    for kernel, title, columns in tables:
        rows = [r for r in result["rows"] if r["kernel"] == kernel]
        if not rows:
            continue
        lines += [f"## {title}", "", "| " + " | ".join(columns) + " |",
                  "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(r[c]) for c in columns) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float) and value and abs(value) < 1e-2:
        return f"{value:.1e}"
    return str(value)


def run_command(module: str, description: str, argv: list[str] | None,
                measure: Callable[[torch.device, Timer, bool], tuple[list[dict], dict]],
                to_markdown: Callable[[dict], str]) -> int:
    """The command line of the kernel benchmarks: ``measure(device, timer, quick)`` gives the
    rows and any fields of the result beside them; ``<run-name>.json`` and ``.md`` are
    written."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--run-name", required=True)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true",
                        help="a few small shapes (runs on CPU under TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        parser.error("needs a CUDA GPU (Triton compiles for it); --quick also runs on CPU under "
                     "TRITON_INTERPRET=1")
    import triton

    rows, fields = measure(torch.device("cuda" if cuda else "cpu"), Timer(cuda), args.quick)
    result = {
        "run": args.run_name,
        "date": datetime.date.today().isoformat(),
        "machine": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__,
        "command": " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)]),
        **fields,
        "rows": rows,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.run_name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{args.run_name}.md").write_text(to_markdown(result))
    print(f"wrote {out / args.run_name}.json and .md", file=sys.stderr)
    return 0


def measure(device: torch.device, timer: Timer, quick: bool) -> tuple[list[dict], dict]:
    if quick:
        shapes, contexts = ATTENTION_SHAPES[:1], (48,)
        trees = (("chain-8", chain(8)), ("tree-20", retrieval_tree(20)))
        hidden_sizes, batches = (HIDDEN_SIZES[0],), (1, 17)
    else:
        shapes, contexts, trees = ATTENTION_SHAPES, CONTEXTS, TREES
        hidden_sizes, batches = HIDDEN_SIZES, PROJECTION_BATCHES
    cuda = device.type == "cuda"
    rate = copy_rate_gbps(device, timer, 16 if quick else 1024)
    print(f"copy rate {rate:.0f} GB/s", file=sys.stderr)
    rows = (projection_rows(device, timer, rate, hidden_sizes, batches,
                            (torch.bfloat16, torch.float32))
            + tree_attention_rows(device, timer, rate, shapes, contexts, trees,
                                  (torch.bfloat16,) if cuda else (torch.float32,))
            + tree_mask_rows(device, timer, trees))
    if cuda and not quick:
        # One float32 case: the dtype vLLM-CPU runs, and the kernel's ieee-dot path.
        rows += tree_attention_rows(device, timer, rate, ATTENTION_SHAPES[:1], (4096,),
                                    TREES[2:3], (torch.float32,))
    return rows, {"copy_gbps": round(rate, 1)}


def main(argv: list[str] | None = None) -> int:
    return run_command("benchmarks.kernel_timing",
                       __doc__.split("\n\n")[0], argv, measure, markdown)


if __name__ == "__main__":
    sys.exit(main())
