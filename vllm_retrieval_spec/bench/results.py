"""A throughput run's rows (one per method and task, compared with plain), its tables and its
plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_retrieval_spec.atomic import atomic_path
from vllm_retrieval_spec.bench.report import markdown_table, write_report, write_whole

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from vllm_retrieval_spec.bench.throughput import BenchSettings, MethodRun


def compared_with_plain(results: list[dict[str, tuple[dict[str, Any], list[list[int]]]]]
                        ) -> list[dict[str, Any]]:
    """Every run's rows (task -> (row, outputs), plain's first, as ``method_runs`` orders them)
    with ``speedup`` and ``outputs_equal_plain`` against plain's row of the same task (None
    where sampled: samples are not plain's outputs)."""
    rows = []
    for by_task in results:
        for task, (row, outputs) in by_task.items():
            if "error" in row:
                rows.append(row)
                continue
            plain_row, plain_outputs = results[0][task]
            row = {**row, "speedup": round(row["tokens_per_s"] / plain_row["tokens_per_s"], 3),
                   "outputs_equal_plain": outputs == plain_outputs
                   if row["temperature"] == 0 else None}
            for half in HALVES:
                if half in row:
                    row[half] = {**row[half], "speedup": round(
                        row[half]["tokens_per_s"] / plain_row[half]["tokens_per_s"], 3)}
            rows.append(row)
    return rows


#: Row fields for the first and the second half of a task's prompts: a method that learns from
#: what it serves should be faster in the second.
HALVES = ("first_half", "second_half")


def halves(batches: list[tuple[int, int, float, int]]) -> dict[str, dict[str, float]]:
    """Prompts, tokens/s and tokens per forward of the batches that start in the first half of
    the prompts, and of the rest ((prompts, output tokens, seconds, forwards) per batch)."""
    total = sum(b[0] for b in batches)
    parts: dict[str, list[tuple[int, int, float, int]]] = {half: [] for half in HALVES}
    start = 0
    for batch in batches:
        parts[HALVES[0] if start < total / 2 else HALVES[1]].append(batch)
        start += batch[0]
    return {half: {"prompts": sum(b[0] for b in part),
                   "tokens_per_s": round(sum(b[1] for b in part) / sum(b[2] for b in part), 3),
                   "tokens_per_forward": round(sum(b[1] for b in part)
                                               / sum(b[3] for b in part), 3)}
            for half, part in parts.items() if part}


def failed_row(run: MethodRun, task: str, error: str) -> dict[str, Any]:
    """The row of a method whose engine failed before it finished ``task``: why, no numbers."""
    return {"task": task, "method": _row_method(run), "datastore": run.datastore,
            "error": error}


def _row_method(run: MethodRun) -> str:
    return run.method + (f"/{run.variant}" if run.variant else "") \
        + (f"@{run.name}" if run.name else "")


def task_row(run: MethodRun, num_speculative_tokens: int | None, task: str,
             settings: BenchSettings, outputs: list[list[int]],
             batches: list[tuple[int, int, float, int]], accepted: float, drafts: float,
             drafted: int, drafting: dict[str, Any]) -> dict[str, Any]:
    """One method's row on one task: its outputs, its batches ((prompts, output tokens, seconds,
    forwards) each), its acceptance counts and the drafting stats its worker kept."""
    output_tokens = sum(map(len, outputs))
    elapsed = sum(b[2] for b in batches)
    forwards = sum(b[3] for b in batches)
    config = dict(run.speculative_config or {})
    config.pop("method", None)
    if num_speculative_tokens is not None:
        config["num_speculative_tokens"] = num_speculative_tokens
    config["dtype"] = settings.dtype
    row = {
        "task": task,
        "method": _row_method(run),
        "config": config,
        "datastore": run.datastore,
        "prompts": len(outputs),
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
        **({"top_p": settings.top_p, "top_k": settings.top_k} if settings.temperature else {}),
        "concurrency": settings.concurrency,
        "output_tokens": output_tokens,
        "tokens_per_s": round(output_tokens / elapsed, 3),
        "tokens_per_forward": round(output_tokens / forwards, 3),
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        # Draft tokens verified per target forward: what the step time pays for.
        "draft_tokens_per_forward": round(drafted / forwards, 3) if drafted else None,
        "draft_ms_p50": _round(drafting["p50_ms"]),
        "draft_ms_p99": _round(drafting["p99_ms"]),
        # The part of drafting the engine waits for (``metrics.DraftingTimer``).
        "draft_critical_ms_p50": _round(drafting["critical_p50_ms"]),
        "draft_critical_ms_p99": _round(drafting["critical_p99_ms"]),
        # Wall time per target forward (per step at concurrency 1), drafting included.
        "step_ms": round(1e3 * elapsed / forwards, 3),
        "elapsed_s": round(elapsed, 2),
        # Draft nodes verified per request per step where trees are on; null for chains.
        "tree_nodes_mean": _round(drafting.get("tree_nodes_mean")),
        **halves(batches),
    }
    if "served_store_tokens" in drafting:
        # What the method has learnt from served requests by the end of the task.
        row["served_store_tokens"] = drafting["served_store_tokens"]
    precomputed = drafting.get("precomputed_used", 0) + drafting.get("precomputed_missed", 0)
    if precomputed:
        # Share of the requests' drafting steps served by drafts made before sampling.
        row["precomputed_share"] = round(drafting.get("precomputed_used", 0) / precomputed, 3)
    if drafting.get("padded_drafts"):
        # Share of the steps whose draft was padded to a cheaper length (pad_drafts), and the
        # step times by draft length that decided it, as the engine learned them.
        row["padded_share"] = round(drafting["padded_drafts"] / forwards, 3)
        row["step_ms_by_draft_len"] = {
            int(key.rsplit("_", 1)[1]): value for key, value in drafting.items()
            if key.startswith("step_ms_draft_")}
    if drafting.get("tree_nodes_mean") is not None:
        # Share of the requests' steps that verified a tree (the others a chain: the tree's
        # branches did not pay for what a tree step costs beyond its nodes, as learned).
        row["tree_step_share"] = round(drafting.get("tree_steps", 0) / forwards, 3)
        if "step_ms_tree_extra" in drafting:
            row["tree_extra_ms"] = drafting["step_ms_tree_extra"]
    if drafting.get("search_ns"):
        # DReSD: share of the ANN search time that drafting did not wait for (thread pool).
        row["search_hidden"] = round(1 - drafting["search_wait_ns"] / drafting["search_ns"], 3)
    return row


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


