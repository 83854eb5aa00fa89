"""Sharded publishing: the ranks of a sharded trainer publish one version together (DESIGN.md §5).

Each rank holds the whole tensors it owns (the trainer gathers each tensor's shards on one owner
rank, so no rank gathers the model), hashes them, encodes their parts against its own copy of their
previous bits (or the store's newest version, read back) and uploads them; rank 0 alone writes the
manifest and moves `latest`. A part is cut and encoded exactly as one process would (same element
ranges, same bytes, same sha256): only the objects the parts are packed into differ.

One version takes four steps on every rank, with the caller's collectives in between:

    report = sp.prepare(owned, latest)         # hash; parent in memory or read back
    plan = sp.plan(all_reports, order, latest)  # the same plan on every rank (anchor or delta, ties)
    part = sp.encode(plan)                       # encode and upload the owned parts
    pv = sp.commit(plan, all_parts, order)       # rank 0: the manifest and `latest`
    sp.finish(plan, ok)                          # every rank: keep the bits as the next parent
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetrl.hub import manifest as mf
from fleetrl.hub.errors import HubError
from fleetrl.hub.publisher import PublishedVersion, Publisher, _Tensor

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ShardReport:
    """What one rank found: its tensors (name -> dtype, shape, sha256) and why it cannot delta."""

    metas: dict[str, tuple[str, list[int], str]]
    problem: str | None
    prev_anchor: int


@dataclass(frozen=True)
class ShardPlan:
    version: int
    parent: int | None
    reason: str | None
    """Why this version is an anchor (None: a delta)."""
    can_delta: bool
    ties: dict[str, str]
    prev_anchor: int


@dataclass(frozen=True)
class ShardParts:
    """One rank's entries and the objects it uploaded (sha256 -> size)."""

    entries: list[mf.TensorEntry]
    objects: dict[str, int]
    written: int


class ShardPublisher(Publisher):
    """One rank's publisher; it keeps the previous bits of the tensors it owns only."""

    _cur: dict[str, _Tensor] | None = None

    def prepare(self, owned: Mapping[str, torch.Tensor], latest: int | None) -> ShardReport:
        """Hash the owned tensors (handed over: not copied) and make `latest` their parent."""
        self._cur = self._snapshot(owned, owned=True)
        problem = self._parent_problem(latest, self._cur)
        metas = {n: (t.dtype, t.shape, t.sha256) for n, t in self._cur.items()}
        return ShardReport(metas, problem, self._prev_anchor)

    def _keeps(self, name: str, cur: Mapping[str, _Tensor]) -> bool:
        return name in cur  # a parent read back: the owned tensors' bits only

    def plan(self, reports: list[ShardReport], order: list[str], latest: int | None) -> ShardPlan:
        """The version's plan, from every rank's report (deterministic: each rank computes it)."""
        metas: dict[str, tuple[str, list[int], str]] = {}
        for r in reports:
            metas |= r.metas
        if set(metas) != set(order):
            raise HubError(f"sharded publish: ranks reported {len(metas)} tensors, the model has {len(order)}")
        version = 0 if latest is None else latest + 1
        reason = next((r.problem for r in reports if r.problem is not None), None)
        if reason is None and latest is not None:
            parent_names = {t.name for t in self.reader.manifest(latest).tensors}
            if parent_names != set(order):
                reason = f"tensor names differ from version {latest}"
        can_delta, prev_anchor = reason is None, reports[0].prev_anchor
        if can_delta and version - prev_anchor >= self.cfg.anchor_interval:
            reason = f"anchor_interval: {version - prev_anchor} versions since anchor {prev_anchor}"
        ties: dict[str, str] = {}
        first: dict[tuple[str, str, tuple[int, ...]], str] = {}
        for name in order:  # tied by content, first name wins: what one process's snapshot does
            dtype, shape, sha = metas[name]
            key = (dtype, sha, tuple(shape))
            if key in first:
                ties[name] = first[key]
            first.setdefault(key, name)
        return ShardPlan(version, latest, reason, can_delta, ties, prev_anchor)

    def encode(self, plan: ShardPlan) -> ShardParts:
        """Encode and upload the parts of the owned tensors that are not tied to another."""
        assert self._cur is not None, "prepare first"
        for name, t in self._cur.items():
            t.tied_to = plan.ties.get(name)
        self._prev_anchor = plan.prev_anchor
        entries, objects = self._encode(self._cur, anchor=plan.reason is not None, with_delta=plan.can_delta)
        written = self._upload(objects)
        return ShardParts(entries, {sha: len(o) for sha, o in objects.items()}, written)

    def commit(self, plan: ShardPlan, parts: list[ShardParts], order: list[str]) -> PublishedVersion:
        """Rank 0: the manifest of every rank's entries, in the model's order, then `latest`."""
        by_name = {e.name: e for p in parts for e in p.entries}
        missing = [n for n in order if n not in by_name]
        if missing:
            raise HubError(f"sharded publish of version {plan.version}: no rank encoded {missing[:3]}")
        objects: dict[str, int] = {}
        for p in parts:
            objects |= p.objects
        return self._commit([by_name[n] for n in order], objects, plan.version, plan.parent, plan.reason,
                            sum(p.written for p in parts))

    def finish(self, plan: ShardPlan, ok: bool) -> None:
        """Every rank: the owned bits become the next parent when rank 0 committed the version."""
        if ok:
            self._prev, self._prev_version = self._cur, plan.version
            self._prev_anchor = plan.version if plan.reason is not None else plan.prev_anchor
        else:
            self._prev, self._prev_version = None, None
        self._cur = None
