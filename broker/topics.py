"""The run's Kafka topics (DESIGN.md §3): their specs, and creating and describing them per region.

Each region cluster holds the same four topics, `fleetrl.<run>.{prompts,partials,trajectories,
dead-letter}`, with the partition counts of `kafka.partitions` and the configs below. `ensure_topics`
is idempotent: it creates what is missing, reports `unchanged` for what matches, and `differs`
(changing nothing) for a topic whose partitions or configs are unlike the spec, since altering a
live topic is an operator's decision. `fleetrl topics create|list|describe` are thin views of these.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from fleetrl.broker.clients import DEAD_LETTER_SLACK_BYTES, bounded, client_kwargs, connect
from fleetrl.broker.errors import TopicError
from fleetrl.broker.naming import STREAMS, Stream, topic_name
from fleetrl.config import FleetConfig
from fleetrl.log import get_logger

log = get_logger(__name__)
_TOPIC_ALREADY_EXISTS = 36


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """What one topic of the run must look like on every region cluster."""

    stream: Stream
    name: str
    partitions: int
    replication_factor: int
    configs: dict[str, str] = field(hash=False)


def topic_specs(config: FleetConfig) -> list[TopicSpec]:
    """The four topics of the run, in `STREAMS` order."""
    k = config.kafka
    specs = []
    for stream in STREAMS:
        limit = k.max_message_bytes + (DEAD_LETTER_SLACK_BYTES if stream == "dead-letter" else 0)
        specs.append(TopicSpec(
            stream=stream,
            name=topic_name(config.run, stream),
            partitions=getattr(k.partitions, stream.replace("-", "_")),
            replication_factor=k.replication_factor,
            configs={"max.message.bytes": str(limit), "retention.ms": str(k.retention_ms)},
        ))
    return specs


@dataclass(frozen=True, slots=True)
class TopicState:
    """A topic as a cluster has it."""

    name: str
    partitions: int
    leaders: dict[int, int]
    configs: dict[str, str]


@dataclass(frozen=True, slots=True)
class TopicChange:
    """What `ensure_topics` did (or would not do) for one topic of one region."""

    region: str
    topic: str
    action: Literal["created", "unchanged", "differs"]
    detail: str = ""


@asynccontextmanager
async def admin_client(config: FleetConfig, region: str, client_id: str = "fleetrl-admin") -> AsyncIterator[Any]:
    """A started aiokafka admin client of `region`'s cluster, closed on exit."""
    admin = AIOKafkaAdminClient(**client_kwargs(config, region, client_id))
    timeout = config.kafka.request_timeout_s
    try:
        await connect(admin.start(), config, region, f"connect admin client to region {region!r}")
        yield admin
    finally:
        await bounded(admin.close(), timeout, f"close admin client of region {region!r}")


async def describe_topics(config: FleetConfig, region: str, names: list[str]) -> dict[str, TopicState]:
    """State of those of `names` that exist on the region's cluster."""
    timeout = config.kafka.request_timeout_s
    async with admin_client(config, region) as admin:
        existing = set(await bounded(admin.list_topics(), timeout, f"list topics of region {region!r}"))
        present = [n for n in names if n in existing]
        if not present:
            return {}
        meta = await bounded(admin.describe_topics(present), timeout, f"describe topics of region {region!r}")
        resources = [ConfigResource(ConfigResourceType.TOPIC, n) for n in present]
        responses = await bounded(admin.describe_configs(resources), timeout, f"describe configs of {region!r}")
    configs = _configs_by_topic(responses)
    out = {}
    for t in meta:
        if t["error_code"]:
            raise TopicError(f"region {region!r}: topic {t['topic']} describe failed with error {t['error_code']}")
        leaders = {p["partition"]: p["leader"] for p in t["partitions"]}
        out[t["topic"]] = TopicState(t["topic"], len(leaders), leaders, configs.get(t["topic"], {}))
    return out


def _configs_by_topic(responses: list[Any]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for response in responses:
        for res in response.resources:
            error_code, _msg, _type, name, entries = res[:5]
            if error_code:
                continue  # the topic vanished between list and describe; its state shows no configs
            out[name] = {e[0]: e[1] for e in entries if e[1] is not None}
    return out


def differences(spec: TopicSpec, state: TopicState) -> list[str]:
    """How an existing topic differs from its spec (empty when it matches)."""
    diffs = []
    if state.partitions != spec.partitions:
        diffs.append(f"partitions {state.partitions} (spec {spec.partitions})")
    for key, want in spec.configs.items():
        have = state.configs.get(key)
        if have is not None and have != want:  # a broker that does not report a config is not a mismatch
            diffs.append(f"{key} {have} (spec {want})")
    return diffs


async def ensure_topics(config: FleetConfig, region: str) -> list[TopicChange]:
    """Create the run's missing topics on `region`'s cluster; report every topic's outcome."""
    specs = topic_specs(config)
    states = await describe_topics(config, region, [s.name for s in specs])
    missing = [s for s in specs if s.name not in states]
    created = await _create(config, region, missing) if missing else set()
    changes = []
    for spec in specs:
        if spec.name in created:
            changes.append(TopicChange(region, spec.name, "created",
                                       f"{spec.partitions} partitions, {_fmt(spec.configs)}"))
        elif spec.name not in states:
            changes.append(TopicChange(region, spec.name, "unchanged", "created concurrently by another client"))
        else:
            diffs = differences(spec, states[spec.name])
            action: Literal["unchanged", "differs"] = "differs" if diffs else "unchanged"
            changes.append(TopicChange(region, spec.name, action, "; ".join(diffs)))
    for c in changes:
        log.info("topic.ensured", region=region, topic=c.topic, action=c.action, detail=c.detail)
    return changes


async def _create(config: FleetConfig, region: str, specs: list[TopicSpec]) -> set[str]:
    new = [NewTopic(s.name, s.partitions, s.replication_factor, topic_configs=dict(s.configs)) for s in specs]
    async with admin_client(config, region) as admin:
        response = await bounded(admin.create_topics(new), config.kafka.request_timeout_s,
                                 f"create topics on region {region!r}")
    created = set()
    for name, code, message in (tuple(e)[:3] for e in response.topic_errors):
        if code == 0:
            created.add(name)
        elif code != _TOPIC_ALREADY_EXISTS:
            raise TopicError(f"region {region!r}: creating topic {name} failed: error {code} {message or ''}".strip())
    return created


def _fmt(configs: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in configs.items())
