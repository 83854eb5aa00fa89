"""Prompt files and the metrics endpoint."""

from __future__ import annotations

import itertools
import json
import pathlib
import urllib.request
from typing import Any

import pytest
from slowdown import scaled

from fleetrl.config import DatasetColumns, DatasetConfig
from fleetrl.trainer import DatasetError, dataset_prompts, file_prompts
from fleetrl.trainer.metrics import TrainerMetrics

KNOWN = frozenset({"reverse", "copy"})


def test_jsonl_prompts_in_order_with_default_task(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "ab=", "reference": "ba"}, {"prompt": "cd:", "task": "copy", "reference": "cd"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert [tuple(p[:3]) for p in file_prompts(f, "reverse", KNOWN)] == [
        ("reverse", "ab=", "ba"), ("copy", "cd:", "cd")]
    # a restart skips what was drawn: the same file gives the same sequence
    assert [tuple(p[:3]) for p in itertools.islice(file_prompts(f, "reverse", KNOWN), 1, None)] == [
        ("copy", "cd:", "cd")]


@pytest.mark.parametrize(("line", "message"), [
    ("not json", r"p.jsonl: cannot read it with datasets: ArrowInvalid: JSON parse error"),
    ('{"task": "reverse"}', r"p.jsonl: row 2: column 'prompt' must be non-empty text"),
    ('{"prompt": "x", "task": "sing"}', r"p.jsonl: row 2: unknown task 'sing'"),
    ("[1, 2]", r"p.jsonl: cannot read it with datasets: ArrowInvalid"),
])
def test_bad_lines_name_file_and_row(tmp_path: pathlib.Path, line: str, message: str) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok="}\n' + line + "\n")
    with pytest.raises(DatasetError, match=message):
        list(file_prompts(f, "reverse", KNOWN))
    with pytest.raises(DatasetError, match="does not exist"):
        list(file_prompts(tmp_path / "missing.jsonl", "reverse", KNOWN))


CHAT = [{"role": "user", "content": "Say red."}]


def _write(kind: str, folder: pathlib.Path, rows: list[dict[str, Any]]) -> pathlib.Path:
    """The same rows as JSONL, Parquet, or a save_to_disk folder (a DatasetDict with a train split)."""
    import datasets

    if kind == "jsonl":
        path = folder / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path
    ds = datasets.Dataset.from_list(rows)
    if kind == "parquet":
        ds.to_parquet(str(folder / "rows.parquet"))
        return folder / "rows.parquet"
    datasets.DatasetDict({"train": ds}).save_to_disk(str(folder / "rows"))
    return folder / "rows"


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "disk"])
def test_trl_formats_read_with_no_mapping(tmp_path: pathlib.Path, kind: str) -> None:
    """TRL's conversational rows (a `prompt` of messages) become chat prompts with their other columns;
    the same file, three formats, the same prompts."""
    rows = [{"prompt": CHAT, "keyword": "red"}, {"prompt": [{"role": "user", "content": "Say blue."}],
                                                  "keyword": "blue"}]
    d = DatasetConfig(path=str(_write(kind, tmp_path, rows)), task="keywords")
    out = list(dataset_prompts(d, keep_columns=True))
    assert [(p.task, p.prompt, p.messages, p.columns) for p in out] == [
        ("keywords", "", CHAT, {"keyword": "red"}),
        ("keywords", "", [{"role": "user", "content": "Say blue."}], {"keyword": "blue"}),
    ]


def test_mapping_system_prompt_shuffle_and_epochs(tmp_path: pathlib.Path) -> None:
    """A question/answer layout mapped to prompt/reference; the system prompt turns text into chat;
    each epoch is shuffled with its own seed, and the same config gives the same order again."""
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(6)]
    d = DatasetConfig(path=str(_write("jsonl", tmp_path, rows)), columns=DatasetColumns(prompt="question",
                      reference="answer"), system_prompt="Be brief.", shuffle=True, epochs=2, seed=3)
    out = list(dataset_prompts(d))
    assert len(out) == 12
    assert out[0].messages is not None and out[0].messages[0] == {"role": "system", "content": "Be brief."}
    firsts = [p.messages[1]["content"] for p in out if p.messages]
    assert sorted(firsts[:6]) == sorted(firsts[6:]) == [f"q{i}" for i in range(6)]
    assert firsts[:6] != firsts[6:]  # epoch 2 is shuffled with its own seed
    assert all(p.reference == p.messages[1]["content"][1:] for p in out if p.messages)
    assert [p.messages for p in dataset_prompts(d)] == [p.messages for p in out]  # a restart: same order
    with pytest.raises(DatasetError, match=r"no column 'answer' \(dataset.columns.reference\)"):
        list(dataset_prompts(d.model_copy(update={"path": str(_write("jsonl", tmp_path, [{"question": "q"}]))})))


def test_messages_column_mapping(tmp_path: pathlib.Path) -> None:
    rows = [{"messages": CHAT, "solution": "red"}]
    d = DatasetConfig(path=str(_write("jsonl", tmp_path, rows)), columns=DatasetColumns(messages="messages"))
    (p,) = list(dataset_prompts(d, keep_columns=True))
    assert (p.messages, p.columns) == (CHAT, {"solution": "red"})


def test_metrics_are_served_with_units_in_their_names() -> None:
    m = TrainerMetrics()
    m.stale_dropped.labels("eu").inc()
    m.publish_bytes.inc(1234)
    port = m.serve(0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=scaled(5)).read().decode()
    finally:
        m.close()
    assert 'fleetrl_trainer_stale_groups_dropped_total{region="eu"} 1.0' in text
    assert "fleetrl_trainer_weight_publish_bytes_total 1234.0" in text
    assert "fleetrl_trainer_step_seconds_bucket" in text and "fleetrl_trainer_staleness_versions_bucket" in text


def test_verl_parquet_rows_read_with_no_mapping(tmp_path: pathlib.Path) -> None:
    """verl's layout: a `prompt` of messages, `data_source`, `ability`, `reward_model`, `extra_info`."""
    rows = [{"data_source": "gsm8k", "prompt": CHAT, "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "12"}, "extra_info": {"index": 0, "split": "train"}}]
    d = DatasetConfig(path=str(_write("parquet", tmp_path, rows)), task="math")
    (p,) = list(dataset_prompts(d, keep_columns=True))
    assert p.messages == CHAT and p.columns is not None
    assert p.columns["reward_model"] == {"style": "rule", "ground_truth": "12"}
    assert (p.columns["data_source"], p.columns["extra_info"]["index"]) == ("gsm8k", 0)
