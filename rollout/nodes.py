"""Which engines a node runs, from the fleet config alone (no torch: the region agent, a supervisor
that never generates, reads these to know how many worker processes to keep and on which devices)."""

from __future__ import annotations

from fleetrl.config import EngineConfig, FleetConfig


def engine_config(config: FleetConfig, region: str, node: str) -> EngineConfig:
    """The engine config of a node: the node's own, else its region's."""
    r = config.region(region)
    return next((n.engine for n in r.nodes if n.name == node and n.engine is not None), r.engine)


def engine_devices(config: FleetConfig, region: str, node: str) -> list[str]:
    """One entry per engine the node runs (its supervised worker processes): `engine.devices`, else one
    engine on the torch `device` (or, for vLLM, on every visible GPU: an empty entry)."""
    cfg = engine_config(config, region, node)
    if cfg.devices:
        return list(cfg.devices)
    return [cfg.device] if cfg.kind == "torch" else [""]
