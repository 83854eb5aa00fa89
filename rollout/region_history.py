"""The region's shared response history: each worker also records the answers its region's other workers give.

Every finished group of a region passes through the region's `trajectories` topic (DESIGN.md §1, §3).
Beside its work, a rollout worker follows that topic with a `LogTail` (no consumer group: the
trainer's group, which consumes the topic, is untouched, and nothing is committed) and hands each
group's prompt and completions to its engine (`Engine.observe_responses`), which records them in its
response history (`fleetrl.rollout.history`) in its own thread, a bounded number of tokens per step.
So a worker drafts, and predicts lengths, for any prompt its region answered before, whichever worker
answered it; and a restarted worker starts `window` records before each partition's end, warming its
history with the region's newest answers. The history stays region-local and bounded.

It is an optimization only, and never makes a worker fail or wait:
* a record that does not decode, is outside the schema's bounds, or is another run's is skipped and
  counted (the trainer dead-letters it; this reader never produces anything);
* the worker's own groups are skipped, since its engine recorded them as they finished: the worker
  names each group (id, attempt) just before producing it (`mine`). A restarted worker's earlier
  groups are not named, and are recorded like anyone's;
* a Kafka failure is logged and the tail reopened after a backoff, from where it stopped (at most
  `window` records back); meanwhile the worker drafts from what it holds.
Decoding runs in a thread. Of a sample with environment turns (`fleetrl.group/2`) only the first
model turn is kept (its tokens up to the first environment token): the rest followed the
environment's replies, which the prompt alone does not give.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fleetrl.broker import (
    SCHEMA_GROUP,
    SOURCE_ENV,
    BrokerError,
    GroupRecord,
    LogTail,
    RawRecord,
    RecordError,
    RecordLimits,
    decode_record,
)
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger
from fleetrl.rollout.engine import Engine

log = get_logger(__name__)
_MINE_MAX = 4096  # own groups remembered until seen in the topic (one lost on its way is forgotten in time)
_BATCH = 256  # records read per fetch


@dataclass(slots=True)
class RegionHistoryStats:
    records: int = 0
    """Group records read from the region's `trajectories`."""
    own: int = 0
    """Of those, this worker's own groups (skipped: its engine recorded them)."""
    skipped: int = 0
    """Records skipped as unreadable: malformed, outside the bounds, or another run's."""
    responses: int = 0
    """Answers handed to the engine."""
    failures: int = 0
    """Times the tail failed (Kafka) and was reopened."""


@dataclass(frozen=True, slots=True)
class _Answers:
    group: tuple[str, int]
    prompt_ids: list[int]
    completions: list[list[int]]


class RegionHistory:
    """Feeds an engine's response history from the region's `trajectories` (see the module docstring)."""

    def __init__(self, config: FleetConfig, region: str, engine: Engine, client_id: str, *, window: int,
                 poll_s: float = 0.5, backoff_s: float = 1.0, max_backoff_s: float = 30.0) -> None:
        self.config, self.region, self.engine, self.client_id = config, region, engine, client_id
        self.window, self.poll_s, self.backoff_s, self.max_backoff_s = window, poll_s, backoff_s, max_backoff_s
        self.limits = RecordLimits.from_config(config)
        self.stats = RegionHistoryStats()
        self._mine: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._next: dict[int, int] = {}  # partition -> offset after the last record read

    def mine(self, group_id: str, attempt: int) -> None:
        """This worker is about to produce the group: skip it when it comes back through the topic."""
        self._mine[(group_id, attempt)] = None
        while len(self._mine) > _MINE_MAX:
            self._mine.popitem(last=False)

    async def run(self) -> None:
        """Follow the topic until cancelled; Kafka failures are retried with a doubling backoff."""
        delay = self.backoff_s
        while True:
            try:
                async with LogTail(self.config, self.region, "trajectories", self.client_id, window=self.window,
                                   from_offsets=self._next) as tail:
                    log.info("region_history.started", region=self.region, window=self.window,
                             resumed=bool(self._next))
                    delay = self.backoff_s
                    while True:
                        raws = await tail.read(_BATCH, self.poll_s)
                        if raws:
                            await self._take(raws)
            except BrokerError as exc:  # an optimization: never the worker's failure
                self.stats.failures += 1
                log.warning("region_history.read_failed", region=self.region, error=str(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.max_backoff_s)

    async def _take(self, raws: list[RawRecord]) -> None:
        for r in raws:
            self._next[r.partition] = max(self._next.get(r.partition, 0), r.offset + 1)
        decoded = await asyncio.to_thread(answers_of, raws, self.limits, self.config.run)
        self.stats.records += len(raws)
        for got in decoded:
            if got is None:
                self.stats.skipped += 1
            elif got.group in self._mine:
                del self._mine[got.group]
                self.stats.own += 1
            elif got.completions:
                self.engine.observe_responses(got.prompt_ids, got.completions)
                self.stats.responses += len(got.completions)


def answers_of(raws: Sequence[RawRecord], limits: RecordLimits, run: str) -> list[_Answers | None]:
    """Each record's prompt and completions (first model turns), or None where it cannot be used."""
    out: list[_Answers | None] = []
    for r in raws:
        try:
            record = decode_record(r.value, limits, expect=SCHEMA_GROUP)
        except RecordError:
            out.append(None)
            continue
        if not isinstance(record, GroupRecord) or record.run != run or len(record.prompt_ids) == 0:
            out.append(None)
            continue
        completions = []
        for s in record.samples:
            tokens = s.completion_ids
            if s.segments is not None:
                env = np.flatnonzero(s.sources() == SOURCE_ENV)
                tokens = tokens[: env[0]] if len(env) else tokens
            if len(tokens):
                completions.append(tokens.tolist())
        out.append(_Answers((record.group_id, record.attempt), record.prompt_ids.tolist(), completions))
    return out
