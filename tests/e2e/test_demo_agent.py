"""`fleetrl demo --config examples/fleet.agent.yaml`: an agent written with the plain `openai` SDK (the example's
own `calculator_agent.py`) trained through each worker's OpenAI-compatible endpoint, under faults.

The inputs are built as the README says (`python -m fleetrl.demo.hf_inputs examples/agent --rows arithmetic`);
the shipped config runs unchanged but for its ports, its input folder and fewer steps (the suite's time
budget). One run, with its only worker node preempted (and replaced) and its agent killed (and restarted)
while agent runs are in flight: their groups are re-sent (docs/agents.md), the demo exits 0, the audit is ok
with no group lost and none trained twice, and the mean reward of the last 10 steps is above the first 10.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml
from demo_testkit import ROOT, assert_accounted, assert_learned, example_config, run_demo
from slowdown import scaled

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
DEMO_TIMEOUT_S = 300  # 40 steps take ~1.5 min on 2 cores (the reference figure: run_demo scales it)
STEPS = 40


def test_agent_example_learns_through_the_endpoint_across_faults(tmp_path: pathlib.Path,
                                                                  workdir: pathlib.Path) -> None:
    doc, config = example_config(tmp_path, "agent", "--rows", "arithmetic")
    doc["dataset"]["env"]["python_path"] = [str(ROOT / "examples" / "agent")]
    doc["algorithm"]["max_steps"] = STEPS
    config.write_text(yaml.safe_dump(doc))
    summary = run_demo(config, workdir, "--preempt-every", f"{scaled(25):g}", "--kill-every", f"{scaled(35):g}",
                       "--kill-only", "agent", steps=STEPS, timeout_s=DEMO_TIMEOUT_S)
    assert_accounted(summary, steps=STEPS)
    assert_learned(summary, STEPS, "agent demo")
    kinds = {f["kind"] for f in summary["faults"]}
    assert {"preempt", "kill"} & kinds, summary["faults"]
    logs = [json.loads(line) for p in (workdir / "logs").glob("agent-*.log") for line in p.read_text().splitlines()
            if line.startswith("{")]
    done = [e for e in logs if e.get("event") == "worker.group_done"]
    # 8 agent runs a group, each of 2 calls that extend one context: one segment per sample
    assert done and all(e["episodes"] == 8 and e["segments"] == [1] * 8 and e["turns"] == 16
                        for e in done[:5]), done[:5]
    stats = [e for e in logs if e.get("event") == "worker.stats" and e.get("agent_samples")]
    assert stats and stats[-1]["agent_samples_resegmented"] == 0
