"""Prompt sources for the dispatcher: a JSONL or Parquet file of prompts.

Generated prompts come from the rollout task registry, which the trainer never imports: the
`fleetrl trainer` command (in `fleetrl/`) wires it in. Both kinds are iterators of
`(task, prompt text, reference)` that restart identically, so resume can skip what was drawn.

JSONL: one object per line, `{"prompt": "...", "task": "reverse", "reference": ...}`; `task`
defaults to `dataset.task`. Parquet (needs `pyarrow`): the same columns.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

from fleetrl.trainer.dispatcher import PromptItem
from fleetrl.trainer.errors import DatasetError


def file_prompts(path: str | pathlib.Path, default_task: str, known_tasks: frozenset[str]) -> Iterator[PromptItem]:
    """Prompts of a `.jsonl` or `.parquet` file, in file order; errors name the file and row."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise DatasetError(f"prompt file {p} does not exist")
    rows = _parquet_rows(p) if p.suffix == ".parquet" else _jsonl_rows(p)
    for where, row in rows:
        yield _item(row, f"{p}:{where}", default_task, known_tasks)


def _jsonl_rows(p: pathlib.Path) -> Iterator[tuple[int, Any]]:
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{p}:{lineno}: not JSON: {exc.msg}") from exc


def _parquet_rows(p: pathlib.Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DatasetError(f"{p}: reading Parquet needs pyarrow (pip install pyarrow)") from exc
    table = pq.read_table(p)
    yield from enumerate(table.to_pylist(), start=1)


def _item(row: Any, where: str, default_task: str, known: frozenset[str]) -> PromptItem:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object with a 'prompt', got {type(row).__name__}")
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"{where}: field 'prompt' must be a non-empty string")
    task = row.get("task") or default_task
    if task not in known:
        raise DatasetError(f"{where}: unknown task {task!r}; known: {sorted(known)} (dataset.task/tasks)")
    return task, prompt, row.get("reference")
