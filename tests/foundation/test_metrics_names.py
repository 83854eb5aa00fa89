"""One metric naming scheme, documented from the code, and a Grafana board that queries only real metrics."""

from __future__ import annotations

import json
import pathlib
import re
import urllib.error
import urllib.request

from slowdown import scaled

from fleetrl.metrics_doc import BEGIN, END, NAME_RE, metric_docs, registries, render

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_docs_metrics_md_is_generated_from_the_code() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    current = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert current == render(), "run: python -m fleetrl.metrics_doc --update docs/metrics.md"


def test_names_follow_the_scheme() -> None:
    docs = metric_docs()
    assert len({d.name for d in docs}) == len(docs), "a name is registered twice"
    for d in docs:
        assert NAME_RE.match(d.name), d.name
        assert d.name.endswith("_total") == (d.type == "counter"), f"{d.name}: counters and only counters end _total"
        assert d.help.strip(), f"{d.name}: needs a help text"
    histograms = [d.name for d in docs if d.type == "histogram"]
    assert all(n.endswith(("_seconds", "_versions", "_bytes")) for n in histograms), histograms


def test_every_daemon_serves_its_documented_names_and_healthz() -> None:
    documented: dict[str, set[str]] = {d.daemon: set() for d in metric_docs()}
    for d in metric_docs():
        documented[d.daemon].add(d.name.removesuffix("_total"))
    for daemon, reg in registries().items():
        port = reg.serve(0, addr="127.0.0.1")
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=scaled(10)).read().decode()
            # prometheus_client adds a `_created` timestamp per counter and histogram: not ours to document.
            served = {n for n in re.findall(r"^# TYPE (fleetrl_\w+) ", body, re.M) if not n.endswith("_created")}
            assert {n.removesuffix("_total") for n in served} == documented[daemon], daemon
            health = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=scaled(10))
            assert health.status == 200 and health.read() == b"ok\n"
            reg.health = lambda: (False, "learner stalled")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=scaled(10))
                raise AssertionError("an unhealthy daemon answered 200")
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and exc.read() == b"learner stalled\n"
        finally:
            reg.close()


def test_every_dashboard_query_names_a_documented_metric() -> None:
    board = json.loads((ROOT / "deploy" / "grafana" / "fleetrl.json").read_text())
    names = {d.name for d in metric_docs()}
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert exprs
    for expr in exprs:
        used = re.findall(r"\bfleetrl_\w+", expr)
        assert used, expr
        for name in used:
            assert re.sub(r"_(bucket|sum|count)$", "", name) in names, f"{name} in {expr!r} is not a FleetRL metric"


# What the board must show (issue 16), each by a metric that some panel queries.
BOARD_MUST_SHOW = {
    "mean reward": "fleetrl_trainer_reward_mean",
    "staleness": "fleetrl_trainer_staleness_versions",
    "groups/s per region": "fleetrl_trainer_groups_received_total",
    "Kafka consumer lag per region": "fleetrl_trainer_consumer_lag_records",
    "stale groups": "fleetrl_trainer_stale_groups_dropped_total",
    "dead-lettered by the trainer": "fleetrl_trainer_dead_lettered_records_total",
    "dead-lettered by rollout workers": "fleetrl_rollout_dead_lettered_records_total",
    "hub bytes per version": "fleetrl_trainer_weight_publish_last_bytes",
    "WAN copies": "fleetrl_replicator_versions_copied_total",
    "node states": "fleetrl_agent_state",
    "cost per region and capacity": "fleetrl_cost_usd_total",
    "spend rate": "fleetrl_cost_usd_per_hour",
    "preemption waste": "fleetrl_cost_groups_resent_total",
}


def test_the_dashboard_shows_what_an_operator_needs() -> None:
    board = json.loads((ROOT / "deploy" / "grafana" / "fleetrl.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    def queried(name: str) -> bool:
        return any(re.search(rf"\b{name}(_bucket|_sum|_count)?\b", e) for e in exprs)

    missing = [what for what, name in BOARD_MUST_SHOW.items() if not queried(name)]
    assert not missing, f"the board shows no {missing}"
    cost = [e for e in exprs if "fleetrl_cost_usd_total" in e and "by (" in e]
    assert any("by (region, capacity)" in e for e in cost), f"cost must be shown per region and capacity: {cost}"
    lag = [e for e in exprs if "fleetrl_trainer_consumer_lag_records" in e]
    assert all("by (region)" in e for e in lag), f"lag must be shown per region: {lag}"
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"]), "panel ids must be unique"
