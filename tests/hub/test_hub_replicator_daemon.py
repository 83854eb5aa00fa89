"""Two `fleetrl replicator` daemons for one region: one holds the lease, the other takes over."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import yaml
from hub_helpers import HUB_KEY, step, tiny_state
from slowdown import scaled

from fleetrl.config import load_config
from fleetrl.hub import Hub, Lease

pytestmark = pytest.mark.integration
LEASE_TTL_S = scaled(10.0)
"""Renewed every third of it: only a holder stalled for over 6 s on busy cores loses it (1.5 s, then 4 s, were
not enough), so it is scaled by the machine's slowdown (a slower machine stalls longer). The takeover after a
kill waits out this much."""


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds, failing after `timeout_s` (already scaled by the caller)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.fixture
def config_file(tmp_path: pathlib.Path, run_id: str) -> pathlib.Path:
    doc = {
        "run": run_id,
        "hub": {"home_store": str(tmp_path / "home"), "anchor_interval": 4, "lease_ttl_s": LEASE_TTL_S,
                "poll_interval_s": 0.1, "threads": 1},
        "regions": [{"name": "west", "kafka": "127.0.0.1:9", "store": str(tmp_path / "west"),
                     "link_costs": {"home": 1}}],
    }
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def daemons(config_file: pathlib.Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    env = {**os.environ, "FLEETRL_HUB_KEY": HUB_KEY, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "fleetrl.cli", "replicator", "--config", str(config_file), "--region", "west",
            "--log-json"]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
    yield procs
    for p in procs:  # only the processes this test started, by their pid
        if p.poll() is None:
            p.kill()
        p.wait(timeout=scaled(10))
        if p.stderr is not None:
            p.stderr.close()


def test_one_daemon_holds_the_lease_and_the_other_takes_over_after_a_kill(
        config_file: pathlib.Path, daemons: list[subprocess.Popen[bytes]]) -> None:
    config = load_config(config_file)
    hub = Hub.from_config(config)
    region = Hub.from_config(config, store="west")
    lease = Lease(region.store, config.run, "replicator", ttl_s=LEASE_TTL_S, holder="observer")
    state = tiny_state()
    hub.publish(state)
    wait_for(lambda: region.latest() == 0, scaled(30), "the first version to reach the region")

    def holder_pid() -> int | None:
        record = lease.current()
        if record is None or record.expires_at < time.time():
            return None
        return int(record.holder.split("-")[-2])

    pids = {p.pid: p for p in daemons}
    first = lease.current()
    assert first is not None and first.expires_at >= time.time()
    holder = int(first.holder.split("-")[-2])
    assert holder in pids
    renewal: list[tuple[int, str]] = []  # (generation, holder) of the first newer record

    def renewed() -> bool:
        record = lease.current()
        if record is not None and record.generation > first.generation:
            renewal.append((record.generation, record.holder))
        return bool(renewal)

    wait_for(renewed, scaled(60), "a renewal of the lease")  # the lease stays with one holder while it renews
    assert renewal[0][1] == first.holder and holder_pid() == holder
    assert all(p.poll() is None for p in daemons)

    os.kill(holder, signal.SIGKILL)
    pids[holder].wait(timeout=scaled(10))
    for v in range(1, 3):
        state = step(state, v)
        hub.publish(state)
    wait_for(lambda: region.latest() == 2, LEASE_TTL_S + scaled(60), "the other daemon to take over and replicate")
    survivor = next(pid for pid in pids if pid != holder)
    assert holder_pid() == survivor

    os.kill(survivor, signal.SIGTERM)  # bounded drain, then exit 0
    assert pids[survivor].wait(timeout=LEASE_TTL_S + scaled(20)) == 0  # past the TTL it would exit 3
    stderr = pids[survivor].stderr.read().decode() if pids[survivor].stderr else ""
    events = [json.loads(line)["event"] for line in stderr.splitlines() if line.startswith("{")]
    assert "lease.acquired" in events and "replicator.stopped" in events
    hub.close()
    region.close()
