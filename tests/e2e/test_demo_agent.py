"""`fleetrl demo --config examples/fleet.agent.yaml`: an agent written with the plain `openai` SDK (the example's
own `calculator_agent.py`) trained through each worker's OpenAI-compatible endpoint, under faults.

The inputs are built as the README says (`python -m fleetrl.demo.hf_inputs examples/agent --rows arithmetic`);
the shipped config runs unchanged but for its ports and its input folder. One run, bounded by its work
(`--until-faults`): its only worker node is preempted (and replaced) and its agent killed (and restarted)
while agent runs are in flight; the preempted worker hands its agent groups over with each run's completed
calls, and the worker that finishes such a group answers those calls from the capture (docs/agents.md):
every one, as the example's agent asks the same again. The demo exits 0, the audit is ok with no group lost
and none trained twice, and the groups' samples are one segment each (every call of the example extends its
conversation). Learning is the demo's own figure (README, docs/agents.md): a run
bounded by faults is too short to show it.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml
from demo_testkit import ROOT, assert_accounted, example_config, run_demo
from slowdown import scaled

DEMO_TIMEOUT_S = 300  # the faults and their recovery take ~1-2 min on 2 cores (run_demo scales it)
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(DEMO_TIMEOUT_S + 80)]
"""pytest's bound outlasts the demo's own and its SIGINT clean-up (tests/conftest.py scales both): a run
that hangs fails with the demo's output, not pytest's stack of a `poll()`."""


def test_agent_example_through_the_endpoint_keeps_its_books_across_faults(tmp_path: pathlib.Path,
                                                                         workdir: pathlib.Path) -> None:
    doc, config = example_config(tmp_path, "agent", "--rows", "arithmetic")
    doc["dataset"]["env"]["python_path"] = [str(ROOT / "examples" / "agent")]
    config.write_text(yaml.safe_dump(doc))
    summary = run_demo(config, workdir, "--preempt-every", f"{scaled(10):g}", "--kill-every", f"{scaled(15):g}",
                       "--kill-only", "agent", "--until-faults", steps=None, timeout_s=DEMO_TIMEOUT_S)
    assert_accounted(summary, steps=None)
    kinds = [f["kind"] for f in summary["faults"]]
    assert "preempt" in kinds and "replace" in kinds and "kill" in kinds, summary["faults"]
    logs = [json.loads(line) for p in (workdir / "logs").glob("agent-*.log") for line in p.read_text().splitlines()
            if line.startswith("{")]
    done = [e for e in logs if e.get("event") == "worker.group_done"]
    # 8 agent runs a group, each of 2 calls that extend one context: one segment per sample
    assert done and all(e["episodes"] == 8 and e["segments"] == [1] * 8 and e["turns"] == 16 for e in done), done[:3]
    # every worker that stops on its own (a preempted node, the run's end) logs its last stats
    assert any(e.get("event") == "worker.stats" and e.get("final") for e in logs)
    stats = [e for e in logs if e.get("event") == "worker.stats" and e.get("agent_samples")]
    assert stats and all(e["agent_samples_resegmented"] == 0 for e in stats)
    assert any(e.get("event") == "worker.handed_over" for e in logs)  # a preempted worker handed its groups over
    # A group the preempted worker handed over with captured calls is replayed wherever its partial is finished:
    # its first call at least, and nothing recorded is generated again (the agent repeats itself given the same
    # answers). Which groups had a call done when the notice came is the machine's timing; that they replay is
    # not. A copy of the group's prompt read again (at-least-once: the preempted worker's commit had not landed)
    # is generated afresh, and the trainer drops whichever copy comes second as a duplicate: only completions of
    # the partial are replays.
    captured = {e["group_id"] for e in logs if e.get("event") == "worker.handed_over"
                and e.get("reason") == "preempted" and e.get("tokens", 0) > 0}
    from_partial = _completions_of_partials(workdir / "logs", captured)
    assert all(e.get("calls_replayed", 0) >= 1 and e.get("tokens_regenerated") == 0 for e in from_partial), \
        from_partial


def _completions_of_partials(logs: pathlib.Path, groups: set[str]) -> list[dict[str, object]]:
    """The `worker.group_done` events of `groups` whose latest admission on that node came from `partials`
    (a worker takes one delivery of a group at a time: a second one in flight is dropped as a duplicate)."""
    out = []
    for path in logs.glob("agent-*.log"):
        admitted: dict[str, str] = {}
        for line in path.read_text().splitlines():
            if not line.startswith("{"):
                continue
            e = json.loads(line)
            if e.get("group_id") not in groups:
                continue
            if e.get("event") == "worker.admitted":
                admitted[e["group_id"]] = e.get("stream", "")
            elif e.get("event") == "worker.group_done" and admitted.get(e["group_id"]) == "partials":
                out.append(e)
    return out
