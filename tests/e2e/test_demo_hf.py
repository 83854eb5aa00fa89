"""`fleetrl demo --config examples/fleet.hf.yaml`: a user's own model, data and reward through the whole pipeline.

The example's inputs are built here as the README says (`python -m fleetrl.demo.hf_inputs`): a Qwen2
folder in bf16 shards with a BPE tokenizer and chat template, and a JSONL of chat prompts; the
reward is the example's TRL-style module. The shipped config runs unchanged but for its broker ports
and the folder it reads from; the demo must exit 0 with the audit ok and the mean reward of the last
10 steps above that of the first 10.
"""

from __future__ import annotations

import pathlib

import pytest
import yaml
from demo_testkit import ROOT, assert_learned, example_config, run_demo

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
DEMO_TIMEOUT_S = 400  # 60 steps take ~1-1.5 min on 2 cores


def test_hf_example_trains_a_local_folder_on_chat_rows_with_a_trl_reward(tmp_path: pathlib.Path,
                                                                          workdir: pathlib.Path) -> None:
    doc, config = example_config(tmp_path, "hf")
    doc["reward"]["python_path"] = [str(ROOT / "examples" / "hf")]
    config.write_text(yaml.safe_dump(doc))
    steps = doc["algorithm"]["max_steps"]
    summary = run_demo(config, workdir, steps=steps, timeout_s=DEMO_TIMEOUT_S)
    assert_learned(summary, steps, "hf demo")
