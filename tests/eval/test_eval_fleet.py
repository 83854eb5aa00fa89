"""`fleetrl eval --where fleet` on real tansu and MQTT with one rollout worker; and with no fleet up.

The worker stands for a region: its agent's heartbeats are published here (a serving node), the
trainer's consumer group reads `trajectories` beside the command and hands what it reads to a trainer's
eval runner, as the running trainer would."""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
from typing import Any

import pytest
import torch
from eval_fleet_testkit import HUB_KEY, REGION, fleet_dict, make_config, write
from fleet_testkit import publish_tiny, read_stream
from slowdown import scaled

from fleetrl import devstack
from fleetrl.broker import (
    Consumer,
    ControlPlane,
    GroupRecord,
    Heartbeat,
    Producer,
    RecordLimits,
    ensure_topics,
    trainer_group,
)
from fleetrl.cli import main
from fleetrl.hub import Hub
from fleetrl.rollout.worker import RolloutWorker
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.eval_book import eval_request_of
from fleetrl.trainer.eval_runner import EvalRunner

pytestmark = pytest.mark.integration

SETS = [{"name": "greedy", "num_prompts": 5, "max_new_tokens": 8},
        {"name": "sampled", "num_prompts": 3, "samples_per_prompt": 2, "temperature": 1.0, "pass_threshold": 0.3}]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    torch.set_num_threads(1)


def _fleet(run_id: str, bootstrap: str, mqtt_port: int, tmp_path: pathlib.Path) -> dict[str, Any]:
    return fleet_dict(run_id, bootstrap, tmp_path / "store", mqtt_port, SETS)


