"""The cost meter and the price book: node-seconds from heartbeats, priced per pool, waste counted
where it was paid, and prices read from the config, a spot price file or EC2 (moto, over HTTP)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from fleetrl import devstack
from fleetrl.broker import EngineStatus, Heartbeat
from fleetrl.config import FleetConfig, parse_config
from fleetrl.trainer.cost import CostMeter
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.errors import PriceError
from fleetrl.trainer.metrics import TrainerMetrics
from fleetrl.trainer.prices import PriceBook, history_price, read_aws, read_price


def _config(**regions: dict[str, Any]) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": "cost", "mqtt": {"heartbeat_interval_s": 5},
        "regions": [{"name": n, "kafka": "127.0.0.1:9092", "store": f"/tmp/{n}", **r} for n, r in regions.items()],
    })


def _beat(ts: float, state: str = "up", tokens: int = 0, *, serving: bool = True, capacity: str | None = None,
          started_at: float | None = None, left: bool = False) -> Heartbeat:
    engines = [EngineStatus(index=0, state="up" if serving else "starting", tokens_sampled=tokens)]
    return Heartbeat(state=state, ts=ts, engines=engines, tokens_sampled=tokens, capacity=capacity,  # type: ignore[arg-type]
                     started_at=started_at, left=left)


def _meter(config: FleetConfig) -> tuple[CostMeter, TrainerMetrics]:
    prices = PriceBook(config)
    prices.load()
    metrics = TrainerMetrics()
    return CostMeter(config, prices, metrics), metrics


def _metric(metrics: TrainerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_node_seconds_between_heartbeats_are_priced_per_pool() -> None:
    # 3.6 $/h on demand = 0.001 $/s; 0.36 $/h spot = 0.0001 $/s.
    config = _config(east={"pools": [{"capacity": "on_demand", "price": 3.6, "nodes": ["base"]},
                                     {"capacity": "spot", "price": 0.36}],
                           "nodes": [{"name": "base"}]})
    meter, metrics = _meter(config)
    meter.observe("east", "base", _beat(100.0))                   # a baseline: nothing before it is ours
    meter.observe("east", "i-0abc", _beat(100.0, capacity="spot", serving=False))
    meter.observe("east", "base", _beat(110.0, tokens=500))        # +10 s on demand, serving
    meter.observe("east", "i-0abc", _beat(110.0, capacity="spot", tokens=40))  # +10 s spot, loading
    meter.observe("east", "i-0abc", _beat(110.0, capacity="spot", tokens=40))  # the same beat again: nothing
    meter.observe("east", "i-0abc", _beat(130.0, capacity="spot", tokens=140))  # +20 s spot, serving
    meter.observe("east", "base", _beat(115.0, "offline", tokens=520, left=True))  # +5 s, then it left
    # A new agent under the old name: paid from its start, its tokens from its start.
    meter.observe("east", "base", _beat(200.0, tokens=7, started_at=198.0))
    od, spot = meter.pools[("east", "on_demand")], meter.pools[("east", "spot")]
    assert (od.node_s, od.serving_s, od.tokens_sampled) == (17.0, 15.0, 527)
    assert (spot.node_s, spot.serving_s, spot.tokens_sampled) == (30.0, 20.0, 140)
    assert od.usd == pytest.approx(0.017) and spot.usd == pytest.approx(0.003)
    assert _metric(metrics, "fleetrl_cost_usd_total", region="east", capacity="spot") == pytest.approx(0.003)
    assert _metric(metrics, "fleetrl_cost_node_seconds_total", region="east", capacity="on_demand") == 17.0
    assert meter.usd_by_capacity() == pytest.approx({"on_demand": 0.017, "spot": 0.003})
    meter.observe("east", "base", _beat(205.0, tokens=57, started_at=198.0))
    assert meter.pools[("east", "on_demand")].tokens_sampled == 577
    assert meter.pools[("east", "on_demand")].node_s == 22.0


def test_a_last_will_pays_nothing_and_the_same_agent_back_pays_its_whole_gap() -> None:
    # A last will's `ts` is when the agent connected: it says nothing of when the node died. A busy broker
    # fires it for an agent that only lost its connection: when that agent speaks again, it ran all along.
    meter, _ = _meter(_config(east={"price": 3.6}))
    meter.observe("east", "n1", _beat(100.0, tokens=10, started_at=90.0))   # 10 s since its start
    meter.observe("east", "n1", _beat(90.0, "offline"))                      # the will (connect time)
    assert meter.usd_per_s(now=101.0) == {"east": 0.0}                        # not counted as live
    meter.observe("east", "n1", _beat(130.0, tokens=70, started_at=90.0))   # back: +30 s, +60 tokens
    pool = meter.pools[("east", "on_demand")]
    assert (pool.node_s, pool.tokens_sampled) == (40.0, 70)
    meter.observe("east", "n1", _beat(90.0, "offline"))                      # it died this time ...
    meter.observe("east", "n1", _beat(400.0, tokens=5, started_at=395.0))  # ... a new agent: from its start
    assert (pool.node_s, pool.tokens_sampled) == (45.0, 75)


def test_a_node_first_heard_of_while_it_runs_is_paid_from_its_agents_start() -> None:
    # The trainer may miss a node's first beats (it reads the retained one between steps): its agent's
    # `started_at` says when the node's time began; an `offline` heard first is a baseline (a node of an
    # earlier life, already counted or never ours).
    meter, _ = _meter(_config(east={"capacity": "spot", "price": 3.6}))
    late = _beat(130.0, tokens=90).model_copy(update={"started_at": 100.0})
    meter.observe("east", "i-1", late)
    gone = _beat(500.0, "offline", tokens=700, left=True).model_copy(update={"started_at": 0.0})
    meter.observe("east", "i-0", gone)
    spot = meter.pools[("east", "spot")]
    assert (spot.node_s, spot.serving_s, spot.tokens_sampled) == (30.0, 0.0, 90)
    meter.observe("east", "i-1", _beat(140.0, tokens=120).model_copy(update={"started_at": 100.0}))
    assert (spot.node_s, spot.serving_s, spot.tokens_sampled) == (40.0, 10.0, 120)


def test_a_region_without_pools_prices_its_nodes_by_its_capacity_and_unpriced_costs_nothing() -> None:
    config = _config(west={"capacity": "spot", "price": 0.72}, free={})
    meter, _ = _meter(config)
    for region in ("west", "free"):
        meter.observe(region, "n1", _beat(0.0))
        meter.observe(region, "n1", _beat(50.0))
    assert meter.usd_by_pool() == pytest.approx({("west", "spot"): 0.01, ("free", "on_demand"): 0.0})
    assert meter.step_fields(50.0, 4, 400)["cost_usd"] == pytest.approx(0.01)


def test_spend_includes_the_time_since_the_last_heartbeat_up_to_two_intervals() -> None:
    meter, _ = _meter(_config(east={"price": 3.6}))
    meter.observe("east", "n1", _beat(0.0))
    meter.observe("east", "n1", _beat(5.0))
    assert meter.usd(now=5.0) == pytest.approx(0.005)
    assert meter.usd(now=8.0) == pytest.approx(0.008)   # 3 s since the beat
    assert meter.usd(now=60.0) == pytest.approx(0.015)  # silent past 2 x 5 s: no more than 10 s
    assert meter.usd_per_s(now=8.0) == pytest.approx({"east": 0.001})
    assert meter.usd_per_s(now=60.0) == {"east": 0.0}
    meter.observe("east", "n1", _beat(9.0))             # the beat replaces the estimate
    assert meter.usd(now=9.0) == pytest.approx(0.009)


def test_step_fields_are_the_spend_since_the_last_step_and_what_it_bought() -> None:
    meter, _ = _meter(_config(east={"price": 36.0}))  # 0.01 $/s
    meter.observe("east", "n1", _beat(0.0))
    meter.observe("east", "n1", _beat(4.0))
    first = meter.step_fields(4.0, groups=8, tokens=1000)
    assert first["cost_usd"] == pytest.approx(0.04)
    assert first["groups_per_usd"] == pytest.approx(200.0) and first["tokens_per_usd"] == pytest.approx(25000.0)
    meter.observe("east", "n1", _beat(6.0))
    second = meter.step_fields(6.0, groups=8, tokens=1000)
    assert second["cost_usd"] == pytest.approx(0.02) and second["cost_usd_total"] == pytest.approx(0.06)
    assert second["cost_usd_on_demand"] == pytest.approx(0.06) and second["cost_usd_spot"] == 0.0


def test_waste_is_counted_where_it_was_paid() -> None:
    meter, metrics = _meter(_config(a={"price": 1.0}, b={"price": 1.0, "transfer_usd_per_gb": 0.02}))
    meter.on_resent("a", 3)
    meter.on_regenerated("a", 250)
    meter.on_regenerated("b", 0)
    meter.on_transfer("b", 500_000_000)
    meter.on_transfer("b", 500_000_000)
    assert dict(meter.groups_resent) == {"a": 3} and dict(meter.tokens_regenerated) == {"a": 250}
    assert _metric(metrics, "fleetrl_cost_groups_resent_total", region="a") == 3
    assert _metric(metrics, "fleetrl_cost_tokens_regenerated_total", region="a") == 250
    assert meter.transfer_usd["b"] == pytest.approx(0.02) and meter.transfer_usd_per_group("b") == pytest.approx(0.01)
    assert meter.summary(0.0)["groups_resent_total"] == 3


def test_an_agent_capture_not_replayed_is_waste_of_the_region_that_sampled_it() -> None:
    """A group from b names tokens of a capture handed over from a that b could not replay: a's waste; a region
    the config does not know is counted for the region the group came from."""
    meter, metrics = _meter(_config(a={"price": 1.0}, b={"price": 1.0}))
    meter.on_unreplayed("b", {"a": 40})
    meter.on_unreplayed("b", {"nowhere": 5, "b": 0})
    assert dict(meter.tokens_regenerated) == {"a": 40, "b": 5}
    assert _metric(metrics, "fleetrl_cost_tokens_regenerated_total", region="a") == 40
    assert meter.summary(0.0)["tokens_regenerated_total"] == 45


def test_a_restored_meter_accrues_the_time_the_trainer_was_down() -> None:
    config = _config(east={"price": 3.6})
    meter, _ = _meter(config)
    meter.observe("east", "n1", _beat(0.0))
    meter.observe("east", "n1", _beat(10.0, tokens=30))
    meter.on_trained("east", 12)
    saved = json.loads(json.dumps(meter.state()))  # the checkpoint's JSON
    again, _ = _meter(config)
    again.restore(saved)
    assert again.usd() == pytest.approx(0.01) and again.trained_tokens["east"] == 12
    again.observe("east", "n1", _beat(70.0, tokens=90))  # 60 s while no trainer listened
    assert again.usd() == pytest.approx(0.07) and again.pools[("east", "on_demand")].tokens_sampled == 90
    assert again.step_fields(70.0, 1, 1)["cost_usd"] == pytest.approx(0.06)


def test_heartbeats_give_the_credits_each_regions_spend_rate() -> None:
    config = _config(a={"price": 3.6}, b={"capacity": "spot", "price": 0.36})
    meter, metrics = _meter(config)
    credits = RegionCredits({"a": 1.0, "b": 1.0}, window_s=60, tokens_per_group=10)
    nodes = {("a", "n1"): _beat(100.0), ("b", "n1"): _beat(100.0), ("b", "n2"): _beat(100.0)}
    meter.heartbeats(nodes, credits, now=101.0)
    assert credits.regions["a"].usd_per_s == pytest.approx(0.001)
    assert credits.regions["b"].usd_per_s == pytest.approx(0.0002)
    assert _metric(metrics, "fleetrl_cost_usd_per_hour", region="b", capacity="spot") == pytest.approx(0.72)
    assert _metric(metrics, "fleetrl_cost_price_usd_per_node_hour", region="a", capacity="on_demand") == 3.6


# -- prices -------------------------------------------------------------------------------------

def _history(*rows: tuple[str, str, str, str]) -> dict[str, Any]:
    return {"SpotPriceHistory": [{"InstanceType": t, "AvailabilityZone": z, "ProductDescription": "Linux/UNIX",
                                  "SpotPrice": p, "Timestamp": ts} for t, z, p, ts in rows]}


HISTORY = _history(
    ("g6e.xlarge", "us-west-2a", "0.90", "2026-11-26T10:00:00+00:00"),
    ("g6e.xlarge", "us-west-2a", "1.10", "2026-11-26T12:00:00+00:00"),  # newer: this one counts
    ("g6e.xlarge", "us-west-2b", "0.70", "2026-11-26T11:00:00+00:00"),
    ("g5.2xlarge", "us-west-2a", "0.50", "2026-11-26T11:30:00+00:00"),
)


def test_a_spot_price_file_gives_the_newest_price_of_each_type_and_zone_aggregated(tmp_path: pathlib.Path) -> None:
    (tmp_path / "spot.json").write_text(json.dumps(HISTORY))
    text = """
