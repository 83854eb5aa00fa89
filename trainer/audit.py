"""`fleetrl audit`: proves from the topics and the trainer's checkpoint that nothing was lost.

Every group the dispatcher sent (a `prompts` record in any region) must be, in the newest
checkpoint, exactly one of: trained once (the collector's ledger), counted stale, waiting in the
buffer, still in flight, or dead-lettered with a reason. A group dispatched after that checkpoint
is not lost: the next start draws its prompt again. Anything else is lost; a group twice in the
ledger was trained twice. Either makes the audit fail.

Past retention: the checkpoint's ledger (`ledger.py`) folds old settled groups into ranges of group
indices and records a settled watermark per region and `prompts` partition, below which every
record belongs to a settled group (or to one with a later record). The audit reads each
`prompts` partition from its watermark on (and `trajectories` from the trainer's committed
offsets), so Kafka retention may delete what lies below; it proves exactly-once for the groups
dispatched from the watermark on, and checks the folded part for consistency (counts match the
ranges, no detailed row inside them). A partition whose log now starts after its watermark lost
records the proof needs: that fails the audit, naming the partition. A checkpoint without
watermarks (format 1, or the first checkpoints after resuming one) is audited from the beginning.

The topic reader is group-less (assign + seek, read to the end offsets), so an audit never moves
any consumer group's offsets.
"""

from __future__ import annotations

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
    read_log_from,
    topic_name,
)
from fleetrl.config import FleetConfig
from fleetrl.trainer.eval_audit import EvalAudit, reconcile_evals
from fleetrl.trainer.eval_book import eval_request_of, parse_eval_group_id
from fleetrl.trainer.ledger import IndexRanges, group_index


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
    read_from: dict[str, dict[int, int]] = field(default_factory=dict)
    """region -> `prompts` partition -> the offset the read began at (the settled watermark, or 0)."""
    log_starts: dict[str, dict[int, int]] = field(default_factory=dict)
    """region -> `prompts` partition -> where the log starts now (after retention)."""


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
    settled_folded: int = 0
    """Settled groups the ledger keeps only as index ranges (proven when they were folded)."""
    watermarks: dict[str, dict[str, int]] = field(default_factory=dict)
    """region -> `prompts` partition -> settled watermark: the proof covers records from it on."""
    skipped_below_watermark: int = 0
    """`prompts` records still in the topics below the watermarks, not read."""
    cut_by_retention: list[str] = field(default_factory=list)
    """Partitions whose log starts after their watermark: records the proof needs are gone."""
    ledger_problems: list[str] = field(default_factory=list)
    foreign_prompts: int = 0
    """`prompts` records of this run with group ids the trainer never issues (not `<run>-<index>`):
    written by someone else (a fuzzer, a misconfigured tool). Not the trainer's groups, so neither
    dispatched nor lost; workers dead-letter the invalid ones, and the collector trains a valid
    one at most once."""
    eval: EvalAudit = field(default_factory=EvalAudit)
    """The eval books (eval_audit.py): eval prompts are not training groups and are counted apart."""

    def problems(self) -> list[str]:
        out = list(self.ledger_problems) + self.eval.problems()
        if self.cut_by_retention:
            out.append(f"records after the settled watermark were removed (retention?) in {self.cut_by_retention}: "
                       f"the groups they held cannot be proven")
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
    ledger = s["collector"].get("ledger") or {}
    folded, ledger_problems = _folded(ledger)
    counts = Counter(row[0] for row in s["collector"]["trained"])
    trained = set(counts)
    stale = set(s["collector"]["stale"])
    pending = {_group_id(raw) for raw in s["collector"]["pending"]}
    in_flight = set(s["dispatcher"]["in_flight"])
    drawn = int(s["dispatcher"]["next_index"])
    evals = {gid for gid in view.dispatched
             if parse_eval_group_id(gid, run) is not None or eval_request_of(gid, run) is not None}
    foreign = {gid for gid in view.dispatched if group_index(gid, run) is None} - evals
    dispatched = set(view.dispatched) - foreign - evals

    def is_folded(gid: str) -> bool:
        index = group_index(gid, run)
        return index is not None and index in folded

    lost, after = [], 0
    for gid in sorted(dispatched):
        if gid in trained or gid in stale or gid in pending or gid in in_flight or gid in view.dead or is_folded(gid):
            continue
        if _index(gid, run) >= drawn:
            after += 1
        else:
            lost.append(gid)
    marks = {r: {str(p): o for p, o in ps} for r, ps in (ledger.get("watermarks") or {}).items()}
    report = AuditReport(
        ok=False, dispatched=len(dispatched), trained=len(trained) + int(ledger.get("folded_trained", 0)),
        stale=len(stale) + int(ledger.get("folded_stale", 0)), pending=len(pending),
        in_flight=len(in_flight & dispatched), dead_lettered=len(set(view.dead) & dispatched),
        after_checkpoint=after, lost=lost,
        trained_twice=sorted(g for g, n in counts.items() if n > 1 or is_folded(g)),
        trained_not_dispatched=sorted(trained - dispatched), checkpoint_step=s["step"],
        settled_folded=len(folded), watermarks=marks,
        skipped_below_watermark=sum(max(0, view.read_from.get(r, {}).get(p, 0) - start)
                                    for r, starts in view.log_starts.items() for p, start in starts.items()),
        cut_by_retention=[f"{r} prompts partition {p}: log starts at {start}, watermark {view.read_from[r][p]}"
                          for r, starts in sorted(view.log_starts.items()) for p, start in sorted(starts.items())
                          if start > view.read_from.get(r, {}).get(p, 0)],
        ledger_problems=ledger_problems, foreign_prompts=len(foreign),
        eval=reconcile_evals(view.dispatched, view.arrived, view.dead, state, run),
    )
    report.ok = not report.problems()
    return report


