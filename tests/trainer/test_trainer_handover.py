"""Which regions are gone, from the heartbeats, and how fast their groups move (trainer/handover.py).

The trainer's clock is passed in, so the timing is exact: a region whose heartbeats all stop has its
groups re-dispatched within 3 heartbeat intervals, never while it still beats.
"""

from __future__ import annotations

import itertools

from fleetrl.broker import Heartbeat, PromptRecord, RecordLimits
from fleetrl.config import FleetConfig
from fleetrl.trainer.collector import Collector
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.dispatcher import Dispatcher
from fleetrl.trainer.handover import Handover, RegionWatch
from fleetrl.trainer.regions import RegionClients

INTERVAL_S = 1.0


def config(handover_timeout_s: float = 4.0) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": "ho", "algorithm": {"max_staleness": 1, "groups_per_step": 4, "n_samples": 2},
        "mqtt": {"heartbeat_interval_s": INTERVAL_S},
        "rollout": {"handover_timeout_s": handover_timeout_s},
        "regions": [{"name": r, "kafka": "127.0.0.1:9", "store": f"/tmp/{r}"} for r in ("a", "b")],
    })


class Fleet:
    """A dispatcher with 8 groups spread over a and b, and the trainer's handover over them. The
    region clients are never connected: a gone region's partials are unreachable, so its groups move
    as prompts (the partials path is the e2e test's)."""

    def __init__(self, cfg: FleetConfig) -> None:
        self.sent: list[tuple[str, PromptRecord]] = []
        self.credits = RegionCredits({"a": 1.0, "b": 1.0}, window_s=10, tokens_per_group=1)
        self.dispatcher = Dispatcher(cfg, itertools.repeat(("reverse", "ab=", "ba")), self._send, self.credits)
        limits = RecordLimits.from_config(cfg)
        self.handover = Handover(cfg, RegionClients(cfg, limits, "g", {}), self.dispatcher, limits,
                                 Collector(cfg.run, max_staleness=1))
        self.nodes: dict[tuple[str, str], Heartbeat] = {}

    async def _send(self, region: str, record: PromptRecord) -> None:
        self.sent.append((region, record))

    def beat(self, region: str, state: str, now: float, engines: tuple[str, ...] | None = None,
             node: str = "n1") -> None:
        """The node's heartbeat, fed to the credits as the trainer does; `engines`: each engine's state
        (None: no engine statuses, as an older agent sends, and `up` serves)."""
        fields: dict[str, object] = {"state": state, "ts": now}
        if engines is not None:
            fields["engines"] = [{"index": i, "state": e} for i, e in enumerate(engines)]
        hb = self.nodes[(region, node)] = Heartbeat.model_validate(fields)
        self.credits.on_heartbeat(region, node, state, 10.0, now, serving=hb.serving)

    def held_by(self, region: str) -> set[str]:
        return {g for g, f in self.dispatcher.in_flight.items() if f.region == region}


async def test_a_region_whose_heartbeats_stop_has_its_groups_redispatched_within_3_intervals() -> None:
    fleet = Fleet(config())
    now = 0.0
    fleet.beat("a", "up", now)
    fleet.beat("b", "up", now)
    await fleet.dispatcher.dispatch(1, 0, now, lambda gid: False, released=0)
    held = fleet.held_by("a")
    assert held and fleet.held_by("b")
    last_beat_a = 0.0
    moved_at = None
    while now < 20.0:  # the trainer's loop: one tick per 0.2 s; a beats until t=10, b always
        now = round(now + 0.2, 1)
        if now % INTERVAL_S == 0:
            fleet.beat("b", "up", now)
            if now <= 10.0:
                fleet.beat("a", "up", now)
                last_beat_a = now
        _, prompts = await fleet.handover.tick(now, 0, fleet.nodes)
        if prompts:
            assert moved_at is None  # moved once
            moved_at = now
    assert moved_at is not None and last_beat_a == 10.0
    assert 2 * INTERVAL_S < moved_at - last_beat_a <= 3 * INTERVAL_S  # not while it beat, within 3
    assert not fleet.held_by("a")
    for gid in held:
        f = fleet.dispatcher.in_flight[gid]
        assert f.region == "b" and f.attempt == 1
    resent = [r for region, r in fleet.sent if r.group_id in held and r.attempt == 1]
    assert len(resent) == len(held) and all(region == "b" for region, r in fleet.sent if r.attempt == 1)
    assert fleet.handover.watch.gone["a"][1] == "silent"

    fleet.beat("a", "up", now + 0.5)  # a comes back: no longer gone, nothing moves again
    assert await fleet.handover.tick(now + 0.5, 0, fleet.nodes) == (0, 0)
    assert "a" not in fleet.handover.watch.gone
    await fleet.handover.close()