run: cost
regions:
  - name: west
    kafka: 127.0.0.1:9092
    store: /tmp/west
    pools:
      - {capacity: on_demand, price: 3.0}
      - capacity: spot
        price: {source: file, path: spot.json, instance_types: [g6e.xlarge], aggregate: max}
"""
    config = parse_config(text, base_dir=tmp_path, env={})
    book = PriceBook(config)
    assert book.load() == {("west", "on_demand"): 3.0, ("west", "spot"): 1.10}
    config.regions[0].pools[1].price.aggregate = "mean"  # type: ignore[union-attr]
    book = PriceBook(config)
    assert book.load()[("west", "spot")] == pytest.approx(0.90)  # (1.10 + 0.70) / 2
    assert not book.due()  # next read after refresh_s


def test_history_price_refuses_what_it_cannot_price() -> None:
    cfg = parse_config("""
run: cost
regions: [{name: w, kafka: h:1, store: /tmp/w, price: {source: file, path: x, instance_types: [p5.48xlarge]}}]
""", env={}).regions[0].price
    with pytest.raises(PriceError, match=r"no spot price for instance types \['p5.48xlarge'\]"):
        history_price(HISTORY["SpotPriceHistory"], cfg, "regions[w] spot price")  # type: ignore[arg-type]
    with pytest.raises(PriceError, match="entry 0 is not a spot price"):
        history_price([{"InstanceType": "p5.48xlarge"}], cfg, "regions[w] spot price")  # type: ignore[arg-type]


def test_an_unreadable_price_file_keeps_the_last_price_and_is_read_again(tmp_path: pathlib.Path) -> None:
    spot = tmp_path / "spot.json"
    spot.write_text(json.dumps(HISTORY))
    config = _config(west={"capacity": "spot", "price": {"source": "file", "path": str(spot),
                                                         "instance_types": ["g5.2xlarge"]}})
    book = PriceBook(config)
    assert book.load(now=0.0) == {("west", "spot"): 0.5}
    spot.write_text("{not json")
    assert book.load(now=4000.0) == {("west", "spot"): 0.5}  # due after refresh_s (3600): failed, kept
    assert book.due(now=4061.0) and not book.due(now=4059.0)  # retried a minute later
    spot.unlink()
    with pytest.raises(PriceError, match=r"cannot read .*spot\.json"):
        read_price(config.regions[0].price, "regions[west] spot price")  # type: ignore[arg-type]


@pytest.mark.integration
def test_spot_prices_are_read_from_ec2_with_describe_spot_price_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """Against moto's server over HTTP. moto 5.2 answers with its own synthetic history (every type asked
    for, in each zone of the region, at $0.00001, dated 2006, named `Linux/UNIX (Amazon VPC)`), so this
    checks the request, the paging and the filters, not a market."""
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/dev/null",
                       "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}.items():
        monkeypatch.setenv(key, value)
    with devstack.moto_s3() as moto:
        endpoint = f"http://127.0.0.1:{moto.port}"
        config = _config(west={"capacity": "spot", "price": {
            "source": "aws", "region_name": "us-west-2", "endpoint_url": endpoint,
            "instance_types": ["g6e.xlarge", "g5.2xlarge"], "availability_zones": ["us-west-2a", "us-west-2b"]}})
        spot = config.regions[0].price
        assert read_aws(spot, "regions[west] spot price") == pytest.approx(0.00001)  # type: ignore[arg-type]
        book = PriceBook(config)
        assert book.load() == {("west", "spot"): pytest.approx(0.00001)}
        gone = _config(west={"capacity": "spot", "price": {
            "source": "aws", "region_name": "us-west-2", "endpoint_url": f"http://127.0.0.1:{devstack.free_port()}",
            "instance_types": ["g6e.xlarge"], "timeout_s": 1}})
        with pytest.raises(PriceError, match=r"regions\[west\] spot price: describe_spot_price_history in "
                                              r"us-west-2 failed"):
            read_aws(gone.regions[0].price, "regions[west] spot price")  # type: ignore[arg-type]
