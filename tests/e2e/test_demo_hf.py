"""`fleetrl demo --config examples/fleet.hf.yaml`: a user's own model, data and reward through the whole pipeline.

The example's inputs are built here as the README says (`python -m fleetrl.demo.hf_inputs`): a Qwen2
folder in bf16 shards with a BPE tokenizer and chat template, and a JSONL of chat prompts; the
reward is the example's TRL-style module. The shipped config runs unchanged but for its broker ports
and the folder it reads from; the demo must exit 0 with the audit ok and the mean reward of the last
10 steps above that of the first 10.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import yaml
from demo_testkit import ROOT, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
DEMO_TIMEOUT_S = 400  # 60 steps take ~1-1.5 min on 2 cores


def test_hf_example_trains_a_local_folder_on_chat_rows_with_a_trl_reward(tmp_path: pathlib.Path,
                                                                          workdir: pathlib.Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("FLEETRL_HUB_KEY", None)
    inputs = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "fleetrl.demo.hf_inputs", str(inputs)], check=True, env=env,
                   capture_output=True, timeout=120)
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "fleet.hf.yaml").read_text())
    doc["model"]["path"] = str(inputs / "model")
    doc["dataset"]["path"] = str(inputs / "prompts.jsonl")
    doc["reward"]["python_path"] = [str(ROOT / "examples" / "hf")]
    doc["mqtt"]["url"] = f"mqtt://127.0.0.1:{free_port()}"
    for region in doc["regions"]:
        region["kafka"] = f"127.0.0.1:{free_port()}"
    config = tmp_path / "fleet.hf.yaml"
    config.write_text(yaml.safe_dump(doc))
    proc = subprocess.run([sys.executable, "-m", "fleetrl.cli", "demo", "--config", str(config), "--workdir",
                           str(workdir)], env=env, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["audit"]["ok"] and summary["audit"]["problems"] == [], summary["audit"]
    rewards = summary["rewards"]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"hf demo: {len(rewards)} steps, reward first 10 {first:.3f} -> last 10 {last:.3f}")
    assert len(rewards) == doc["algorithm"]["max_steps"] and last > first, rewards
