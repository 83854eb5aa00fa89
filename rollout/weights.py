"""Keeps an engine's weights current from the region's hub store (DESIGN.md §4, §5).

Pulls are driven by the control plane, not by polling the store: the region's replicator announces
each version its store holds (retained, `fleetrl/<run>/replicas/<region>`; where a region reads the
home store, the trainer's policy announcement plays that part), and whoever hears it (the region
agent, over its worker's command pipe, or the worker's own control-plane client) calls
`notify(version)`. `WeightSync` then brings its host copy of the weights to that version in a thread
(in place over the previous one, so only the delta chain is read; a node more than an anchor
interval behind starts from the newest anchor) and stages it on the engine, which switches between
two decoding steps. Along a delta chain only what changed is handed over: the changed elements'
positions and values to an engine that scatters them itself (the torch engine, on its device: no
dense copy of the model, no clone of the host state), else the tensors the chain touched (vLLM).
Every changed word was checked against its part's digest on the host before anything is staged.

The store's `latest` is read only once at start and then every `rollout.weight_fallback_poll_s`
(minutes) without an announcement: at 10,000 nodes a 0.2 s poll would be 50,000 requests a second.
Nothing waits for a pull: generation goes on with the old weights meanwhile. A version that fails
verification is logged and skipped, never loaded.

A LoRA run's versions are adapters on a base version of full weights: the base is materialized once
(when the engine does not hold it yet) and handed to the engine with the first adapter; after that
only the adapter chain is read, updated in place as a full state would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from fleetrl.hub import Hub, HubError
from fleetrl.log import get_logger
from fleetrl.rollout.adapters import LoraWeights
from fleetrl.rollout.engine import Engine, TensorChanges
from fleetrl.rollout.errors import EngineError

log = get_logger(__name__)
_STOP_CHECK_S = 0.2  # how promptly a worker still waiting for its first weights notices a stop
_RETRY_S = 5.0  # retry of a pull that failed on a transient store error


class WeightSync:
    def __init__(self, hub: Hub, engine: Engine, fallback_poll_s: float, transfer_s: float = 0.0) -> None:
        self.hub, self.engine, self.fallback_poll_s = hub, engine, fallback_poll_s
        self.transfer_s = transfer_s
        """Emulated WAN copy of each version (`engine.emulate.weight_transfer_s`), waited before the pull."""
        self.have: int | None = None
        self.announced: int | None = None
        """Newest version announced as held by the region store (None: nothing heard yet)."""
        self._state: dict[str, Any] | None = None
        self.base: int | None = None
        """The base version under the engine's adapter (a LoRA run), once one was staged."""
        self._adapter: dict[str, Any] | None = None
        self._adapter_version: int | None = None
        self._refused: set[int] = set()
        self._wake = asyncio.Event()

    def notify(self, version: int) -> None:
        """The region store holds `version` (an announcement): pull it if it is newer than ours."""
        if self.announced is None or version > self.announced:
            self.announced = version
        if self.have is None or version > self.have:
            self._wake.set()

    async def load_first(self, stopped: Callable[[], bool]) -> bool:
        """Load the newest version, waiting for one to be announced (or found by the fallback poll);
        False if `stopped()` turns true first."""
        target = await self._target(read_latest=True)
        next_poll = time.monotonic() + self.fallback_poll_s
        while not stopped():
            if target is not None and await self.refresh(target):
                return True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_STOP_CHECK_S):
                    await self._wake.wait()
            polled = time.monotonic() >= next_poll
            if polled:
                next_poll = time.monotonic() + self.fallback_poll_s
            if self._wake.is_set() or polled:
                target = await self._target(read_latest=polled and not self._wake.is_set())
        return False

    async def run(self) -> None:
        """Background task: pull each announced version; read `latest` only when nothing was announced
        for `fallback_poll_s`; retry a pull that failed on a transient error. Runs until cancelled."""
        timeout_s = self.fallback_poll_s
        while True:
            woke = True
            try:
                async with asyncio.timeout(timeout_s):
                    await self._wake.wait()
            except TimeoutError:
                woke = False
            target = await self._target(read_latest=not woke and timeout_s == self.fallback_poll_s)
            failed = target is not None and not await self.refresh(target) and self._behind(target)
            timeout_s = min(self.fallback_poll_s, _RETRY_S) if failed else self.fallback_poll_s

    def _behind(self, version: int) -> bool:
        return version not in self._refused and (self.have is None or version > self.have)

    async def _target(self, read_latest: bool) -> int | None:
        """The version to pull: the announced one, or the store's `latest` (fallback)."""
        self._wake.clear()
        if not read_latest:
            return self.announced
        try:
            latest = await asyncio.to_thread(self.hub.latest)
        except HubError as exc:
            log.warning("weights.latest_failed", error=str(exc), retriable=exc.retriable)
            return self.announced
        log.info("weights.fallback_poll", latest=latest, have=self.have)
        known = [v for v in (latest, self.announced) if v is not None]
        return max(known) if known else None

    async def refresh(self, version: int | None = None) -> bool:
        """Stage `version` (default: the store's `latest`) if it is newer than what the engine has;
        True if one was staged."""
        if version is None:
            version = await self._target(read_latest=True)
        if version is None or (self.have is not None and version <= self.have) or version in self._refused:
            return False
        started = time.monotonic()
        if self.transfer_s:  # EMULATED: the version's copy into the region store over a WAN link
            await asyncio.sleep(self.transfer_s)
        try:
            how, base = await asyncio.to_thread(self._pull, version)
        except (HubError, EngineError) as exc:
            retriable = isinstance(exc, HubError) and exc.retriable
            log.warning("weights.materialize_failed", version=version, error=str(exc), retriable=retriable)
            if not retriable:
                self._refused.add(version)
            return False
        log.info("weights.staged", version=version, previous=self.have, staged=how, base=base,
                 seconds=round(time.monotonic() - started, 3))
        self.have = version
        return True

    def _pull(self, version: int) -> tuple[str, int | None]:
        """Bring the engine to `version` (a thread); returns what was staged, `changes` (positions and
        values), `part` (the changed tensors), `all` or `adapter`, and the version's base (None: full)."""
        manifest = self.hub.manifest(version)
        if manifest.adapter is not None:
            return "adapter", self._pull_adapter(version, manifest.adapter.base)
        self._adapter = self._adapter_version = self.base = None
        if self._state is not None and self.have is not None:
            changed = self.hub.changes(version, self._state, self.have)
            if changed is not None:
                if self.engine.accepts_changes:  # values of their own memory: `_state` may change meanwhile
                    self.engine.stage_changes({n: TensorChanges(c.positions, c.values) for n, c in changed.items()},
                                              version)
                    return "changes", None
                self.engine.stage_weights({n: self._state[n].clone() for n in changed}, version, complete=False)
                return "part", None
        self._state = self.hub.materialize(version, into=self._state, have_version=self.have)
        # The engine reads its own copy when it applies it: the next version updates `_state` in place.
        self.engine.stage_weights({k: v.clone() for k, v in self._state.items()}, version)
        return "all", None

    def _pull_adapter(self, version: int, base: int) -> int:
        """Hand the engine LoRA adapter `version`, with its base's full weights the first time."""
        base_state = None
        if self.base != base:  # once per base: the engine keeps it from then on
            self._state = None
            base_state = self.hub.materialize(base)
        info, self._adapter = self.hub.materialize_adapter(version, base, into=self._adapter,
                                                           have_version=self._adapter_version)
        self._adapter_version = version
        adapter = LoraWeights(version, info, {k: v.clone() for k, v in self._adapter.items()})
        self.engine.stage_adapter(adapter, base=base_state)
        self.base = base
        return base
