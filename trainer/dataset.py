"""Prompt sources for the dispatcher: a dataset read with the `datasets` library (DESIGN.md §11).

Generated prompts come from the rollout task registry, which the trainer never imports: the
`fleetrl trainer` command (in `fleetrl/`) wires it in. Both kinds are iterators of `PromptItem`
that restart identically (same seed, same order), so resume can skip what was drawn.

`dataset.path` is a JSONL or Parquet file, or a folder written by `datasets.save_to_disk`; only
local files are read. TRL's dataset formats work with no mapping: a `prompt` column of text, or of
messages (`[{role, content}]`, the conversational form). `dataset.columns` maps other layouts (a
`messages` column, a question/answer pair). A chat row travels as `messages` and the worker renders
it with its tokenizer's chat template; every column that is not the prompt or the task travels as
`columns` for reward functions (TRL hands them to `reward_funcs` as keyword arguments).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

from fleetrl.config import DatasetConfig
from fleetrl.trainer.dispatcher import PromptItem
from fleetrl.trainer.errors import DatasetError

Messages = list[dict[str, Any]]


def load_rows(d: DatasetConfig) -> Any:
    """The `datasets.Dataset` of `dataset.path` (a JSONL/JSON or Parquet file, or a save_to_disk folder)."""
    if d.path is None:
        raise DatasetError("dataset.path is not set")
    p = pathlib.Path(d.path)
    if not p.exists():
        raise DatasetError(f"dataset.path {p} does not exist")
    import datasets

    datasets.disable_progress_bars()
    try:
        if p.is_dir():
            loaded = datasets.load_from_disk(str(p))
            if isinstance(loaded, datasets.DatasetDict):
                if d.split not in loaded:
                    raise DatasetError(f"dataset.split {d.split!r} is not in {p}; splits: {sorted(loaded)}")
                loaded = loaded[d.split]
            return loaded
        if p.suffix == ".parquet":
            return datasets.Dataset.from_parquet(str(p), keep_in_memory=True)
        if p.suffix in (".jsonl", ".json"):
            return datasets.Dataset.from_json(str(p), keep_in_memory=True)
    except DatasetError:
        raise
    except Exception as exc:  # datasets and pyarrow raise many unrelated types for a bad file
        root = _root_cause(exc)
        raise DatasetError(f"dataset.path {p}: cannot read it with datasets: {type(root).__name__}: {root}") from exc
    raise DatasetError(f"dataset.path {p}: expected a .jsonl, .json or .parquet file or a save_to_disk folder")


def _root_cause(exc: BaseException) -> BaseException:
    """datasets wraps the parser's error (the one that names the line) in a generic one."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def dataset_prompts(d: DatasetConfig, rows: Any = None, *, keep_columns: bool = False) -> Iterator[PromptItem]:
    """Every row of the dataset, `dataset.epochs` times (each epoch shuffled with its own seed when
    `dataset.shuffle`); errors name the file and the row. `keep_columns`: send the rows' other
    columns along (custom reward functions read them; built-in rewards need only `reference`)."""
    rows = load_rows(d) if rows is None else rows
    if len(rows) == 0:
        raise DatasetError(f"dataset.path {d.path} holds no rows")
    for epoch in range(d.epochs):
        order = rows.shuffle(seed=d.seed + epoch, keep_in_memory=True) if d.shuffle else rows
        for i, row in enumerate(order):
            yield row_item(row, f"{d.path}: row {i + 1}", d, keep_columns=keep_columns)


def row_item(row: Any, where: str, d: DatasetConfig, *, keep_columns: bool = False) -> PromptItem:
    """One row -> one prompt: text, or chat messages; the other columns travel along."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a row of named columns, got {type(row).__name__}")
    c = d.columns
    source = c.messages or c.prompt
    if source not in row:
        field = "messages" if c.messages else "prompt"
        raise DatasetError(f"{where}: no column {source!r} (dataset.columns.{field}); columns: {sorted(row)}")
    value = row[source]
    task = row.get(c.task) or d.task
    if task not in d.known_tasks:
        raise DatasetError(f"{where}: unknown task {task!r}; known: {sorted(d.known_tasks)} (dataset.task/tasks)")
    reference_column = c.reference or "reference"
    if c.reference is not None and c.reference not in row:
        raise DatasetError(f"{where}: no column {c.reference!r} (dataset.columns.reference); columns: {sorted(row)}")
    reference = row.get(reference_column)
    columns = ({k: v for k, v in row.items() if k not in (source, c.task)} or None) if keep_columns else None
    if isinstance(value, str) and value:
        if d.system_prompt is None:
            return PromptItem(task, value, reference, None, columns)
        return PromptItem(task, "", reference, _with_system([{"role": "user", "content": value}], d), columns)
    messages = _messages(value, where, source)
    return PromptItem(task, "", reference, _with_system(messages, d), columns)


def is_chat(row: dict[str, Any], d: DatasetConfig) -> bool:
    """Whether a row's prompt is chat messages (or becomes chat through `dataset.system_prompt`)."""
    value = row.get(d.columns.messages or d.columns.prompt)
    return d.system_prompt is not None or not isinstance(value, str)


def _messages(value: Any, where: str, column: str) -> Messages:
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: column {column!r} must be non-empty text or a list of "
                           f"{{role, content}} messages, got {type(value).__name__}")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: column {column!r} message {j} is not {{role: str, content: str}}")
        out.append({"role": m["role"], "content": m["content"]})  # Arrow adds absent keys as None: drop them
    return out


def _with_system(messages: Messages, d: DatasetConfig) -> Messages:
    if d.system_prompt is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": d.system_prompt}, *messages]


def file_prompts(path: str | pathlib.Path, default_task: str, known_tasks: frozenset[str]) -> Iterator[PromptItem]:
    """Prompts of a file with the default column layout, in file order (one epoch, no shuffle)."""
    extra = sorted(known_tasks - {default_task})
    yield from dataset_prompts(DatasetConfig(path=str(path), task=default_task, tasks=extra))
