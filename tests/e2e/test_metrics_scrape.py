"""`curl /metrics` and `/healthz` on a live fleet: the trainer, an agent and a replicator of `fleetrl demo`.

The demo in miniature runs as real processes (tansu per region, amqtt, directory stores). While it
trains, the test writes one undecodable record into region local-a's `trajectories` (the trainer
dead-letters it) and one into its `prompts` (local-a's rollout worker dead-letters it), then scrapes
every daemon over HTTP until the figures of a working fleet show, and checks that each serves every
metric name docs/metrics.md lists for it, with live values where the run must have made some.
Ctrl-C (SIGINT) ends the demo; nothing it started is left running.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import yaml
from demo_testkit import STALL, alive, ctrl_c_reaches_it, demo_config, kill_leftovers
from prometheus_client.parser import text_string_to_metric_families
from slowdown import scaled

from fleetrl.broker import SCHEMA_HEADER, Producer, topic_name
from fleetrl.config import FleetConfig, load_config
from fleetrl.demo.view import LogTail
from fleetrl.metrics_doc import metric_docs

pytestmark = pytest.mark.e2e
START_TIMEOUT_S = 120  # until the trainer's first step on 2 shared cores (~10 s when idle)
SCRAPE_TIMEOUT_S = 90  # until the scrapes show a working fleet
# (both the reference machine's figures: `_wait` scales every bound it is given)
# daemon -> (log file, event naming its metrics port)
DAEMONS = {
    "trainer": ("trainer.log", "trainer.metrics"),
    "agent": ("agent-local-a-node-1.log", "agent.metrics"),
    "replicator": ("replicator-local-a.log", "replicator.metrics"),
}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def demo(tmp_path: pathlib.Path) -> Iterator[tuple[subprocess.Popen[str], pathlib.Path, FleetConfig]]:
    """The demo on free ports, every daemon serving metrics, more steps than it runs (the test stops it)."""
    doc, path = demo_config(tmp_path)
    doc["rollout"]["metrics_port"] = 0
    path.write_text(yaml.safe_dump(doc))
    work = tmp_path / "work"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("FLEETRL_HUB_KEY", None)  # the demo brings its own
    proc = subprocess.Popen([sys.executable, "-m", "fleetrl.cli", "demo", "--config", str(path), *STALL, "--workdir",
                             str(work), "--steps", "1000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True, preexec_fn=ctrl_c_reaches_it)
    try:
        yield proc, work, load_config(path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the demo's own bounded cleanup first
            try:
                proc.wait(timeout=scaled(60))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=scaled(10))
        if proc.stdout is not None:
            proc.stdout.close()
        kill_leftovers(work)


def _events(log: pathlib.Path, event: str) -> list[dict[str, object]]:
    return [doc for doc in LogTail(log).events() if doc.get("event") == event]


def _wait(what: str, check: Callable[[], bool], proc: subprocess.Popen[str], timeout_s: float) -> None:
    """Poll `check` until it holds, within `timeout_s` (the reference machine's figure, scaled)."""
    timeout_s = scaled(timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the demo exited ({proc.returncode}) before {what}:\n{out[-4000:]}")
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s")


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=scaled(10)) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _samples(body: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), -1.0)


async def _plant_bad_records(config: FleetConfig) -> None:
    """One undecodable record in local-a's trajectories (for the trainer) and prompts (for its worker)."""
    async with Producer(config, "local-a", "test-bad-records") as producer:
        for stream in ("trajectories", "prompts"):
            await producer.send_raw(topic_name(config.run, stream), f"bad-{stream}".encode(), b"\xc1 not msgpack",
                                    [(SCHEMA_HEADER, b"fleetrl.group/1")])


# What a working fleet shows once it trained a step and the planted records were dead-lettered.
LIVE: dict[str, Callable[[Samples], bool]] = {
    "trainer": lambda s: _value(s, "fleetrl_trainer_steps_total") >= 1
    and _value(s, "fleetrl_trainer_dead_lettered_records_total", region="local-a", reason="malformed") == 1
    and _value(s, "fleetrl_trainer_consumer_lag_records", region="local-a") >= 0
    and _value(s, "fleetrl_trainer_consumer_lag_records", region="local-b") >= 0
    and _value(s, "fleetrl_trainer_groups_received_total", region="local-a") >= 1,
    "agent": lambda s: _value(s, "fleetrl_rollout_groups_done_total") >= 1
    and _value(s, "fleetrl_rollout_dead_lettered_records_total", reason="malformed") == 1
    and _value(s, "fleetrl_agent_state", state="up") == 1,
    "replicator": lambda s: _value(s, "fleetrl_replicator_versions_copied_total", region="local-a") >= 1
    and _value(s, "fleetrl_replicator_lease_held", region="local-a") == 1,
}


def test_every_daemon_serves_its_documented_metrics_and_healthz_while_the_fleet_runs(
    demo: tuple[subprocess.Popen[str], pathlib.Path, FleetConfig],
) -> None:
    proc, work, config = demo
    logs = work / "logs"
    _wait("first training step", lambda: bool(_events(logs / "trainer.log", "step.done")), proc, START_TIMEOUT_S)
    ports: dict[str, int] = {}
    for daemon, (log, event) in DAEMONS.items():
        _wait(f"{event} in {log}", lambda log=log, event=event: bool(_events(logs / log, event)), proc, 30)
        ports[daemon] = int(str(_events(logs / log, event)[0]["port"]))
    asyncio.run(_plant_bad_records(config))

    scraped: dict[str, str] = {}

    def live() -> bool:
        for daemon, port in ports.items():
            status, scraped[daemon] = _get(port, "/metrics")
            assert status == 200, f"{daemon} /metrics answered {status}"
        return all(LIVE[d](_samples(scraped[d])) for d in DAEMONS)

    try:
        _wait("scrape showing a working fleet", live, proc, SCRAPE_TIMEOUT_S)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last scrapes:\n" + "\n".join(
            f"--- {d}\n" + "\n".join(ln for ln in body.splitlines() if not ln.startswith("#"))
            for d, body in scraped.items())) from None

    for daemon, body in scraped.items():
        documented = {d.name.removesuffix("_total") for d in metric_docs() if d.daemon == daemon}
        served = {n.removesuffix("_total") for n in re.findall(r"^# TYPE (fleetrl_\w+) ", body, re.M)
                  if not n.endswith("_created")}
        assert documented, daemon
        assert documented <= served, f"{daemon} does not serve {sorted(documented - served)}"
        assert served <= documented, f"{daemon} serves undocumented {sorted(served - documented)}"
        status, health = _get(ports[daemon], "/healthz")
        assert status == 200, f"{daemon} /healthz answered {status}: {health}"
        if daemon == "agent":  # the agent's reason line is JSON with its state and engines
            doc = json.loads(health)
            assert doc["ok"] is True and doc["state"] == "up" and doc["engines"][0]["state"] == "up", doc
        else:
            assert health == "ok\n", (daemon, health)

    pids: dict[str, int] = json.loads((work / "pids.json").read_text())
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=scaled(90))
    assert proc.returncode == 130
    assert [name for name, pid in pids.items() if alive(pid)] == []
