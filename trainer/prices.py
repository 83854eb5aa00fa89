"""Prices of the fleet's capacity: US dollars per node-hour of each region's on-demand and spot pools.

`PriceBook` reads what `regions[].price` / `pools[].price` say (fleetrl/config/pricing.py): a number,
a spot price history in a JSON file (the shape `aws ec2 describe-spot-price-history` prints), or that
history read from EC2 with boto3's `describe_spot_price_history`. A history is reduced to one price:
the newest entry of each (instance type, zone) that matches, aggregated (`mean`, `max`, `min`).

Reads are blocking (a file, an HTTPS call): the trainer runs `load` in a thread at start and again
every `refresh_s`. A source that cannot be read keeps the price the book had (none at first, so the
pool's nodes cost 0 until it is read), logs `cost.price_unavailable` naming the region, pool and
source, and is read again a minute later: a price service that is down never stops training.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import statistics
import time
from collections.abc import Iterable
from typing import Any

from fleetrl.config import AwsSpotPriceConfig, Capacity, FilePriceConfig, FleetConfig, PriceConfig
from fleetrl.log import get_logger
from fleetrl.trainer.errors import PriceError

log = get_logger(__name__)
CAPACITIES: tuple[Capacity, ...] = ("on_demand", "spot")
_RETRY_S = 60.0  # a source that failed is read again this soon


def history_price(entries: Iterable[dict[str, Any]], cfg: FilePriceConfig | AwsSpotPriceConfig, where: str,
                  *, match_product: bool = True) -> float:
    """One price per node-hour from spot price history entries: the newest of each (type, zone) that
    matches `cfg`, aggregated by `cfg.aggregate`. `match_product`: filter by product description here
    (a file); EC2 filters by it itself (and an emulator may name the product its own way)."""
    newest: dict[tuple[str, str], tuple[str, float]] = {}
    for i, e in enumerate(entries):
        try:
            kind, zone, stamp = str(e["InstanceType"]), str(e["AvailabilityZone"]), str(e["Timestamp"])
            price = float(e["SpotPrice"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PriceError(f"{where}: entry {i} is not a spot price (InstanceType, AvailabilityZone, "
                             f"SpotPrice, Timestamp): {e!r:.200}") from exc
        if cfg.instance_types and kind not in cfg.instance_types:
            continue
        if cfg.availability_zones and zone not in cfg.availability_zones:
            continue
        if match_product and e.get("ProductDescription", cfg.product_description) != cfg.product_description:
            continue
        if price < 0 or price != price:
            raise PriceError(f"{where}: entry {i} has price {price}")
        if (kind, zone) not in newest or stamp > newest[(kind, zone)][0]:
            newest[(kind, zone)] = (stamp, price)
    if not newest:
        raise PriceError(f"{where}: no spot price for instance types {cfg.instance_types or 'any'} in zones "
                         f"{cfg.availability_zones or 'any'} ({cfg.product_description})")
    prices = [p for _, p in newest.values()]
    if cfg.aggregate == "max":
        return max(prices)
    return min(prices) if cfg.aggregate == "min" else statistics.fmean(prices)


def read_file(cfg: FilePriceConfig, where: str) -> float:
    try:
        doc = json.loads(pathlib.Path(cfg.path).read_text())
    except OSError as exc:
        raise PriceError(f"{where}: cannot read {cfg.path}: {exc.strerror}", retriable=True) from exc
    except ValueError as exc:
        raise PriceError(f"{where}: {cfg.path} is not JSON: {exc}") from exc
    entries = doc.get("SpotPriceHistory") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise PriceError(f"{where}: {cfg.path} has no SpotPriceHistory list (the shape `aws ec2 "
                         "describe-spot-price-history --output json` prints)")
    return history_price(entries, cfg, f"{where} ({cfg.path})")


def read_aws(cfg: AwsSpotPriceConfig, where: str) -> float:
    """The spot price history of `cfg.region_name` from EC2, over the last `lookback_s`."""
    import boto3
    import botocore.config
    import botocore.exceptions

    client = boto3.client("ec2", region_name=cfg.region_name, endpoint_url=cfg.endpoint_url,
                          config=botocore.config.Config(connect_timeout=cfg.timeout_s, read_timeout=cfg.timeout_s,
                                                        retries={"max_attempts": 2}))
    args: dict[str, Any] = {
        "InstanceTypes": cfg.instance_types, "ProductDescriptions": [cfg.product_description],
        "StartTime": datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=cfg.lookback_s),
    }
    if cfg.availability_zones:
        args["Filters"] = [{"Name": "availability-zone", "Values": cfg.availability_zones}]
    entries: list[dict[str, Any]] = []
    try:
        for page in client.get_paginator("describe_spot_price_history").paginate(**args):
            entries += [{**e, "Timestamp": str(e.get("Timestamp"))} for e in page.get("SpotPriceHistory", [])]
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        raise PriceError(f"{where}: describe_spot_price_history in {cfg.region_name} failed: {exc}",
                         retriable=True) from exc
    return history_price(entries, cfg, f"{where} (EC2 {cfg.region_name})", match_product=False)


def read_price(price: PriceConfig, where: str) -> float:
    """US dollars per node-hour of one pool (`where` names it in errors)."""
    if isinstance(price, FilePriceConfig):
        return read_file(price, where)
    if isinstance(price, AwsSpotPriceConfig):
        return read_aws(price, where)
    return float(price)


class PriceBook:
    """The price of every priced (region, capacity) pool, read now and again when due."""

    def __init__(self, config: FleetConfig) -> None:
        self.sources: dict[tuple[str, Capacity], PriceConfig] = {}
        for region in config.regions:
            for capacity in CAPACITIES:
                price = region.price_of(capacity)
                if price is not None:
                    self.sources[(region.name, capacity)] = price
        self.prices: dict[tuple[str, Capacity], float] = {}
        self._due: dict[tuple[str, Capacity], float] = {key: 0.0 for key in self.sources}

    @property
    def priced(self) -> bool:
        """Whether any pool has a price: without one the trainer measures no cost."""
        return bool(self.sources)

    def usd_per_node_hour(self, region: str, capacity: Capacity) -> float:
        """The pool's price (0 when unpriced or not read yet)."""
        return self.prices.get((region, capacity), 0.0)

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return any(now >= at for at in self._due.values())

    def load(self, now: float | None = None) -> dict[tuple[str, Capacity], float]:
        """Read every source that is due (blocking: run it in a thread); returns the prices now known."""
        now = time.monotonic() if now is None else now
        for key, source in self.sources.items():
            if now < self._due[key]:
                continue
            where = f"regions[{key[0]}] {key[1]} price"
            try:
                price = read_price(source, where)
            except PriceError as exc:
                self._due[key] = now + _RETRY_S
                log.error("cost.price_unavailable", region=key[0], capacity=key[1], error=str(exc),
                          kept=self.prices.get(key))
                continue
            refresh = getattr(source, "refresh_s", None)
            self._due[key] = now + refresh if refresh is not None else float("inf")
            if self.prices.get(key) != price:
                log.info("cost.price", region=key[0], capacity=key[1], usd_per_node_hour=round(price, 6),
                         source=getattr(source, "source", "config"))
            self.prices[key] = price
        return dict(self.prices)
