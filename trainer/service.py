"""The trainer loop on rank 0: dispatch, collect, step, publish, checkpoint, commit (DESIGN.md §1).

One asyncio task runs the loop; blocking work (the optimizer step, the hub publish, the checkpoint
write) runs in threads so the Kafka clients keep heartbeating. Per region it holds one producer
(prompts, and dead letters of that region) and one consumer of `trajectories` in the group
`fleetrl.<run>.trainer`. The order within a step is what makes resume exact:

    step -> snapshot (bf16 copy) -> checkpoint (every rank its shards, then atomic) -> commit offsets
                 └─> in the background, while the next step trains: publish version -> announce

In the background the snapshot itself is cast while the next step's forward and backward run; that
step's optimizer update waits for the cast to finish before it changes the weights.

Nothing in the loop waits for arrivals it could take in, and no admitted group waits to be sent:
a round's dispatch sends (a link round trip for their acknowledgements) run alongside the poll;
while the learner steps, the loop sends the groups the previous step admitted and keeps polling, so
the groups of the next step are buffered by the time this one ends (a group the running step took
counts as resolved until it is marked trained: a redelivered copy is a duplicate). Sends are done
before a step's checkpoint is written.

Step N's weights are version v+N: `self.version` moves when the snapshot is taken, and prompts
dispatched from then on ask for it (engines wait for it to land). One publish is in flight at a
time (`WeightPublisher.submit` waits for the previous one), so versions land in order; with
`trainer.publish_in_background: false`, or in `algorithm.mode: sync`, the publish runs inline,
before the checkpoint.

In sync mode (the on-policy baseline) `max_staleness` is 0, so the dispatcher admits one step's
groups only once the previous step is trained and its version published: workers generate with
that version alone and sit idle while the learner steps;
the step's groups are spread over the regions in proportion to their capacity (`credits.py`), as a
synchronous trainer over the same workers would split its batch.

A SIGKILL anywhere leaves the newest checkpoint consistent with itself; what a checkpoint holds and
how a restart takes it up (republishing its weights when the store moved past it) is `resume.py`'s.

Held-out evaluations (`eval_runner.py`, docs/eval.md) ride the same loop: scheduled when a version is
published, their prompts sent with the round's dispatch within `eval.max_share`, their groups taken to
the eval books instead of the collector, and the ones still out taken in before the drain.

A LoRA policy (`model.lora`) publishes its frozen base once, as a version of full weights, before
its first adapter version (`WeightPublisher.ensure_base`; a restart finds it again); every step's
version is then the adapter alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from fleetrl.broker import (
    ControlPlane,
    GroupRecord,
    KafkaError,
    RecordError,
    RecordLimits,
    encode_record,
    trainer_group,
)
from fleetrl.config import FleetConfig
from fleetrl.crashpoints import crash_point
from fleetrl.hub import Hub
from fleetrl.log import get_logger
from fleetrl.trainer.batch import build_step_batch
from fleetrl.trainer.collector import Collector
from fleetrl.trainer.cost import CostMeter
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.dispatcher import Dispatcher, PromptItem
from fleetrl.trainer.eval_dead import EvalDeadLetters
from fleetrl.trainer.eval_runner import EvalRunner
from fleetrl.trainer.handover import Handover
from fleetrl.trainer.learner import Learner, StepStats
from fleetrl.trainer.metrics import TrainerMetrics
from fleetrl.trainer.prices import PriceBook
from fleetrl.trainer.publisher import WeightPublisher
from fleetrl.trainer.regions import RegionClients
from fleetrl.trainer.resume import Checkpoints
from fleetrl.trainer.round_trips import RoundTrips
from fleetrl.trainer.tracking import TrainerTracking

log = get_logger(__name__)

POLL_TIMEOUT_S = 0.2
POLL_MAX_RECORDS = 256


@dataclass(slots=True)
class TrainerResult:
    steps: int
    version: int
    rewards: list[float] = field(default_factory=list)
    """Mean reward of each step's samples, in step order (this process's steps only)."""
    step_spans: list[tuple[float, float]] = field(default_factory=list)
    """Wall-clock (start, end) of each step: from taking its groups to its version published (sync
    mode) or submitted for publishing (async)."""
    trained_groups: int = 0
    stale_groups: int = 0
    duplicates: int = 0


class Trainer:
    def __init__(self, config: FleetConfig, prompts: Callable[[], Iterator[PromptItem]], learner: Learner,
                 *, metrics: TrainerMetrics | None = None, use_mqtt: bool = True,
                 eval_prompts: Mapping[str, Sequence[PromptItem]] | None = None) -> None:
        self.config, self.learner, self._prompts = config, learner, prompts
        self.metrics = metrics or TrainerMetrics()
        self.use_mqtt = use_mqtt
        a = config.algorithm
        self.collector = Collector(config.run, a.max_staleness, config.trainer.ledger_detail_groups)
        placement = config.trainer.placement
        self.credits = RegionCredits(
            {r.name: r.weight for r in config.regions}, window_s=config.trainer.throughput_window_s,
            tokens_per_group=a.n_samples * a.max_new_tokens, by_capacity=a.mode == "sync",
            price_aware=placement.price_aware, horizon_s=placement.horizon_s, max_staleness=a.max_staleness,
        )
        self.prices = PriceBook(config)
        self.cost = CostMeter(config, self.prices, self.metrics)
        self._pricing: asyncio.Task[object] | None = None
        self.clients: RegionClients | None = None
        self.announcer: ControlPlane | None = None
        self.dispatcher = Dispatcher(config, prompts(), self._send_prompt, self.credits, waste=self.cost)
        self.tracking = TrainerTracking(config, on_drop=lambda name: self.metrics.tracking_dropped.labels(name).inc())
        """Experiment figures (trainer/tracking/): each step's, released once a checkpoint covers it."""
        self.evals = EvalRunner(config, eval_prompts or {}, self._send_eval, self.credits, self.tracking.deferred,
                                self.metrics)
        """Held-out evaluations on the fleet (eval_runner.py): their groups never reach the collector; their
        figures are released, like a step's, once a checkpoint covers the evaluation's end."""
        self.step, self.version, self._target = 0, 0, 0
        self.checkpoints = Checkpoints(config, learner, self.collector, self.dispatcher, self.cost, self.metrics,
                                       self.tracking, self.evals)
        self.round_trips = RoundTrips(self.metrics)
        self._version_at: dict[int, float] = {}
        """When each recent version became the newest: a group sent ahead for it could start then."""
        self.result = TrainerResult(0, 0)

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self, max_steps: int | None = None, stop: asyncio.Event | None = None) -> TrainerResult:
        target = max_steps if max_steps is not None else self.config.algorithm.max_steps
        self._target = target
        stop = stop or asyncio.Event()
        async with AsyncExitStack() as stack:
            hub = Hub.from_config(self.config)
            stack.callback(hub.close)
            announcer = None
            if self.use_mqtt:
                announcer = await stack.enter_async_context(ControlPlane(self.config, f"{self.config.run}-trainer"))
            self.publisher = WeightPublisher(hub, announcer, self.metrics)
            self.evals.pin = hub.pin
            stack.push_async_callback(self.publisher.close, self.config.trainer.drain_timeout_s)
            self.announcer = announcer
            await self._restore_or_start()
            self.tracking.start()
            stack.push_async_callback(asyncio.to_thread, self.tracking.close)
            await asyncio.to_thread(self.prices.load)
            stack.push_async_callback(self._stop_pricing)
            limits = RecordLimits.from_config(self.config)
            self.clients = await stack.enter_async_context(
                RegionClients(self.config, limits, trainer_group(self.config.run), self.checkpoints.offsets,
                              on_dead_letter=self._count_dead_letter))
            self.eval_dead = await stack.enter_async_context(EvalDeadLetters(self.config, f"{self.config.run}-trainer"))
            self.handover = Handover(self.config, self.clients, self.dispatcher, limits, self.collector)
            stack.push_async_callback(self.handover.close)
            self.handover.start()
            await self._loop(target, stop)
            await self._finish_evals(stop)
            await asyncio.wait_for(self._drain(), self.config.trainer.drain_timeout_s)
        self.result.steps, self.result.version = self.step, self.version
        self.result.trained_groups = self.collector.ledger.trained_count
        self.result.stale_groups, self.result.duplicates = self.collector.ledger.stale_count, self.collector.duplicates
        return self.result

    async def _restore_or_start(self) -> None:
        self.step, self.version = await self.checkpoints.restore_or_start(self.publisher, self._prompts)

    async def _loop(self, target: int, stop: asyncio.Event) -> None:
        assert self.clients is not None
        if self.publisher.last is not None:
            await self.publisher.announce()
        self.evals.on_start(self.version, self.step)
        while self.step < target and not stop.is_set():
            now = time.time()
            moved = await self.dispatcher.redispatch_silent(now, self.config.trainer.silent_region_timeout_s)
            self.metrics.redispatched.inc(moved)
            self._heartbeats(now)
            await self._hand_over(now)
            # The round's sends wait for their acknowledgements (a link round trip) while the poll
            # waits for arrivals: one overlaps the other. Arrivals are handled once both are done.
            _, polled = await asyncio.gather(self._dispatch(now), self.clients.poll(POLL_MAX_RECORDS, POLL_TIMEOUT_S))
            await self._handle(polled)
            if self.evals.unfinished:  # an eval prompt a worker dead-lettered will not return (eval_dead.py)
                await self.eval_dead.poll(self.evals.on_dead_letter)
            for region, lag in (await self.clients.lag()).items():
                self.metrics.consumer_lag.labels(region).set(lag)
            while self.step < target and self.collector.ready(self.config.algorithm.groups_per_step):
                if not await self._train_one():
                    break
            if self._finished():
                log.info("trainer.out_of_work", step=self.step, admitted=self.dispatcher.admitted)
                break

    async def _finish_evals(self, stop: asyncio.Event) -> None:
        """Training is done: take in the evaluations still out, bounded by `eval.finish_timeout_s` (by half
        of `trainer.drain_timeout_s` when a signal stopped the trainer: its drain is bounded)."""
        assert self.clients is not None
        bound = self.config.eval.finish_timeout_s
        if stop.is_set():
            bound = min(bound, self.config.trainer.drain_timeout_s / 2)
        deadline = time.monotonic() + bound
        while self.evals.unfinished and time.monotonic() < deadline:
            _, polled = await asyncio.gather(self.evals.dispatch(time.time(), self.dispatcher.per_region()),
                                             self.clients.poll(POLL_MAX_RECORDS, POLL_TIMEOUT_S))
            await self._handle(polled)
            await self.eval_dead.poll(self.evals.on_dead_letter)
        if self.evals.unfinished:
            log.warning("eval.unfinished", evals=[(e.set_name, e.version) for e in self.evals.book.unfinished()])

    async def _stop_pricing(self) -> None:
        """A price read still in flight (a thread: it cannot be cancelled) ends within its own timeout."""
        if self._pricing is not None:
            await asyncio.wait({self._pricing}, timeout=30.0)

    def _finished(self) -> bool:
        d = self.dispatcher
        return d.exhausted and not d.in_flight and not self.collector.ready(self.config.algorithm.groups_per_step)

    # -- groups -------------------------------------------------------------------------------

    async def _on_group(self, region: str, delivery: Any) -> None:
        record = delivery.record
        assert isinstance(record, GroupRecord)
        if record.eval is not None and record.run == self.config.run:
            self.evals.on_group(record, self.step)  # never trained: the eval's own books
            assert self.clients is not None
            self.clients.handled(region, delivery)
            return
        now = time.time()
        flight = self.dispatcher.in_flight.get(record.group_id)
        latency = None
        if flight is not None and flight.region == region:
            # From when it could start: a group sent ahead waited for its version, not for the region.
            latency = now - max(flight.dispatched_at, self._version_at.get(flight.min_version, 0.0))
        self.credits.on_arrival(region, now, latency, tokens=sum(len(smp.completion_ids) for smp in record.samples))
        self.cost.on_transfer(region, delivery.size)
        if record.samples:
            self.dispatcher.observe_lengths(record.group_id, sum(len(s.completion_ids) for s in record.samples)
                                            / len(record.samples))
        verdict = self.collector.offer(record, self.version)
        if verdict == "foreign":
            err = RecordError("wrong_run", f"record of run {record.run!r} in run {self.config.run!r}'s topic",
                              field="run", group_id=record.group_id)
            assert self.clients is not None
            await self.clients.producer(region).dead_letter(
                (delivery.key or "").encode(), encode_record(record), err,
                delivery.topic, delivery.partition, delivery.offset)
            self.metrics.foreign.labels(region).inc()
        elif verdict == "duplicate":
            self.metrics.duplicates.labels(region).inc()
            self._lost(region, record)
            log.info("group.duplicate", group_id=record.group_id, attempt=record.attempt, region=region)
        else:
            self.metrics.groups.labels(region).inc()
            if flight is not None and latency is not None:
                self.round_trips.observe(region, flight.dispatched_at, record.timings, now)
            self.dispatcher.resolve(record.group_id)
            self.cost.on_unreplayed(region, record.regenerated or {})
            if verdict == "stale":
                self._count_stale(region, record)
        assert self.clients is not None
        self.clients.handled(region, delivery)

    def _lost(self, region: str, record: GroupRecord) -> None:
        """The region's work on this group was paid for and is not trained (a duplicate, or stale)."""
        self.credits.on_lost(region, time.time())
        self.cost.on_regenerated(region, sum(len(smp.completion_ids) for smp in record.samples))

    def _count_dead_letter(self, region: str, reason: str) -> None:
        self.metrics.dead_lettered.labels(region, reason).inc()

    def _count_stale(self, region: str, record: GroupRecord) -> None:
        self.metrics.stale_dropped.labels(region).inc()
        self._lost(region, record)
        log.warning("group.stale", group_id=record.group_id, region=region,
                    lag=self.collector.lag(record, self.version), bound=self.collector.max_lag)

    async def _send_prompt(self, region: str, record: Any) -> None:
        """One bounded send: a partitioned region costs the loop one request timeout, then it is skipped."""
        partition, offset = await self._produce_prompt(region, record)
        crash_point("trainer.dispatch.prompt_produced")
        self.collector.note_dispatched(record.group_id, region, partition, offset)
        crash_point("trainer.dispatch.ledger_updated")
        self.metrics.dispatched.labels(region).inc()

    async def _send_eval(self, region: str, record: Any) -> None:
        """An eval prompt: sent as a training prompt is, counted in the eval books, not the ledger."""
        await self._produce_prompt(region, record)

    async def _produce_prompt(self, region: str, record: Any) -> tuple[int, int]:
        assert self.clients is not None
        timeout_s = self.config.kafka.request_timeout_s
        try:
            partition, offset = await asyncio.wait_for(
                self.clients.send(region, "prompts", record.group_id, record),
                timeout_s + self.clients.link_delay_s.get(region, 0.0))
        except TimeoutError as exc:
            # The record may still land: a second copy of a prompt is deduplicated downstream.
            raise KafkaError(f"send of {record.group_id} to region {region!r} took over {timeout_s} s",
                             retriable=True) from exc
        return partition, offset

    async def _hand_over(self, now: float) -> None:
        """Move the work of regions whose nodes are all draining, offline or silent; a gone region is
        back once a node serves, an engine up (handover.py)."""
        nodes = self.announcer.nodes if self.announcer is not None else {}
        partials, prompts = await self.handover.tick(now, self.version, nodes)
        self.metrics.partials_moved.inc(partials)
        self.metrics.redispatched.inc(prompts)
        gone = self.handover.watch.gone
        for region, (since, _) in gone.items():  # eval prompts there go elsewhere, while a region serves
            if now - since >= self.config.rollout.handover_timeout_s and len(gone) < len(self.config.regions):
                self.evals.region_gone(region)

    def _heartbeats(self, now: float) -> None:
        nodes = self.announcer.nodes if self.announcer is not None else {}
        for (region, node), hb in list(nodes.items()):
            # A retained "up" from a node that died long ago carries its old `ts`: it will not count;
            # nor does an "up" node whose engines all still start (`serving`, credits.py).
            self.credits.on_heartbeat(region, node, hb.state, hb.tokens_per_s, min(hb.ts, now),
                                      busy_tokens_per_s=hb.busy_tokens_per_s, serving=hb.serving)
        for region, rate in self.credits.rates(now).items():
            self.metrics.region_rate.labels(region).set(rate)
        self.cost.heartbeats(nodes, self.credits, now)
        if self.prices.due() and (self._pricing is None or self._pricing.done()):
            # Reading a price file or EC2's history blocks: in a thread, never holding up the loop.
            self._pricing = asyncio.ensure_future(asyncio.to_thread(self.prices.load))

    # -- one step -----------------------------------------------------------------------------

    async def _train_one(self) -> bool:
        a = self.config.algorithm
        groups, dropped = self.collector.take(a.groups_per_step, self.version)
        for g in dropped:
            self._count_stale(g.region, g)
        if len(groups) < a.groups_per_step:
            self.collector.give_back(groups)
            return False
        t0, wall0 = time.monotonic(), time.time()
        batch = build_step_batch(groups, a.advantage, self.version)
        log.info("step.started", step=self.step + 1, version=self.version, groups=len(groups))
        cast_wait0 = self.learner.snapshot_wait_s
        stats = await self._while_training(asyncio.to_thread(self.learner.train_step, batch))
        for g in groups:
            self.metrics.staleness.observe(self.collector.lag(g, self.version))
        self.collector.mark_trained(groups, self.step + 1, self.version)
        for g in groups:
            self.cost.on_trained(g.region, sum(len(smp.completion_ids) for smp in g.samples))
        self.step += 1
        self.version = await self._publish_step(self.version + 1, self.learner.snapshot_wait_s - cast_wait0)
        self.evals.on_published(self.version, self.step, last=self.step >= self._target)
        self._version_at[self.version] = time.time()
        self._version_at.pop(self.version - 64, None)  # (groups ask at most `dispatch_ahead_steps` ahead)
        self.result.step_spans.append((wall0, time.time()))
        seconds = time.monotonic() - t0
        self.credits.on_step(time.time())
        self.metrics.step_seconds.observe(seconds)
        self.metrics.steps.inc()
        self.metrics.reward_mean.set(batch.stats["reward_mean"])
        self.metrics.clip_fraction.set(stats.clip_fraction)
        self.metrics.approx_kl.set(stats.approx_kl)
        self.result.rewards.append(batch.stats["reward_mean"])
        cost = self.cost.step_fields(time.time(), len(groups), stats.tokens)
        self.tracking.record_step(self.step, self.version, groups, batch_stats=batch.stats, stats=stats,
                                  seconds=seconds, cost_fields=cost)
        log.info("step.done", step=self.step, version=self.version, reward_mean=round(batch.stats["reward_mean"], 4),
                 reward_std=round(batch.stats["reward_std"], 4), loss=round(stats.loss, 5),
                 grad_norm=round(stats.grad_norm, 4), clip_fraction=stats.clip_fraction,
                 tis_truncated=stats.tis_truncated_fraction, tis_weight=round(stats.tis_weight_mean, 4), kl=stats.kl,
                 approx_kl=round(stats.approx_kl, 6), updates=stats.updates,
                 tokens=stats.tokens, lag_max=batch.stats["lag_max"],
                 lag_mean=round(batch.stats["lag_mean"], 3), groups=len(groups), seconds=round(seconds, 3),
                 **_reward_parts(groups), **self.round_trips.summary(),
                 **cost)
        if self.step % self.config.trainer.checkpoint_every == 0:
            await self._checkpoint()
        return True

    async def _dispatch(self, now: float) -> int:
        """Admit and send what the bound allows now (prompts ask for the newest version), and the eval
        prompts their share allows."""
        sent = await self.dispatcher.dispatch(self.step, self.version, now, self.collector.is_resolved,
                                              released=self.collector.ledger.stale_count)
        return sent + await self.evals.dispatch(now, self.dispatcher.per_region())

    async def _handle(self, polled: dict[str, list[Any]]) -> None:
        for region, deliveries in polled.items():
            for d in deliveries:
                await self._on_group(region, d)

    async def _while_training(self, step: Awaitable[StepStats]) -> StepStats:
        """Run the step; meanwhile send what the previous step admitted and take in what arrives:
        groups join the buffer for the next step (so it can start as soon as this one is done, not a
        poll later), and hostile records are dead-lettered while the learner computes, not only
        between steps. The step's own groups were taken before it started; a group offered meanwhile
        is judged against the version before this step, and again (`Collector.take`) when a later
        step takes it."""
        task = asyncio.ensure_future(step)
        assert self.clients is not None
        # The room the previous step opened (a step taken straight after it, its groups already
        # buffered, would otherwise hold the next groups' dispatch until it is done); awaited below,
        # before the step's checkpoint, so no checkpoint is written while a send is in flight.
        sends = asyncio.ensure_future(self._dispatch(time.time()))
        try:
            while not task.done():
                poll = asyncio.ensure_future(self.clients.poll(POLL_MAX_RECORDS, POLL_TIMEOUT_S))
                await asyncio.wait({task, poll}, return_when=asyncio.FIRST_COMPLETED)
                if not poll.done():
                    # The step is done first: stop waiting (a region's read stays in flight in
                    # `RegionClients` and is collected by the next poll; nothing is lost).
                    poll.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await poll
                    break
                await self._handle(poll.result())
        finally:
            if not task.done():  # a poll failed: the learner's thread still finishes its step
                await asyncio.wait({task})
            await asyncio.wait({sends})
        sends.result()  # a fatal send error is raised as the loop's own dispatch raises it
        return task.result()

    async def _publish_step(self, version: int, cast_wait_s: float) -> int:
        """Snapshot the weights and publish them as `version`: in the background (the cast while the
        next step's forward and backward run, the publish while it trains) or inline. `cast_wait_s`:
        what this step's optimizer update waited for the previous snapshot's cast."""
        t0 = time.monotonic()
        if self.config.trainer.publish_in_background and self.config.algorithm.mode == "async":
            await self.publisher.submit(lambda: asyncio.to_thread(self.learner.begin_published_state), version)
        else:
            snapshot = await asyncio.to_thread(self.learner.published_state)
            crash_point("trainer.step.snapshot_taken")
            await self.publisher.publish(snapshot, version)
        self.metrics.publish_stall_seconds.observe(time.monotonic() - t0 + cast_wait_s)
        return version

    # -- checkpoint and commit ----------------------------------------------------------------

    async def _checkpoint(self) -> None:
        """Save everything the next start needs, then (only then) commit the offsets it covers."""
        assert self.clients is not None
        await self.checkpoints.save(self.step, self.version, self.clients)
        self.tracking.release(self.step)

    async def _drain(self) -> None:
        """Bounded shutdown: what was trained is published, checkpointed and committed."""
        await self.publisher.flush()
        if self.step != self.checkpoints.saved_step and self.step > 0:
            await self._checkpoint()
        elif self.evals.enabled and self.step > 0:  # the evaluations taken in since the step's checkpoint
            assert self.clients is not None
            await self.checkpoints.save(self.step, self.version, self.clients, amend=True)
            self.tracking.release(self.step)  # their figures, now that the amended checkpoint holds them
        log.info("trainer.drained", step=self.step, version=self.version)


def _reward_parts(groups: list[GroupRecord]) -> dict[str, Any]:
    """`reward_fns`: each custom reward function's mean over the step's groups that carry it (none for
    built-in task rewards, so the step log stays as it was)."""
    sums: dict[str, list[float]] = {}
    for g in groups:
        for name, value in (g.reward_parts or {}).items():
            acc = sums.setdefault(name, [0.0, 0.0])
            acc[0] += value
            acc[1] += 1
    if not sums:
        return {}
    return {"reward_fns": {name: round(total / n, 4) for name, (total, n) in sums.items()}}
