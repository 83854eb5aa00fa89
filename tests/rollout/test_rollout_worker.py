"""The worker against real tansu and a directory hub: nothing lost, nothing duplicated, handover keeps tokens."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import IO, Any

import numpy as np
import pytest
import torch
from aiokafka.partitioner import DefaultPartitioner
from rollout_testkit import (
    HUB_KEY,
    REGION,
    fleet_dict,
    groups,
    make_config,
    partials,
    prompts,
    publish_tiny,
    read_stream,
    send_prompts,
    setup_topics,
)
from slowdown import scaled

from fleetrl.broker import (
    SCHEMA_HEADER,
    SCHEMA_PROMPT,
    Consumer,
    Producer,
    PromptRecord,
    RecordLimits,
    group_lag,
    rollout_group,
    topic_name,
)
from fleetrl.config import FleetConfig
from fleetrl.rollout.worker import RolloutWorker

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    torch.set_num_threads(1)


async def _run_worker_until(config: FleetConfig, node: str, done: Any, timeout_s: float) -> RolloutWorker:
    """Run an in-process worker until `done(worker)` holds (bounded: `timeout_s` on the reference machine,
    scaled), then stop it (SIGTERM path)."""
    worker, stop = RolloutWorker(config, REGION, node), asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(timeout_s)
    while not done(worker) and loop.time() < deadline and not task.done():
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, timeout=scaled(30))
    return worker


async def test_n_prompts_become_n_groups(run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path) -> None:
    config = make_config(fleet_dict(run_id, tansu_bootstrap, tmp_path / "store", group_session_timeout_s=8.0))
    publish_tiny(config)
    await setup_topics(config)
    sent = prompts(config, 6, max_new_tokens=8)
    await send_prompts(config, sent)
    worker = await _run_worker_until(config, "n1", lambda w: w.groups_done >= 6, timeout_s=60)
    out = groups(await read_stream(config, "trajectories", 6, timeout_s=20))
    assert sorted(g.group_id for g in out) == sorted(p.group_id for p in sent)  # none lost, none twice
    by_id = {p.group_id: p for p in sent}
    for g in out:
        assert (g.region, g.node, g.task, len(g.samples)) == (REGION, "n1", "reverse", 4)
        assert g.prompt_ids[0] == 1 and len(g.prompt_ids) == len(by_id[g.group_id].prompt or "") + 1
        for s in g.samples:
            assert 1 <= len(s.completion_ids) <= 8 and (s.versions == 0).all()
            assert s.finish_reason in ("stop", "length") and 0.0 <= s.reward <= 1.0
            assert np.isfinite(s.logprobs).all() and (s.logprobs <= 0).all()
    assert worker.groups_handed_over == 0
    assert worker.consumer.timeouts[:2] == (8.0, 1.0)  # rollout.group_session_timeout_s; beats at most 1 s apart
    # Everything was committed: a new member of the rollout group finds no work.
    again = await read_stream(config, "prompts", 1, timeout_s=2, group=f"fleetrl.{run_id}.rollout", scale=False)
    assert again == []


async def _rollout_lag(config: FleetConfig) -> int:
    return sum(row.lag for row in await group_lag(config, REGION) if row.group.endswith(".rollout"))


async def test_dead_letters_are_committed_without_waiting_for_a_group(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path
) -> None:
    """Prompts that are all hostile complete no group, yet the worker commits past their dead letters
    while it runs (a worker SIGKILLed afterwards leaves nothing to dead-letter twice)."""
    config = make_config(fleet_dict(run_id, tansu_bootstrap, tmp_path / "store"))
    publish_tiny(config)
    await setup_topics(config)
    topic = topic_name(config.run, "prompts")
    async with Producer(config, REGION, "hostile") as producer:
        await asyncio.gather(*(producer.send_raw(topic, b"h%d" % i, b"\xc1 not msgpack %d" % i,
                                                 [(SCHEMA_HEADER, SCHEMA_PROMPT.encode())]) for i in range(40)))
    worker, stop = RolloutWorker(config, REGION, "n1"), asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    loop = asyncio.get_running_loop()
    deadline, lag = loop.time() + scaled(60), -1
    try:
        while loop.time() < deadline and not task.done():
            if sum(worker.dead_lettered.values()) == 40:
                lag = await _rollout_lag(config)
                if lag == 0:
                    break
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=scaled(30))
    assert worker.dead_lettered == {"malformed": 40} and worker.groups_done == 0
    assert lag == 0, f"the rollout group still lags {lag} records behind its dead letters"


def _spawn_worker(
    config_path: pathlib.Path, node: str, log_path: pathlib.Path
) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    log = open(log_path, "wb")  # noqa: SIM115 - closed by the test after the process ended
    env = {**os.environ, "FLEETRL_HUB_KEY": HUB_KEY, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fleetrl.rollout", "--config", str(config_path),
                             "--region", REGION, "--node", node], stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, log


def _events(log_path: pathlib.Path) -> Iterator[dict[str, Any]]:
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            yield json.loads(line)


def _wait_for_event(proc: subprocess.Popen[bytes], log_path: pathlib.Path, pred: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if any(pred(e) for e in _events(log_path)):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"worker never logged the awaited event; log tail: {log_path.read_text()[-2000:]}")


@pytest.fixture
def worker_procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Worker subprocesses a test starts; any still running at the end are killed by their PID."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=scaled(10))


async def test_sigkill_before_commit_redoes_the_prompts(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path, worker_procs: list[subprocess.Popen[bytes]]
) -> None:
    data = fleet_dict(run_id, tansu_bootstrap, tmp_path / "store")
    config = make_config(data)
    config_path = tmp_path / "fleet.yaml"
    config_path.write_text(json.dumps(data))
    publish_tiny(config)
    await setup_topics(config)
    # min_version 1 is not published yet: the worker takes the prompts and holds them uncommitted.
    sent = prompts(config, 4, max_new_tokens=8, min_version=1)
    await send_prompts(config, sent)
    proc, log = _spawn_worker(config_path, "doomed", tmp_path / "doomed.log")
    worker_procs.append(proc)
    admitted: set[str] = set()
    deadline = time.monotonic() + scaled(60)
    while len(admitted) < 4 and time.monotonic() < deadline and proc.poll() is None:
        admitted = {e["group_id"] for e in _events(tmp_path / "doomed.log") if e.get("event") == "worker.admitted"}
        time.sleep(0.05)
    assert len(admitted) == 4, (tmp_path / "doomed.log").read_text()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=scaled(10))
    log.close()
    publish_tiny(config, seed=1)  # version 1 arrives; a new worker redoes every prompt
    await _run_worker_until(config, "survivor", lambda w: w.groups_done >= 4, timeout_s=60)
    out = groups(await read_stream(config, "trajectories", 4, timeout_s=20))
    assert sorted(g.group_id for g in out) == sorted(p.group_id for p in sent)
    assert all(g.node == "survivor" and all((s.versions == 1).all() for s in g.samples) for g in out)


def _two_per_partition(records: list[PromptRecord], partitions: int) -> list[PromptRecord]:
    """Two records per partition of the topic, by the producer's own key hash (aiokafka's default)."""
    hashed, picked = DefaultPartitioner(), defaultdict(list)
    for r in records:
        part = hashed(r.group_id.encode(), list(range(partitions)), list(range(partitions)))
        if len(picked[part]) < 2:
            picked[part].append(r)
    assert len(picked) == partitions and all(len(v) == 2 for v in picked.values())
    return [r for part in sorted(picked) for r in picked[part]]


async def test_a_member_joining_and_leaving_commits_nothing_early_and_loses_nothing(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path
) -> None:
    """Prompts wait uncommitted for a version not yet published while a second member joins the rollout
    group and leaves again (a spot node's life). Each of the four prompt partitions holds two; the
    visitor takes three of the six partitions, so at least one prompt partition stays and one moves.
    The worker reads its kept partitions again from their committed offsets: those re-delivered
    prompts are the same work, not done (before, it counted them done and committed prompts it had not
    produced). Prompts of partitions that went to the visitor are given up here and read again after
    it leaves; at the end every prompt is produced exactly once."""
    data = fleet_dict(run_id, tansu_bootstrap, tmp_path / "store", max_groups_in_flight=4)
    data["kafka"]["partitions"] = {"prompts": 4, "partials": 2, "trajectories": 2, "dead_letter": 1}
    config = make_config(data)
    publish_tiny(config)
    await setup_topics(config)
    sent = _two_per_partition(prompts(config, 64, max_new_tokens=4, min_version=1), 4)
    await send_prompts(config, sent)
    worker, stop = RolloutWorker(config, REGION, "n1"), asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    loop = asyncio.get_running_loop()
    try:
        deadline = loop.time() + scaled(60)
        while worker.stats()["groups_in_flight"] < 8 and loop.time() < deadline and not task.done():
            await asyncio.sleep(0.05)
        assert worker.stats()["groups_in_flight"] == 8  # all admitted, all waiting for version 1
        limits = RecordLimits.from_config(config)
        async with Producer(config, REGION, "visitor") as producer:
            visitor = Consumer(config, REGION, ["partials", "prompts"], rollout_group(config.run), limits,
                               producer, "visitor")
            async with visitor:  # joined and assigned once it starts; it never polls, so reads nothing
                moved = visitor.assignment()
                prompts_topic = topic_name(config.run, "prompts")
                assert len(moved) == 3 and sum(t == prompts_topic for t, _ in moved) >= 1  # one of 4 stays at least
                deadline = loop.time() + scaled(30)
                while worker.consumer.assignment() & moved or not worker.consumer.assignment():
                    assert loop.time() < deadline, "the worker was never re-assigned"
                    await asyncio.sleep(0.1)
                on_moved = 2 * sum(t == prompts_topic for t, _ in moved)
                # the kept partitions' records come again from the committed offsets
                deadline = loop.time() + scaled(30)
                while worker.redelivered < 8 - on_moved and loop.time() < deadline:
                    await asyncio.sleep(0.1)
                assert worker.redelivered == 8 - on_moved
                assert await _rollout_lag(config) == 8, "a prompt was committed before its group was produced"
                assert worker.stats()["groups_in_flight"] == 8 - on_moved  # the visitor's were given up
        publish_tiny(config, seed=1)  # version 1: the worker, alone again, produces every prompt
        deadline = loop.time() + scaled(90)
        while worker.groups_done < 8 and loop.time() < deadline and not task.done():
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=scaled(30))
    out = groups(await read_stream(config, "trajectories", 9, timeout_s=10))
    assert sorted(g.group_id for g in out) == sorted(p.group_id for p in sent)  # each once: none lost, none twice
    assert await _rollout_lag(config) == 0


async def test_sigterm_mid_generation_hands_over_tokens_that_another_worker_keeps(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path, worker_procs: list[subprocess.Popen[bytes]]
) -> None:
    long = 400  # a random-init model rarely emits EOS: generation is long enough to interrupt
    data = fleet_dict(run_id, tansu_bootstrap, tmp_path / "store", max_new_tokens=long)
    config = make_config(data)  # the finisher's: full speed
    # The preempted worker's steps take 50 ms each: its groups are mid-generation for ~20 s after the first
    # tokens, not the half second the tiny model needs, however late the test gets to send SIGTERM.
    data["regions"][0]["engine"]["emulate"] = {"step_delay_s": 0.05, "tail_p": 1.0}
    config_path = tmp_path / "fleet.yaml"
    config_path.write_text(json.dumps(data))
    publish_tiny(config)
    await setup_topics(config)
    sent = prompts(config, 3, max_new_tokens=long)
    await send_prompts(config, sent)
    proc, log = _spawn_worker(config_path, "preempted", tmp_path / "preempted.log")
    worker_procs.append(proc)
    _wait_for_event(proc, tmp_path / "preempted.log",
                    lambda e: e.get("event") == "worker.stats" and e["tokens_in_flight"] > 0, timeout_s=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=scaled(30)) == 0
    log.close()
    # As many partials as the worker says it handed over (they may lie in both partitions).
    [stopped] = [e for e in _events(tmp_path / "preempted.log") if e.get("event") == "worker.stopped"]
    n_handed = stopped["handed_over"].get("sigterm", 0)
    handed = partials(await read_stream(config, "partials", n_handed, timeout_s=30, group=f"{run_id}-peek"))
    assert n_handed >= 1 and len(handed) == n_handed
    assert all(p.handed_over_by.reason == "sigterm" for p in handed)
    assert all(p.handed_over_by.node == "preempted" for p in handed)
    assert sum(len(s.completion_ids) for p in handed for s in p.samples) > 0

    await _run_worker_until(config, "finisher", lambda w: w.groups_done >= len(handed), timeout_s=90)
    out = groups(await read_stream(config, "trajectories", 3, timeout_s=20))
    assert sorted(g.group_id for g in out) == sorted(p.group_id for p in sent)  # none lost, none twice
    final = {g.group_id: g for g in out}
    for p in handed:
        g = final[p.group_id]
        assert g.node == "finisher"
        for before, after in zip(p.samples, g.samples, strict=True):
            n = len(before.completion_ids)
            np.testing.assert_array_equal(after.completion_ids[:n], before.completion_ids)
            np.testing.assert_array_equal(after.logprobs[:n], before.logprobs)
            np.testing.assert_array_equal(after.versions[:n], before.versions)
            if before.finish_reason is not None:
                assert after.finish_reason == before.finish_reason and len(after.completion_ids) == n


async def test_deadline_and_min_version_hand_groups_back_as_partials(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path
) -> None:
    """A deadline shorter than any engine step cuts a group after each of its steps, however fast the
    machine (the loop steps before it checks the deadline, so every round adds a token and the group
    ends within `long` rounds); a prompt asking for a version never published comes back again and
    again, and is still waiting, freshly re-admitted from `partials`, when the worker stops."""
    long = 12
    data = fleet_dict(run_id, tansu_bootstrap, tmp_path / "store", max_new_tokens=long,
                      group_deadline_s=1e-6, min_version_wait_s=0.2)
    config = make_config(data)
    publish_tiny(config)
    await setup_topics(config)
    runs_long, needs_v5 = prompts(config, 2, max_new_tokens=long)
    needs_v5.min_version = 5  # never published: handed back after min_version_wait_s, again and again

    def done(w: RolloutWorker) -> bool:  # needs_v5 back in the worker after at least one hand-back
        return w.groups_done >= 1 and w.handed_over_by_reason["min_version"] >= 1 \
            and w.stats()["groups_in_flight"] == 1

    await send_prompts(config, [runs_long, needs_v5])
    worker = await _run_worker_until(config, "n1", done, timeout_s=90)
    assert worker.groups_done == 1 and worker.handed_over_by_reason["deadline"] >= 1
    assert worker.handed_over_by_reason["sigterm"] == 1  # needs_v5, still waiting when the worker stopped
    handed = partials(await read_stream(config, "partials", worker.groups_handed_over, timeout_s=10,
                                        group=f"{run_id}-peek"))
    reasons = Counter((p.group_id, p.handed_over_by.reason) for p in handed)
    assert reasons == {(runs_long.group_id, "deadline"): worker.handed_over_by_reason["deadline"],
                       (needs_v5.group_id, "min_version"): worker.handed_over_by_reason["min_version"],
                       (needs_v5.group_id, "sigterm"): 1}
    assert all(len(s.completion_ids) == 0 for p in handed if p.group_id == needs_v5.group_id for s in p.samples)
    [done_group] = groups(await read_stream(config, "trajectories", 1, timeout_s=10))
    assert done_group.group_id == runs_long.group_id
    cuts = sorted((p for p in handed if p.group_id == runs_long.group_id),
                  key=lambda p: sum(len(s.completion_ids) for s in p.samples))
    sizes = [sum(len(s.completion_ids) for s in p.samples) for p in cuts]
    assert sizes == sorted(set(sizes)) and sizes[0] >= 1  # each round added tokens; none cut empty
    for before, after in zip(cuts[-1].samples, done_group.samples, strict=True):
        np.testing.assert_array_equal(after.completion_ids[: len(before.completion_ids)], before.completion_ids)


WAIT_S = scaled(10.0)
"""The worker's `min_version_wait_s` in the test below, scaled by the machine's slowdown: the test leaves
the worker half of it to take each new version, which a slower machine needs longer for."""


async def test_prompts_sent_ahead_wait_beside_the_decoding_slots_while_versions_keep_coming(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path
) -> None:
    """Two prompts ask for version 2 (sent ahead by the trainer) while version 0 is the newest. They wait
    here without taking the worker's 2 decoding slots from two prompts of version 0; and because
    versions keep landing (1 halfway through `min_version_wait_s`, 2 just after it), they are not
    handed back `min_version_wait_s` after their receipt: that clock restarts with each new version.

    The times are on the worker's own clock (its prompts' receipt), and leave the worker half the wait
    (5 s) to take each version: a busy machine's slower test loop does not change the verdict."""
    data = fleet_dict(run_id, tansu_bootstrap, tmp_path / "store", max_groups_in_flight=2,
                      min_version_wait_s=WAIT_S)
    data["kafka"]["partitions"]["prompts"] = 1  # the worker reads them in the order sent: ahead first
    config = make_config(data)
    publish_tiny(config)
    await setup_topics(config)
    now_p, ahead_p = prompts(config, 2, max_new_tokens=8), prompts(config, 4, max_new_tokens=8)[2:]
    for p in ahead_p:
        p.min_version = 2
    await send_prompts(config, ahead_p + now_p)
    worker, stop = RolloutWorker(config, REGION, "n1"), asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    loop = asyncio.get_running_loop()
    ahead_ids = {p.group_id for p in ahead_p}
    try:
        deadline = loop.time() + scaled(30)
        while loop.time() < deadline and not task.done() and not (
                {j.group_id for j in worker._waiting} == ahead_ids and worker.groups_done == 2):
            await asyncio.sleep(0.02)
        assert worker.groups_done == 2 and {j.group_id for j in worker._waiting} == ahead_ids, \
            "the version-0 prompts were held back behind the ones sent ahead"
        # the hand-back clock of the waiting prompts started here (time.monotonic, the worker's clock)
        clock = min(max(j.received_mono, worker._have_since) for j in worker._waiting)
        await asyncio.sleep(max(0.0, clock + WAIT_S / 2 - time.monotonic()))
        assert await asyncio.to_thread(publish_tiny, config, 1) == 1
        await asyncio.sleep(max(0.0, clock + WAIT_S + 0.5 - time.monotonic()))  # past the first deadline
        assert await asyncio.to_thread(publish_tiny, config, 2) == 2
        deadline = loop.time() + scaled(30)
        while worker.groups_done < 4 and loop.time() < deadline and not task.done():
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=scaled(30))
    assert worker.groups_done == 4 and worker.groups_handed_over == 0
    out = groups(await read_stream(config, "trajectories", 4, timeout_s=20))
    ahead_out = [g for g in out if g.group_id in ahead_ids]
    assert len(ahead_out) == 2 and all((s.versions == 2).all() for g in ahead_out for s in g.samples)