def _eval(*args: str) -> tuple[int, Any]:
    """`fleetrl eval ... --json` in this process: (exit code, the rows or None)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["eval", *args, "--json"])
    return code, json.loads(out.getvalue()) if code == 0 else None


async def test_eval_on_the_fleet_returns_each_prompt_once_at_its_pinned_version(
        run_id: str, tansu_bootstrap: str, mqtt_server: devstack.ServerProcess, tmp_path: pathlib.Path) -> None:
    """Versions 0 and 1 are in the store; `--version 0 --where fleet` sends every prompt through Kafka to the
    worker, which generates it at exactly 0 (not the newer 1); each comes back once; the greedy set's figures
    equal the local mode's; the trainer's group still reads every group and its runner skips them all."""
    data = _fleet(run_id, tansu_bootstrap, mqtt_server.port, tmp_path)
    path, config = write(tmp_path, data), make_config(data)
    publish_tiny(config)
    publish_tiny(config, seed=1)
    await ensure_topics(config, REGION)
    worker, stop = RolloutWorker(config, REGION, "n1"), asyncio.Event()
    work = asyncio.create_task(worker.run(stop))
    async with ControlPlane(config, f"{run_id}-agent") as agent, \
            Producer(config, REGION, f"{run_id}-trainer-p") as dead_letters, \
            Consumer(config, REGION, ["trajectories"], trainer_group(run_id), RecordLimits.from_config(config),
                     dead_letters, f"{run_id}-trainer-c") as trainer_consumer:

        async def beat() -> None:  # the region agent's heartbeats: one serving node
            while not stop.is_set():
                await agent.heartbeat(REGION, "n1", Heartbeat(state="up", ts=time.time(), engines=1))
                await asyncio.sleep(0.5)

        beating = asyncio.create_task(beat())
        try:
            code, rows = await asyncio.to_thread(_eval, "--config", str(path), "--version", "0", "--where", "fleet",
                                                 "--timeout-s", str(scaled(120)), "--probe-s", str(scaled(5)))
            assert code == 0
            # The trainer's group reads every group the command's prompts made (the command took none away).
            trainer_runner = EvalRunner(config, {}, _no_send, RegionCredits({REGION: 1.0}, window_s=30.0,
                                                                            tokens_per_group=8.0))
            seen: list[GroupRecord] = []
            loop = asyncio.get_running_loop()
            deadline = loop.time() + scaled(60)
            while len(seen) < 8 and loop.time() < deadline:
                seen += [d.record for d in await trainer_consumer.poll(64, 0.5) if isinstance(d.record, GroupRecord)]
        finally:
            stop.set()
            await beating
            await asyncio.wait_for(work, timeout=scaled(30))
    assert [(r["set"], r["version"], r["prompts"], r["samples"]) for r in rows] == [
        ("greedy", 0, 5, 5), ("sampled", 0, 3, 6)]
    assert rows[0]["regions"] == {REGION: 5}
    # Each prompt came back once, every token at exactly version 0, while version 1 was the newest.
    out = [d.record for d in await read_stream(config, REGION, "trajectories", 8, timeout_s=20)
           if isinstance(d.record, GroupRecord)]
    requests = {eval_request_of(g.group_id, run_id) for g in out}
    assert len(requests) == 1 and None not in requests and len({g.group_id for g in out}) == len(out) == 8
    for g in out:
        assert g.eval is not None and g.eval.version == 0
        assert all((s.versions == 0).all() for s in g.samples), g.group_id
    with Hub.from_config(config) as hub:
        assert hub.pinned() == []  # the request's pin is released
    # The trainer neither trains, nor dead-letters, nor books them: skipped and counted.
    assert len(seen) == 8
    for g in seen:
        trainer_runner.on_group(g, 0)
    assert trainer_runner.book.foreign == 8 and trainer_runner.book.orphans == 0 and not trainer_runner.book.evals
    # Greedy is deterministic: the local mode (other group ids, the same weights) gives the same figures.
    code, local = await asyncio.to_thread(_eval, "--config", str(path), "--version", "0", "--where", "local",
                                          "--set", "greedy")
    assert code == 0
    assert {k: v for k, v in local[0].items() if k != "regions"} == {k: v for k, v in rows[0].items()
                                                                       if k != "regions"}


async def _no_send(region: str, record: object) -> None:
    raise AssertionError("the trainer's runner sends nothing here")


def test_where_fleet_with_no_fleet_is_a_clear_error_and_auto_evaluates_here(
        run_id: str, mqtt_server: devstack.ServerProcess, tmp_path: pathlib.Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    data = _fleet(run_id, "127.0.0.1:1", devstack.free_port(), tmp_path)  # no MQTT broker on that port
    path, config = write(tmp_path, data), make_config(data)
    publish_tiny(config)
    started = time.monotonic()
    assert main(["eval", "--config", str(path), "--version", "0", "--where", "fleet", "--probe-s", "2"]) == 1
    err = capsys.readouterr().err
    assert "MQTT control plane" in err and "--where local" in err
    # MQTT answers, but no node of the run's regions heartbeats: named per region.
    data["mqtt"]["url"] = f"mqtt://127.0.0.1:{mqtt_server.port}"
    path = write(tmp_path, data)
    assert main(["eval", "--config", str(path), "--version", "0", "--where", "fleet", "--probe-s", "2"]) == 1
    err = capsys.readouterr().err
    assert f"{REGION}: no serving node heartbeat" in err
    assert time.monotonic() - started < scaled(60)  # a bound, not a speed: a hang would pass it
    # auto: the same search, then the local engine
    assert main(["eval", "--config", str(path), "--version", "0", "--set", "greedy", "--probe-s", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert "evaluating here" in captured.err and json.loads(captured.out)[0]["prompts"] == 5


async def test_a_fleet_that_returns_nothing_in_time_fails_naming_what_returned_and_releases_its_pin(
        run_id: str, tansu_bootstrap: str, mqtt_server: devstack.ServerProcess, tmp_path: pathlib.Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A node heartbeats but no worker takes the prompts: the command ends at `--timeout-s` (the bound under
    test, not scaled) with exit 1, naming what returned, and its pin is gone."""
    data = _fleet(run_id, tansu_bootstrap, mqtt_server.port, tmp_path)
    path, config = write(tmp_path, data), make_config(data)
    publish_tiny(config)
    await ensure_topics(config, REGION)
    async with ControlPlane(config, f"{run_id}-agent") as agent:
        # (stamped ahead: it stays fresh for the whole run without an agent beating)
        await agent.heartbeat(REGION, "n1", Heartbeat(state="up", ts=time.time() + scaled(60), engines=1))
        code = await asyncio.to_thread(main, ["eval", "--config", str(path), "--version", "latest", "--where",
                                              "fleet", "--set", "greedy", "--timeout-s", "2",
                                              "--probe-s", str(scaled(5))])
    assert code == 1
    err = capsys.readouterr().err
    assert "greedy@0 0/5 returned within --timeout-s 2 s" in err and "pin is released" in err
    with Hub.from_config(config) as hub:
        assert hub.pinned() == []


def test_a_region_serves_when_a_node_is_up_with_an_engine_up_and_heartbeats_recently() -> None:
    from fleetrl.broker import EngineStatus
    from fleetrl.eval_fleet import serving_nodes

    now = 1000.0
    nodes = {("a", "1"): Heartbeat(state="up", ts=now - 1, engines=1),
             ("a", "2"): Heartbeat(state="up", ts=now - 1, engines=1),
             ("b", "1"): Heartbeat(state="up", ts=now - 10, engines=1),  # silent for 10 s: a dead agent
             ("c", "1"): Heartbeat(state="draining", ts=now, engines=1),
             ("d", "1"): Heartbeat(state="up", ts=now, engines=[EngineStatus(index=0, state="starting")]),
             ("e", "1"): Heartbeat(state="up", ts=now, engines=[EngineStatus(index=0, state="up")])}
    assert serving_nodes(nodes, now, stale_after_s=6.0) == {"a": 2, "e": 1}
