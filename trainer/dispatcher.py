"""The dispatcher: turns prompts into `fleetrl.prompt/1` work, admitted under the staleness bound.

Admission (DESIGN.md §6): a new group is admitted only while
`in_flight + consumed <= (version + 1 + max_staleness) * groups_per_step`, where `version` counts
learner steps and `consumed` the groups taken off the wire for training (trained, or buffered for
the next step). A group dropped stale is settled without feeding a step, so it returns its place
(`released`): otherwise every stale drop would shrink the window for good, and a run that dropped
`(1 + max_staleness) * groups_per_step` of them over its life could admit nothing more and stall
(seen in a 20-minute soak whose trainer restarts made in-flight work stale). So the dispatcher
never runs more than `1 + max_staleness` steps of work ahead of the learner, and groups generated
in order reach the learner at most `max_staleness` versions old.

Past the window, `algorithm.dispatch_ahead_steps` steps' worth of groups are sent ahead, each with
the `min_version` it would have been admitted with: the j-th step's worth past the window asks for
the newest version + j. A worker holds such a prompt until those weights land and starts it then,
so the group is generated no staler than the bound allows, and the link and the Kafka fetch on the
way out are paid while the learner still computes the version it waits for (the round trip's
`to_worker` phase leaves the critical path). Admitted groups go to regions by
credit (`credits.py`); with `rollout.length_aware` a region's latency counts in proportion to the
group's predicted length (`lengths.py`: its prompt's completion length the last time it was
answered). A group whose region has been silent for `silent_region_timeout_s` is sent again, to
another region where one has credit, with `attempt + 1`; the collector trains whichever attempt
arrives first and drops the other as a duplicate.

The groups admitted in one round are sent concurrently and their acknowledgements awaited together,
so a round costs one link round trip, not one per group (the producer batches a region's records
per partition, in order); each group is noted as sent only once its own record is acknowledged, and
a send that fails moves that group alone to the next region. The state here is plain data (cursor
into the prompt source, groups in flight) and goes into every checkpoint; sending is an injected
coroutine, so the state machine is tested without Kafka.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Protocol

from fleetrl.broker import KafkaError, PromptRecord, Sampling
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.lengths import PromptLengths, content_key

log = get_logger(__name__)

class PromptItem(NamedTuple):
    """One prompt as a prompt source yields it (a plain `(task, prompt, reference)` tuple also does)."""

    task: str
    prompt: str
    """The prompt text; "" for a chat row (`messages`)."""
    reference: Any
    messages: list[dict[str, Any]] | None = None
    """The chat form, rendered by the worker with its tokenizer's chat template (`fleetrl.prompt/2`)."""
    columns: dict[str, Any] | None = None
    """The dataset row's other fields, handed to reward functions (`fleetrl.prompt/2`)."""

Send = Callable[[str, PromptRecord], Awaitable[None]]
"""Produce one prompt record to a region's `prompts` topic and wait for the ack."""


def admission_budget(version: int, admitted: int, max_staleness: int, groups_per_step: int) -> int:
    """How many more groups may be admitted now: (version + 1 + s) * G - (in flight + consumed)."""
    return max(0, (version + 1 + max_staleness) * groups_per_step - admitted)


def versions_ahead(version: int, admitted: int, max_staleness: int, groups_per_step: int,
                   ahead_steps: int) -> int | None:
    """The versions past `version` that the next group must wait for: 0 while the admission budget has
    room, j for the j-th step's worth of groups past the window (up to `ahead_steps`), None past that."""
    if admission_budget(version, admitted, max_staleness, groups_per_step) > 0:
        return 0
    ahead = (admitted - (version + 1 + max_staleness) * groups_per_step) // groups_per_step + 1
    return ahead if ahead <= ahead_steps else None


def group_id(run: str, index: int) -> str:
    """Deterministic id of the prompt at `index`: a re-dispatch after a restart reuses it."""
    return f"{run}-{index:09d}"


@dataclass(slots=True)
class InFlight:
    index: int
    region: str
    attempt: int
    dispatched_at: float
    min_version: int
    task: str
    prompt: str
    reference: Any
    sent: bool = True
    """False while no region's cluster acknowledged it (every send failed): retried each round."""
    messages: list[dict[str, Any]] | None = None
    columns: dict[str, Any] | None = None


class WasteSink(Protocol):
    """Where work lost to preemption is counted, by the region that paid for it (`cost.CostMeter`)."""

    def on_resent(self, region: str, groups: int = 1) -> None: ...

    def on_regenerated(self, region: str, tokens: int) -> None: ...