async def test_a_draining_region_keeps_its_groups_for_the_handover_then_they_move() -> None:
    fleet = Fleet(config(handover_timeout_s=4.0))
    fleet.beat("a", "up", 0.0)
    fleet.beat("b", "up", 0.0)
    await fleet.dispatcher.dispatch(1, 0, 0.0, lambda gid: False, released=0)
    held = fleet.held_by("a")
    fleet.beat("a", "draining", 1.0)  # the agent keeps beating `draining` while its workers hand over
    fleet.beat("b", "up", 1.0)
    assert await fleet.handover.tick(1.0, 0, fleet.nodes) == (0, 0)
    assert fleet.handover.watch.gone["a"] == (1.0, "drain")
    fleet.beat("a", "draining", 4.0)
    fleet.beat("b", "up", 4.0)
    assert await fleet.handover.tick(4.9, 0, fleet.nodes) == (0, 0)  # partials may still be on their way
    _, prompts = await fleet.handover.tick(5.0, 0, fleet.nodes)
    assert prompts == len(held) and not fleet.held_by("a")
    await fleet.handover.close()


def test_region_watch_reasons() -> None:
    watch = RegionWatch(["a", "b", "c"], heartbeat_interval_s=1.0)
    watch.observe("a", "n1", "offline", 5.0, 5.0)
    watch.observe("a", "n2", "offline", 5.0, 5.0)
    watch.observe("b", "n1", "up", 5.0, 5.0)
    watch.observe("b", "n2", "draining", 5.0, 5.0)
    assert watch.update(5.0) == (["a"], [])  # b still has a node up; c was never heard of
    assert watch.gone["a"][1] == "offline"
    watch.observe("b", "n1", "draining", 5.5, 5.5)
    assert watch.update(5.5) == (["b"], []) and watch.gone["b"][1] == "drain"
    # A retained "up" from long ago (a trainer restarted after the region died) is silent at once.
    watch.observe("c", "n1", "up", 1.0, 100.0)
    assert "c" in watch.update(100.0)[0] and watch.gone["c"][1] == "silent"


def test_a_region_counts_as_left_only_when_every_node_left_not_on_a_last_will() -> None:
    """`left` (what lets the handover move a region's unstarted groups before its bound): every node
    `offline` with `left`. A last will's `offline` (the agent died; its workers may live on, or a
    restarted agent resume) does not count, nor does one node leaving while another drains."""
    watch = RegionWatch(["a", "b"], heartbeat_interval_s=1.0)
    watch.observe("a", "n1", "offline", 5.0, 5.0)  # a last will
    watch.observe("b", "n1", "offline", 5.0, 5.0, left=True)
    watch.observe("b", "n2", "draining", 5.0, 5.0)
    watch.update(5.0)
    assert watch.gone["a"][1] == "offline" and watch.gone["b"][1] == "drain"
    assert watch.left == set()
    watch.observe("b", "n2", "offline", 6.0, 6.0, left=True)
    watch.update(6.0)
    assert watch.left == {"b"}
    watch.observe("a", "n1", "up", 7.0, 7.0)  # a restarted agent: a is back
    watch.observe("b", "n3", "up", 7.0, 7.0, serving=False)  # a replacement whose engine loads: b stays left
    assert watch.update(7.0) == ([], ["a"]) and watch.left == {"b"}
    watch.observe("b", "n3", "up", 8.0, 8.0)
    assert watch.update(8.0) == ([], ["b"]) and watch.left == set()


