"""Which control-plane announcement tells a region's workers that their store holds a new version.

A region whose store is a replica hears it from its replicator (`fleetrl/<run>/replicas/<region>`,
retained). A region that reads the home store itself (one-region and development setups, where no
replicator runs) hears it from the trainer's policy announcement (`fleetrl/<run>/policy`). Either way a
node never reads across the WAN: the version named is one its own store already holds.
"""

from __future__ import annotations

from collections.abc import Callable

from fleetrl.broker import ControlPlane, ControlPlaneError
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger

log = get_logger(__name__)


def reads_home_store(config: FleetConfig, region: str) -> bool:
    return config.region(region).store.url == config.hub.home_store.url


def announced_version(config: FleetConfig, cp: ControlPlane, region: str) -> int | None:
    """The newest version the region's store is announced to hold (None: nothing heard yet)."""
    if reads_home_store(config, region):
        return cp.policy.version if cp.policy is not None else None
    replica = cp.replicas.get(region)
    return replica.version if replica is not None else None


async def follow_announcements(config: FleetConfig, region: str, client_id: str,
                               notify: Callable[[int], None]) -> None:
    """Call `notify(version)` for each newly announced version until cancelled (a standalone worker's
    own listener; under a region agent the agent listens and forwards). Starts while MQTT is down."""
    async with ControlPlane(config, client_id, watch_nodes=False, watch_replicas=True, wait_connected=False) as cp:
        last: int | None = None
        while True:
            version = announced_version(config, cp, region)
            if version is not None and version != last:
                last = version
                notify(version)
            try:
                await cp.changed(timeout_s=5.0)
            except ControlPlaneError as exc:  # the worker goes on with the store's fallback poll
                log.error("weights.announcements_lost", region=region, error=str(exc),
                          fallback_poll_s=config.rollout.weight_fallback_poll_s)
                return
