"""Evaluations on the fleet, from the trainer's side: schedule, dispatch, take in, report (DESIGN.md §12).

* Schedule: when the trainer publishes version V (and `eval.every_versions` divides it, or it is the
  run's last), and at the start with `eval.before_training`, every eval set gets an evaluation at V.
* Dispatch: each round, eval prompts go out through the same `prompts` topics as training prompts, as
  `fleetrl.prompt/2` records pinned to V (`eval: {set, version}`, `min_version` V), placed by the
  region credits, while the eval groups in flight stay within `eval.max_share` of the training window
  (`(1 + max_staleness + dispatch_ahead_steps) * groups_per_step` groups; at least one). A prompt silent
  for `eval.deadline_s` is sent again with the next attempt, to another region where one serves.
* Take in: an eval group never reaches the collector; the book (`eval_book.py`) counts it returned once.
* Report: a complete evaluation's figures (`eval_figures.py`) go to the experiment log at the step that
  published V (`eval/<set>/pass@1`, ...), to the `eval.done` log event, and into the checkpoint.

Prompts come from `eval_prompts` (set name -> its prompts), built outside the trainer package with the
same loaders as the training prompts (the trainer never imports the rollout task registry).

`fleetrl eval --where fleet` (fleetrl/eval_fleet.py) runs one of these too, with a `request` id: its
group ids name the request (`eval_book.eval_group_id`), its pin is its own (`<run>/pins/<N>-<request>`),
and it takes in only its own groups. The trainer's runner (no request) skips the groups of any request:
neither trained, nor dead-lettered, nor in its books (`book.foreign` counts them).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from fleetrl.broker import EvalTag, GroupRecord, KafkaError, PromptRecord, Sampling
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.dispatcher import PromptItem
from fleetrl.trainer.eval_book import (
    EvalBook,
    Evaluation,
    Flight,
    eval_group_id,
    eval_request_of,
    parse_eval_group_id,
)
from fleetrl.trainer.eval_figures import ReturnedGroup
from fleetrl.trainer.metrics import TrainerMetrics

log = get_logger(__name__)

SendEval = Callable[[str, PromptRecord], Awaitable[None]]


class ExperimentLog(Protocol):
    """Where experiment figures go (the trackers: `trainer/tracking/`); it never blocks."""

    def scalars(self, step: int, figures: Mapping[str, float]) -> None: ...

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None: ...


TABLE_COLUMNS = ("set", "version", "prompts", "samples", "pass@1", "pass@k", "reward_mean", "length_mean",
                 "truncated")


class EvalRunner:
    def __init__(self, config: FleetConfig, prompts: Mapping[str, Sequence[PromptItem]], send: SendEval,
                 credits: RegionCredits, experiment_log: ExperimentLog | None = None,
                 metrics: TrainerMetrics | None = None, request: str | None = None) -> None:
        self.config, self.cfg, self.send, self.credits = config, config.eval, send, credits
        self.metrics = metrics
        self.request = request
        """None: the trainer's evaluations; else the `fleetrl eval` request this runner serves (its group ids)."""
        self.pin: Callable[[int, bool], None] | None = None
        """Pins a version in the home store through retention, or releases it (`Hub.pin`; set by the trainer)."""
        self._pinned: set[int] = set()
        self.prompts = dict(prompts)
        self.experiment_log = experiment_log
        self.book = EvalBook(config.run)
        a = config.algorithm
        window = (1 + a.max_staleness + a.dispatch_ahead_steps) * a.groups_per_step
        self.max_in_flight = max(1, math.floor(self.cfg.max_share * window))
        """Eval groups in flight at most (`eval.max_share` of the training window)."""
        missing = [s.name for s in self.cfg.sets if self.cfg.enabled and s.name not in self.prompts]
        if missing:
            raise ValueError(f"eval sets {missing} have no prompts (eval.sets)")

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    # -- schedule -------------------------------------------------------------------------------

    def on_start(self, version: int, step: int) -> None:
        """The version training starts from (a fresh start: `before_training`)."""
        if self.enabled and self.cfg.before_training and step == 0:
            self.schedule(version, step)

    def on_published(self, version: int, step: int, last: bool) -> None:
        every = self.cfg.every_versions
        if self.enabled and ((every is not None and version % every == 0) or (last and every is not None)):
            self.schedule(version, step)

    def schedule(self, version: int, step: int, names: Sequence[str] | None = None) -> None:
        """An evaluation of every set (or of the sets `names`) at `version`, reported at `step`."""
        for s in self.cfg.sets:
            if names is not None and s.name not in names:
                continue
            ev = self.book.schedule(s.name, version, step, min(s.num_prompts, len(self.prompts[s.name])))
            if ev is not None:
                log.info("eval.scheduled", set=s.name, version=version, step=step, prompts=ev.prompts)

    @property
    def unfinished(self) -> bool:
        return bool(self.book.unfinished())

    # -- dispatch -------------------------------------------------------------------------------

    async def dispatch(self, now: float, per_region: Mapping[str, int]) -> int:
        """Send what the share allows now (re-sending silent prompts first); how many were acknowledged.
        `per_region`: the training groups in flight per region (placement sees both)."""
        if not self.book.evals:
            return 0
        await self._sync_pins()
        sends: list[tuple[Evaluation, int, Flight]] = []
        for ev in self.book.unfinished():
            for index, f in ev.in_flight.items():
                if not f.sent or now - f.dispatched_at > self.cfg.deadline_s:
                    if f.sent:
                        ev.resent += 1
                        log.warning("eval.resent", set=ev.set_name, version=ev.version, index=index, region=f.region)
                    exclude = frozenset({f.region}) if f.sent else frozenset()
                    # (in the book at once: the next placement of this round counts it)
                    ev.in_flight[index] = Flight(self._pick(now, per_region, exclude), f.attempt + int(f.sent), now,
                                                 sent=False)
                    sends.append((ev, index, ev.in_flight[index]))
        room = self.max_in_flight - self.book.in_flight()
        for ev in self.book.unfinished():
            while room > 0 and ev.next_index < ev.prompts:
                ev.in_flight[ev.next_index] = Flight(self._pick(now, per_region), 0, now, sent=False)
                sends.append((ev, ev.next_index, ev.in_flight[ev.next_index]))
                ev.next_index += 1
                room -= 1
        results = await asyncio.gather(*(self._send(ev, index, flight, now) for ev, index, flight in sends))
        if self.metrics is not None:
            self.metrics.eval_groups_in_flight.set(self.book.in_flight())
        return sum(results)

    def region_gone(self, region: str) -> int:
        """`region` is gone (trainer/handover.py): its eval prompts are sent again elsewhere at the next
        dispatch, from scratch (an eval partial left there is superseded by the new attempt); how many."""
        moved = 0
        for ev in self.book.unfinished():
            for f in ev.in_flight.values():
                if f.region == region and f.sent and f.dispatched_at > 0.0:
                    f.dispatched_at = 0.0  # past any deadline: re-sent with the next attempt, excluding `region`
                    moved += 1
        return moved

    def _pick(self, now: float, per_region: Mapping[str, int], exclude: frozenset[str] = frozenset()) -> str:
        counts = dict(per_region)
        for ev in self.book.evals.values():
            for f in ev.in_flight.values():
                counts[f.region] = counts.get(f.region, 0) + 1
        return self.credits.pick(counts, now, exclude=exclude)

    async def _send(self, ev: Evaluation, index: int, flight: Flight, now: float) -> int:
        """Send to `flight.region`, or to the next region when its cluster fails (as the training
        dispatcher does); 1 if one acknowledged. When every region failed it stays unsent for the next
        round. Without the failover a region whose cluster was not connected yet kept every eval prompt
        placed on it, failing each round, while the other region trained."""
        tried: set[str] = set()
        while True:
            try:
                return await self._send_once(ev, index, flight)
            except _SendFailed:
                tried.add(flight.region)
                self.credits.on_send_failure(flight.region, now)
                if len(tried) >= len(self.credits.regions):
                    return 0  # stays unsent: the next round sends it again
                flight.region = self._pick(now, {}, exclude=frozenset(tried))

    async def _send_once(self, ev: Evaluation, index: int, flight: Flight) -> int:
        s = self.cfg.set(ev.set_name)
        item = PromptItem(*self.prompts[ev.set_name][index])
        gid = eval_group_id(self.config.run, ev.set_name, ev.version, index, self.request)
        record = PromptRecord(
            group_id=gid, run=self.config.run,
            task=item.task, n_samples=s.samples_per_prompt,
            sampling=Sampling(temperature=s.wire_temperature, top_p=s.top_p,
                              max_new_tokens=s.max_new_tokens or self.config.algorithm.max_new_tokens),
            prompt=item.prompt if item.messages is None else None, reference=item.reference,
            min_version=ev.version, dispatched_at=flight.dispatched_at, attempt=flight.attempt,
            messages=item.messages, columns=item.columns, eval=EvalTag(ev.set_name, ev.version))
        try:
            await self.send(flight.region, record)
        except KafkaError as exc:
            if not exc.retriable:
                raise
            log.warning("eval.send_failed", group_id=record.group_id, region=flight.region, error=str(exc))
            raise _SendFailed from exc
        flight.sent = True
        return 1

    async def _sync_pins(self) -> None:
        """Retention keeps every version an unfinished evaluation needs (`<run>/pins/<N>` in the home store)."""
        wanted = self.book.pinned_versions()
        if self.pin is None or wanted == self._pinned:
            return
        for version in sorted(wanted - self._pinned):
            await asyncio.to_thread(self.pin, version, True)
            self._pinned.add(version)
        for version in sorted(self._pinned - wanted):
            await asyncio.to_thread(self.pin, version, False)
            self._pinned.discard(version)

    async def release_pins(self) -> None:
        """Release every pin this runner holds (a `fleetrl eval` that ends, finished or not)."""
        for version in sorted(self._pinned):
            if self.pin is not None:
                await asyncio.to_thread(self.pin, version, False)
            self._pinned.discard(version)

    # -- arrivals -------------------------------------------------------------------------------

    def on_group(self, record: GroupRecord, step: int) -> None:
        """An eval group arrived (never for the collector). The trainer skips (and counts) the groups of a
        `fleetrl eval` request; a request's runner ignores every group but its own."""
        if self.request is None and eval_request_of(record.group_id, self.config.run) is not None:
            self.book.foreign += 1
            if self.metrics is not None:
                self.metrics.eval_foreign.inc()
            log.debug("eval.foreign_group", group_id=record.group_id)
            return
        parsed = parse_eval_group_id(record.group_id, self.config.run, self.request)
        if parsed is None and self.request is not None:
            return
        if parsed is None or record.eval is None or (parsed[0], parsed[1]) != (record.eval.set_name,
                                                                                 record.eval.version):
            self.book.orphans += 1
            log.warning("eval.unknown_group", group_id=record.group_id)
            return
        set_name, version, index = parsed
        ev = self.book.on_return(set_name, version, index, ReturnedGroup.of(record))
        if ev is not None:
            self._report(ev)

    def on_dead_letter(self, group_id: str, attempt: int, reason: str) -> None:
        """A worker dead-lettered an eval prompt of this runner (its reward failed, its version was gone):
        it will not return, and the evaluation ends without it (`eval_dead.py` follows the dead letters)."""
        parsed = parse_eval_group_id(group_id, self.config.run, self.request)
        ev = None if parsed is None else self.book.evals.get((parsed[0], parsed[1]))
        if parsed is None or ev is None:
            return
        dead_before = len(ev.dead)
        settled = self.book.on_dead(*parsed, attempt)
        if len(ev.dead) > dead_before:
            log.warning("eval.dead_lettered", group_id=group_id, attempt=attempt, reason=reason)
            if self.metrics is not None:
                self.metrics.eval_dead_lettered.inc()
        if settled is not None:
            self._report(settled)

    def _report(self, ev: Evaluation) -> None:
        if not ev.returned:
            log.warning("eval.failed", set=ev.set_name, version=ev.version, dead_lettered=len(ev.dead))
            return
        s = self.cfg.set(ev.set_name)
        f = ev.measure(s.samples_per_prompt, s.pass_threshold)
        ev.row = {"step": ev.step, **f.row(), **({"dead_lettered": len(ev.dead)} if ev.dead else {})}
        log.info("eval.done", step=ev.step, resent=ev.resent, duplicates=ev.duplicates, dead_lettered=len(ev.dead),
                 **f.row())
        if self.metrics is not None:
            self.metrics.eval_pass_at_1.labels(ev.set_name).set(f.pass_at_1)
            self.metrics.eval_reward_mean.labels(ev.set_name).set(f.reward_mean)
            self.metrics.eval_version.labels(ev.set_name).set(ev.version)
            self.metrics.eval_groups_in_flight.set(self.book.in_flight())
        if self.experiment_log is not None:
            self.experiment_log.scalars(ev.step, f.scalars())
            self.experiment_log.table(ev.step, f"eval/{ev.set_name}", TABLE_COLUMNS,
                                      [[f.set_name, f.version, f.prompts, f.samples, f.pass_at_1, f.pass_at_k,
                                        f.reward_mean, f.length_mean, f.truncated]])

    # -- checkpoint -----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return self.book.state()

    def restore(self, state: dict[str, Any] | None) -> None:
        self.book.restore(state)
        self._pinned = {e.version for e in self.book.evals.values()}  # the finished ones are released again


class _SendFailed(Exception):
    """A retriable Kafka failure of one region's send (logged where it happened)."""
