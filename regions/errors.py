"""Errors of the region agent.

    RegionsError            base; `retriable` says whether starting the agent again may succeed
    ├── AgentConfigError    the agent's identity or options are wrong (unknown region, bad node name,
    │                       an unreadable notice file path): fix the command line or fleet.yaml
    └── AgentError          the agent cannot go on (its rollout worker stopped on its own, the control
                            plane client died)

Messages name the region, the node and the thing at fault.
"""

from __future__ import annotations


class RegionsError(Exception):
    """Base of every region-agent error."""

    retriable: bool = False

    def __init__(self, message: str, *, retriable: bool | None = None) -> None:
        super().__init__(message)
        if retriable is not None:
            self.retriable = retriable


class AgentConfigError(RegionsError):
    """The agent was started with an identity or option that cannot work."""


class AgentError(RegionsError):
    """The running agent hit something it cannot recover from."""

    retriable = True
