"""A rollout region (`regions[]`) and its nodes: the region's Kafka cluster and object store, its
engines, preemption notices, and what its capacity costs (the pricing models are `pricing.py`)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from fleetrl.config.base import NAME_RE, Model, ReferenceProblem
from fleetrl.config.engine import EngineConfig, TorchEngineConfig
from fleetrl.config.preemption import NoPreemptionConfig, PreemptionConfig
from fleetrl.config.pricing import Capacity, NodePoolConfig, PriceConfig
from fleetrl.config.transport import KafkaClusterConfig, StoreConfig


class NodeConfig(Model):
    """A rollout node of a region."""

    name: str = Field(pattern=NAME_RE)
    """Node name, unique within its region (the agent's `--node`)."""
    engine: EngineConfig | None = None
    """Overrides the region's engine for this node."""


class RegionConfig(Model):
    """One rollout region: an autonomous cell with its own Kafka and object store."""

    name: str = Field(pattern=NAME_RE)
    """Region name, used in topics, MQTT paths and store names ("home" is reserved)."""
    kafka: KafkaClusterConfig
    store: StoreConfig
    """The region's object store; its nodes read weights only from here."""
    link_costs: dict[str, float] = Field(default_factory=dict)
    """Cost of reading from another store (`home` or a region name); lower is nearer."""
    nodes: list[NodeConfig] = Field(default_factory=list)
    """The region's rollout nodes (agents start with `--node NAME`)."""
    engine: EngineConfig = Field(default_factory=TorchEngineConfig)
    """Default engine of the region's nodes."""
    weight: float = Field(1.0, gt=0)
    """Initial share of admission credits before throughput is measured."""
    emulate_link_delay_s: float = Field(0.0, ge=0, le=10)
    """Emulated one-way delay of the link between home and this region, for benchmarks and drills on
    one machine (`bench/pipeline.py`): the trainer holds each prompt this long before producing it to
    the region's cluster, and each trajectory this long after fetching it. 0 (the default): off."""
    preemption: PreemptionConfig = Field(default_factory=NoPreemptionConfig)
    """Where the region's nodes learn they are about to be preempted: `{source: none | file | aws | gcp |
    azure, ...}`. On a notice the agent hands its unfinished groups over, goes offline and exits 0 inside
    the notice window."""
    capacity: Capacity = "on_demand"
    """Capacity type of the region's nodes (`on_demand` or `spot`), unless `pools` places a node in another
    pool or an auto-scaled node's heartbeat says otherwise."""
    price: PriceConfig | None = None
    """US dollars per node-hour of the region's nodes (of `capacity`), or where to read it (`{source: file |
    aws, ...}`, docs/cost.md). None, with no `pools`: the region is not priced (its cost counts as 0)."""
    pools: list[NodePoolConfig] = Field(default_factory=list)
    """Node pools of the region, each with its capacity type and price (an on-demand base and spot nodes
    above it); instead of `price`."""
    transfer_usd_per_gb: float = Field(0.0, ge=0)
    """US dollars per GB of trajectories the region's link carries to home (the bytes of each record the
    trainer reads; prompts out are a few hundred bytes and not counted): the link's part of a group's
    price (0: not counted)."""

    @field_validator("name")
    @classmethod
    def _not_home(cls, name: str) -> str:
        if name == "home":
            raise ValueError('"home" is the name of the home store, not a region')
        return name

    @model_validator(mode="after")
    def _pools_apart(self) -> RegionConfig:
        kinds = [p.capacity for p in self.pools]
        for i, kind in enumerate(kinds):
            if kinds.index(kind) != i:
                raise ReferenceProblem(("pools", i, "capacity"), f"two pools of {kind} capacity: give one its price")
        if self.pools and self.price is not None:
            raise ReferenceProblem(("price",), "set either price (for the whole region) or pools, not both")
        listed = {n.name for n in self.nodes}
        for i, pool in enumerate(self.pools):
            unknown = sorted(set(pool.nodes) - listed)
            if unknown:
                raise ReferenceProblem(("pools", i, "nodes"), f"node(s) {unknown} are not in the region's nodes")
        return self

    def price_of(self, capacity: Capacity) -> PriceConfig | None:
        """The price of the region's `capacity` nodes (None: not priced)."""
        for pool in self.pools:
            if pool.capacity == capacity:
                return pool.price
        return self.price if capacity == self.capacity and not self.pools else None

    def node_capacity(self, node: str) -> Capacity:
        """The capacity type of a listed (or unlisted) node, from the config alone."""
        for pool in self.pools:
            if node in pool.nodes:
                return pool.capacity
        return self.capacity
