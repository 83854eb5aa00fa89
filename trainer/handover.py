"""Cross-region handover: the trainer moves a lost region's work to another region (DESIGN.md §3).

A region is *gone* when it has nodes and none of them is up: every node draining (`drain`), every
node offline (`offline`, a whole-region preemption or stop), or no heartbeat from any node for two
heartbeat intervals (`silent`). `RegionWatch` decides this from the retained heartbeats, with the
trainer's own clock (a heartbeat counts as fresh when its content changed recently, so clocks of
other regions do not matter), so a silent region is noticed within 3 heartbeat intervals rather than
after `trainer.silent_region_timeout_s`.

A gone region is *back* once one of its nodes serves: `up` with an engine `up` (`Heartbeat.serving`;
a heartbeat without engine statuses serves when `up`). A node that is `up` while all its engines
still start (the model loads for tens of seconds after a replacement) or restart holds its region
where it is: a region not gone is not lost for it (its work waits in the region's topics for the
engines), and a gone region is not back for it, so nothing is sent to a worker that cannot take it
yet and the region does not flap between gone and back while its engines load.

For a gone region the trainer reads the region's `partials` topic (its own consumer group
`fleetrl.<run>.trainer.handover`) and re-dispatches each partial of a group it still has in flight there, as a
`fleetrl.partial/1` record with the tokens, logprobs and per-token versions kept and `attempt + 1`,
to the `partials` topic of another region, where a worker resumes it token for token. A partial
whose group was already moved, trained or superseded by a newer attempt is skipped. A partial whose
prompt is already staler than the admission bound would arrive only to be dropped: its group is
dispatched again from scratch at the current version instead.

Groups the region still holds without a partial (never admitted by a worker, or lost with a node
that died without handing over) are dispatched again as prompts with `attempt + 1`: at once for a
silent region; for a draining one after `rollout.handover_timeout_s` (the workers' own bound), since
its partials are on their way. An agent that leaves (a preemption notice, a stop) says `offline`
with `left` only once its workers have stopped, each unfinished group handed over (its partial
acknowledged) or the worker killed past its bound; so once every node of a region has left and the
trainer has read the region's `partials` to an end asked of the broker after that, no partial is
still to come: the rest move at once, not a handover bound later (the groups a preempted region
never started held admission slots for that long). An `offline` without `left` is a last will: the
agent died, and its workers may live on or a restarted agent take the region's work up again, so
the region keeps the handover bound. A region that comes back finds its copies superseded: the trainer's
dedup by `group_id` trains exactly one of the attempts.

The handover consumers join their groups when the trainer starts, in the background (an unreachable
cluster never stalls the loop; it is tried again when its region goes), and stay joined, unpolled
while their region lives: joining a group takes seconds (tansu: half the session timeout; Kafka:
`group.initial.rebalance.delay.ms`, 3 s), and a preempted region's partials waited that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Literal

from fleetrl.broker import (
    Consumer,
    Delivery,
    Heartbeat,
    KafkaError,
    PartialRecord,
    RecordLimits,
    trainer_handover_group,
)
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger
from fleetrl.trainer.collector import Collector
from fleetrl.trainer.dispatcher import Dispatcher
from fleetrl.trainer.regions import RegionClients

log = get_logger(__name__)
GoneReason = Literal["drain", "offline", "silent"]
_POLL_S = 0.05  # a gone region's partials are polled within the trainer's loop: keep it short
_IDLE_MEMBER_S = 24 * 3600.0
"""A handover consumer is polled only while its region is gone: the client may go this long between
polls before it leaves its group (it joins again on the next poll, as one opened then would)."""


@dataclass(slots=True)
class _Node:
    state: str
    beat_ts: float
    seen_at: float
    """Trainer time at which this heartbeat content was first seen."""
    serving: bool = True
    """`up` with an engine up (`Heartbeat.serving`); an `up` node that is not serving is starting."""
    left: bool = False
    """`offline` with `Heartbeat.left`: its agent stopped its workers and left."""


class RegionWatch:
    """Which regions are gone, from the nodes' heartbeats (see the module docstring)."""

    def __init__(self, regions: list[str], heartbeat_interval_s: float) -> None:
        self.silent_after_s = 2.0 * heartbeat_interval_s
        self._nodes: dict[str, dict[str, _Node]] = {r: {} for r in regions}
        self.gone: dict[str, tuple[float, GoneReason]] = {}
        """region -> (trainer time it was found gone, why)."""
        self.left: set[str] = set()
        """Gone regions whose nodes all left (`offline` with `Heartbeat.left`)."""

    def observe(self, region: str, node: str, state: str, beat_ts: float, now: float, *,
                serving: bool = True, left: bool = False) -> None:
        """`serving`: whether an `up` node has an engine up (`Heartbeat.serving`); False while its
        engines all start or restart. `left`: `Heartbeat.left`."""
        nodes = self._nodes.get(region)
        if nodes is None:
            return
        serving, left = serving and state == "up", left and state == "offline"
        known = nodes.get(node)
        if known is None:
            # A retained heartbeat seen for the first time may be old: trust its own clock, bounded by ours.
            nodes[node] = _Node(state, beat_ts, min(beat_ts, now), serving, left)
        elif beat_ts != known.beat_ts or state != known.state or serving != known.serving or left != known.left:
            nodes[node] = _Node(state, beat_ts, now, serving, left)

    def update(self, now: float) -> tuple[list[str], list[str]]:
        """Re-assess every region; returns (regions newly gone, regions back)."""
        went, back = [], []
        for region, nodes in self._nodes.items():
            reason = self._reason(nodes, now)
            if reason == "starting":
                continue  # neither lost nor back while its engines load (see the module docstring)
            if reason is not None and region not in self.gone:
                self.gone[region] = (now, reason)
                went.append(region)
                log.warning("handover.region_gone", region=region, reason=reason, nodes=len(nodes))
            elif reason is not None and self.gone[region][1] != reason:
                self.gone[region] = (self.gone[region][0], reason)
            elif reason is None and region in self.gone:
                del self.gone[region]
                back.append(region)
                log.info("handover.region_back", region=region)
            if reason == "offline" and all(n.left for n in self._nodes[region].values()):
                self.left.add(region)
            else:
                self.left.discard(region)
        return went, back

    def _reason(self, nodes: Mapping[str, _Node], now: float) -> GoneReason | Literal["starting"] | None:
        """Why the region is gone; None while a node serves; "starting" while its live `up` nodes
        all start their engines (the region keeps whatever it was)."""
        if not nodes:
            return None  # never heard of: not lost, just not measured yet
        live = [n for n in nodes.values() if now - n.seen_at <= self.silent_after_s]
        if any(n.serving for n in live):
            return None
        if any(n.state == "up" for n in live):
            return "starting"
        if any(n.state == "draining" for n in live):
            return "drain"
        if all(n.state == "offline" for n in nodes.values()):
            return "offline"
        return "silent"


