"""The publisher: every step's weights into the hub, then the version announced on MQTT.

The learner keeps fp32 master weights; engines run the publish dtype (bf16 by default). The hub
writes the cast as a delta against the previous version into the home store (blocking work: it
runs in a thread), and only after the manifest and the `latest` pointer are written is the
version announced on the retained `fleetrl/<run>/policy` topic. A node that misses the message
finds the same version through the store's `latest`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Protocol

import torch

from fleetrl.broker import ControlPlaneError, PolicyAnnouncement
from fleetrl.hub import Hub, PublishedVersion
from fleetrl.log import get_logger
from fleetrl.trainer.metrics import TrainerMetrics

log = get_logger(__name__)


class Announcer(Protocol):
    async def announce_policy(self, announcement: PolicyAnnouncement) -> None: ...


class WeightPublisher:
    def __init__(self, hub: Hub, announcer: Announcer | None, metrics: TrainerMetrics) -> None:
        self.hub, self.announcer, self.metrics = hub, announcer, metrics
        self.last: PublishedVersion | None = None

    async def publish(self, state_dict: Mapping[str, torch.Tensor]) -> PublishedVersion:
        t0 = time.monotonic()
        pv = await asyncio.to_thread(self.hub.publish, state_dict)
        seconds = time.monotonic() - t0
        self.metrics.publish_seconds.observe(seconds)
        self.metrics.publish_bytes.inc(pv.bytes_written)
        self.metrics.last_publish_bytes.set(pv.bytes_written)
        self.metrics.version.set(pv.version)
        self.last = pv
        await self.announce()
        log.info("weights.published", version=pv.version, anchor=pv.anchor, bytes=pv.bytes_written,
                 seconds=round(seconds, 3))
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

    def latest_version(self) -> int | None:
        return self.hub.latest()
