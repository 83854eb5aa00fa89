"""What rollout capacity costs (`regions[].capacity`, `price`, `pools`; `trainer.placement`).

A region's nodes are `on_demand` or `spot` capacity, and a node-hour of each has a price in US
dollars. The price is data, never a constant in code: a number in fleet.yaml, or the spot prices in
a file in the shape `aws ec2 describe-spot-price-history` prints, or the same history read from EC2
(boto3 `describe_spot_price_history`) when the trainer starts and every `refresh_s` after. The
trainer turns the node-seconds its heartbeats show into dollars (`fleetrl.trainer.cost`), and, with
`trainer.placement.price_aware`, places work where a useful group is cheapest (`trainer/credits.py`).

    regions:
      - name: us-west-2
        capacity: spot            # every node of the region, unless a pool says otherwise
        price: 1.12               # USD per node-hour
      - name: eu-west-1
        pools:                    # an on-demand base and spot above it (one auto-scaling group)
          - {capacity: on_demand, price: 3.40}
          - capacity: spot
            price: {source: aws, region_name: eu-west-1, instance_types: [g6e.xlarge, g5.2xlarge]}
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from fleetrl.config.base import Model

__all__ = [
    "AwsSpotPriceConfig", "Capacity", "FilePriceConfig", "NodePoolConfig", "PlacementConfig", "PriceConfig",
    "PriceSource",
]

Capacity = Literal["on_demand", "spot"]
"""`on_demand`: reserved or on-demand capacity, kept until released. `spot`: preemptible capacity
(spot instances, spare GPUs of a production cluster) at a discount, taken back at a notice."""

_INSTANCE_TYPE = r"^[a-z0-9-]+\.[a-z0-9-]+$"


class _SpotHistory(Model):
    """What to take from a spot price history: the newest price of each (instance type, zone)
    among the entries that match, aggregated over them."""

    instance_types: list[Annotated[str, Field(pattern=_INSTANCE_TYPE)]] = Field(default_factory=list)
    """Instance types the pool's nodes run (a mixed-instances group's overrides); empty: every type."""
    availability_zones: list[str] = Field(default_factory=list)
    """Zones the pool's nodes run in; empty: every zone."""
    product_description: str = "Linux/UNIX"
    """The product (`Linux/UNIX`, `Linux/UNIX (Amazon VPC)`, `Windows`, ...)."""
    aggregate: Literal["mean", "max", "min"] = "mean"
    """How the newest prices of the matching types and zones make one price per node-hour: `max`
    bounds the bill, `mean` follows a group that spreads over them, `min` follows
    `lowest-price` allocation."""
    refresh_s: float = Field(3600.0, ge=60)
    """How often the trainer reads the prices again (spot prices move a few times a day)."""


class FilePriceConfig(_SpotHistory):
    """Spot prices from a JSON file in the shape `aws ec2 describe-spot-price-history --output json`
    prints: `{"SpotPriceHistory": [{"InstanceType", "AvailabilityZone", "ProductDescription",
    "SpotPrice", "Timestamp"}, ...]}` (a sidecar or a cron job may keep it current)."""

    source: Literal["file"] = "file"
    """Price source."""
    path: str = Field(min_length=1)
    """The file; relative to the config file."""


class AwsSpotPriceConfig(_SpotHistory):
    """Spot prices read from EC2's spot price history (`describe_spot_price_history`, boto3) with the
    trainer's AWS credentials (`ec2:DescribeSpotPriceHistory`)."""

    source: Literal["aws"] = "aws"
    """Price source."""
    region_name: str = Field(min_length=1)
    """The AWS region whose history is read (where the pool's nodes run)."""
    instance_types: list[Annotated[str, Field(pattern=_INSTANCE_TYPE)]] = Field(min_length=1)
    """Instance types the pool's nodes run (a mixed-instances group's overrides)."""
    endpoint_url: str | None = Field(None, pattern=r"^https?://")
    """EC2 endpoint (None: AWS's own; a private endpoint or an emulator otherwise)."""
    lookback_s: float = Field(6 * 3600.0, gt=0, le=90 * 86400)
    """How far back the history is read: the newest price of each type and zone within it counts
    (EC2 records a price when it changes, so a quiet market has few entries)."""
    timeout_s: float = Field(10.0, gt=0)
    """Bound of one read (a read that fails keeps the prices the trainer had, and is retried)."""


PriceSource = Annotated[FilePriceConfig | AwsSpotPriceConfig, Field(discriminator="source")]
"""A file or AWS, chosen by `source`."""

PriceConfig = Annotated[float, Field(ge=0)] | PriceSource
"""US dollars per node-hour: a number, or where to read it (`{source: file | aws, ...}`)."""


class NodePoolConfig(Model):
    """A pool of a region's nodes: one capacity type and its price (an auto-scaling group's
    on-demand base and its spot nodes are two pools of one region)."""

    capacity: Capacity
    """The pool's capacity type; at most one pool of each type per region."""
    price: PriceConfig
    """US dollars per node-hour, or where to read it."""
    nodes: list[str] = Field(default_factory=list)
    """Nodes listed under `regions[].nodes` that belong here (an auto-scaled node says its capacity in
    its heartbeat instead: its agent reads it from the instance metadata, see docs/regions.md)."""


class PlacementConfig(Model):
    """How the trainer places admitted groups on regions in `algorithm.mode: async` (`credits.py`)."""

    price_aware: bool = False
    """Fill the cheapest capacity per useful group first, among the regions expected to return a group
    within `horizon_s`; a region none of whose groups could come back in time is never preferred for its
    price, so on-demand capacity stays the floor that keeps the trainer fed. A useful group's price is the
    region's dollars per second over the groups per second its serving nodes deliver, net of its measured
    preemption waste, plus its link's transfer cost. False (the default): by expected return alone."""
    horizon_s: float | None = Field(None, gt=0)
    """How soon a group placed by price must be expected back. None: the time the learner takes to
    consume the admission window, `(1 + max_staleness)` times the measured interval between steps (a
    group back within it is trained no staler than the bound allows, and the learner does not wait for
    it)."""

    @model_validator(mode="after")
    def _horizon_needs_price(self) -> PlacementConfig:
        if self.horizon_s is not None and not self.price_aware:
            raise ValueError("horizon_s applies to price-aware placement: set price_aware: true or leave it out")
        return self