def moved_partial(record: PartialRecord, attempt: int, now: float) -> PartialRecord:
    """A lost region's partial as it goes to another region: the new attempt, its samples unchanged (tokens,
    logprobs, versions and, in a `fleetrl.partial/2`, an agent run's segments and contexts, which the
    receiving worker replays: docs/agents.md)."""
    return PartialRecord(prompt=dataclasses.replace(record.prompt, attempt=attempt, dispatched_at=now),
                         samples=record.samples, handed_over_by=record.handed_over_by)


class Handover:
    """Moves the work of gone regions elsewhere; `tick()` once per trainer loop round."""

    def __init__(self, config: FleetConfig, clients: RegionClients, dispatcher: Dispatcher,
                 limits: RecordLimits, collector: Collector) -> None:
        self.config, self.clients, self.dispatcher, self.limits = config, clients, dispatcher, limits
        self.collector = collector
        self.watch = RegionWatch([r.name for r in config.regions], config.mqtt.heartbeat_interval_s)
        self.group = trainer_handover_group(config.run)
        self._consumers: dict[str, Consumer] = {}
        self._stacks: dict[str, AsyncExitStack] = {}
        self._opening: dict[str, asyncio.Task[None]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self.partials_moved = 0
        self.prompts_moved = 0
        self._read_out: set[str] = set()
        """Offline regions whose partials were all read (see the module docstring)."""

    def start(self) -> None:
        """Join every region's handover consumer in the background (see the module docstring)."""
        for region in self.config.regions:
            self._open(region.name)

    async def tick(self, now: float, version: int,
                   nodes: Mapping[tuple[str, str], Heartbeat]) -> tuple[int, int]:
        """Observe the heartbeats, move what gone regions hold; returns (partials, prompts) moved."""
        for (region, node), beat in list(nodes.items()):
            self.watch.observe(region, node, beat.state, beat.ts, now, serving=beat.serving, left=beat.left)
        went, _back = self.watch.update(now)
        for region in went:
            if region in self._consumers:
                log.info("handover.reading_partials", region=region)
            else:
                self._open(region)  # its consumer could not join at start: try again
        self._read_out &= self.watch.left
        partials = prompts = 0
        gone = frozenset(self.watch.gone)
        for region, (since, reason) in list(self.watch.gone.items()):
            partials += await self._move_partials(region, now, version, gone)
            settled = reason == "silent" or region in self._read_out
            if settled or now - since >= self.config.rollout.handover_timeout_s:
                prompts += await self.dispatcher.redispatch_region(region, now, exclude=gone)
        self.partials_moved += partials
        self.prompts_moved += prompts
        return partials, prompts

    # -- the partials of a gone region --------------------------------------------------------

    async def _move_partials(self, region: str, now: float, version: int, gone: frozenset[str]) -> int:
        consumer = self._consumers.get(region)
        if consumer is None:
            return 0
        try:
            deliveries = await consumer.poll(max_records=256, timeout_s=_POLL_S)
        except KafkaError as exc:
            log.warning("handover.poll_failed", region=region, error=str(exc))
            return 0
        latest: dict[str, PartialRecord] = {}
        for d in deliveries:  # a group handed over twice in the region: its later record has more tokens
            if isinstance(d.record, PartialRecord):
                latest[d.record.group_id] = d.record
        moved = 0
        for record in latest.values():
            moved += await self._move_one(region, record, now, version, gone)
        await self._commit(region, consumer, deliveries)
        if not deliveries and region in self.watch.left and region not in self._read_out:
            await self._check_read_out(region, consumer)
        return moved

    async def _check_read_out(self, region: str, consumer: Consumer) -> None:
        """Every node of `region` left (its partials acknowledged before that) and this poll found
        nothing: whether the partials are read to an end asked of the broker now."""
        try:
            done = await consumer.read_to_end()
        except KafkaError as exc:
            log.warning("handover.end_unknown", region=region, error=str(exc))
            return
        if done:
            self._read_out.add(region)
            log.info("handover.partials_read", region=region,
                     held=sum(1 for f in self.dispatcher.in_flight.values() if f.region == region))

    async def _move_one(self, region: str, record: PartialRecord, now: float, version: int,
                        gone: frozenset[str]) -> int:
        gid = record.group_id
        flight = self.dispatcher.in_flight.get(gid)
        tokens = sum(len(s.completion_ids) for s in record.samples)
        if flight is None or flight.region != region or flight.attempt != record.prompt.attempt:
            log.info("handover.superseded", group_id=gid, region=region, attempt=record.prompt.attempt)
            if self.dispatcher.waste is not None:  # its tokens were paid for in the region, and are not used
                self.dispatcher.waste.on_regenerated(region, tokens)
            return 0  # trained, moved already, or a newer attempt is out: this copy is not needed
        if self.collector.lag_of(record.prompt.min_version, version) > self.collector.max_lag:
            # Its tokens would arrive too stale to train: start the group afresh at today's version.
            flight.min_version = version
            if self.dispatcher.waste is not None:
                self.dispatcher.waste.on_regenerated(region, tokens)
            log.info("handover.too_stale", group_id=gid, region=region, min_version=record.prompt.min_version)
            return 0  # redispatch_region sends it as a prompt
        target = self.dispatcher.pick(now, exclude=gone | {region})
        if target in gone or target == region:
            return 0  # nowhere to go: the prompt fallback sends it once a region is back
        moved = moved_partial(record, flight.attempt + 1, now)
        try:
            await asyncio.wait_for(self.clients.producer(target).send("partials", gid, moved),
                                   self.config.kafka.request_timeout_s)
        except (KafkaError, TimeoutError) as exc:
            log.warning("handover.send_failed", group_id=gid, region=target, error=str(exc))
            return 0
        self.dispatcher.moved(gid, target, now)
        log.info("handover.partial_moved", group_id=gid, from_region=region, to_region=target,
                 attempt=flight.attempt, tokens=tokens, reason=record.handed_over_by.reason)
        return 1

    async def _commit(self, region: str, consumer: Consumer, deliveries: list[Delivery]) -> None:
        if not deliveries:
            return
        try:
            await consumer.commit(deliveries)
        except KafkaError as exc:  # re-read later: every record is checked against the dispatcher again
            log.warning("handover.commit_failed", region=region, error=str(exc))

    # -- consumers, opened and closed in the background ---------------------------------------

    def _open(self, region: str) -> None:
        if region in self._consumers or region in self._opening:
            return
        task = asyncio.create_task(self._open_consumer(region), name=f"handover-open-{region}")
        self._opening[region] = task
        task.add_done_callback(lambda _t: self._opening.pop(region, None))

    async def _open_consumer(self, region: str) -> None:
        stack = AsyncExitStack()
        try:
            consumer = await stack.enter_async_context(Consumer(
                self.config, region, ["partials"], self.group, self.limits, self.clients.producer(region),
                f"{self.config.run}-handover-{region}", max_poll_interval_s=_IDLE_MEMBER_S))
        except KafkaError as exc:  # its groups still move as prompts
            await stack.aclose()
            log.warning("handover.partials_unreachable", region=region, error=str(exc))
            return
        self._consumers[region], self._stacks[region] = consumer, stack
        log.info("handover.reading_partials" if region in self.watch.gone else "handover.consumer_ready",
                 region=region)

    def ready(self, region: str) -> bool:
        """Whether `region`'s handover consumer has joined its group (it reads only while the region is
        gone)."""
        return region in self._consumers

    def _close(self, region: str) -> None:
        opening = self._opening.pop(region, None)
        if opening is not None:
            opening.cancel()
        self._consumers.pop(region, None)
        stack = self._stacks.pop(region, None)
        if stack is not None:
            task = asyncio.create_task(stack.aclose(), name=f"handover-close-{region}")
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every handover consumer; those still joining are cancelled and awaited too (bounded),
        so that each closes its connections (a trainer that stops within a join's seconds has some)."""
        joining = list(self._opening.values())
        for region in list(self._stacks) + list(self._opening):
            self._close(region)
        tasks = [*joining, *self._closing]
        if tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True),
                                       self.config.kafka.request_timeout_s)
