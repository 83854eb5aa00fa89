"""Sync mode spreads each step's groups over the regions by capacity, as a synchronous trainer over
the same workers would (trainer/credits.py), with the real dispatcher, credits and collector and an
in-memory send (the dispatcher's injected transport)."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from slowdown import scaled
from trainer_groups import make_group

from fleetrl.broker import Heartbeat, PromptRecord
from fleetrl.broker.control import EngineStatus
from fleetrl.config import FleetConfig
from fleetrl.trainer.collector import Collector
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.dispatcher import Dispatcher


def _sync_config(g: int, regions: tuple[str, ...]) -> FleetConfig:
    # One step's groups a dispatch (none sent ahead): the split of a step is what these tests check.
    return FleetConfig.model_validate({
        "run": "spread", "algorithm": {"mode": "sync", "groups_per_step": g, "n_samples": 2,
                                       "dispatch_ahead_steps": 0},
        "regions": [{"name": r, "kafka": "127.0.0.1:9092", "store": f"/tmp/{r}"} for r in regions],
    })


class SyncFleet:
    """The dispatcher of a sync run; `step()` admits one step's groups and returns where they went."""

    def __init__(self, g: int, credits: RegionCredits) -> None:
        self.cfg = _sync_config(g, tuple(credits.regions))
        self.credits = credits
        self.sent: list[tuple[str, PromptRecord]] = []
        self.dispatcher = Dispatcher(self.cfg, itertools.repeat(("reverse", "abc=", "cba")), self._send, credits)
        self.collector = Collector("spread", 0)
        self.version = 0

    async def _send(self, region: str, record: PromptRecord) -> None:
        self.sent.append((region, record))

    def step(self, now: float) -> Counter[str]:
        """Admit a step's groups, then return them all (each region's arrive), train, publish."""
        before = len(self.sent)
        asyncio.run(asyncio.wait_for(
            self.dispatcher.dispatch(self.version, self.version, now, self.collector.is_resolved,
                                     released=self.collector.ledger.stale_count), timeout=scaled(10)))
        placed = self.sent[before:]
        for i, (region, p) in enumerate(placed):
            self.credits.on_arrival(region, now + 1.0, latency_s=1.0)
            assert self.collector.offer(make_group(p.group_id, "spread", version=self.version, n=2, seed=i),
                                        self.version) == "accepted"
            self.dispatcher.resolve(p.group_id)
        groups, dropped = self.collector.take(self.cfg.algorithm.groups_per_step, self.version)
        assert len(groups) == self.cfg.algorithm.groups_per_step and not dropped
        self.collector.mark_trained(groups, self.version + 1, self.version)
        self.version += 1
        return Counter(region for region, _ in placed)


def _beat(credits: RegionCredits, now: float, **busy_tokens_per_s: float) -> None:
    for region, rate in busy_tokens_per_s.items():
        credits.on_heartbeat(region, "n1", "up", 0.0, now, busy_tokens_per_s=rate)


def test_sync_steps_split_by_capacity_not_by_what_each_region_returned() -> None:
    # The slow region returned most of the work so far (the starved-fast-region history of issue 25),
    # but the fast region's engines deliver 3x the tokens per second while busy: a synchronous trainer
    # over these workers gives it 3/4 of every step.
    credits = RegionCredits({"fast": 1.0, "slow": 1.0}, window_s=10, tokens_per_group=100, by_capacity=True)
    for r in ("fast", "slow"):
        credits.on_dispatch(r, 0.0)
    for t in range(1, 10):
        credits.on_arrival("slow", float(t), latency_s=0.5)
    credits.on_arrival("fast", 9.0, latency_s=3.0)
    fleet = SyncFleet(8, credits)
    for k in range(3):
        _beat(credits, 10.0 + k, fast=300.0, slow=100.0)
        assert fleet.step(10.0 + k) == Counter(fast=6, slow=2)
    # capacities move (the slow region's nodes got faster): the next step follows them
    _beat(credits, 13.0, fast=300.0, slow=300.0)
    assert fleet.step(13.0) == Counter(fast=4, slow=4)