COLUMNS = ("task", "method", "datastore", "tokens_per_s", "speedup", "tokens_per_forward",
           "mean_acceptance_length", "draft_tokens_per_forward", "draft_ms_p50", "draft_ms_p99",
           "draft_critical_ms_p50", "draft_critical_ms_p99", "step_ms", "outputs_equal_plain")


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the rows' headline columns, task by task (methods in run order)."""
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    ordered = sorted(rows, key=lambda row: tasks.index(row["task"]))
    # Why a method's engine failed, where one did (its other cells are empty).
    columns = COLUMNS + (("error",) if any("error" in row for row in rows) else ())
    return "\n".join(markdown_table([(c, c) for c in columns], ordered))


def format_halves_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of speedup and tokens per forward in each half of the prompts: learning
    from served requests shows as a second half faster than the first."""
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    ordered = [{**row, **{f"{half}_{name}": row.get(half, {}).get(name)
                          for half in HALVES for name in ("speedup", "tokens_per_forward")}}
               for row in sorted(rows, key=lambda row: tasks.index(row["task"]))
               if row["method"] != "plain"]
    columns = [("task", "task"), ("method", "method"), ("datastore", "datastore"),
               ("speedup, 1st half", "first_half_speedup"),
               ("speedup, 2nd half", "second_half_speedup"),
               ("tokens/forward, 1st half", "first_half_tokens_per_forward"),
               ("tokens/forward, 2nd half", "second_half_tokens_per_forward"),
               ("served store tokens", "served_store_tokens")]
    return "\n".join(markdown_table(columns, ordered))


def write_results(results: dict[str, Any], output_dir: str | Path) -> tuple[Path, Path, Path]:
    """``<run>.json``, ``<run>.md``, the plot ``<run>.png`` and the plain outputs for replay,
    ``<run>.plain.jsonl``. Returns the paths of the first three."""
    results = dict(results)
    plain_outputs = results.pop("plain_outputs")
    png_path = Path(output_dir) / f"{results['run']}.png"
    json_path, md_path = write_report(results, output_dir, [
        f"![speedup and tokens per forward]({png_path.name})", "", format_table(results["rows"]),
        "", "By half of the prompts (learning from served requests shows in the second):", "",
        format_halves_table(results["rows"])])
    write_whole(Path(output_dir) / f"{results['run']}.plain.jsonl",
                "".join(json.dumps(record) + "\n" for record in plain_outputs))
    with atomic_path(png_path) as temporary:
        write_plot(results, temporary)
    return json_path, md_path, png_path


def write_plot(results: dict[str, Any], path: Path) -> Figure:
    """Speedup over plain and tokens per target forward, per method (bars) and task (groups).
    Plain decoding is the dashed line at 1; hatched bars did not equal plain's greedy output.
    Returns the figure written (closed), whose two axes hold the bars."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["method"] != "plain"]
    tasks = list(dict.fromkeys(r["task"] for r in results["rows"]))
    labels = list(dict.fromkeys(_label(r) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(9.0, 2.4 * len(tasks)), 4.6),
                             layout="constrained")
    width = 0.8 / max(len(labels), 1)
    for ax, metric, name in ((axes[0], "speedup", "speedup over plain (tokens/s)"),
                             (axes[1], "tokens_per_forward", "tokens per target forward")):
        for j, label in enumerate(labels):
            by_task = {r["task"]: r for r in rows if _label(r) == label}
            for i, task in enumerate(tasks):
                row = by_task.get(task)
                if row is None or row.get(metric) is None:
                    continue
                ax.bar(i + (j - (len(labels) - 1) / 2) * width, row[metric], width,
                       color=f"C{j}",
                       hatch="//" if row.get("outputs_equal_plain") is False else None)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(tasks)), tasks)
        ax.set_ylabel(name)
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{j}") for j in range(len(labels))]
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 7),
               frameon=False)
    fig.suptitle(f"{results['run']}: {results['model']}, {results['machine']}, "
                 f"vLLM {results['vllm']} (dashed: plain decoding)", fontsize=10)
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
    return fig


def _label(row: dict[str, Any]) -> str:
    # A row's method carries its variant and name (``rest/tree``, ``hybrid@b``); the datastore
    # goes before them, as in ``MethodRun.label`` (``rest:stdlib/tree``).
    method = row["method"]
    base = len(method.split("/")[0].split("@")[0])
    return method_label(method[:base], row.get("datastore")) + method[base:]


def method_label(method: str, datastore: str | None) -> str:
    """``rest:stdlib``: a method on a named datastore, as ``--methods`` spells it."""
    return f"{method}:{datastore}" if datastore else method
