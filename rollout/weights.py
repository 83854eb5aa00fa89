"""Keeps an engine's weights current from the region's hub store (DESIGN.md §5).

`WeightSync` polls the store's `latest` every `rollout.weight_poll_s`, materializes a newer version
in a thread (in place over the previous one, so only the delta chain is read), and stages it on the
engine, which switches between two decoding steps. Nothing waits for it: generation goes on with
the old weights meanwhile. A version that fails verification is logged and skipped, never loaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fleetrl.hub import Hub, HubError
from fleetrl.log import get_logger
from fleetrl.rollout.engine import Engine

log = get_logger(__name__)
_STOP_CHECK_S = 0.2  # how promptly a worker still waiting for its first weights notices a stop


class WeightSync:
    def __init__(self, hub: Hub, engine: Engine, poll_s: float) -> None:
        self.hub, self.engine, self.poll_s = hub, engine, poll_s
        self.have: int | None = None
        self._state: dict[str, Any] | None = None
        self._refused: set[int] = set()

    async def load_first(self, stopped: Callable[[], bool]) -> bool:
        """Load the newest published version, waiting for one; False if `stopped()` turns true first."""
        while not stopped():
            if await self.refresh():
                return True
            await asyncio.sleep(min(self.poll_s, _STOP_CHECK_S))
        return False

    async def run(self) -> None:
        """Background task: poll and stage newer versions until cancelled."""
        while True:
            await asyncio.sleep(self.poll_s)
            await self.refresh()

    async def refresh(self) -> bool:
        """Stage the newest version if it is newer than what the engine has; True if one was staged."""
        try:
            latest = await asyncio.to_thread(self.hub.latest)
        except HubError as exc:
            log.warning("weights.latest_failed", error=str(exc), retriable=exc.retriable)
            return False
        if latest is None or (self.have is not None and latest <= self.have) or latest in self._refused:
            return False
        started = time.monotonic()
        try:
            state = await asyncio.to_thread(self._materialize, latest)
        except HubError as exc:
            log.warning("weights.materialize_failed", version=latest, error=str(exc), retriable=exc.retriable)
            if not exc.retriable:
                self._refused.add(latest)
            return False
        # The engine copies from its own snapshot: the next materialize updates `_state` in place.
        self.engine.stage_weights({k: v.clone() for k, v in state.items()}, latest)
        log.info("weights.staged", version=latest, previous=self.have,
                 seconds=round(time.monotonic() - started, 3))
        self.have = latest
        return True

    def _materialize(self, version: int) -> dict[str, Any]:
        self._state = self.hub.materialize(version, into=self._state, have_version=self.have)
        return self._state
