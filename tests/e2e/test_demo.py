"""`fleetrl demo` in miniature: the whole pipeline as processes on free ports, a few steps.

Asserts what the demo promises: exit 0, an audit that passes (every dispatched group trained once
or counted), the final version replicated into both regions, rewards reported for every step, and
no process it started left running. A second run kills one agent with SIGKILL again and again: the
demo restarts it as its unit would, until its start limit; then it must name it, show its log, stop
everything else and exit non-zero.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from demo_testkit import STALL, alive, assert_evals_balanced, assert_tracked, ctrl_c_reaches_it
from slowdown import scaled

from fleetrl.demo.supervision import BACKOFF_MAX_S, START_LIMIT

pytestmark = pytest.mark.e2e
STEPS = 4
DEMO_TIMEOUT_S = 150  # bound of one demo run (it takes ~20 s on 2 cores); the reference figure, scaled where used


@pytest.fixture(autouse=True)
def _demo_reaped() -> Iterator[None]:
    """A demo a failed test left running gets SIGINT (its own bounded cleanup), then SIGKILL."""
    yield
    for proc in _STARTED:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=scaled(60))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=scaled(10))
        if proc.stdout is not None:
            proc.stdout.close()
    _STARTED.clear()


_STARTED: list[subprocess.Popen[str]] = []


def _demo(config: pathlib.Path, work: pathlib.Path, steps: int = STEPS) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("FLEETRL_HUB_KEY", None)  # the demo brings its own
    proc = subprocess.Popen([sys.executable, "-m", "fleetrl.cli", "demo", "--config", str(config), *STALL, "--workdir",
                             str(work), "--steps", str(steps)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True, preexec_fn=ctrl_c_reaches_it)
    _STARTED.append(proc)
    return proc


def _wait_for_line(proc: subprocess.Popen[str], log: pathlib.Path, text: str, timeout_s: float = 90) -> None:
    """Wait (bounded: `timeout_s` on the reference machine, scaled) until a child's log holds `text`; the
    demo must still be running then."""
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        time.sleep(0.1)
    out = _finish(proc) if proc.poll() is None else (proc.stdout.read() if proc.stdout else "")
    raise AssertionError(f"{log.name} never showed {text}; demo output:\n{out[-4000:]}")


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=scaled(DEMO_TIMEOUT_S))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the demo's own bounded cleanup first
        out, _ = proc.communicate(timeout=scaled(60))
        raise AssertionError(f"demo ran over {scaled(DEMO_TIMEOUT_S):.0f} s:\n{out[-4000:]}") from None
    return out


def test_demo_trains_replicates_audits_and_leaves_nothing_running(demo_config: pathlib.Path,
                                                                  workdir: pathlib.Path) -> None:
    doc = yaml.safe_load(demo_config.read_text())
    doc["tracking"]["samples_every"] = 2  # a table of samples within the run's few steps
    demo_config.write_text(yaml.safe_dump(doc))
    proc = _demo(demo_config, workdir)
    out = _finish(proc)
    assert proc.returncode == 0, out[-4000:]
    summary: dict[str, Any] = json.loads((workdir / "summary.json").read_text())
    audit = summary["audit"]
    assert audit["ok"] and audit["problems"] == [], audit
    groups_per_step = yaml.safe_load(demo_config.read_text())["algorithm"]["groups_per_step"]
    assert audit["trained"] == STEPS * groups_per_step  # each trained once (the ledger has no repeats)
    assert audit["dispatched"] >= audit["trained"]
    assert summary["steps"] == STEPS and len(summary["rewards"]) == STEPS
    assert all(0.0 <= r <= 1.0 for r in summary["rewards"])
    assert summary["final_version"] == STEPS  # version 0 at start, one per step
    for name, region in summary["regions"].items():
        assert region["replica_version"] == STEPS, f"region {name} did not get the final version: {region}"
        assert region["wan_copies"] >= 1 and region["groups_done"] >= 1
    assert "audit" in out and f"step {STEPS}/{STEPS}" in out
    # The shipped config evaluates a held-out set before training and at the run's last version.
    assert_evals_balanced(summary)
    assert [(r["version"], r["step"]) for r in summary["eval"]] == [(0, 0), (STEPS, STEPS)]
    assert f"eval reverse-held-out at version {STEPS}: pass@1" in out
    # The shipped config prices local-a on demand and local-b spot: the run's cost, by capacity type.
    cost = summary["cost"]
    assert cost["usd"] > 0 and cost["trained_groups"] == audit["trained"]
    assert cost["usd_by_capacity"]["on_demand"] > 0 and cost["usd_by_capacity"]["spot"] > 0
    assert cost["usd"] == pytest.approx(sum(cost["usd_by_capacity"].values()), abs=1e-5)
    assert cost["usd_per_1000_groups"] == pytest.approx(1000 * cost["usd"] / audit["trained"], rel=1e-3)
    assert cost["tokens_trained"] > 0  # (sampled tokens come with heartbeats, which a run of seconds may miss)
    assert "per 1,000 trained groups" in out
    pids: dict[str, int] = json.loads((workdir / "pids.json").read_text())
    assert {"trainer", "replicator-local-a", "replicator-local-b", "agent-local-a-node-1",
            "agent-local-b-node-1", "tansu-local-a", "tansu-local-b"} <= set(pids)
    assert summary["still_running"] == []
    assert [name for name, pid in pids.items() if alive(pid)] == []
    assert summary["exit_codes"] and all(code == 0 for code in summary["exit_codes"].values()), summary["exit_codes"]
    # The trainer's experiment records (the shipped config feeds TensorBoard): every step once, sample tables.
    rows = assert_tracked(demo_config, workdir / "tracking", STEPS)
    tables = [r for r in rows if r.get("table") == "samples"]
    assert [t["step"] for t in tables] == list(range(2, STEPS + 1, 2)) and tables[0]["rows"], tables
    steps = [r for r in rows if "table" not in r and "train/loss" in r]
    per_region = {k: v for k, v in steps[0].items() if k.startswith("train/groups/")}
    assert set(per_region) == {f"train/groups/{r}" for r in summary["regions"]}  # every region, 0 included
    assert sum(per_region.values()) == groups_per_step
    assert steps[-1]["cost/usd_total"] > 0  # the shipped config prices its regions
    # each evaluation's figures reach the trackers too, at the step that published its version, once
    tracked = {(r["step"], round(r[f"eval/{e['set']}/pass@1"], 4)) for r in rows for e in summary["eval"]
               if f"eval/{e['set']}/pass@1" in r}
    assert tracked == {(e["step"], e["pass@1"]) for e in summary["eval"]}, (tracked, summary["eval"])


def test_a_dying_agent_fails_the_demo_with_its_log_and_stops_the_rest(demo_config: pathlib.Path,
                                                                      workdir: pathlib.Path) -> None:
    """An agent that keeps dying is restarted as its unit's Restart=on-failure would restart it, with a
    doubling backoff, until its start limit; its next death fails the demo, which names it, shows its log,
    stops the rest and exits 1 (issue 46: the demo supervises like the packaged units)."""
    proc = _demo(demo_config, workdir, steps=1000)  # never reached: the agent's deaths end the run
    _wait_for_line(proc, workdir / "logs" / "agent-local-b-node-1.log", '"agent.started"')
    killed: list[int] = []
    for _ in range(START_LIMIT + 1):  # START_LIMIT restarts, then the failure that is fatal
        pid = _next_pid(proc, workdir, "agent-local-b-node-1", killed)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    out = _finish(proc)
    assert proc.returncode == 1, out[-4000:]
    assert "agent-local-b-node-1" in out and "exited with code -9" in out
    restarts = re.findall(r"agent-local-b-node-1 \(pid \d+\) exited with code -9: restarting it in (\d+) s "
                          r"\(failure (\d+) of", out)
    assert restarts == [(str(2 ** i), str(i + 1)) for i in range(START_LIMIT)], out[-4000:]
    pids: dict[str, int] = json.loads((workdir / "pids.json").read_text())
    assert [name for name, pid in pids.items() if alive(pid)] == [] and not any(alive(pid) for pid in killed)


def _next_pid(proc: subprocess.Popen[str], work: pathlib.Path, name: str, killed: list[int]) -> int:
    """The live pid the demo recorded for `name` that is not one of `killed` (its restart), waited for
    (bounded by its longest backoff and a start, scaled)."""
    deadline = time.monotonic() + scaled(BACKOFF_MAX_S + 60)
    while time.monotonic() < deadline and proc.poll() is None:
        pids_file = work / "pids.json"
        pid = json.loads(pids_file.read_text()).get(name) if pids_file.exists() else None
        if pid is not None and pid not in killed and alive(pid):
            return int(pid)
        time.sleep(0.1)
    out = _finish(proc) if proc.poll() is None else (proc.stdout.read() if proc.stdout else "")
    raise AssertionError(f"{name} was not restarted after {len(killed)} deaths; demo output:\n{out[-4000:]}")


def test_ctrl_c_mid_run_stops_everything(demo_config: pathlib.Path, workdir: pathlib.Path) -> None:
    proc = _demo(demo_config, workdir, steps=1000)  # never reached: the interrupt comes after the first step
    _wait_for_line(proc, workdir / "logs" / "trainer.log", '"step.done"')
    pids: dict[str, int] = json.loads((workdir / "pids.json").read_text())
    proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends to the demo
    out = _finish(proc)
    assert proc.returncode == 130, out[-4000:]
    assert "interrupted" in out
    assert [name for name, pid in pids.items() if alive(pid)] == []
