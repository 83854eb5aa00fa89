"""Price-aware placement (`trainer.placement.price_aware`) with the real dispatcher, credits and cost
meter: spot is preferred while a useful group costs less there, dropped once its preemptions make it
dearer, and on-demand takes what spot cannot return in time. Off (the default), placement is by
expected return alone, as before."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from typing import Any

import pytest

from fleetrl.broker import EngineStatus, Heartbeat, PromptRecord
from fleetrl.config import FleetConfig
from fleetrl.trainer.cost import CostMeter
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.dispatcher import Dispatcher
from fleetrl.trainer.prices import PriceBook

TOKENS_PER_GROUP = 100.0
NOW = 1000.0


def _config(price_aware: bool, horizon_s: float | None = None) -> FleetConfig:
    placement: dict[str, Any] = {"price_aware": price_aware}
    if horizon_s is not None:
        placement["horizon_s"] = horizon_s
    region = {"kafka": "127.0.0.1:9092", "store": "/tmp/x"}
    return FleetConfig.model_validate({
        "run": "price",
        "algorithm": {"max_staleness": 1, "groups_per_step": 4, "n_samples": 2, "dispatch_ahead_steps": 0},
        "trainer": {"placement": placement},
        "regions": [{"name": "od", **region, "price": 3.0},                       # $3.00 a node-hour
                    {"name": "spot", **region, "capacity": "spot", "price": 1.05}],  # 65 % off
    })


class Fleet:
    """The trainer's placement pieces over an in-memory transport: heartbeats in, prompts out."""

    def __init__(self, price_aware: bool, horizon_s: float | None = None) -> None:
        self.config = _config(price_aware, horizon_s)
        p = self.config.trainer.placement
        self.credits = RegionCredits({"od": 1.0, "spot": 1.0}, window_s=60, tokens_per_group=TOKENS_PER_GROUP,
                                     price_aware=p.price_aware, horizon_s=p.horizon_s, max_staleness=1)
        prices = PriceBook(self.config)
        prices.load()
        self.cost = CostMeter(self.config, prices)
        self.sent: list[tuple[str, PromptRecord]] = []
        self.dispatcher = Dispatcher(self.config, itertools.repeat(("reverse", "abc=", "cba")), self._send,
                                     self.credits, waste=self.cost)
        self.step = 0

    async def _send(self, region: str, record: PromptRecord) -> None:
        self.sent.append((region, record))

    def beat(self, now: float, serving: dict[str, bool] | None = None) -> None:
        """One node per region, both delivering one group a second while busy."""
        serving = serving or {}
        nodes = {}
        for region in ("od", "spot"):
            up = serving.get(region, True)
            nodes[(region, "n1")] = Heartbeat(
                state="up", ts=now, busy_tokens_per_s=TOKENS_PER_GROUP if up else 0.0,
                engines=[EngineStatus(index=0, state="up" if up else "starting")])
        for (region, node), hb in nodes.items():
            self.credits.on_heartbeat(region, node, hb.state, hb.tokens_per_s, now,
                                      busy_tokens_per_s=hb.busy_tokens_per_s, serving=hb.serving)
        self.cost.heartbeats(nodes, self.credits, now)

    def dispatch(self, now: float) -> Counter[str]:
        before = len(self.sent)
        asyncio.run(self.dispatcher.dispatch(self.step, self.step, now, lambda _: False, released=0))
        return Counter(region for region, _ in self.sent[before:])

    def steps_every(self, interval_s: float) -> None:
        """Two learner steps `interval_s` apart: the horizon is (1 + max_staleness) of that interval."""
        self.credits.on_step(NOW - interval_s)
        self.credits.on_step(NOW)


def test_spot_takes_the_window_while_a_useful_group_is_cheaper_there() -> None:
    fleet = Fleet(price_aware=True)
    fleet.beat(NOW - 1)
    fleet.steps_every(10.0)  # horizon 20 s: a backlog of up to 19 groups at 1 group/s is back in time
    assert fleet.credits.horizon() == pytest.approx(20.0)
    assert fleet.credits.useful_price("spot", NOW) == pytest.approx(1.05 / 3600)  # $ per group at 1 group/s
    assert fleet.dispatch(NOW) == {"spot": 8}  # the whole window, (1 + s) x 4 groups


def test_placement_by_expected_return_is_the_default() -> None:
    fleet = Fleet(price_aware=False)
    fleet.beat(NOW - 1)
    fleet.steps_every(10.0)
    assert fleet.dispatch(NOW) == {"od": 4, "spot": 4}  # equal nodes: an even split, whatever they cost


def test_on_demand_takes_what_spot_cannot_return_within_the_horizon() -> None:
    # Spot returns its 5th group in 5 s at 1 group/s (an idle region's first at once): the rest go on demand.
    fleet = Fleet(price_aware=True, horizon_s=5.0)
    fleet.beat(NOW - 1)
    assert fleet.dispatch(NOW) == {"spot": 5, "od": 3}


def test_spot_is_dropped_once_its_preemptions_make_a_useful_group_dearer() -> None:
    fleet = Fleet(price_aware=True)
    fleet.beat(NOW - 1)
    fleet.steps_every(10.0)
    assert fleet.dispatch(NOW) == {"spot": 8}
    # Spot is preempted: the region goes, and its groups are sent again from scratch (handover.py's path
    # for a gone region). Each is lost there: waste share 8 / 8 until something arrives from it.
    assert asyncio.run(fleet.dispatcher.redispatch_region("spot", NOW + 1, exclude=frozenset())) == 8
    assert fleet.cost.groups_resent == {"spot": 8}
    assert fleet.credits.waste_share("spot", NOW + 1) == 1.0
    for gid in [g for g, f in fleet.dispatcher.in_flight.items() if f.region == "od"][:8]:
        fleet.dispatcher.resolve(gid)  # trained
        fleet.credits.on_arrival("od", NOW + 2, latency_s=1.0)
    for _ in range(2):  # two groups come back from spot's replacement nodes: waste 8 / 10
        fleet.credits.on_arrival("spot", NOW + 2, latency_s=1.0)
    fleet.beat(NOW + 2)
    # 1.05 / (1 - 0.8) = 5.25 $ per useful group-hour against 3.00 on demand: on demand now.
    assert fleet.credits.useful_price("spot", NOW + 2) > fleet.credits.useful_price("od", NOW + 2)
    fleet.step = 2  # the learner trained the 8 groups: the window opens again
    assert fleet.dispatch(NOW + 2) == {"od": 8}


def test_spot_stays_preferred_while_its_waste_costs_less_than_its_discount() -> None:
    fleet = Fleet(price_aware=True)
    fleet.beat(NOW - 1)
    fleet.steps_every(10.0)
    for _ in range(4):
        fleet.credits.on_lost("spot", NOW)
        fleet.credits.on_arrival("spot", NOW, latency_s=1.0)
    assert fleet.credits.waste_share("spot", NOW) == 0.5  # 1.05 / 0.5 = 2.10 < 3.00
    assert fleet.dispatch(NOW) == {"spot": 8}


def test_on_demand_is_the_floor_when_spot_has_no_serving_node() -> None:
    fleet = Fleet(price_aware=True)
    fleet.beat(NOW - 1, serving={"spot": False})  # the replacements still load their engines
    fleet.steps_every(10.0)
    assert fleet.dispatch(NOW) == {"od": 8}
