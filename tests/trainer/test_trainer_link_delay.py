"""`regions[].emulate_link_delay_s`: the trainer's clients hold prompts and trajectories on the link.

Real tansu. The delay is a lower bound on when the other side sees a record (read on the monotonic
clock, so it cannot flake); the upper bounds are generous and only guard against a record held
forever. Nothing here asserts on speed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import pytest
from pydantic import ValidationError
from slowdown import scaled
from trainer_groups import make_group

from fleetrl.broker import (
    Consumer,
    Producer,
    PromptRecord,
    RecordLimits,
    Sampling,
    ensure_topics,
    rollout_group,
    trainer_group,
)
from fleetrl.config import FleetConfig, RegionConfig
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.dispatcher import Dispatcher
from fleetrl.trainer.regions import RegionClients

pytestmark = [pytest.mark.integration]
REGION = "local-a"
DELAY_S = 0.6


@pytest.fixture
def delayed_fleet(make_fleet: Callable[..., FleetConfig]) -> Callable[..., FleetConfig]:
    def make(delay_s: float, **algorithm: object) -> FleetConfig:
        config = make_fleet(**algorithm)
        region = RegionConfig.model_validate({**config.regions[0].model_dump(exclude={"emulate_link_delay_s"}),
                                             "emulate_link_delay_s": delay_s})
        return config.model_copy(update={"regions": [region]})

    return make


def test_link_delay_is_bounded_and_off_by_default(make_fleet: Callable[..., FleetConfig],
                                                  delayed_fleet: Callable[[float], FleetConfig]) -> None:
    assert make_fleet().regions[0].emulate_link_delay_s == 0.0
    assert delayed_fleet(DELAY_S).regions[0].emulate_link_delay_s == DELAY_S
    with pytest.raises(ValidationError, match="emulate_link_delay_s"):
        delayed_fleet(-1.0)


async def test_trajectories_reach_the_trainer_only_after_the_link_delay(
    delayed_fleet: Callable[[float], FleetConfig],
) -> None:
    config = delayed_fleet(DELAY_S)
    await ensure_topics(config, REGION)
    limits = RecordLimits.from_config(config)
    async with RegionClients(config, limits, trainer_group(config.run), {}) as clients, \
            Producer(config, REGION, "region-side") as region_side:
        # Wait (bounded: 10 s on the reference machine) until the consumer is assigned, so that the fetch
        # time is what we measure.
        for _ in range(round(scaled(100))):
            await clients.poll(16, 0.1)
            if clients.consumers[REGION].assignment():
                break
        await region_side.send("trajectories", "g-1", make_group("g-1", config.run, n=config.algorithm.n_samples))
        seen: list[tuple[float, float]] = []  # (first fetched by the consumer, handed to the trainer)
        fetched_at = None
        deadline = time.monotonic() + scaled(60)
        while not seen and time.monotonic() < deadline:
            out = await clients.poll(16, 0.2)
            transit = clients._in_transit[REGION]
            if fetched_at is None and transit:
                fetched_at = transit[0][0] - DELAY_S
            for _ in out.get(REGION, []):
                assert fetched_at is not None, "a delayed delivery was handed over without crossing the link"
                seen.append((fetched_at, time.monotonic()))
    assert len(seen) == 1, seen
    fetched, handed = seen[0]
    assert handed - fetched >= DELAY_S


async def test_prompts_are_produced_only_after_the_link_delay(
    delayed_fleet: Callable[[float], FleetConfig],
) -> None:
    config = delayed_fleet(DELAY_S)
    await ensure_topics(config, REGION)
    limits = RecordLimits.from_config(config)
    record = PromptRecord(group_id="p-1", run=config.run, task="reverse", n_samples=2,
                          sampling=Sampling(temperature=1.0, top_p=1.0, max_new_tokens=8), prompt="abc",
                          reference="cba", min_version=0, dispatched_at=time.time(), attempt=0)
    async with RegionClients(config, limits, trainer_group(config.run), {}) as clients, \
            Producer(config, REGION, "region-side") as region_side, \
            Consumer(config, REGION, ["prompts"], rollout_group(config.run), limits, region_side,
                     "region-side") as region_consumer:
        t0 = time.monotonic()
        await clients.send(REGION, "prompts", record.group_id, record)
        sent = time.monotonic()
        got = []
        deadline = time.monotonic() + scaled(60)
        while not got and time.monotonic() < deadline:
            got = await region_consumer.poll(16, 0.2)
    assert sent - t0 >= DELAY_S
    assert [d.record.group_id for d in got] == ["p-1"]  # type: ignore[union-attr]


def _rounds(spans: list[tuple[float, float]]) -> int:
    """Link round trips the sends cost one after another: the longest chain of sends each of which
    started only after the one before it was acknowledged (1 when all share one round trip)."""
    chain: list[int] = []
    ordered = sorted(spans)
    for i, (start, _) in enumerate(ordered):
        before = [chain[j] for j in range(i) if ordered[j][1] <= start]
        chain.append(1 + max(before, default=0))
    return max(chain, default=0)


async def test_admitting_many_groups_costs_one_round_trip_not_one_each(
    delayed_fleet: Callable[..., FleetConfig],
) -> None:
    """The dispatcher pipelines its sends: N groups admitted at once to a region behind a slow link
    are all on the wire before the first acknowledgement comes back, and all land in Kafka."""
    config = delayed_fleet(1.0, groups_per_step=8, max_staleness=1)
    a = config.algorithm
    groups = a.groups_per_step * (1 + a.max_staleness + a.dispatch_ahead_steps)  # the window and the steps ahead
    await ensure_topics(config, REGION)
    limits = RecordLimits.from_config(config)
    spans: list[tuple[float, float]] = []
    async with RegionClients(config, limits, trainer_group(config.run), {}) as clients, \
            Producer(config, REGION, "region-side") as region_side, \
            Consumer(config, REGION, ["prompts"], rollout_group(config.run), limits, region_side,
                     "region-side") as region_consumer:

        async def send(region: str, record: PromptRecord) -> None:
            start = time.monotonic()
            await clients.send(region, "prompts", record.group_id, record)
            spans.append((start, time.monotonic()))

        credits = RegionCredits({REGION: 1.0}, window_s=10, tokens_per_group=1)
        dispatcher = Dispatcher(config, itertools.repeat(("reverse", "abc=", "cba")), send, credits)
        sent = await dispatcher.dispatch(0, 0, time.time(), lambda gid: False, released=0)
        got: list[str] = []
        deadline = time.monotonic() + scaled(60)
        while len(got) < groups and time.monotonic() < deadline:
            got += [d.record.group_id for d in await region_consumer.poll(64, 0.2)]  # type: ignore[union-attr]
    assert groups >= 8 and sent == groups and len(spans) == groups
    assert sorted(got) == sorted(dispatcher.in_flight)
    # one wave: sequential sends would make this `groups` round trips of the link
    assert _rounds(spans) == 1, spans


def test_round_trips_of_sequential_sends_are_counted_one_each() -> None:
    """The measure above is not blind: sends that each wait for the previous ack are N round trips."""
    assert _rounds([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]) == 3
    assert _rounds([(0.0, 1.0), (0.1, 1.1), (1.2, 2.2)]) == 2
    assert _rounds([(0.0, 1.0), (0.0, 1.0)]) == 1