def test_sync_before_any_measurement_splits_by_weight_and_unmeasured_nodes_borrow_the_mean() -> None:
    credits = RegionCredits({"a": 3.0, "b": 1.0}, window_s=10, tokens_per_group=100, by_capacity=True)
    fleet = SyncFleet(4, credits)
    assert fleet.step(0.0) == Counter(a=3, b=1)  # no heartbeats yet: the configured weights
    # b measured 200 tokens/s; a's node is up but has measured nothing: it counts as 3 x 200
    credits.on_heartbeat("a", "n1", "up", 0.0, 1.0, busy_tokens_per_s=0.0)
    credits.on_heartbeat("b", "n1", "up", 0.0, 1.0, busy_tokens_per_s=200.0)
    assert credits.capacities(1.0) == {"a": 600.0, "b": 200.0}
    assert fleet.step(1.0) == Counter(a=3, b=1)
    # two measured nodes in b add up
    credits.on_heartbeat("a", "n1", "up", 0.0, 2.0, busy_tokens_per_s=200.0)
    credits.on_heartbeat("b", "n2", "up", 0.0, 2.0, busy_tokens_per_s=200.0)
    assert credits.capacities(2.0) == {"a": 200.0, "b": 400.0}
    assert fleet.step(2.0) == Counter(a=1, b=3)


def test_sync_sends_nothing_to_a_region_without_live_nodes_or_with_a_failed_cluster() -> None:
    credits = RegionCredits({"a": 1.0, "b": 1.0, "c": 1.0}, window_s=10, tokens_per_group=100, by_capacity=True)
    fleet = SyncFleet(6, credits)
    _beat(credits, 1.0, a=100.0, b=100.0, c=100.0)
    assert fleet.step(1.0) == Counter(a=2, b=2, c=2)
    credits.on_heartbeat("c", "n1", "offline", 0.0, 2.0)  # preempted, no replacement yet
    assert fleet.step(2.0) == Counter(a=3, b=3)
    credits.on_send_failure("b", 3.0)  # b's cluster refused a send: no credit for a window
    assert fleet.step(3.0) == Counter(a=6)
    # heartbeats older than the window do not count: with nothing live anywhere, the weights decide
    assert credits.capacities(30.0) == {"a": 0.0, "b": 0.0, "c": 0.0}
    assert fleet.step(30.0) == Counter(a=2, b=2, c=2)


def test_capacity_travels_in_the_heartbeat() -> None:
    engines = [EngineStatus(index=0, state="up", busy_tokens_per_s=120.5),
               EngineStatus(index=1, state="up", busy_tokens_per_s=80.0)]
    beat = Heartbeat(state="up", busy_tokens_per_s=200.5, engines=engines)
    back = Heartbeat.model_validate_json(beat.to_json())
    assert back.busy_tokens_per_s == 200.5
    assert isinstance(back.engines, list) and [e.busy_tokens_per_s for e in back.engines] == [120.5, 80.0]
    # an older node's heartbeat, without the field, reads as "not measured yet"
    assert Heartbeat.model_validate_json(b'{"state": "up", "tokens_per_s": 3.0}').busy_tokens_per_s == 0.0


@settings(max_examples=200, deadline=None)
@given(caps=st.lists(st.floats(min_value=1.0, max_value=1000.0), min_size=1, max_size=5),
       groups=st.integers(min_value=1, max_value=64))
def test_capacity_split_is_makespan_even(caps: list[float], groups: int) -> None:
    """No group could move to another region and finish the step sooner: for every region r that got
    work and every other region s, r's share over its capacity is at most s's with one more group."""
    names = [f"r{i}" for i in range(len(caps))]
    credits = RegionCredits(dict.fromkeys(names, 1.0), window_s=10, tokens_per_group=100, by_capacity=True)
    for name, cap in zip(names, caps, strict=True):
        credits.on_heartbeat(name, "n1", "up", 0.0, 0.0, busy_tokens_per_s=cap)
    held: dict[str, int] = {}
    for _ in range(groups):
        r = credits.pick(held, 0.0)
        held[r] = held.get(r, 0) + 1
    assert sum(held.values()) == groups
    for r, n in held.items():
        for s, cap_s in zip(names, caps, strict=True):
            assert n / caps[names.index(r)] <= (held.get(s, 0) + 1) / cap_s + 1e-12
