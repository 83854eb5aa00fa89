"""Region agents (DESIGN.md §1, §2): the daemon on each rollout node, around its rollout worker.

Public surface; other packages import only these names. `RegionAgent` (and the rollout worker and
torch behind it) loads lazily so that `fleetrl agent --help` stays instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fleetrl.regions.errors import AgentConfigError, AgentError, RegionsError
from fleetrl.regions.identity import check_identity
from fleetrl.regions.preemption import Notice, NoticeFileWatcher, PreemptionWatcher, SignalWatcher

if TYPE_CHECKING:
    from fleetrl.regions.agent import RegionAgent

_LAZY = {"RegionAgent": "fleetrl.regions.agent"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fleetrl.regions' has no attribute {name!r}")


__all__ = [
    "AgentConfigError",
    "AgentError",
    "Notice",
    "NoticeFileWatcher",
    "PreemptionWatcher",
    "RegionAgent",
    "RegionsError",
    "SignalWatcher",
    "check_identity",
]
