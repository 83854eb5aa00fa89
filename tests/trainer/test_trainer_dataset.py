"""Prompt files and the metrics endpoint."""

from __future__ import annotations

import itertools
import json
import pathlib
import urllib.request

import pytest

from fleetrl.trainer import DatasetError, file_prompts
from fleetrl.trainer.metrics import TrainerMetrics

KNOWN = frozenset({"reverse", "copy"})


def test_jsonl_prompts_in_order_with_default_task(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "ab=", "reference": "ba"}, {"prompt": "cd:", "task": "copy", "reference": "cd"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert list(file_prompts(f, "reverse", KNOWN)) == [("reverse", "ab=", "ba"), ("copy", "cd:", "cd")]
    # a restart skips what was drawn: the same file gives the same sequence
    assert list(itertools.islice(file_prompts(f, "reverse", KNOWN), 1, None)) == [("copy", "cd:", "cd")]


@pytest.mark.parametrize(("line", "message"), [
    ("not json", r"p.jsonl:2: not JSON"),
    ('{"task": "reverse"}', r"p.jsonl:2: field 'prompt'"),
    ('{"prompt": "x", "task": "sing"}', r"p.jsonl:2: unknown task 'sing'"),
    ("[1, 2]", r"p.jsonl:2: expected an object"),
])
def test_bad_lines_name_file_and_line(tmp_path: pathlib.Path, line: str, message: str) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok="}\n' + line + "\n")
    with pytest.raises(DatasetError, match=message):
        list(file_prompts(f, "reverse", KNOWN))
    with pytest.raises(DatasetError, match="does not exist"):
        list(file_prompts(tmp_path / "missing.jsonl", "reverse", KNOWN))


def test_metrics_are_served_with_units_in_their_names() -> None:
    m = TrainerMetrics()
    m.stale_dropped.labels("eu").inc()
    m.publish_bytes.inc(1234)
    port = m.serve(0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    assert 'fleetrl_trainer_stale_groups_dropped_total{region="eu"} 1.0' in text
    assert "fleetrl_trainer_weight_publish_bytes_total 1234.0" in text
    assert "fleetrl_trainer_step_seconds_bucket" in text and "fleetrl_trainer_staleness_versions_bucket" in text
