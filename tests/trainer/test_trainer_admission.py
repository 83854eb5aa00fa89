"""Admission, credits and the collector's verdicts, as state machines with an in-memory transport."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_groups import make_group

from fleetrl.broker import KafkaError, PromptRecord
from fleetrl.config import FleetConfig
from fleetrl.trainer.collector import Collector
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.dispatcher import Dispatcher, admission_budget, versions_ahead


def _config(s: int, g: int, regions: tuple[str, ...] = ("a",), ahead: int = 0) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": "adm", "algorithm": {"max_staleness": s, "groups_per_step": g, "n_samples": 2,
                                    "dispatch_ahead_steps": ahead},
        "regions": [{"name": r, "kafka": "127.0.0.1:9092", "store": f"/tmp/{r}"} for r in regions],
    })


class Sim:
    """Dispatcher + collector + a learner that steps whenever `groups_per_step` groups are buffered."""

    def __init__(self, s: int, g: int, ahead: int = 0) -> None:
        self.cfg = _config(s, g, ahead=ahead)
        self.sent: list[PromptRecord] = []
        self.credits = RegionCredits({"a": 1.0}, window_s=60, tokens_per_group=10)
        prompts = itertools.repeat(("reverse", "abc=", "cba"))
        self.dispatcher = Dispatcher(self.cfg, prompts, self._send, self.credits)
        self.collector = Collector("adm", s)
        self.version = 0
        self.lags: list[int] = []
        self.outstanding: list[PromptRecord] = []

    async def _send(self, region: str, record: PromptRecord) -> None:
        self.sent.append(record)
        self.outstanding.append(record)

    async def admit(self) -> None:
        await self.dispatcher.dispatch(self.version, self.version, 0.0, self.collector.is_resolved,
                                       released=self.collector.ledger.stale_count)
        a = self.cfg.algorithm
        holding = self.dispatcher.admitted - self.collector.ledger.stale_count
        assert holding <= (self.version + 1 + a.max_staleness + a.dispatch_ahead_steps) * a.groups_per_step
        assert all(p.min_version <= self.version + a.dispatch_ahead_steps for p in self.sent)

    def arrivable(self) -> list[PromptRecord]:
        """The groups that can finish now: a worker holds one sent ahead until its version exists."""
        return [p for p in self.outstanding if p.min_version <= self.version]

    def arrive(self, pick: int, gen: int) -> None:
        """Group `pick` of those outstanding finishes, sampled with a version in [min_version, now]."""
        ready = self.arrivable()
        p = ready[pick % len(ready)]
        self.outstanding.remove(p)
        used = p.min_version + gen % (self.version - p.min_version + 1)
        group = make_group(p.group_id, "adm", version=used, n=2, seed=len(self.sent))
        verdict = self.collector.offer(group, self.version)
        if verdict != "duplicate":
            self.dispatcher.resolve(p.group_id)
        while self.collector.ready(self.cfg.algorithm.groups_per_step):
            batch, _ = self.collector.take(self.cfg.algorithm.groups_per_step, self.version)
            if len(batch) < self.cfg.algorithm.groups_per_step:
                self.collector.give_back(batch)
                break
            self.lags += [self.version - g.min_version for g in batch]
            self.collector.mark_trained(batch, self.version + 1, self.version)
            self.version += 1


def _run(sim: Sim, arrivals: list[tuple[int, int]]) -> None:
    async def go() -> None:
        for pick, gen in arrivals:
            await sim.admit()
            if sim.arrivable():
                sim.arrive(pick, gen)

    asyncio.run(go())


@settings(max_examples=60, deadline=None)
@given(s=st.integers(0, 3), g=st.integers(1, 4), ahead=st.integers(0, 2),
       arrivals=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 10_000)), min_size=1, max_size=120))
def test_trained_groups_lag_at_most_s_plus_one_under_any_arrival_order(
        s: int, g: int, ahead: int, arrivals: list[tuple[int, int]]) -> None:
    sim = Sim(s, g, ahead)
    _run(sim, arrivals)
    assert all(lag <= s + 1 for lag in sim.lags)
    # every admitted group is accounted for exactly once: trained, stale, buffered or outstanding
    trained = [e.group_id for e in sim.collector.trained]
    assert len(trained) == len(set(trained))
    accounted = set(trained) | set(sim.collector.stale) | set(sim.collector.pending) | {
        p.group_id for p in sim.outstanding}
    assert accounted == {p.group_id for p in sim.sent}
    assert len(sim.sent) == sim.dispatcher.admitted


@settings(max_examples=30, deadline=None)
@given(s=st.integers(0, 3), g=st.integers(1, 4), n=st.integers(1, 80), ahead=st.integers(0, 2))
def test_in_order_arrivals_are_never_stale_and_lag_at_most_s(s: int, g: int, n: int, ahead: int) -> None:
    """Admission alone keeps FIFO work within s versions, even sampled at the oldest allowed version;
    groups sent ahead ask for the version they would be admitted at, so they keep the same bound."""
    sim = Sim(s, g, ahead)
    _run(sim, [(0, 0)] * n)  # always the oldest outstanding group, generated at its min_version
    assert not sim.collector.stale
    assert all(lag <= s for lag in sim.lags)
    assert sim.version >= 1 or n < g


def test_groups_sent_ahead_ask_for_the_version_they_may_start_with() -> None:
    """s=1, G=2, two steps ahead: the window's 4 groups ask for the newest version, then 2 for the
    next and 2 for the one after; a step moves the window by G and sends G more, two versions ahead."""
    sim = Sim(1, 2, ahead=2)

    async def go() -> None:
        await sim.admit()
        assert [p.min_version for p in sim.sent] == [0, 0, 0, 0, 1, 1, 2, 2]
        await sim.admit()  # nothing more until a step
        assert len(sim.sent) == 8
        for _ in range(2):
            sim.arrive(0, 0)
        assert sim.version == 1
        await sim.admit()
        assert [p.min_version for p in sim.sent[8:]] == [3, 3]

    asyncio.run(go())
    sim0 = Sim(1, 2, ahead=0)
    asyncio.run(sim0.admit())
    assert [p.min_version for p in sim0.sent] == [0, 0, 0, 0]


def test_groups_dropped_stale_return_their_place_so_a_run_never_stalls() -> None:
    """Trainer restarts publish versions without steps, so the work in flight arrives stale. Those
    groups are settled without feeding a step: they must free their admission, or the window
    (here (1 + 1) x 2 = 4 groups) stays full of settled work and nothing is ever dispatched again."""
    cfg = _config(1, 2)
    sent: list[PromptRecord] = []

    async def send(region: str, record: PromptRecord) -> None:
        sent.append(record)

    async def go() -> tuple[int, int, int]:
        d = Dispatcher(cfg, itertools.repeat(("reverse", "abc=", "cba")),
                       send, RegionCredits({"a": 1.0}, window_s=60, tokens_per_group=10))
        collector = Collector("adm", 1)
        first = await d.dispatch(0, 0, 0.0, collector.is_resolved, released=collector.ledger.stale_count)
        for i, p in enumerate(list(sent)):  # sampled at version 0; the learner is at version 3 now
            assert collector.offer(make_group(p.group_id, "adm", version=0, n=2, seed=i), 3) == "stale"
            d.resolve(p.group_id)
        again = await d.dispatch(0, 3, 0.0, collector.is_resolved, released=collector.ledger.stale_count)
        for i, p in enumerate(sent[first:]):  # the new work is fresh and makes a step
            assert collector.offer(make_group(p.group_id, "adm", version=3, n=2, seed=10 + i), 3) == "accepted"
        return first, again, len(collector.pending)

    first, again, buffered = asyncio.run(go())
    assert first == 4
    assert again == 4  # the 4 stale groups gave their places back
    assert buffered == 4 and len({p.group_id for p in sent}) == 8
    assert all(p.min_version == 3 for p in sent[4:])


def test_admission_budget_formula() -> None:
    # s=1, G=8: at version 0, 16 groups may be admitted; with 10 admitted, 6 more
    assert admission_budget(0, 0, 1, 8) == 16
    assert admission_budget(0, 10, 1, 8) == 6
    assert admission_budget(2, 30, 1, 8) == 2  # (2+1+1)*8 = 32
    assert admission_budget(0, 40, 1, 8) == 0
    # past the window, the versions a group waits for, up to `ahead_steps` steps of groups
    assert versions_ahead(0, 15, 1, 8, 2) == 0
    assert versions_ahead(0, 16, 1, 8, 2) == 1 and versions_ahead(0, 23, 1, 8, 2) == 1
    assert versions_ahead(0, 24, 1, 8, 2) == 2 and versions_ahead(0, 31, 1, 8, 2) == 2
    assert versions_ahead(0, 32, 1, 8, 2) is None
    assert versions_ahead(0, 16, 1, 8, 0) is None


def test_collector_verdicts() -> None:
    c = Collector("r", max_staleness=1)
    assert c.offer(make_group("r-1", "r", version=5), version=5) == "accepted"
    assert c.offer(make_group("r-1", "r", version=5), version=5) == "duplicate"  # delivered twice
    assert c.offer(make_group("r-1", "r", version=5, attempt=1), version=5) == "duplicate"  # redone
    assert c.offer(make_group("r-2", "r", version=2), version=5) == "stale"  # lag 3 > 1 + 1
    assert c.offer(make_group("r-2", "r", version=5), version=5) == "duplicate"  # stale is final
    assert c.offer(make_group("r-3", "r", version=3), version=5) == "accepted"  # lag 2 = bound
    assert c.offer(make_group("x-1", "other"), version=5) == "foreign"
    batch, dropped = c.take(2, version=6)  # r-3 now lags 3: dropped at take time, counted
    assert [g.group_id for g in batch] == ["r-1"] and [g.group_id for g in dropped] == ["r-3"]
    c.mark_trained(batch, step=1, version=6)
    restored = Collector("r", 1)
    restored.restore(c.state())
    assert set(restored.stale) == {"r-2", "r-3"} and restored.duplicates == 3
    assert restored.offer(make_group("r-1", "r", version=6), 6) == "duplicate"  # trained before the restart


def test_credits_follow_throughput_and_skip_a_silent_region() -> None:
    cr = RegionCredits({"fast": 1.0, "slow": 1.0, "dead": 1.0}, window_s=10, tokens_per_group=100)
    for r in ("fast", "slow", "dead"):
        cr.on_dispatch(r, 0.0)
    for t in np.linspace(1, 9, 30):
        cr.on_arrival("fast", float(t))
    for t in (2.0, 6.0, 9.0):
        cr.on_arrival("slow", t)
    rates = cr.rates(10.0)
    assert rates["fast"] == 3.0 and rates["slow"] == 0.3 and rates["dead"] == 0.0
    picks: dict[str, int] = {}
    in_flight: dict[str, int] = {}
    for _ in range(33):
        r = cr.pick(in_flight, 10.0)
        in_flight[r] = in_flight.get(r, 0) + 1
        picks[r] = picks.get(r, 0) + 1
    assert picks == {"fast": 30, "slow": 3}
    # heartbeats bring a region back: 2 nodes x 50 tokens/s over 100 tokens a group = 1 group/s
    cr.on_heartbeat("dead", "n1", "up", 50.0, 10.0)
    cr.on_heartbeat("dead", "n2", "up", 50.0, 10.0)
    assert cr.rates(10.0)["dead"] == 1.0
    # a region whose groups take long to come back gets work only once the others are backed up
    lat = RegionCredits({"near": 1.0, "far": 1.0}, window_s=10, tokens_per_group=1)
    for r, latency in (("near", 1.0), ("far", 8.0)):
        lat.on_dispatch(r, 0.0)
        for t in range(1, 11):
            lat.on_arrival(r, float(t), latency_s=latency)  # both return 1 group/s
    assert lat.latency("far", 10.0) == 8.0
    # near: max(1 s, (in_flight + 1) / 1) ; far: max(8 s, ...) -> near until it holds 7 groups
    assert [lat.pick({"near": n}, 10.0) for n in (0, 6, 7, 8)] == ["near", "near", "far", "far"]
    # before anything is measured, configured weights decide
    fresh = RegionCredits({"a": 3.0, "b": 1.0}, window_s=10, tokens_per_group=1)
    assert fresh.rates(0.0) == {"a": 3.0, "b": 1.0}


def test_an_idle_region_with_live_nodes_is_probed_again() -> None:
    # "busy" returns 2 groups/s; "idle" was drained and resumed: no arrivals in the window and its
    # fresh worker reports ~0 tokens/s, so by throughput alone it would never get work again.
    cr = RegionCredits({"busy": 1.0, "idle": 1.0}, window_s=10, tokens_per_group=100)
    for r in ("busy", "idle"):
        cr.on_dispatch(r, 0.0)
    for t in np.linspace(1, 9.5, 20):
        cr.on_arrival("busy", float(t))
    cr.on_heartbeat("busy", "b1", "up", 200.0, 9.0)
    cr.on_heartbeat("idle", "i1", "up", 0.01, 9.0)
    assert cr.rates(10.0)["idle"] < 0.01
    assert cr.pick({"busy": 3, "idle": 0}, 10.0) == "idle"  # one group to prove it can work
    # ... but only one while it has not shown its rate: the next goes where it returns sooner
    assert cr.pick({"busy": 3, "idle": 1}, 10.0) == "busy"
    # a region whose nodes are all offline (or silent) is not probed
    cr.on_heartbeat("idle", "i1", "offline", 0.0, 9.5)
    assert cr.pick({"busy": 3, "idle": 0}, 10.0) == "busy"


def test_silent_region_is_redispatched_with_a_new_attempt() -> None:
    cfg = _config(1, 2, regions=("a", "b"))
    sent: list[tuple[str, Any]] = []

    async def send(region: str, record: PromptRecord) -> None:
        sent.append((region, record))

    credits = RegionCredits({"a": 1.0, "b": 1.0}, window_s=10, tokens_per_group=1)
    d = Dispatcher(cfg, itertools.repeat(("reverse", "ab=", "ba")), send, credits)

    async def go() -> None:
        await d.dispatch(0, 0, 0.0, lambda gid: False, released=0)
        assert len(sent) == 4 and {r for r, _ in sent} == {"a", "b"}
        credits.on_arrival("b", 50.0)  # b answers, a stays silent
        moved = await d.redispatch_silent(100.0, timeout_s=60.0)
        assert moved == 2
        again = sent[4:]
        assert all(r == "b" and p.attempt == 1 for r, p in again)
        assert await d.redispatch_silent(101.0, timeout_s=60.0) == 0  # just sent: not silent yet

    asyncio.run(go())
    state = d.state()
    d2 = Dispatcher(cfg, iter(()), send, credits)
    d2.restore(state, itertools.repeat(("reverse", "ab=", "ba")))
    assert d2.next_index == 4 and set(d2.in_flight) == set(d.in_flight)




def test_a_failing_region_cluster_is_skipped_and_unsent_groups_retried() -> None:
    cfg = _config(0, 2, regions=("a", "b"))
    down = {"a"}
    sent: list[tuple[str, str]] = []

    async def send(region: str, record: PromptRecord) -> None:
        if region in down:
            raise KafkaError(f"region {region} unreachable", retriable=True)
        sent.append((region, record.group_id))

    credits = RegionCredits({"a": 1.0, "b": 1.0}, window_s=10, tokens_per_group=1)
    d = Dispatcher(cfg, itertools.repeat(("reverse", "ab=", "ba")), send, credits)

    async def go() -> None:
        assert await d.dispatch(0, 0, 0.0, lambda gid: False, released=0) == 2
        assert {r for r, _ in sent} == {"b"}  # a failed once, then had no credit for a window
        down.add("b")  # now nothing is reachable: admitted groups wait unsent
        d.in_flight.clear()
        d.next_index = 0
        sent.clear()
        assert await d.dispatch(0, 0, 1.0, lambda gid: False, released=0) == 0
        assert all(not f.sent for f in d.in_flight.values()) and len(d.in_flight) == 2
        down.clear()
        assert await d.dispatch(0, 0, 30.0, lambda gid: False, released=0) == 2  # retried in the next round
        assert all(f.sent for f in d.in_flight.values()) and len(sent) == 2

    asyncio.run(go())


def test_a_preemptions_stranded_groups_do_not_starve_their_region() -> None:
    """The fast region lost a node: 2 of its groups came back 40 s late, redone by the replacement,
    among 20 that took 1 s. It still returns most groups fastest, so it keeps getting work before the
    slow region (3 s) does; a latency averaged over the window (4.5 s) would send the next several
    groups to the slow region."""
    cr = RegionCredits({"fast": 1.0, "slow": 1.0}, window_s=30, tokens_per_group=1)
    for r in ("fast", "slow"):
        cr.on_dispatch(r, 0.0)
    for t in range(1, 21):
        cr.on_arrival("fast", float(t), latency_s=1.0)
        cr.on_arrival("slow", float(t), latency_s=3.0)
    cr.on_arrival("fast", 20.5, latency_s=40.0)
    cr.on_arrival("fast", 20.6, latency_s=40.0)
    assert cr.latency("fast", 21.0) == 1.0
    assert cr.pick({"fast": 1, "slow": 1}, 21.0) == "fast"


def test_a_fast_region_given_little_is_judged_by_its_engines_not_by_what_it_returned() -> None:
    """Both regions returned 1 group/s (what they were given), but the fast one's engines deliver 10x
    the slow one's while busy: its backlog drains faster, so it takes most of the next groups instead
    of half. Groups turned out 40 tokens, not the configured bound of 400."""
    cr = RegionCredits({"fast": 1.0, "slow": 1.0}, window_s=10, tokens_per_group=400)
    for r in ("fast", "slow"):
        cr.on_dispatch(r, 0.0)
        for t in range(1, 11):
            cr.on_arrival(r, float(t), latency_s=0.5, tokens=40)
    assert cr.tokens_per_group == 40
    cr.on_heartbeat("fast", "f1", "up", 40.0, 10.0, busy_tokens_per_s=400.0)  # 10 groups/s while busy
    cr.on_heartbeat("slow", "s1", "up", 40.0, 10.0, busy_tokens_per_s=40.0)  # 1 group/s
    in_flight: dict[str, int] = {}
    for _ in range(8):
        r = cr.pick(in_flight, 10.0)
        in_flight[r] = in_flight.get(r, 0) + 1
    assert in_flight == {"fast": 7, "slow": 1}  # by arrivals alone: 4 and 4
