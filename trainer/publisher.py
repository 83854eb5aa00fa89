"""The publisher: every step's weights into the hub, then the version announced on MQTT.

The learner keeps fp32 master weights; engines run the publish dtype (bf16 by default). After a
step the trainer hands `submit` a snapshot of the cast (a private copy on the learner's device,
cast while the next step's forward and backward run): the hub encodes it as a delta against the
previous version, uploads it into the home store and moves `latest` in a thread, while the next
step trains. Only after the manifest and the `latest` pointer are written is the version announced
on the retained `fleetrl/<run>/policy` topic. One publish is in flight at a time, so versions land
and are announced strictly in order: `submit` first waits for the previous one (that wait, plus any
wait of the next optimizer update for the cast, is the trainer's stall), and a publish that failed
raises there, or in `flush`. A node that misses the message finds the same version through the
store's `latest`.

A LoRA policy's versions are its adapter alone: `ensure_base` first makes sure the home store holds
its frozen base as a version of full weights (published once; found again on a restart), and every
publish after that is an adapter on that base.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from typing import Protocol, TypeAlias

import torch

from fleetrl.broker import ControlPlaneError, PolicyAnnouncement
from fleetrl.config import LoraAdapterConfig
from fleetrl.crashpoints import crash_point
from fleetrl.hub import AdapterInfo, Hub, HubError, PublishedVersion
from fleetrl.log import get_logger
from fleetrl.trainer.metrics import TrainerMetrics

log = get_logger(__name__)

Snapshot: TypeAlias = Mapping[str, torch.Tensor] | Future[dict[str, torch.Tensor]]
"""A step's weights to publish: the tensors, or the future of a cast still running (snapshots.py)."""


class Announcer(Protocol):
    async def announce_policy(self, announcement: PolicyAnnouncement) -> None: ...


