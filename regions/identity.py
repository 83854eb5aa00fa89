"""Who an agent is: its region must be in fleet.yaml, its node name must match the name pattern."""

from __future__ import annotations

from fleetrl.config import FleetConfig, NodeConfig
from fleetrl.regions.errors import AgentConfigError


def check_identity(config: FleetConfig, region: str, node: str) -> None:
    """An unknown region or a node name outside the pattern is refused before anything starts.

    Nodes need not be listed under `regions[].nodes`: auto-scaled nodes are named by instance id.
    """
    try:
        config.region(region)
    except KeyError as exc:
        raise AgentConfigError(str(exc.args[0])) from None
    try:
        NodeConfig(name=node)
    except ValueError as exc:  # pydantic's ValidationError
        raise AgentConfigError(f"node name {node!r} is not a valid name: lower-case letters, digits and '-', "
                               f"starting with a letter or digit, at most 63 characters") from exc
