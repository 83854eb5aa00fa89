"""`fleetrl topics ...` and `fleetrl status` through `fleetrl.cli.main`, against the fixture servers."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import pathlib
from typing import Any

import pytest
from broker_testkit import (
    commands_listening,
    fleet_yaml,
    make_config,
    make_group,
    make_prompt,
    next_command,
    poll_until,
    write_config,
)
from slowdown import scaled

from fleetrl import devstack
from fleetrl.broker import (
    SCHEMA_HEADER,
    Consumer,
    ControlPlane,
    EngineStatus,
    Heartbeat,
    PolicyAnnouncement,
    Producer,
    RecordError,
    RecordLimits,
    ensure_topics,
    topic_name,
    trainer_group,
)
from fleetrl.broker.lag import end_offsets
from fleetrl.cli import main

pytestmark = pytest.mark.integration


@pytest.fixture
def fleet_file(run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path) -> pathlib.Path:
    return write_config(fleet_yaml(run_id, tansu_bootstrap), tmp_path / "fleet.yaml")


class Run:
    """`fleetrl ...` through `main`, with stdout and stderr captured in memory.

    Not capsys: structlog loggers keep the stream they were created with, and capsys closes its
    streams after each test.
    """

    def __init__(self, *argv: str) -> None:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            self.code = main(list(argv))
        self.out, self.err = out.getvalue(), err.getvalue()

    @property
    def json(self) -> Any:
        assert self.out.strip(), f"no output; stderr: {self.err[-2000:]}"
        return json.loads(self.out)


def test_create_is_idempotent(fleet_file: pathlib.Path, run_id: str) -> None:
    run = Run("topics", "create", "--config", str(fleet_file), "--json")
    code, first = run.code, run.json
    assert code == 0
    assert {(c["topic"], c["action"]) for c in first} == {
        (f"fleetrl.{run_id}.{s}", "created") for s in ("prompts", "partials", "trajectories", "dead-letter")}
    run = Run("topics", "create", "--config", str(fleet_file), "--json")
    code, second = run.code, run.json
    assert code == 0 and [c["action"] for c in second] == ["unchanged"] * 4
    run = Run("topics", "describe", "--config", str(fleet_file), "--json")
    code, described = run.code, run.json
    assert code == 0
    partitions = {r["topic"].rsplit(".", 1)[1]: r["partitions"] for r in described}
    assert partitions == {"prompts": 4, "partials": 4, "trajectories": 4, "dead-letter": 1}
    by_topic = {r["topic"].rsplit(".", 1)[1]: r for r in described}
    assert by_topic["trajectories"]["configs"]["max.message.bytes"] == str(1024 * 1024)
    assert all(r["differences"] == [] for r in described)
    # The table form says "unchanged" for people too.
    table = Run("topics", "create", "--config", str(fleet_file))
    assert table.code == 0 and table.out.count("unchanged") == 4


def test_create_reports_a_topic_unlike_its_spec(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path
) -> None:
    small = write_config(fleet_yaml(run_id, tansu_bootstrap, partitions=2), tmp_path / "small.yaml")
    big = write_config(fleet_yaml(run_id, tansu_bootstrap, partitions=6), tmp_path / "big.yaml")
    assert Run("topics", "create", "--config", str(small), "--json").code == 0
    run = Run("topics", "create", "--config", str(big), "--json")
    code, changes = run.code, run.json
    assert code == 1
    prompts = next(c for c in changes if c["topic"].endswith(".prompts"))
    assert prompts["action"] == "differs" and "partitions 2 (spec 6)" in prompts["detail"]
    run = Run("topics", "list", "--config", str(big), "--json")
    code, listed = run.code, run.json
    assert {r["partitions"] for r in listed if not r["topic"].endswith("dead-letter")} == {2}


def test_lag_matches_what_was_produced_and_committed(
    fleet_file: pathlib.Path, run_id: str, tansu_bootstrap: str
) -> None:
    config = make_config(fleet_yaml(run_id, tansu_bootstrap))

    async def produce_and_commit() -> dict[int, int]:
        await ensure_topics(config, "r1")
        async with Producer(config, "r1", "p") as producer:
            for i in range(10):
                await producer.send("trajectories", f"g{i}", make_group(f"g{i}", run=run_id))
            for i in range(5):
                await producer.send("prompts", f"p{i}", make_prompt(f"p{i}", run=run_id))
            async with Consumer(config, "r1", ["trajectories"], trainer_group(run_id),
                                RecordLimits.from_config(config), producer, "trainer") as consumer:
                got = await poll_until(consumer, 10)
                await consumer.commit([d for d in got if d.offset == 0])  # one record per partition is done
        return {p: 1 for p in {d.partition for d in got}}

    committed = asyncio.run(produce_and_commit())
    ends = asyncio.run(end_offsets(config, "r1", topic_name(run_id, "trajectories")))
    run = Run("topics", "lag", "--config", str(fleet_file), "--json")
    code, rows = run.code, run.json
    assert code == 0
    trainer = {r["partition"]: r for r in rows if r["group"] == f"fleetrl.{run_id}.trainer"}
    assert {p: r["end"] for p, r in trainer.items()} == ends and sum(ends.values()) == 10
    for p, r in trainer.items():
        assert r["committed"] == committed.get(p)
        assert r["lag"] == ends[p] - committed.get(p, 0)
    rollout = [r for r in rows if r["group"] == f"fleetrl.{run_id}.rollout"]
    assert sum(r["lag"] for r in rollout if r["topic"].endswith(".prompts")) == 5  # nothing consumed yet
    assert all(r["committed"] is None for r in rollout)


def test_dead_letters_are_shown_and_replayed(
    fleet_file: pathlib.Path, run_id: str, tansu_bootstrap: str
) -> None:
    config = make_config(fleet_yaml(run_id, tansu_bootstrap))
    source = topic_name(run_id, "trajectories")

    async def dead_letter_two() -> None:
        await ensure_topics(config, "r1")
        async with Producer(config, "r1", "p") as producer:
            for i, reason in enumerate(["unknown_task", "token_range"]):
                from fleetrl.broker import encode_record

                value = encode_record(make_group(f"g{i}", run=run_id))
                err = RecordError(reason, f"{reason} went wrong", field="task", group_id=f"g{i}").at(source, 2, 40 + i)
                await producer.dead_letter(f"g{i}".encode(), value, err, source, 2, 40 + i,
                                           headers=[(SCHEMA_HEADER, b"fleetrl.group/1")])

    asyncio.run(dead_letter_two())
    run = Run("topics", "dlq", "show", "--config", str(fleet_file), "--json")
    code, shown = run.code, run.json
    assert code == 0
    assert [(d["key"], d["reason"], d["original_offset"]) for d in shown] == [
        ("g0", "unknown_task", 40), ("g1", "token_range", 41)]
    assert shown[0]["original_topic"] == source and shown[0]["schema"] == "fleetrl.group/1"

    run = Run("topics", "dlq", "replay", "--config", str(fleet_file), "--region", "r1", "--all",
                      "--dry-run", "--json")
    code, dry = run.code, run.json
    assert code == 0 and len(dry["replayed"]) == 2
    assert sum(asyncio.run(end_offsets(config, "r1", source)).values()) == 0  # a dry run sends nothing

    at = f"{shown[1]['partition']}:{shown[1]['offset']}"
    run = Run("topics", "dlq", "replay", "--config", str(fleet_file), "--region", "r1",
                       "--offset", at, "--json")
    code, done = run.code, run.json
    assert code == 0 and [d["key"] for d in done["replayed"]] == ["g1"]
    assert sum(asyncio.run(end_offsets(config, "r1", source)).values()) == 1

    missing = Run("topics", "dlq", "replay", "--config", str(fleet_file), "--region", "r1", "--offset", "0:999")
    assert missing.code == 1 and "0:999" in missing.err
    assert Run("topics", "dlq", "replay", "--config", str(fleet_file), "--region", "r1").code == 2


def test_unreachable_region_is_named(run_id: str, tmp_path: pathlib.Path) -> None:
    data = fleet_yaml(run_id, f"127.0.0.1:{devstack.free_port()}", kafka={"request_timeout_s": 2.0})
    path = write_config(data, tmp_path / "fleet.yaml")
    run = Run("topics", "list", "--config", str(path), "--json")
    assert run.code == 1 and "region 'r1'" in run.err


def test_status_shows_policy_and_nodes(
    run_id: str, mqtt_server: devstack.ServerProcess, tmp_path: pathlib.Path
) -> None:
    """`status` shows the policy and every listed node as soon as their retained messages are in (the
    generous --wait-s is only a bound); a listed node never heard from is waited for only that long."""
    data = fleet_yaml(run_id, "127.0.0.1:9", mqtt_port=mqtt_server.port)
    data["regions"][0]["nodes"] = [{"name": "n1"}, {"name": "n2"}]
    path = write_config(data, tmp_path / "fleet.yaml")

    async def publish() -> None:
        async with ControlPlane(make_config(data), f"{run_id}-trainer") as cp:
            await cp.announce_policy(PolicyAnnouncement(version=7, manifest="m", anchor=0, sha256="00",
                                                        published_at=1.0))
            engines = [EngineStatus(index=0, device="cpu", state="up", version=7),
                       EngineStatus(index=1, device="cpu", state="crashloop", restarts=3, last_error="boom")]
            await cp.heartbeat("r1", "n1", Heartbeat(state="up", version=7, tokens_per_s=99.0, engines=engines))
            await cp.heartbeat("r1", "n2", Heartbeat(state="offline", version=6))

    asyncio.run(publish())
    run = Run("status", "--config", str(path), "--json", "--wait-s", str(scaled(20)))
    code, fleet = run.code, run.json
    assert code == 0
    assert fleet["policy"]["version"] == 7
    assert [(n["node"], n["state"], n["version"]) for n in fleet["nodes"]] == [("n1", "up", 7), ("n2", "offline", 6)]
    assert [e["state"] for e in fleet["nodes"][0]["engines"]] == ["up", "crashloop"]
    table = Run("status", "--config", str(path), "--wait-s", str(scaled(20)))
    assert table.code == 0
    out = table.out
    assert "policy version 7" in out and "n1" in out and "offline" in out
    assert "0:up" in out and "1:crashloop r3 (boom)" in out

    data["regions"][0]["nodes"].append({"name": "n3"})  # never started: --wait-s ends the wait for it
    silent = Run("status", "--config", str(write_config(data, tmp_path / "fleet-n3.yaml")), "--json", "--wait-s", "1")
    assert silent.code == 0 and "n3" not in {n["node"] for n in silent.json["nodes"]}


def test_control_drain_reaches_the_regions_nodes(
    run_id: str, mqtt_server: devstack.ServerProcess, tmp_path: pathlib.Path
) -> None:
    data = fleet_yaml(run_id, "127.0.0.1:9", mqtt_port=mqtt_server.port)
    path = write_config(data, tmp_path / "fleet.yaml")

    async def listen_while_sending() -> Any:
        async with ControlPlane(make_config(data), f"{run_id}-node") as cp, \
                ControlPlane(make_config(data), f"{run_id}-prober") as prober:
            commands = cp.commands("r1")
            await commands_listening(commands, prober, "r1")  # subscribed before the operator sends
            run = await asyncio.to_thread(Run, "control", "drain", "--config", str(path), "--region", "r1",
                                          "--reason", "maintenance")
            assert run.code == 0, run.err
            return await next_command(commands)

    command = asyncio.run(listen_while_sending())
    assert (command.cmd, command.reason) == ("drain", "maintenance")


def test_control_refuses_an_unknown_region(run_id: str, tmp_path: pathlib.Path) -> None:
    path = write_config(fleet_yaml(run_id, "127.0.0.1:9"), tmp_path / "fleet.yaml")
    run = Run("control", "stop", "--config", str(path), "--region", "nowhere")
    assert run.code == 2 and "argument --region: 'nowhere' not in" in run.err  # a bad argument (issue 47)
