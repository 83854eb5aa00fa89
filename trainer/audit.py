"""`fleetrl audit`: proves from the topics and the trainer's checkpoint that nothing was lost.

Every group the dispatcher sent (a `prompts` record in any region) must be, in the newest
checkpoint, exactly one of: trained once (the collector's ledger), counted stale, waiting in the
buffer, still in flight, or dead-lettered with a reason. A group dispatched after that checkpoint
is not lost: the next start draws its prompt again. Anything else is lost; a group twice in the
ledger was trained twice. Either makes the audit fail.

The topic reader is group-less (assign + seek to the beginning, read to the end offsets), so an
audit never moves any consumer group's offsets.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fleetrl.broker import (
    DeadLetter,
    GroupRecord,
    PromptRecord,
    RawRecord,
    RecordError,
    Stream,
    TopicError,
    decode_record,
    read_log,
    topic_name,
)
from fleetrl.config import FleetConfig


@dataclass(slots=True)
class TopicView:
    """What the topics of every region say."""

    dispatched: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    """group id -> [(region, attempt)] of each prompt record."""
    arrived: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    """group id -> [(region, attempt)] of each trajectory that decoded."""
    dead: dict[str, list[str]] = field(default_factory=dict)
    """group id (the record key) -> reasons of its dead letters."""
    dead_letters: int = 0


@dataclass(slots=True)
class AuditReport:
    ok: bool
    dispatched: int
    trained: int
    stale: int
    pending: int
    in_flight: int
    dead_lettered: int
    after_checkpoint: int
    lost: list[str]
    trained_twice: list[str]
    trained_not_dispatched: list[str]
    checkpoint_step: int | None

    def problems(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{len(self.lost)} dispatched group(s) lost: {self.lost[:10]}")
        if self.trained_twice:
            out.append(f"{len(self.trained_twice)} group(s) trained more than once: {self.trained_twice[:10]}")
        if self.trained_not_dispatched:
            out.append(f"{len(self.trained_not_dispatched)} trained group(s) never dispatched: "
                       f"{self.trained_not_dispatched[:10]}")
        return out


def reconcile(view: TopicView, state: dict[str, Any] | None, run: str) -> AuditReport:
    """Classify every dispatched group against the checkpoint state (None: no checkpoint yet)."""
    s = state or {"step": None, "collector": {"trained": [], "stale": {}, "pending": []},
                  "dispatcher": {"next_index": 0, "in_flight": {}}}
    trained_rows = s["collector"]["trained"]
    counts = Counter(row[0] for row in trained_rows)
    trained = set(counts)
    stale = set(s["collector"]["stale"])
    pending = {_group_id(raw) for raw in s["collector"]["pending"]}
    in_flight = set(s["dispatcher"]["in_flight"])
    drawn = int(s["dispatcher"]["next_index"])
    dispatched = set(view.dispatched)
    lost, after = [], 0
    for gid in sorted(dispatched):
        if gid in trained or gid in stale or gid in pending or gid in in_flight or gid in view.dead:
            continue
        if _index(gid, run) >= drawn:
            after += 1
        else:
            lost.append(gid)
    report = AuditReport(
        ok=False, dispatched=len(dispatched), trained=len(trained), stale=len(stale), pending=len(pending),
        in_flight=len(in_flight & dispatched), dead_lettered=len(set(view.dead) & dispatched),
        after_checkpoint=after, lost=lost,
        trained_twice=sorted(g for g, n in counts.items() if n > 1),
        trained_not_dispatched=sorted(trained - dispatched), checkpoint_step=s["step"],
    )
    report.ok = not report.problems()
    return report


def _group_id(raw: bytes) -> str:
    record = decode_record(raw)
    assert isinstance(record, GroupRecord)
    return record.group_id


def _index(gid: str, run: str) -> int:
    """The prompt index in a dispatcher group id `<run>-<index>`; foreign ids count as lost."""
    prefix = f"{run}-"
    try:
        return int(gid[len(prefix):]) if gid.startswith(prefix) else -1
    except ValueError:
        return -1


# -- reading the topics -----------------------------------------------------------------------


async def read_topics(config: FleetConfig, timeout_s: float = 30.0) -> TopicView:
    view = TopicView()
    for region in config.regions:
        await _read_region(config, region.name, view, timeout_s)
    return view


async def _read_region(config: FleetConfig, region: str, view: TopicView, timeout_s: float) -> None:
    streams: tuple[Stream, ...] = ("prompts", "trajectories", "dead-letter")
    for stream in streams:
        for raw in await _read_all(config, region, stream, timeout_s):
            if stream == "dead-letter":
                dl = DeadLetter.from_record(raw.partition, raw.offset, raw.key, raw.value, raw.headers)
                view.dead_letters += 1
                view.dead.setdefault((raw.key or b"").decode(errors="replace"), []).append(dl.reason)
                continue
            try:
                record = decode_record(raw.value)
            except RecordError:
                continue  # the consumer dead-letters these; they show up in the dead-letter topic
            if isinstance(record, PromptRecord) and stream == "prompts":
                view.dispatched.setdefault(record.group_id, []).append((region, record.attempt))
            elif isinstance(record, GroupRecord):
                view.arrived.setdefault(record.group_id, []).append((region, record.attempt))


async def _read_all(config: FleetConfig, region: str, stream: Stream, timeout_s: float) -> list[RawRecord]:
    # read_log bounds itself by kafka.request_timeout_s; timeout_s bounds the whole topic
    topic = topic_name(config.run, stream)
    try:
        return await asyncio.wait_for(read_log(config, region, topic, client_id=f"{config.run}-audit"), timeout_s)
    except TopicError:
        return []  # a topic never created holds nothing to audit
