"""Every crash window of the critical sequences, hit on purpose (`fleetrl.crashpoints`, docs/crashpoints.md).

A random SIGKILL rarely lands in a window a few milliseconds wide; these tests land in each one.
Two demo runs side by side (each with its own tansu, MQTT, directory stores, trainer, replicators,
agents and their workers) arm a sequence of named crash points per process kind: the first run the
single sweep, the second the double one: the trainer, the replicators and the rollout workers each
SIGKILL themselves at their next point, and are restarted as systemd would (the trainer and
replicators by the demo, a worker by its agent's supervisor). The kinds run their sequences at the
same time, so one set of servers serves every point of a run. Then, per point: it fired, the process
came back, and the run went on after it; and for each run: every step done, the audit ok (0 lost, 0
trained twice), every version in every store verified, gapless and in order, and every replica at
the last version (`fleetrl hub verify --all`, which the demo runs).

How long: a run lasts as long as its trainer's sequence. Each trainer point costs a restart (a new
process imports torch, resumes from its checkpoint and rejoins its groups: 10-15 s on 2 cores) and the
passes up to its `@N`; the replicators' and workers' points fire meanwhile. One run of all 16 trainer
points took 5.5 minutes with its last steps done within seconds of the last crash; split 8 and 8 over
two runs at once, the sweep takes about half that.

The double sweep crashes a restart again while it recovers (the same point, or the next one). The
retention pass (`fleetrl hub gc`) is a command, not a daemon: its points are crashed and rerun here
without the demo.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import demo_testkit
import pytest
import torch
import yaml
from demo_testkit import assert_accounted, run_demo
from slowdown import scaled

from fleetrl.config import load_config
from fleetrl.crashpoints import POINTS
from fleetrl.hub import Hub

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# `@N`: the N-th time this process passes there, so that the crash lands mid-run (a checkpoint on disk,
# versions published, groups in flight) rather than in the first seconds of a start.
TRAINER = [
    "trainer.step.snapshot_taken@2", "trainer.checkpoint.weights_written@2", "trainer.checkpoint.state_written@2",
    "trainer.checkpoint.renamed@2", "trainer.offsets.committed@2", "hub.publish.objects_written@3",
    "hub.publish.manifest_written@3", "hub.publish.holder_written@3", "trainer.publish.latest_moved@3",
    "trainer.publish.announced@3", "trainer.dispatch.prompt_produced@9", "trainer.dispatch.ledger_updated@9",
]
REPLICATOR = [
    # a restart waits out its dead predecessor's lease while versions accumulate: its catch-up is several
    "hub.replicate.objects_copied@2", "hub.replicate.backfilled", "hub.replicate.manifest_copied@2",
    "hub.replicate.holder_written@2",
    "hub.replicate.home_holder_written@2", "hub.replicate.latest_moved@2", "replicator.announced@2",
]
WORKER = ["rollout.group.produced@2", "rollout.offsets.committed@3", "rollout.partial.produced"]
GC = ["hub.gc.manifest_deleted@2", "hub.gc.holder_deleted@3", "hub.gc.object_deleted@2"]
# the double sweep: the second entry fires at its first hit after the restart, i.e. while it recovers
DOUBLE_TRAINER = [
    "hub.publish.manifest_written@3", "hub.publish.manifest_written",  # dies again in the republish
    "trainer.checkpoint.state_written@2", "hub.publish.objects_written",  # and in the next point of it
]
DOUBLE_REPLICATOR = ["hub.replicate.manifest_copied@2", "hub.replicate.manifest_copied",
                     "hub.replicate.holder_written@2", "hub.replicate.home_holder_written"]
DOUBLE_WORKER = ["rollout.group.produced@2", "rollout.group.produced", "rollout.offsets.committed"]
STEPS = 32
SWEEPS = {  # the trainer's 16 points, 8 per run, are the critical path of each
    "single": {"trainer": TRAINER[:8], "replicator": REPLICATOR, "worker": WORKER},
    "double": {"trainer": TRAINER[8:] + DOUBLE_TRAINER, "replicator": DOUBLE_REPLICATOR, "worker": DOUBLE_WORKER},
}
SWEEP_TIMEOUT_S = 900  # the reference machine's figure: run_demo and the timeout mark scale it
# The sweep's demo run is the first test's setup: its bound, not the suite's 300 s per test.
pytestmark.append(pytest.mark.timeout(SWEEP_TIMEOUT_S + 120))
# The sweep runs its two demos at once: its tests hold two of the suite's fleet slots (tests/conftest.py).
pytestmark.append(pytest.mark.fleet(slots=len(SWEEPS)))


def test_every_crash_point_is_swept() -> None:
    """A new crash point in the code joins a sweep here (and the table in docs/crashpoints.md)."""
    swept = {e.partition("@")[0] for e in TRAINER + REPLICATOR + WORKER + GC}
    assert swept == set(POINTS)
    doc = (demo_testkit.ROOT / "docs" / "crashpoints.md").read_text()
    assert all(f"`{p}`" in doc for p in POINTS), sorted(p for p in POINTS if f"`{p}`" not in doc)


def _sweep_config(tmp_path: pathlib.Path) -> pathlib.Path:
    """The demo config; each group's samples are cut after 1 s when they wait (min_version), so workers
    hand unfinished groups over as partials during the run (the partials crash point)."""
    doc, path = demo_testkit.demo_config(tmp_path)
    doc["rollout"]["min_version_wait_s"] = 1.0
    path.write_text(yaml.safe_dump(doc))
    return path


def _crashes(summary: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in summary["faults"] if f["kind"] == "crash"]


def _assert_recovered(summary: dict[str, Any], workdir: pathlib.Path, sequences: dict[str, list[str]]) -> None:
    """Each point fired in its kind's order, each crashed trainer and replicator was restarted, the run
    went on after every crash, and the books and stores are whole."""
    fired = _crashes(summary)
    for kind, points in sequences.items():
        got = [f["target"] for f in fired if f["detail"].startswith(f"{kind} ")]
        assert got == [p.partition("@")[0] for p in points], (kind, got)
    for crash in fired:
        kind = crash["detail"].split()[0]
        if kind in ("trainer", "replicator"):
            assert any(f["kind"] == "restart" and f["target"].startswith(kind) and f["t"] >= crash["t"]
                       for f in summary["faults"]), crash
    # a crash after the last step (the trainer's drain, a replicator catching up) is recovered too: the
    # restarted trainer drained and exited 0 (the demo fails on any other exit)
    assert summary["exit_codes"]["trainer"] == 0, summary["exit_codes"]
    assert_accounted(summary, steps=STEPS)
    assert summary["stores_ok"], summary["stores"]
    final = {s["store"]: s["latest"] for s in summary["stores"]}
    assert set(final) == {"home", "local-a", "local-b"} and len(set(final.values())) == 1, final
    for s in summary["stores"]:
        assert s["gaps"] == [] and s["bad"] == {} and s["newest"] == s["latest"], s
    assert "VersionConflict" not in (workdir / "logs" / "trainer.log").read_text()


Sweep = dict[str, tuple[dict[str, Any], pathlib.Path]]
"""Run name (`SWEEPS`) -> (its summary, its work directory)."""


def _sweep_run(tmp: pathlib.Path, sequences: dict[str, list[str]]) -> tuple[dict[str, Any], pathlib.Path]:
    work = tmp / "work"
    try:
        points = ",".join(e for seq in sequences.values() for e in seq)
        summary = run_demo(_sweep_config(tmp), work, "--crash-at", points, steps=STEPS, timeout_s=SWEEP_TIMEOUT_S)
    finally:
        demo_testkit.kill_leftovers(work)
    return summary, work


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """Two demo runs at once (a set of servers each): one crashes at every replicator and worker point
    and the first half of the trainer's, the other at the rest of the trainer's and then at each pair of
    the double sweep, in order per kind."""
    with ThreadPoolExecutor(len(SWEEPS)) as pool:
        runs = {name: pool.submit(_sweep_run, tmp_path_factory.mktemp(f"sweep-{name}"), sequences)
                for name, sequences in SWEEPS.items()}
        return {name: run.result() for name, run in runs.items()}


def _run_of(sweep: Sweep, point: str) -> tuple[dict[str, Any], pathlib.Path]:
    """The run whose first crash at `point` is its single-sweep crash (the double run also repeats some)."""
    name = next(n for n, seqs in SWEEPS.items() if any(e.partition("@")[0] == point for seq in seqs.values()
                                                        for e in seq))
    return sweep[name]


@pytest.mark.parametrize("point", [p.partition("@")[0] for p in TRAINER + REPLICATOR + WORKER])
def test_a_crash_at_the_point_is_recovered_by_a_restart(sweep: Sweep, point: str) -> None:
    summary, work = _run_of(sweep, point)
    crash = [f for f in _crashes(summary) if f["target"] == point]
    assert crash, (point, _crashes(summary))
    crash = crash[:1]  # its single-sweep crash (the double sweep comes after, in the same run)
    kind = POINTS[point].kind
    assert crash[0]["detail"].startswith(f"{kind} pid ")
    # the marker names the process that died there, and a later process of the kind did the work after it
    marker = next((work / "crashes" / kind).glob(f"*-{point}"))
    assert json.loads(marker.read_text())["point"] == point
    if kind == "worker":  # its agent's supervisor restarted it
        assert any('"agent.worker_restart"' in p.read_text() for p in (work / "logs").glob("agent-*.log"))
    later = [row for row in summary["_rows"] if row["t"] > crash[0]["t"]]
    assert later, f"no step after the crash at {point}"


def test_the_sweep_run_ends_whole(sweep: Sweep) -> None:
    for name, (summary, work) in sweep.items():
        _assert_recovered(summary, work, SWEEPS[name])


def test_a_restart_that_crashes_again_while_it_recovers_also_recovers(sweep: Sweep) -> None:
    """Each pair of the double sweep: the second crash came from the restarted process (another pid)
    at its first pass there, i.e. while it recovered; the run still ended whole (above)."""
    summary, _ = sweep["double"]
    for kind, points in (("trainer", DOUBLE_TRAINER), ("replicator", DOUBLE_REPLICATOR)):
        fired = [f for f in _crashes(summary) if f["detail"].startswith(f"{kind} ")][-len(points):]
        assert [f["target"] for f in fired] == [p.partition("@")[0] for p in points]
        for first, second in zip(fired[::2], fired[1::2], strict=True):
            assert first["detail"] != second["detail"], (first, second)  # another process died the second time
            if kind == "trainer":  # one trainer: the second crash was its restart's (two replicators share a list)
                assert any(f["kind"] == "restart" and f["target"] == "trainer" and first["t"] <= f["t"] <= second["t"]
                           for f in summary["faults"]), (first, second)


# -- retention (`fleetrl hub gc`) ----------------------------------------------------------------------


def _cli(args: list[str], config: pathlib.Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetrl.cli", *args, "--config", str(config)], env=env,
                          capture_output=True, text=True, timeout=scaled(120), check=False)


@pytest.mark.parametrize("point", GC)
def test_a_gc_pass_crashed_at_the_point_is_finished_by_the_next(tmp_path: pathlib.Path, point: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Versions 0..9 (anchor every 4), a window of 3: `fleetrl hub gc` crashed mid-pass leaves a store
    whose retained versions all verify, and the next pass removes exactly what the first would have."""
    doc = {
        "run": "gc", "model": {"tiny": {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                                        "num_hidden_layers": 1}},
        "hub": {"home_store": str(tmp_path / "home"), "anchor_interval": 4, "retention_versions": 3,
                "gc_grace_s": 0, "signing": {"scheme": "hmac-sha256", "key_env": "GC_TEST_KEY"}},
        "regions": [{"name": "r", "kafka": "127.0.0.1:1", "store": str(tmp_path / "r")}],
    }
    config_path = tmp_path / "fleet.yaml"
    config_path.write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("GC_TEST_KEY", "k" * 32)
    config = load_config(config_path)
    g = torch.Generator().manual_seed(0)
    weights = {"w": torch.randn(64, 16, generator=g).to(torch.bfloat16)}
    with Hub.from_config(config) as hub:
        for v in range(10):
            weights["w"][v % 64, :] += 1.0  # a few rows change per version
            assert hub.publish(weights).version == v
        doomed = hub.gc(dry_run=True)
    assert doomed.deleted_versions and doomed.deleted_objects
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    crashed = _cli(["hub", "gc"], config_path, {**env, "FLEETRL_CRASH_AT": point,
                                                "FLEETRL_CRASH_DIR": str(tmp_path / "crashes")})
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    assert '"crashpoint.hit"' in crashed.stderr
    with Hub.from_config(config) as hub:
        # mid-pass, the window's versions all verify (a doomed version may have lost its chain's start)
        check = hub.verify_store()
        assert check.latest == 9 and set(check.bad) <= set(doomed.deleted_versions), check
    again = _cli(["hub", "gc"], config_path, env)
    assert again.returncode == 0, again.stderr[-2000:]
    with Hub.from_config(config) as hub:
        check = hub.verify_store()
        assert check.ok and check.versions == doomed.kept_versions, check
        assert sorted({int(i.key.split("/")[2]) for i in hub.store.scan("gc/holders/")}) == doomed.kept_versions
        left = hub.gc(dry_run=True)
    assert left.deleted_versions == [] and left.deleted_objects == [], left