class Dispatcher:
    def __init__(self, config: FleetConfig, prompts: Iterator[PromptItem], send: Send,
                 credits: RegionCredits, waste: WasteSink | None = None) -> None:
        self.config, self.send, self.credits, self.waste = config, send, credits, waste
        self._prompts = prompts
        self.next_index = 0
        """Prompts drawn from the source so far: every admitted group, in flight or consumed."""
        self.in_flight: dict[str, InFlight] = {}
        self.exhausted = False
        self.lengths = PromptLengths()
        """Completion lengths of the prompts answered so far: placement by predicted work."""
        self.length_aware = config.rollout.length_aware
        a = config.algorithm
        self.sampling = Sampling(temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.max_new_tokens)

    @property
    def admitted(self) -> int:
        return self.next_index

    def next_min_version_offset(self, step: int, released: int) -> int | None:
        """How many versions past the newest the next group must wait for (`versions_ahead`); None when
        it may not be sent yet, or the data set's prompts are all drawn. `released`: admitted groups
        settled without training."""
        a, d = self.config.algorithm, self.config.dataset
        if d.num_prompts is not None and self.next_index >= d.num_prompts:
            return None
        return versions_ahead(step, self.admitted - released, a.max_staleness, a.groups_per_step,
                              a.dispatch_ahead_steps)

    async def dispatch(self, step: int, version: int, now: float, resolved: Callable[[str], bool], *,
                       released: int) -> int:
        """Admit and send as many groups as the bound allows; returns how many were sent.

        Admission counts in learner steps (the `version` of the bound: versions published since
        start); `version` is the newest published policy, the least a worker may sample with;
        `released` is how many admitted groups were dropped stale (they hold no place).
        """
        sent = await self._retry_unsent(now)
        sends: list[tuple[str, InFlight]] = []
        while not self.exhausted and (ahead := self.next_min_version_offset(step, released)) is not None:
            item = next(self._prompts, None)
            if item is None:
                self.exhausted = True
                log.info("dispatch.exhausted", admitted=self.admitted)
                break
            index, gid = self.next_index, group_id(self.config.run, self.next_index)
            self.next_index += 1
            if resolved(gid):  # trained before a restart lost the dispatch record: not again
                continue
            p = PromptItem(*item)
            flight = InFlight(index, "", 0, now, version + ahead, p.task, p.prompt, p.reference,
                              messages=p.messages, columns=p.columns)
            flight.region = self._place(flight, now)
            self.in_flight[gid] = flight  # counts for the next group's placement
            sends.append((gid, flight))
        return sent + await self._send_all(sends, now)

    async def _send_all(self, sends: list[tuple[str, InFlight]], now: float) -> int:
        """Send every record at once and wait for all the acknowledgements: a region's records share
        the link's round trips instead of paying one each. Returns how many were acknowledged; a
        fatal error cancels the rest and is raised as a sequential send would raise it."""
        if len(sends) <= 1:
            return sum([await self._send(gid, f, now) for gid, f in sends])
        try:
            async with asyncio.TaskGroup() as tasks:
                running = [tasks.create_task(self._send(gid, f, now), name=f"dispatch-{gid}") for gid, f in sends]
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None
        return sum(t.result() for t in running)

    async def redispatch_silent(self, now: float, timeout_s: float) -> int:
        """Send again, with a new attempt, every group whose region has been silent too long."""
        sends: list[tuple[str, InFlight]] = []
        for gid, f in list(self.in_flight.items()):
            quiet = self.credits.silent_since(f.region)
            if not f.sent or now - f.dispatched_at <= timeout_s or (quiet is not None and now - quiet <= timeout_s):
                continue
            old = f.region
            self.lost(old, now)
            f.region = self._place(f, now, exclude=frozenset({old}))
            f.attempt += 1
            f.dispatched_at = now
            log.warning("dispatch.redispatched", group_id=gid, attempt=f.attempt, from_region=old, to_region=f.region)
            sends.append((gid, f))
        return await self._send_all(sends, now)

    async def redispatch_region(self, region: str, now: float, exclude: frozenset[str]) -> int:
        """Send every group still in flight in `region` (a gone region, see handover.py) to another
        region not in `exclude`, with a new attempt; returns how many were acknowledged."""
        moved = 0
        for gid, f in list(self.in_flight.items()):
            if f.region != region or not f.sent:
                continue
            target = self.pick(now, exclude=exclude | {region})
            if target in exclude or target == region:
                return moved  # every other region is gone too: wait for one to come back
            f.region, f.attempt, f.dispatched_at = target, f.attempt + 1, now
            self.lost(region, now)
            log.warning("dispatch.redispatched", group_id=gid, attempt=f.attempt, from_region=region,
                        to_region=target, why="region_gone")
            moved += await self._send(gid, f, now)
        return moved

    def pick(self, now: float, exclude: frozenset[str] = frozenset()) -> str:
        """The region the next group would go to (credits), avoiding `exclude` where any other is left."""
        return self.credits.pick(self._per_region(), now, exclude=exclude)

    def lost(self, region: str, now: float, tokens: int = 0) -> None:
        """A group of `region` is sent again from scratch (its work there is lost); `tokens`: the tokens
        of it the trainer holds and cannot use (a partial too stale to move)."""
        self.credits.on_lost(region, now)
        if self.waste is not None:
            self.waste.on_resent(region)
            self.waste.on_regenerated(region, tokens)

    def observe_lengths(self, gid: str, tokens_per_sample: float) -> None:
        """A group in flight came back with this mean completion length: its prompt's next prediction."""
        f = self.in_flight.get(gid)
        if f is not None:
            self.lengths.observe(content_key(f.task, f.prompt, f.messages), tokens_per_sample)

    def _work(self, f: InFlight) -> float:
        """The group's predicted work in groups of average length (1.0 unless length-aware)."""
        if not self.length_aware:
            return 1.0
        return self.lengths.relative_work(content_key(f.task, f.prompt, f.messages))

    def _place(self, f: InFlight, now: float, exclude: frozenset[str] = frozenset()) -> str:
        return self.credits.pick(self._per_region(), now, exclude=exclude, work=self._work(f))

    def moved(self, gid: str, region: str, now: float) -> None:
        """The group was handed to `region` as a partial with the next attempt (see handover.py)."""
        f = self.in_flight[gid]
        f.region, f.attempt, f.dispatched_at, f.sent = region, f.attempt + 1, now, True
        self.credits.on_dispatch(region, now)

    def resolve(self, gid: str) -> InFlight | None:
        """The group was consumed (trained, stale, or known dead): no longer in flight."""
        return self.in_flight.pop(gid, None)

    async def _send(self, gid: str, f: InFlight, now: float) -> int:
        """Send to `f.region`, or to the next region when its cluster fails; 1 if one acknowledged.

        The group is in flight either way (admitted is admitted): when every region failed it waits,
        unsent, for the next round.
        """
        self.in_flight[gid] = f
        tried: set[str] = set()
        while True:
            record = PromptRecord(
                group_id=gid, run=self.config.run, task=f.task, n_samples=self.config.algorithm.n_samples,
                sampling=self.sampling, prompt=f.prompt if f.messages is None else None, reference=f.reference,
                min_version=f.min_version, dispatched_at=f.dispatched_at, attempt=f.attempt,
                messages=f.messages, columns=f.columns,
            )
            try:
                await self.send(f.region, record)
            except KafkaError as exc:
                if not exc.retriable:
                    raise
                tried.add(f.region)
                self.credits.on_send_failure(f.region, now)
                log.warning("dispatch.send_failed", group_id=gid, region=f.region, error=str(exc))
                if len(tried) == len(self.credits.regions):
                    f.sent = False
                    return 0
                f.region = self._place(f, now, exclude=frozenset(tried))
                continue
            f.sent = True
            self.credits.on_dispatch(f.region, f.dispatched_at)
            return 1

    async def _retry_unsent(self, now: float) -> int:
        sends: list[tuple[str, InFlight]] = []
        for gid, f in list(self.in_flight.items()):
            if not f.sent:
                f.region = self._place(f, now)
                f.dispatched_at = now
                sends.append((gid, f))
        return await self._send_all(sends, now)

    def per_region(self) -> dict[str, int]:
        """Groups in flight per region."""
        return self._per_region()

    def _per_region(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for f in self.in_flight.values():
            counts[f.region] = counts.get(f.region, 0) + 1
        return counts

    # -- checkpoint ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"next_index": self.next_index, "exhausted": self.exhausted,
                "in_flight": {g: asdict(f) for g, f in self.in_flight.items()}}

    def restore(self, state: dict[str, Any], prompts: Iterator[PromptItem]) -> None:
        """Continue after `state`: the prompt source restarts and skips what was drawn already."""
        self.next_index = int(state["next_index"])
        self.exhausted = bool(state.get("exhausted", False))
        self.in_flight = {g: InFlight(**f) for g, f in state["in_flight"].items()}
        self._prompts = itertools.islice(prompts, self.next_index, None)
