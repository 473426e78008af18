"""The results every benchmark writes (``docs/results-schema.md``): a JSON document ``<run>.json``
and a markdown page ``<run>.md`` beside it, saying where, when and how it was made.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

from vllm_retrieval_spec.atomic import atomic_path


def machine() -> str:
    """``cpu-2core``, or the GPU's name."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu-{os.cpu_count()}core"


def results_document(run: str, command: str, rows: list[dict[str, Any]],
                     **fields: Any) -> dict[str, Any]:
    """The schema's header (run, date, machine, then ``fields`` such as model and vllm, command)
    and its rows."""
    return {"run": run, "date": datetime.date.today().isoformat(), "machine": machine(),
            **fields, "command": command, "rows": rows}


def module_command(module: str, argv: list[str] | None) -> str:
    """How ``python -m module`` was invoked (``argv`` None: this process's arguments)."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def markdown_table(columns: list[tuple[str, str]], rows: list[dict[str, Any]]) -> list[str]:
    """Lines of a markdown table: ``columns`` are (heading, row key); None shows as empty."""
    lines = ["| " + " | ".join(heading for heading, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if row.get(key) is None else _cell(row[key])
                                for _, key in columns) + " |" for row in rows]
    return lines


def _cell(value: Any) -> str:
    # A newline would end the row mid-cell and a '|' add a column (a failed row's error, say
    # pydantic's multi-line ValidationError from vLLM's config), breaking the rest of the table.
    return str(value).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def write_report(results: dict[str, Any], output_dir: str | Path,
                 body: list[str]) -> tuple[Path, Path]:
    """``<run>.json`` and ``<run>.md`` (a heading, where and how it ran, then ``body``)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / f"{results['run']}.json"
    md_path = output_dir / f"{results['run']}.md"
    write_whole(json_path, json.dumps(results, indent=1) + "\n")
    where = [results["date"], results["machine"]]
    where += [results["model"]] if "model" in results else []
    where += [f"vLLM {results['vllm']}"] if "vllm" in results else []
    where.append(f"Python {platform.python_version()}")
    write_whole(md_path, "\n".join([f"# {results['run']}", "", ", ".join(where), "",
                                    f"`{results['command']}`", "", *body]) + "\n")
    return json_path, md_path


def write_whole(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or is left as it was (an interrupted run truncates no
    result)."""
    with atomic_path(path) as temporary:
        temporary.write_text(text)
