"""Payloads of the MQTT control plane (DESIGN.md §4): small JSON documents validated with pydantic.

    fleetrl/<run>/policy                  PolicyAnnouncement   retained: the newest published version
    fleetrl/<run>/nodes/<region>/<node>   Heartbeat            retained; the last will says "offline"
    fleetrl/<run>/control/<region>        ControlCommand       not retained: drain / resume / stop
    fleetrl/<run>/replicas/<region>       ReplicaAnnouncement  retained: the newest version the region store holds

Nothing here is the only copy of anything: a node that missed a message recovers from the retained
state and the object store.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Payload(BaseModel):
    # Unknown keys are ignored (a newer publisher may add fields); wrong types are refused.
    model_config = ConfigDict(extra="ignore", frozen=True)

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()


class PolicyAnnouncement(_Payload):
    """The newest policy version, announced by the trainer's publisher after the manifest is durable."""

    version: int = Field(ge=0)
    manifest: str
    """Store key of the version's manifest (`<run>/versions/<N:012d>.json`)."""
    anchor: int = Field(ge=0)
    """Version of the anchor the delta chain starts from."""
    sha256: str
    """Hash of the manifest bytes."""
    published_at: float


class ReplicaAnnouncement(_Payload):
    """The newest version a region's store holds, announced by its replicator after the holder reference
    is written: the region's workers pull when it changes (and never read across the WAN themselves)."""

    version: int = Field(ge=0)
    manifest_sha256: str
    """Hash of the manifest bytes (the same in every store)."""
    anchor: int = Field(ge=0)
    """Version of the anchor the delta chain starts from: a node too far behind starts there."""
    ts: float = Field(default_factory=time.time)


EngineState = Literal["starting", "up", "restarting", "crashloop", "stopped"]


class EngineStatus(_Payload):
    """One engine of a node: the supervised worker process that runs it."""

    index: int = Field(ge=0)
    device: str = ""
    """The engine's device (`cpu`, `cuda:0`, or a CUDA_VISIBLE_DEVICES value)."""
    state: EngineState
    """`starting` (loading), `up`, `restarting` (after a crash or hang, in backoff), `crashloop` (it keeps
    failing; still retried at the capped backoff), `stopped` (drained or leaving)."""
    pid: int | None = None
    restarts: int = 0
    """Worker processes started after the first one."""
    version: int | None = None
    tokens_per_s: float = 0.0
    busy_tokens_per_s: float = 0.0
    """Tokens sampled per second of engine work (decoding steps, weight loads) over the worker's life:
    what the engine delivers while it has work, however little it was given (0: not measured yet)."""
    in_flight: int = 0
    tokens_sampled: int = Field(0, ge=0)
    """Tokens the engine sampled, over all its worker processes (a restart does not reset it)."""
    last_error: str = ""
    """Last error line of the worker that failed most recently."""


class Heartbeat(_Payload):
    """A node's retained state; `ts` lets a reader tell a stale "up" from a live one."""

    state: Literal["up", "draining", "offline"]
    version: int | None = None
    """Policy version the node's engines run (None before the first load)."""
    tokens_per_s: float = 0.0
    busy_tokens_per_s: float = 0.0
    """The node's capacity: its engines' `busy_tokens_per_s` summed (0: not measured yet). Sync mode
    spreads each step's groups by it (docs/trainer.md)."""
    in_flight: int = 0
    """Groups being decoded."""
    engines: int | list[EngineStatus] = 0
    """Engines on the node: a count, or each engine's status (what region agents send)."""
    left: bool = False
    """With `offline`: the agent left on purpose, after its workers stopped (each unfinished group
    handed over, or the worker killed past its bound), so nothing more will come from this node. The
    last will's `offline` (the agent died; its workers may live on, or a restarted agent resume the
    region's work) does not say it."""
    capacity: Literal["on_demand", "spot"] | None = None
    """The node's capacity type, as its agent knows it (the config's pool, or the instance metadata of an
    auto-scaled node); None (an older agent): the region's, from the config. The trainer prices the
    node's time by it (docs/cost.md)."""
    tokens_sampled: int = Field(0, ge=0)
    """Tokens the node's engines sampled since its agent started: what its time bought, whether or not the
    tokens reach training (the trainer counts the difference as preemption waste)."""
    started_at: float | None = None
    """When the node's agent started (its clock): the trainer counts a node it first hears of from then."""
    ts: float = Field(default_factory=time.time)

    @property
    def serving(self) -> bool:
        """Whether the node can take work now: `up` with at least one engine `up`. An agent is `up` as
        soon as it runs, while its engines may still load the model for tens of seconds (`starting`)
        or wait out a restart: such a node is alive but serves nothing yet. A heartbeat that lists no
        engine statuses (`engines` a count: an older agent, a node without supervisors) serves
        whenever it is `up`, as before engines were reported."""
        if self.state != "up":
            return False
        return not isinstance(self.engines, list) or any(e.state == "up" for e in self.engines)


class ControlCommand(_Payload):
    """An operator's (or the trainer's) command to every node of a region."""

    cmd: Literal["drain", "resume", "stop"]
    reason: str = ""