class WeightPublisher:
    def __init__(self, hub: Hub, announcer: Announcer | None, metrics: TrainerMetrics) -> None:
        self.hub, self.announcer, self.metrics = hub, announcer, metrics
        self.last: PublishedVersion | None = None
        self.adapter: AdapterInfo | None = None
        """Set by `ensure_base` for a LoRA policy: every version published is an adapter on that base."""
        self._pending: asyncio.Task[PublishedVersion] | None = None

    async def ensure_base(self, base: Callable[[], Mapping[str, torch.Tensor]], cfg: LoraAdapterConfig) -> int:
        """Make every later publish an adapter (per `cfg`) on a base version holding exactly `base()`:
        the base of the store's newest version (or that version itself) when it is that, else `base()`
        published now as the next version of full weights (not announced: engines load it with the
        first adapter). Returns the base version."""
        await self.flush()
        state = await asyncio.to_thread(base)
        found = await asyncio.to_thread(self._held_base, state)
        if found is None:
            pv = await asyncio.to_thread(self.hub.publish, state, owned=True)
            found = pv.version
            log.info("weights.base_published", version=found, bytes=pv.bytes_written, tensors=len(state))
        else:
            log.info("weights.base_found", version=found)
        self.adapter = AdapterInfo(base=found, r=cfg.r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout)
        return found

    def _held_base(self, state: Mapping[str, torch.Tensor]) -> int | None:
        newest = self.hub.newest()
        if newest is None:
            return None
        candidate = self.hub.manifest(newest).base
        candidate = newest if candidate is None else candidate
        try:
            return candidate if self.hub.holds(state, candidate) else None
        except HubError as exc:  # gone (retention) or unreadable: publish the base again
            log.warning("weights.base_unreadable", version=candidate, error=str(exc))
            return None

    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> PublishedVersion:
        """Publish a snapshot now (after any publish in flight) and announce; returns when both are done."""
        await self.flush()
        return await self._publish(state_dict, version)

    async def submit(self, take: Callable[[], Awaitable[Snapshot]], version: int) -> float:
        """Publish as `version`, in the background, the snapshot `take()` hands over (the tensors, or a
        future of them while they are being cast: they must not change once taken).

        Waits for the publish before it first (strict order, one in flight: the snapshot buffer that
        publish read as its parent is free only then) and raises its error if it failed; only then
        calls `take`. Returns the seconds spent waiting."""
        t0 = time.monotonic()
        await self.flush()
        waited = time.monotonic() - t0
        snapshot = await take()
        self._pending = asyncio.create_task(self._publish(snapshot, version, from_step=True),
                                            name=f"publish-v{version}")
        return waited

    async def flush(self) -> PublishedVersion | None:
        """Wait for the publish in flight, if any; raises its error."""
        task, self._pending = self._pending, None
        return None if task is None else await task

    async def close(self, timeout_s: float) -> None:
        """Bounded wait for a publish still in flight when the trainer stops on an error; its own
        failure is logged (the error that stopped the trainer is the one that propagates)."""
        task, self._pending = self._pending, None
        if task is None:
            return
        try:
            await asyncio.wait_for(task, timeout_s)
        except Exception as exc:  # reported here: the error that stopped the trainer propagates
            log.error("weights.publish_failed", error=f"{type(exc).__name__}: {exc}")

    async def _publish(self, snapshot: Snapshot, version: int | None, from_step: bool = False
                       ) -> PublishedVersion:
        state_dict = await _ready(snapshot)
        if from_step:
            crash_point("trainer.step.snapshot_taken")
        t0 = time.monotonic()
        # The trainer's state dicts are snapshots (Learner.published_state): the hub may keep them.
        pv = await asyncio.to_thread(self.hub.publish, state_dict, version=version, owned=True, adapter=self.adapter)
        seconds = time.monotonic() - t0
        self.metrics.publish_seconds.observe(seconds)
        self.metrics.publish_bytes.inc(pv.bytes_written)
        self.metrics.last_publish_bytes.set(pv.bytes_written)
        self.metrics.version.set(pv.version)
        self.last = pv
        crash_point("trainer.publish.latest_moved")
        await self.announce()
        crash_point("trainer.publish.announced")
        log.info("weights.published", version=pv.version, anchor=pv.anchor, bytes=pv.bytes_written,
                 seconds=round(seconds, 3), anchor_reason=pv.anchor_reason)
        return pv

    async def announce(self) -> None:
        """(Re-)announce the newest version on the retained policy topic."""
        if self.announcer is None or self.last is None:
            return
        pv = self.last
        try:
            await self.announcer.announce_policy(PolicyAnnouncement(
                version=pv.version, manifest=pv.manifest_key, anchor=pv.anchor, sha256=pv.sha256,
                published_at=pv.published_at,
            ))
        except ControlPlaneError as exc:
            # Never the only copy: the next step announces again (retained), and nodes fall back to a
            # slow poll of the store's `latest` (rollout.weight_fallback_poll_s).
            log.warning("weights.announce_failed", version=pv.version, error=str(exc))

    def store_versions(self) -> tuple[int | None, int | None]:
        """(`latest` pointer, newest complete version) of the home store: they differ when a publisher
        was killed between creating a version's manifest and moving `latest`."""
        return self.hub.latest(), self.hub.newest()

    def holds(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        """Whether `version` is exactly `state_dict` (for an adapter: on the same base)."""
        base = None if self.adapter is None else self.adapter.base
        return self.hub.manifest(version).base == base and self.hub.holds(state_dict, version)

    def adopt(self, version: int) -> None:
        """Make the store's `version` the last published (read back), so that it is announced again."""
        self.last = self.hub.published(version)


async def _ready(snapshot: Snapshot) -> Mapping[str, torch.Tensor]:
    """The snapshot's tensors, once its cast (if it is still running) is done."""
    if isinstance(snapshot, Future):
        cast: dict[str, torch.Tensor] = await asyncio.wrap_future(snapshot)
        return cast
    return snapshot
