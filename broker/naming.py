"""Names of the run's Kafka topics, consumer groups and MQTT topics (DESIGN.md §3, §4)."""

from __future__ import annotations

from typing import Literal

Stream = Literal["prompts", "partials", "trajectories", "dead-letter"]
STREAMS: tuple[Stream, ...] = ("prompts", "partials", "trajectories", "dead-letter")
SCHEMA_HEADER = "fleetrl-schema"


def topic_name(run: str, stream: Stream) -> str:
    """`fleetrl.<run>.<stream>`."""
    if stream not in STREAMS:
        raise ValueError(f"unknown stream {stream!r}; streams: {STREAMS}")
    return f"fleetrl.{run}.{stream}"


def rollout_group(run: str) -> str:
    """Consumer group of a region's rollout workers."""
    return f"fleetrl.{run}.rollout"


def trainer_group(run: str) -> str:
    """Consumer group of the trainer on every region cluster."""
    return f"fleetrl.{run}.trainer"


def trainer_handover_group(run: str) -> str:
    """Consumer group in which the trainer reads a gone region's `partials` to move them elsewhere."""
    return f"{trainer_group(run)}.handover"


def policy_topic(run: str) -> str:
    """Retained policy announcement."""
    return f"fleetrl/{run}/policy"


def node_topic(run: str, region: str, node: str) -> str:
    """Retained heartbeat of one node; its last will sets state offline."""
    return f"fleetrl/{run}/nodes/{region}/{node}"


def control_topic(run: str, region: str) -> str:
    """Commands to a region's nodes (not retained)."""
    return f"fleetrl/{run}/control/{region}"


def replica_topic(run: str, region: str) -> str:
    """Retained: the newest version a region's store holds, written by the region's replicator."""
    return f"fleetrl/{run}/replicas/{region}"
