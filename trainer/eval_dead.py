"""Eval prompts a worker dead-lettered, found in each region's `dead-letter` topic (DESIGN.md §12).

A worker that cannot generate an eval prompt (its reward failed, its pinned version is gone) dead-letters
it, keyed by its group id, and nothing comes back on `trajectories`: without this the evaluation waited for
it forever. `EvalDeadLetters` follows each region's `dead-letter` topic with a `LogTail` (no consumer
group: it takes nothing from anyone), and hands each eval record's group id, attempt and reason to the
runner (`EvalRunner.on_dead_letter`), whose book counts the prompt dead-lettered: the evaluation ends
without it, its figures over the prompts that returned, the count in its row.

It reads only while some evaluation is unfinished (the caller polls it then), never waits for a record,
and opens each region's reader in the background on the first poll, retrying a region that does not
answer after `kafka.request_timeout_s`. A reader starts `window` records before each partition's end: a
restarted trainer finds again the dead letters of the evaluations its checkpoint holds open (a dead
letter of an attempt older than the one in flight changes nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from types import TracebackType

from fleetrl.broker import (
    DeadLetter,
    GroupRecord,
    KafkaError,
    LogTail,
    PartialRecord,
    PromptRecord,
    RawRecord,
    RecordError,
    decode_record,
)
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger

log = get_logger(__name__)

DEAD_WINDOW = 4096
"""Dead letters per partition read again when a reader starts."""
READ_MAX_RECORDS = 512

OnDead = Callable[[str, int, str], None]
"""(group id, attempt, reason) of a dead-lettered eval record."""


class EvalDeadLetters:
    """`async with EvalDeadLetters(config, client_id) as dead: await dead.poll(runner.on_dead_letter)`."""

    def __init__(self, config: FleetConfig, client_id: str, regions: list[str] | None = None,
                 window: int = DEAD_WINDOW) -> None:
        self.config, self.client_id, self.window = config, client_id, window
        self.regions = regions if regions is not None else [r.name for r in config.regions]
        self._tails: dict[str, LogTail] = {}
        self._opening: dict[str, asyncio.Task[None]] = {}
        self._retry_at: dict[str, float] = {}
        self._reached: dict[str, dict[int, int]] = {}
        """Region -> partition -> the next offset to read (a reopened reader goes on from there)."""

    async def __aenter__(self) -> EvalDeadLetters:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def start(self) -> EvalDeadLetters:
        """Open every region's reader now (a caller that must not miss what comes from here on)."""
        await asyncio.gather(*(self._open(r) for r in self.regions if r not in self._tails))
        return self

    async def poll(self, on_dead: OnDead) -> int:
        """Hand every eval dead letter the regions' readers hold now to `on_dead`; how many."""
        self._open_missing()
        found = 0
        for region, tail in list(self._tails.items()):
            try:
                raws = await tail.read(READ_MAX_RECORDS, 0.0)
            except KafkaError as exc:
                if not exc.retriable:
                    raise
                log.warning("eval.dead_letters_read_failed", region=region, error=str(exc))
                del self._tails[region]
                await tail.close()
                self._retry_at[region] = time.monotonic() + self.config.kafka.request_timeout_s
                continue
            for raw in raws:
                self._reached.setdefault(region, {})[raw.partition] = raw.offset + 1
                found += _hand(raw, on_dead)
        return found

    def _open_missing(self) -> None:
        now = time.monotonic()
        for region in self.regions:
            if region in self._tails or region in self._opening or self._retry_at.get(region, 0.0) > now:
                continue
            self._opening[region] = asyncio.create_task(self._open(region), name=f"eval-dead-letters-{region}")

    async def _open(self, region: str) -> None:
        tail = LogTail(self.config, region, "dead-letter", f"{self.client_id}-{region}", window=self.window,
                       from_offsets=self._reached.get(region))
        try:
            await tail.start()
            self._tails[region] = tail
        except KafkaError as exc:  # a region not reachable yet: tried again later
            log.warning("eval.dead_letters_unreachable", region=region, error=str(exc))
            self._retry_at[region] = time.monotonic() + self.config.kafka.request_timeout_s
            await tail.close()
        finally:
            self._opening.pop(region, None)

    async def close(self) -> None:
        opening = list(self._opening.values())
        for task in opening:
            task.cancel()
        for task in opening:
            with contextlib.suppress(asyncio.CancelledError, KafkaError):
                await task
        tails, self._tails = list(self._tails.values()), {}
        for tail in tails:
            await tail.close()


def _hand(raw: RawRecord, on_dead: OnDead) -> int:
    """Call `on_dead` for one dead letter of an eval record; 1 if it was one."""
    gid = raw.key.decode(errors="replace") if raw.key else ""
    if "-eval" not in gid:
        return 0
    try:
        record = decode_record(raw.value)
    except RecordError:
        return 0  # not a record at all: no eval prompt of anyone's
    if isinstance(record, PartialRecord):
        attempt, tagged = record.prompt.attempt, record.prompt.eval is not None
    elif isinstance(record, PromptRecord | GroupRecord):
        attempt, tagged = record.attempt, record.eval is not None
    else:
        return 0
    if not tagged:
        return 0
    on_dead(gid, attempt, DeadLetter.from_record(raw.partition, raw.offset, raw.key, raw.value, raw.headers).reason)
    return 1
