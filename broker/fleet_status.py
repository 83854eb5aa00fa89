"""`fleetrl status [--json] [--watch S]`: the fleet from the MQTT retained state (DESIGN.md §4, §9).

Shows the announced policy, each region's replica announcement, and each node's heartbeat with its
engines. A node whose heartbeat is older than three heartbeat intervals and not `offline` is marked
stale (its agent is gone and its last will has not fired yet, or the clock is off). `--watch S` keeps
the client connected and redraws every S seconds until Ctrl-C.

The broker sends the retained messages right after the client subscribes, but how soon depends on the
broker and its load. So `status` reads until the state it can know to expect is in, the policy and a
heartbeat of every node the config lists, then takes what else comes in the same burst (nodes the
config does not list, such as auto-scaled ones, and replica announcements): it ends once nothing new
has come for `_SETTLE_S`. `--wait-s` bounds the whole read; past it, it shows what it has (no policy
announced yet, a listed node never heard from).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from fleetrl.broker.errors import BrokerError
from fleetrl.broker.mqtt import ControlPlane
from fleetrl.config import FleetConfig

_SETTLE_S = 0.2
"""Once the expected state is in: how long without a new retained message ends the read."""


def status(args: argparse.Namespace, config: FleetConfig) -> int:
    try:
        if getattr(args, "watch", None):
            asyncio.run(_watch(config, args))
            return 0
        view = asyncio.run(_collect(config, args.wait_s))
    except BrokerError as exc:
        print(f"fleetrl: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    if args.json:
        print(json.dumps(view, indent=2, default=str))
    else:
        Console(width=None if sys.stdout.isatty() else 200).print(render(view))
    return 0


async def _collect(config: FleetConfig, wait_s: float) -> dict[str, Any]:
    async with ControlPlane(config, f"fleetrl-status-{os.getpid()}", watch_replicas=True) as cp:
        await _read_retained(config, cp, wait_s)
        return fleet_view(config, cp)


async def _read_retained(config: FleetConfig, cp: ControlPlane, wait_s: float) -> None:
    """Wait, at most `wait_s`, until `cp` holds the policy and a heartbeat of every node `config` lists,
    then until no retained message has come for `_SETTLE_S`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while not (complete := _expected_state_in(config, cp)) and (left := deadline - loop.time()) > 0:
        await cp.changed(left)
    while complete and (left := deadline - loop.time()) > 0 and await cp.changed(min(_SETTLE_S, left)):
        pass  # a message of the same burst: an unlisted node, a replica announcement


def _expected_state_in(config: FleetConfig, cp: ControlPlane) -> bool:
    listed = {(region.name, node.name) for region in config.regions for node in region.nodes}
    return cp.policy is not None and listed <= cp.nodes.keys()


async def _watch(config: FleetConfig, args: argparse.Namespace) -> None:
    async with ControlPlane(config, f"fleetrl-status-{os.getpid()}", watch_replicas=True) as cp:
        await _read_retained(config, cp, min(args.wait_s, args.watch))
        with Live(render(fleet_view(config, cp)), auto_refresh=False) as live:
            while True:
                await asyncio.sleep(args.watch)
                view = fleet_view(config, cp)
                live.update(render(view) if not args.json else Text(json.dumps(view, default=str)), refresh=True)


def fleet_view(config: FleetConfig, cp: ControlPlane) -> dict[str, Any]:
    """The retained state as one JSON-able document (what `--json` prints)."""
    now = time.time()
    stale_after_s = 3 * config.mqtt.heartbeat_interval_s
    nodes = [
        {"region": region, "node": node, **beat.model_dump(), "age_s": round(now - beat.ts, 1),
         "stale": beat.state != "offline" and now - beat.ts > stale_after_s}
        for (region, node), beat in sorted(cp.nodes.items())
    ]
    return {"run": config.run, "policy": cp.policy.model_dump() if cp.policy else None,
            "replicas": {r: a.model_dump() for r, a in sorted(cp.replicas.items())}, "nodes": nodes}


def render(view: dict[str, Any]) -> Group:
    policy = view["policy"]
    head = Text(f"run {view['run']}: no policy announced yet" if policy is None else
                f"run {view['run']}: policy version {policy['version']} (anchor {policy['anchor']}), published "
                f"{time.ctime(policy['published_at'])}; replicas: " +
                (", ".join(f"{r} v{a['version']}" for r, a in view["replicas"].items()) or "none announced"))
    table = Table(title="nodes")
    for column in ("region", "node", "capacity", "state", "version", "tokens/s", "in flight", "engines", "age (s)"):
        table.add_column(column, overflow="fold")
    for n in view["nodes"]:
        table.add_row(n["region"], n["node"], n.get("capacity") or "", n["state"] + (" (stale)" if n["stale"] else ""),
                      "" if n["version"] is None else str(n["version"]), f"{n['tokens_per_s']:.1f}",
                      str(n["in_flight"]), _engines(n["engines"]), str(n["age_s"]))
    return Group(head, table)


def _engines(engines: Any) -> str:
    """`0:up 1:crashloop (last error...)`; old heartbeats carry a count or names."""
    if not isinstance(engines, list):
        return str(engines)
    parts = []
    for e in engines:
        if not isinstance(e, dict):
            parts.append(str(e))
            continue
        text = f"{e['index']}:{e['state']}" + (f" r{e['restarts']}" if e.get("restarts") else "")
        if e["state"] in ("crashloop", "restarting") and e.get("last_error"):
            text += f" ({e['last_error'][:80]})"
        parts.append(text)
    return " ".join(parts)