async def test_a_region_is_not_back_until_an_engine_of_its_replacement_node_is_up() -> None:
    """An agent beats `up` as soon as it runs, while its engines load the model for tens of seconds.
    A preempted region whose replacement node is starting stays gone (its groups moved once, nothing
    sent back to it, not declared gone again) until an engine is up; an engine that restarts in a
    region that is not gone does not lose the region either."""
    fleet = Fleet(config(handover_timeout_s=2.0))
    fleet.beat("a", "up", 0.0, engines=("up",))
    fleet.beat("b", "up", 0.0)
    await fleet.dispatcher.dispatch(1, 0, 0.0, lambda gid: False, released=0)
    held = fleet.held_by("a")
    assert held and fleet.held_by("b")

    async def run(start: float, end: float, a_engines: tuple[str, ...] | None, a_node: str = "n1") -> int:
        """Ticks every 0.2 s, b beating every interval and a's node `up` with `a_engines` (None: a
        does not beat); returns the prompts moved."""
        moved, now = 0, start
        while now < end:
            if now % INTERVAL_S == 0:
                if a_engines is not None:
                    fleet.beat("a", "up", now, engines=a_engines, node=a_node)
                fleet.beat("b", "up", now)
            moved += (await fleet.handover.tick(now, 0, fleet.nodes))[1]
            now = round(now + 0.2, 1)
        return moved

    # a's only engine crashed and restarts: a is not lost, its groups wait for the new worker
    assert await run(1.0, 6.0, ("restarting",)) == 0
    assert "a" not in fleet.handover.watch.gone and fleet.held_by("a") == held
    # a is preempted: gone, and its groups move to b once the handover bound is over
    fleet.beat("a", "offline", 6.0, engines=("stopped",))
    assert await fleet.handover.tick(6.0, 0, fleet.nodes) == (0, 0)
    assert fleet.handover.watch.gone["a"] == (6.0, "offline")
    assert await run(6.2, 8.2, None) == len(held)
    assert not fleet.held_by("a")
    # its replacement n2 beats `up` while its engines load: a stays gone as it was, gets no new work
    for t in range(9, 30, 3):
        assert await run(float(t), float(t + 3), ("starting", "starting"), a_node="n2") == 0
        assert fleet.handover.watch.gone["a"] == (6.0, "offline")
        assert fleet.dispatcher.pick(float(t + 3)) == "b"
    # one engine is up: a is back, and an idle region with a serving node is worth a group again
    await run(30.0, 30.2, ("starting", "up"), a_node="n2")
    assert "a" not in fleet.handover.watch.gone
    assert fleet.dispatcher.pick(30.2) == "a"
    await fleet.handover.close()


def test_a_moved_partial_carries_an_agent_runs_capture_unchanged() -> None:
    """A `fleetrl.partial/2` (an agent run's completed calls: segments and contexts) moves to another region
    with its new attempt and every sample field as it came, through the codec."""
    from fleetrl.broker import (
        SCHEMA_PARTIAL,
        SCHEMA_PARTIAL_V2,
        HandedOverBy,
        PartialRecord,
        PartialSample,
        Sampling,
        decode_record,
        encode_record,
        floats,
        ids,
        segments_of,
    )
    from fleetrl.trainer.handover import moved_partial

    limits = RecordLimits(vocab_size=100, known_tasks=frozenset({"t"}))
    sample = PartialSample(ids([5, 6, 7, 8]), floats([-0.5, 0.0, -0.25, -0.75]), ids([3, -1, 4, 4]),
                           segments=segments_of([0, 1, 0, 0]), contexts=[(0, ids([1, 2])), (2, ids([9]))])
    prompt = PromptRecord(group_id="g", run="ho", task="t", n_samples=1, sampling=Sampling(), prompt_ids=ids([1, 2]),
                          attempt=2)
    record = decode_record(encode_record(PartialRecord(prompt, [sample], HandedOverBy("a", "n1", "drain")), limits),
                           limits, expect=SCHEMA_PARTIAL)
    assert isinstance(record, PartialRecord)
    moved = decode_record(encode_record(moved_partial(record, 3, 10.0), limits), limits, expect=SCHEMA_PARTIAL)
    assert isinstance(moved, PartialRecord) and moved.schema == SCHEMA_PARTIAL_V2
    assert moved.prompt.attempt == 3 and moved.prompt.dispatched_at == 10.0
    (s,) = moved.samples
    assert s.completion_ids.tolist() == [5, 6, 7, 8] and s.versions.tolist() == [3, -1, 4, 4]
    assert s.logprobs.tolist() == [-0.5, 0.0, -0.25, -0.75]
    assert s.segments is not None and s.segments.tolist() == [[0, 0], [1, 1], [2, 0]]
    assert s.contexts is not None and [(at, p.tolist()) for at, p in s.contexts] == [(0, [1, 2]), (2, [9])]