def _folded(ledger: dict[str, Any]) -> tuple[IndexRanges, list[str]]:
    """The folded group indices, and what is wrong with them (counts that do not match)."""
    try:
        folded = IndexRanges.from_rows(ledger.get("folded", []))
    except ValueError as exc:
        return IndexRanges(), [f"checkpoint ledger: folded groups unreadable: {exc}"]
    n_trained, n_stale = int(ledger.get("folded_trained", 0)), int(ledger.get("folded_stale", 0))
    if n_trained + n_stale != len(folded):
        return folded, [f"checkpoint ledger: {n_trained} trained + {n_stale} stale folded groups, "
                        f"but its ranges hold {len(folded)}"]
    return folded, []


def watermarks_of(state: dict[str, Any] | None) -> dict[str, dict[int, int]]:
    """region -> `prompts` partition -> settled watermark, from a checkpoint state ({} if none)."""
    ledger = ((state or {}).get("collector") or {}).get("ledger") or {}
    return {str(r): {int(p): int(o) for p, o in ps} for r, ps in (ledger.get("watermarks") or {}).items()}


def _group_id(raw: bytes) -> str:
    record = decode_record(raw)
    assert isinstance(record, GroupRecord)
    return record.group_id


def _index(gid: str, run: str) -> int:
    """The prompt index in a dispatcher group id `<run>-<index>` (-1 for any other id)."""
    prefix = f"{run}-"
    try:
        return int(gid[len(prefix):]) if gid.startswith(prefix) else -1
    except ValueError:
        return -1


# -- reading the topics -----------------------------------------------------------------------


async def read_topics(config: FleetConfig, timeout_s: float = 30.0, state: dict[str, Any] | None = None) -> TopicView:
    """What the topics say; with a checkpoint `state`, `prompts` from its settled watermarks and
    `trajectories` from its committed offsets on. A topic read fails when no record arrives for
    `timeout_s`."""
    view = TopicView()
    marks = watermarks_of(state)
    consumed: dict[str, dict[int, int]] = {}
    for region, rows in ((state or {}).get("offsets") or {}).items():
        for topic, partition, offset in rows:
            if topic == topic_name(config.run, "trajectories"):
                consumed.setdefault(region, {})[int(partition)] = int(offset)
    for region in config.regions:
        starts = {"prompts": marks.get(region.name, {}), "trajectories": consumed.get(region.name, {})}
        await _read_region(config, region.name, view, timeout_s, starts)
    return view


async def _read_region(config: FleetConfig, region: str, view: TopicView, timeout_s: float,
                       starts: dict[str, dict[int, int]]) -> None:
    streams: tuple[Stream, ...] = ("prompts", "trajectories", "dead-letter")
    for stream in streams:
        records, log_starts = await _read(config, region, stream, timeout_s, starts.get(stream))
        if stream == "prompts":
            view.log_starts[region] = log_starts
            view.read_from[region] = {p: (starts.get(stream) or {}).get(p, 0) for p in log_starts}
        for raw in records:
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


async def _read(config: FleetConfig, region: str, stream: Stream, timeout_s: float,
                start: dict[int, int] | None) -> tuple[list[RawRecord], dict[int, int]]:
    # fails when no record arrives for timeout_s, however long the log (a total bound would fail a long run)
    topic = topic_name(config.run, stream)
    try:
        return await read_log_from(config, region, topic, start, client_id=f"{config.run}-audit",
                                   stall_timeout_s=timeout_s)
    except TopicError:
        return [], {}  # a topic never created holds nothing to audit
