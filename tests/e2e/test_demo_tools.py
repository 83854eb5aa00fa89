"""`fleetrl demo --config examples/fleet.tools.yaml`: episodes of a skyrl-gym tool environment (the example's
own `lookup_env.py`, written against skyrl-gym's API) through the whole pipeline.

The inputs are built as the README says (`python -m fleetrl.demo.hf_inputs examples/tools --rows tools`);
the shipped config runs unchanged but for its ports, its input folder and fewer steps (the suite's time
budget); the demo must exit 0 with the audit ok and the mean reward of the last 10 steps above the first 10.
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
DEMO_TIMEOUT_S = 300  # 32 steps take ~1 min on 2 cores
STEPS = 32


def test_tools_example_learns_to_read_its_tool(tmp_path: pathlib.Path, workdir: pathlib.Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("FLEETRL_HUB_KEY", None)
    inputs = tmp_path / "tools"
    subprocess.run([sys.executable, "-m", "fleetrl.demo.hf_inputs", str(inputs), "--rows", "tools"], check=True,
                   env=env, capture_output=True, timeout=120)
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "fleet.tools.yaml").read_text())
    doc["model"]["path"] = str(inputs / "model")
    doc["dataset"]["path"] = str(inputs / "prompts.jsonl")
    doc["dataset"]["env"]["python_path"] = [str(ROOT / "examples" / "tools")]
    doc["algorithm"]["max_steps"] = STEPS
    doc["mqtt"]["url"] = f"mqtt://127.0.0.1:{free_port()}"
    for region in doc["regions"]:
        region["kafka"] = f"127.0.0.1:{free_port()}"
    config = tmp_path / "fleet.tools.yaml"
    config.write_text(yaml.safe_dump(doc))
    proc = subprocess.run([sys.executable, "-m", "fleetrl.cli", "demo", "--config", str(config), "--workdir",
                           str(workdir)], env=env, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["audit"]["ok"] and summary["audit"]["problems"] == [], summary["audit"]
    rewards = summary["rewards"]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"tools demo: {len(rewards)} steps, reward first 10 {first:.3f} -> last 10 {last:.3f}")
    assert len(rewards) == STEPS and last > first, rewards
    agent_log = "".join(p.read_text() for p in (workdir / "logs").glob("agent-*.log"))
    assert '"turns": 16' in agent_log  # 8 episodes of 2 model turns: the tool's answer came between them
