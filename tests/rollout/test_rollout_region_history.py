"""The region-shared response history: a worker drafts from the answers any worker of its region gave.

The engine's side (an inbox indexed within a per-step budget) runs without servers; the reader and
the worker run against real tansu: what another producer wrote to the region's `trajectories` ends
up in the engine's history, bad records are skipped without a dead letter, the worker's own groups
are not recorded twice, and the trainer's consumer group still reads every record.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from rollout_testkit import (
    HUB_KEY,
    REGION,
    fleet_dict,
    make_config,
    prompts,
    publish_tiny,
    read_stream,
    send_prompts,
    setup_topics,
)
from slowdown import scaled

from fleetrl.broker import (
    SCHEMA_GROUP,
    SCHEMA_HEADER,
    GroupRecord,
    LogTail,
    Producer,
    Sample,
    Sampling,
    expand_segments,
    floats,
    group_lag,
    ids,
    read_log,
    topic_name,
    trainer_group,
)
from fleetrl.config import FleetConfig, ModelConfig, SpeculativeConfig
from fleetrl.rollout.engine import GroupRequest
from fleetrl.rollout.history import prompt_key
from fleetrl.rollout.region_history import RegionHistory
from fleetrl.rollout.torch_engine import TorchEngine
from fleetrl.rollout.worker import RolloutWorker

P1, C1 = [1, 40, 41, 42], [[50, 51, 52, 53, 54, 55, 56], [50, 51, 60, 61]]
P2, C2 = [1, 43, 44], [[70, 71, 72, 73, 74, 75]]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    torch.set_num_threads(1)


def _engine(**spec: Any) -> TorchEngine:
    model = ModelConfig(tiny={"vocab_size": 128}).build()
    return TorchEngine(model, max_batch=4, eos_ids=[2], speculative=SpeculativeConfig(**spec))


def _group(config: FleetConfig, group_id: str, prompt: list[int], completions: list[list[int]], *,
           node: str = "n2", run: str | None = None, attempt: int = 0,
           segments: list[np.ndarray] | None = None) -> GroupRecord:
    samples = []
    for i, c in enumerate(completions):
        seg = segments[i] if segments is not None else None
        env = expand_segments(seg, len(c)) == 1  # environment tokens: logprob 0, version -1
        samples.append(Sample(ids(c), floats(np.where(env, 0.0, -0.5)), ids(np.where(env, -1, 0)), reward=1.0,
                              finish_reason="stop", segments=seg))
    return GroupRecord(group_id=group_id, run=run or config.run, task="reverse", attempt=attempt, region=REGION,
                       node=node, prompt_ids=ids(prompt), samples=samples)


async def _produce(config: FleetConfig, records: list[GroupRecord], raw: tuple[bytes, ...] = ()) -> None:
    topic = topic_name(config.run, "trajectories")
    async with Producer(config, REGION, "other-worker") as producer:
        for r in records:
            await producer.send("trajectories", r.group_id, r)
        for i, value in enumerate(raw):
            await producer.send_raw(topic, b"bad%d" % i, value, [(SCHEMA_HEADER, SCHEMA_GROUP.encode())])


async def _until(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait until `done()` holds, within `timeout_s` (the reference machine's figure, scaled)."""
    timeout_s = scaled(timeout_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not done():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


def _drafts(engine: TorchEngine, prompt: list[int], completion: list[int], after: int) -> list[int]:
    """What the history drafts for a sample of `prompt` that has produced `completion[:after]`."""
    entry = engine.history.get(prompt_key(prompt))
    assert entry is not None, f"no history for prompt {prompt}"
    return engine.history.draft(entry, completion[:after], 8)[0]


# -- the engine's side, no servers ---------------------------------------------------------------


def test_observed_answers_are_recorded_in_the_engine_thread_within_a_token_budget() -> None:
    engine = _engine(region_history_tokens_per_step=10)
    engine.observe_responses(P1, C1)
    assert engine.observed_waiting == 2 and engine.history.get(prompt_key(P1)) is None  # nothing recorded yet
    assert engine.record_observed() == 1  # 7 tokens; the next 4 would pass the budget of 10
    assert engine.record_observed() == 1
    assert engine.observed_waiting == 0 and engine.responses_observed == 2
    assert _drafts(engine, P1, C1[0], 3) == C1[0][3:]
    assert engine.history.predicted_length(prompt_key(P1), default=99) == pytest.approx(5.5)


def test_a_decoding_step_records_waiting_answers() -> None:
    engine = _engine()
    engine.observe_responses(P2, C2)
    engine.submit(GroupRequest("g", [1, 9, 9], Sampling(max_new_tokens=4), n_samples=1))
    engine.step()
    assert engine.observed_waiting == 0 and engine.responses_observed == 1
    assert _drafts(engine, P2, C2[0], 2) == C2[0][2:]


def test_the_inbox_keeps_what_the_history_could_hold() -> None:
    engine = _engine(history_responses=2, history_tokens=1024)
    engine.observe_responses(P1, [[5, 6, 7], [8, 9], [10, 11, 12]])  # a prompt keeps its last 2 answers only
    assert engine.observed_waiting == 2
    engine.observe_responses(P2, [[7] * 1019])  # 1,024 tokens waiting: the history's whole budget
    assert engine.responses_dropped == 0 and engine.observed_waiting == 3
    engine.observe_responses([1, 3], [[9] * 3])  # over it: the oldest go
    assert engine.responses_dropped == 2 and engine.observed_waiting == 2


# -- the reader, against tansu -------------------------------------------------------------------


def _config(run_id: str, bootstrap: str, tmp_path: pathlib.Path, **speculative: Any) -> FleetConfig:
    data = fleet_dict(run_id, bootstrap, tmp_path / "store")
    data["regions"][0]["engine"]["speculative"] = speculative
    return make_config(data)


@pytest.mark.integration
async def test_the_reader_records_other_workers_answers_and_skips_bad_foreign_and_own_records(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path
) -> None:
    config = _config(run_id, tansu_bootstrap, tmp_path)
    await setup_topics(config)
    episode = [30, 31, 32, 33, 34, 35]  # model turn, two environment tokens, model turn
    before = [_group(config, "g-old", P1, C1),
              _group(config, "g-foreign", [1, 90, 91], [[92, 93, 94]], run="another-run"),
              _group(config, "g-env", [1, 80], [episode], segments=[np.array([[0, 0], [3, 1], [5, 0]], np.int32)])]
    await _produce(config, before, raw=(b"\xc1 not msgpack", b"\x81\xa6schema\xaffleetrl.group/1"))
    engine = _engine()
    feed = RegionHistory(config, REGION, engine, "test-history", window=16, poll_s=0.1)
    feed.mine("g-mine", 0)
    task = asyncio.create_task(feed.run())
    try:
        await _until(lambda: feed.stats.records >= 5, 30, "the records already in the topic")
        await _produce(config, [_group(config, "g-new", P2, C2), _group(config, "g-mine", [1, 95], [[96, 97]])])
        await _until(lambda: feed.stats.records >= 7, 30, "the records produced afterwards")
        assert not task.done()  # bad records broke nothing
    finally:
        task.cancel()
        await asyncio.wait([task], timeout=scaled(30))
    while engine.record_observed():
        pass
    assert (feed.stats.records, feed.stats.skipped, feed.stats.own, feed.stats.responses) == (7, 3, 1, 4)
    assert _drafts(engine, P1, C1[0], 3) == C1[0][3:]
    assert _drafts(engine, P2, C2[0], 1) == C2[0][1:]
    assert engine.history.predicted_length(prompt_key(P1), default=99) == pytest.approx(5.5)
    assert engine.history.predicted_length(prompt_key([1, 80]), default=99) == 3  # the first model turn only
    for absent in ([1, 90, 91], [1, 95]):  # another run's; this worker's own (its engine has it already)
        assert engine.history.get(prompt_key(absent)) is None
    assert await read_log(config, REGION, topic_name(config.run, "dead-letter")) == []  # never dead-letters


@pytest.mark.integration
async def test_the_trainer_group_still_reads_every_record_the_reader_read(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path
) -> None:
    config = _config(run_id, tansu_bootstrap, tmp_path)
    await setup_topics(config)
    sent = [_group(config, f"g{i}", [1, 40 + i], [[50 + i, 51]]) for i in range(5)]
    await _produce(config, sent)
    engine = _engine()
    feed = RegionHistory(config, REGION, engine, "test-history", window=16, poll_s=0.1)
    task = asyncio.create_task(feed.run())
    try:
        await _until(lambda: feed.stats.responses >= 5, 30, "the reader to read every group")
    finally:
        task.cancel()
        await asyncio.wait([task], timeout=scaled(30))
    trainer = trainer_group(config.run)
    lag = [row for row in await group_lag(config, REGION) if row.group == trainer]
    assert sum(row.lag for row in lag) == 5 and all(row.committed is None for row in lag)  # nothing taken
    got = await read_stream(config, "trajectories", 5, timeout_s=30, group=trainer)
    assert sorted(d.record.group_id for d in got) == [f"g{i}" for i in range(5)]


@pytest.mark.integration
async def test_a_log_tail_starts_a_window_before_each_end_or_where_it_stopped(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path
) -> None:
    config = _config(run_id, tansu_bootstrap, tmp_path)
    await setup_topics(config)
    await _produce(config, [_group(config, f"g{i}", [1, 40 + i], [[50]]) for i in range(8)])
    log = await read_log(config, REGION, topic_name(config.run, "trajectories"))
    ends = {r.partition: r.offset + 1 for r in sorted(log, key=lambda r: r.offset)}

    async def tail(window: int, expected: set[tuple[int, int]],
                   from_offsets: dict[int, int] | None = None) -> set[tuple[int, int]]:
        """What the tail reads: until it has read `expected` (however long its fetches take), then once
        more, briefly, for anything it should not have read."""
        got: set[tuple[int, int]] = set()
        async with LogTail(config, REGION, "trajectories", "test-tail", window=window,
                           from_offsets=from_offsets) as t:
            async with asyncio.timeout(scaled(30)):
                for _ in range(300):
                    if got >= expected:
                        break
                    got |= {(r.partition, r.offset) for r in await t.read(100, 0.3)}
            got |= {(r.partition, r.offset) for r in await t.read(100, 0.3)}
        return got

    assert len(ends) == 2 and sum(ends.values()) == 8
    last_two = {(p, o) for p, end in ends.items() for o in (end - 2, end - 1)}
    last = {(p, end - 1) for p, end in ends.items()}
    everything = {(r.partition, r.offset) for r in log}
    assert await tail(2, last_two) == last_two
    assert await tail(100, everything) == everything  # a short log: all of it
    assert await tail(100, last, {p: end - 1 for p, end in ends.items()}) == last
    assert await tail(2, last_two, {p: 0 for p in ends}) == last_two  # never further back than the window
    assert await tail(0, set()) == set()


# -- the worker ----------------------------------------------------------------------------------


@pytest.mark.parametrize("speculative", [{"region_history": False}, {"enabled": False}])
def test_the_worker_reads_nothing_without_region_history_or_drafts(
    run_id: str, tmp_path: pathlib.Path, speculative: dict[str, Any]
) -> None:
    for spec, reads in ((speculative, False), ({}, True)):
        worker = RolloutWorker(_config(run_id, "127.0.0.1:9", tmp_path, **spec), REGION, "n1")  # connects nowhere
        worker.hub.close()
        assert (worker.region_history is not None) == reads


@pytest.mark.integration
async def test_a_worker_drafts_from_answers_other_workers_gave_and_not_twice_from_its_own(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path
) -> None:
    config = _config(run_id, tansu_bootstrap, tmp_path)
    publish_tiny(config)
    await setup_topics(config)
    await _produce(config, [_group(config, "g-before", P1, C1)])  # before the worker starts: its warm-up
    await send_prompts(config, prompts(config, 2, max_new_tokens=8))
    worker, stop = RolloutWorker(config, REGION, "n1"), asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    feed = worker.region_history
    assert feed is not None
    try:
        await _until(lambda: feed.stats.records >= 1 or task.done(), 60, "the warm-up")
        await _produce(config, [_group(config, "g-after", P2, C2)])
        await _until(lambda: task.done() or (worker.groups_done >= 2 and feed.stats.own >= 2
                                             and worker.engine.responses_observed >= 3), 60,
                     "the worker's groups and the other worker's answers")
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=scaled(30))
    engine = worker.engine
    assert isinstance(engine, TorchEngine)
    stats = worker.stats()
    assert (stats["region_records"], stats["region_own"], stats["region_skipped"]) == (4, 2, 0)
    assert engine.responses_observed == 3  # the other worker's three answers; its own 8 were recorded once
    assert _drafts(engine, P1, C1[0], 3) == C1[0][3:]
    assert _drafts(engine, P2, C2[0], 2) == C2[0][2:]