async def test_a_preemption_cuts_the_poll_short_and_leaves_its_prompts_to_the_next_owner(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path
) -> None:
    """A node told of its preemption does not wait for its poll (a rebalance can hold one for seconds,
    the node paid all along): the poll is cancelled, and a prompt that reaches the partitions after the
    notice stays in Kafka, uncommitted, for the partition's next owner. Before, the poll (here one of
    60 s on an idle worker) went on, took the prompt, and handed it over as a partial of no tokens."""
    config = make_config(fleet_dict(run_id, tansu_bootstrap, tmp_path / "store", idle_poll_s=60.0,
                                    handover_timeout_s=150.0))
    publish_tiny(config)
    await setup_topics(config)
    worker, stop, preempted = RolloutWorker(config, REGION, "spot"), asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(worker.run(stop, preempted))
    loop = asyncio.get_running_loop()
    try:
        deadline = loop.time() + scaled(60)
        while not (getattr(worker, "consumer", None) is not None and worker.consumer.assignment()):
            assert loop.time() < deadline and not task.done(), "the worker never polled an assignment"
            await asyncio.sleep(0.05)
        preempted.set()
        deadline = loop.time() + scaled(10)  # the poll (60 s) would outlast this unless cut short
        while not getattr(worker, "polls_cancelled", 0) and loop.time() < deadline and not task.done():
            await asyncio.sleep(0.05)
        sent = prompts(config, 1, max_new_tokens=4)
        await send_prompts(config, sent)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=scaled(120))
    assert worker.groups_handed_over == 0 and worker.groups_done == 0
    assert worker.polls_cancelled == 1
    assert await _rollout_lag(config) == 1  # the prompt waits, uncommitted, for whoever owns its partition next
    again = await read_stream(config, "prompts", 1, timeout_s=20, group=f"fleetrl.{run_id}.rollout")
    assert [d.record.group_id for d in again] == [sent[0].group_id]
