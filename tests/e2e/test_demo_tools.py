"""`fleetrl demo --config examples/fleet.tools.yaml`: episodes of a skyrl-gym tool environment (the example's
own `lookup_env.py`, written against skyrl-gym's API) through the whole pipeline.

The inputs are built as the README says (`python -m fleetrl.demo.hf_inputs examples/tools --rows tools`);
the shipped config runs unchanged but for its ports, its input folder and fewer steps (the suite's time
budget); the demo must exit 0 with the audit ok and the mean reward of the last 10 steps above the first 10.
"""

from __future__ import annotations

import pathlib

import pytest
import yaml
from demo_testkit import ROOT, assert_learned, example_config, run_demo

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
DEMO_TIMEOUT_S = 300  # 32 steps take ~1 min on 2 cores (the reference figure: run_demo scales it)
STEPS = 32


def test_tools_example_learns_to_read_its_tool(tmp_path: pathlib.Path, workdir: pathlib.Path) -> None:
    doc, config = example_config(tmp_path, "tools", "--rows", "tools")
    doc["dataset"]["env"]["python_path"] = [str(ROOT / "examples" / "tools")]
    doc["algorithm"]["max_steps"] = STEPS
    config.write_text(yaml.safe_dump(doc))
    summary = run_demo(config, workdir, steps=STEPS, timeout_s=DEMO_TIMEOUT_S)
    assert_learned(summary, STEPS, "tools demo")
    agent_log = "".join(p.read_text() for p in (workdir / "logs").glob("agent-*.log"))
    assert '"turns": 16' in agent_log  # 8 episodes of 2 model turns: the tool's answer came between them
