"""`fleetrl topics ...` and `fleetrl control`: how operators see and repair the broker layer.

Each handler takes `(args, config)` from `fleetrl.cli` and returns an exit code. Every topics command
runs against each region cluster (or the one `--region` names); a region that cannot be reached is
reported on stderr naming it, the others still run, and the exit code is 1. Output is a rich table
(coloured on a TTY) or, with `--json`, one JSON document on stdout for scripts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Table

from fleetrl.broker.deadletter import DeadLetter
from fleetrl.broker.dlq import read_dead_letters, replay_dead_letters, select
from fleetrl.broker.errors import BrokerError
from fleetrl.broker.lag import group_lag
from fleetrl.broker.mqtt import ControlPlane
from fleetrl.broker.topics import TopicChange, describe_topics, ensure_topics, topic_specs
from fleetrl.config import FleetConfig

T = TypeVar("T")
_REPLAY_ALL_LIMIT = 1_000_000


def _console() -> Console:
    # Off a terminal rich would wrap at 80 columns; scripts should use --json, people get full rows.
    return Console(width=None if sys.stdout.isatty() else 200)


def _regions(args: argparse.Namespace, config: FleetConfig) -> list[str]:
    if getattr(args, "region", None):  # one fleet.yaml names (`fleetrl.cli` refused any other)
        return [args.region]
    return [r.name for r in config.regions]


def _per_region(
    args: argparse.Namespace, config: FleetConfig, work: Callable[[str], Awaitable[T]]
) -> tuple[dict[str, T], int]:
    """Run `work` for each region; failures are reported naming the region and make the exit code 1."""

    async def all_regions() -> tuple[dict[str, T], int]:
        out: dict[str, T] = {}
        code = 0
        for region in _regions(args, config):
            try:
                out[region] = await work(region)
            except (BrokerError, TimeoutError) as exc:
                print(f"fleetrl: region {region!r}: {exc}", file=sys.stderr)
                code = 1
        return out, code

    return asyncio.run(all_regions())


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    _console().print(table)


# -- topics ---------------------------------------------------------------------------------------


def topics_create(args: argparse.Namespace, config: FleetConfig) -> int:
    """Create the run's four topics on each region cluster; idempotent, reports each topic's outcome."""
    results, code = _per_region(args, config, lambda region: ensure_topics(config, region))
    changes: list[TopicChange] = [c for region_changes in results.values() for c in region_changes]
    if args.json:
        _print_json([asdict(c) for c in changes])
    else:
        _table(f"topics of run {config.run}", ["region", "topic", "action", "detail"],
               [[c.region, c.topic, c.action, c.detail] for c in changes])
    if any(c.action == "differs" for c in changes):
        print("fleetrl: some topics differ from the spec and were left unchanged (see `detail`)", file=sys.stderr)
        code = 1
    return code


def topics_list(args: argparse.Namespace, config: FleetConfig) -> int:
    """The run's topics per region: present or missing, and their partition counts."""
    specs = topic_specs(config)
    results, code = _per_region(args, config, lambda region: describe_topics(config, region, [s.name for s in specs]))
    rows = [
        {"region": region, "topic": s.name, "exists": s.name in states,
         "partitions": states[s.name].partitions if s.name in states else None, "spec_partitions": s.partitions}
        for region, states in results.items() for s in specs
    ]
    if args.json:
        _print_json(rows)
    else:
        _table(f"topics of run {config.run}", ["region", "topic", "exists", "partitions", "spec"],
               [[r["region"], r["topic"], "yes" if r["exists"] else "MISSING", r["partitions"], r["spec_partitions"]]
                for r in rows])
    return code if all(r["exists"] for r in rows) or code else 1


def topics_describe(args: argparse.Namespace, config: FleetConfig) -> int:
    """Partitions, leaders and configs of the run's topics, with differences from the spec."""
    from fleetrl.broker.topics import differences

    specs = topic_specs(config)
    results, code = _per_region(args, config, lambda region: describe_topics(config, region, [s.name for s in specs]))
    rows: list[dict[str, Any]] = []
    for region, states in results.items():
        for spec in specs:
            state = states.get(spec.name)
            rows.append({
                "region": region, "topic": spec.name, "exists": state is not None,
                "partitions": state.partitions if state else None,
                "leaders": sorted(set(state.leaders.values())) if state else [],
                "configs": state.configs if state else {},
                "differences": differences(spec, state) if state else ["missing"],
            })
    if args.json:
        _print_json(rows)
    else:
        _table(f"topics of run {config.run}", ["region", "topic", "partitions", "leaders", "configs", "vs spec"],
               [[r["region"], r["topic"], r["partitions"], ",".join(map(str, r["leaders"])),
                 " ".join(f"{k}={v}" for k, v in sorted(r["configs"].items())),
                 "; ".join(r["differences"]) or "ok"] for r in rows])
    return code


def topics_lag(args: argparse.Namespace, config: FleetConfig) -> int:
    """Per-partition lag of the rollout and trainer groups (end offset minus committed offset)."""
    results, code = _per_region(args, config, lambda region: group_lag(config, region))
    rows = [row for region_rows in results.values() for row in region_rows]
    if args.json:
        _print_json([{**asdict(r), "lag": r.lag} for r in rows])
    else:
        _table(f"consumer lag of run {config.run}",
               ["region", "group", "topic", "partition", "start", "end", "committed", "lag"],
               [[r.region, r.group, r.topic, r.partition, r.start, r.end,
                 "-" if r.committed is None else r.committed, r.lag] for r in rows])
    return code


# -- dead letters ---------------------------------------------------------------------------------


def _letter_json(region: str, d: DeadLetter) -> dict[str, Any]:
    return {
        "region": region, "partition": d.partition, "offset": d.offset,
        "key": d.key.decode(errors="replace") if d.key is not None else None,
        "reason": d.reason, "field": d.field, "message": d.message, "schema": d.schema,
        "original_topic": d.original_topic, "original_partition": d.original_partition,
        "original_offset": d.original_offset, "bytes": len(d.value),
    }


def _letters_table(title: str, letters: list[dict[str, Any]]) -> None:
    _table(title, ["region", "at", "key", "reason", "field", "from", "message"],
           [[d["region"], f"{d['partition']}:{d['offset']}", d["key"], d["reason"], d["field"],
             f"{d['original_topic']}[{d['original_partition']}]@{d['original_offset']}", d["message"]]
            for d in letters])


def dlq_show(args: argparse.Namespace, config: FleetConfig) -> int:
    """Dead-lettered records with their reasons; `at` (PARTITION:OFFSET) is what replay takes."""
    results, code = _per_region(args, config, lambda region: read_dead_letters(config, region, args.limit))
    letters = [_letter_json(region, d) for region, found in results.items() for d in found]
    if args.json:
        _print_json(letters)
    else:
        _letters_table(f"dead letters of run {config.run}", letters)
    return code


def dlq_replay(args: argparse.Namespace, config: FleetConfig) -> int:
    """Re-produce chosen dead letters (or --all) of one region to their original topics."""
    if bool(args.offsets) == bool(args.all):
        print(f"{args.command_prog}: error: argument --offset: give --offset PARTITION:OFFSET (repeatable) or "
              f"--all, one of them", file=sys.stderr)
        return 2
    positions: list[tuple[int, int]] = args.offsets  # PARTITION:OFFSET pairs, parsed by fleetrl/cli_args.py
    region = args.region

    async def run() -> list[DeadLetter]:
        letters = await read_dead_letters(config, region, limit=_REPLAY_ALL_LIMIT)
        chosen = letters if args.all else select(letters, positions)
        return chosen if args.dry_run else await replay_dead_letters(config, region, chosen)

    try:
        done = asyncio.run(run())
    except BrokerError as exc:
        print(f"fleetrl: region {region!r}: {exc}", file=sys.stderr)
        return 1
    letters = [_letter_json(region, d) for d in done]
    verb = "would replay" if args.dry_run else "replayed"
    if args.json:
        _print_json({"dry_run": args.dry_run, "replayed": letters})
    else:
        _letters_table(f"{verb} {len(letters)} dead letter(s) of region {region}", letters)
    return 0


# -- operator commands ----------------------------------------------------------------------------


def control(args: argparse.Namespace, config: FleetConfig) -> int:
    """Send drain / resume / stop to every node of a region over the control plane."""
    from fleetrl.broker.control import ControlCommand

    command = ControlCommand(cmd=args.command_name, reason=args.reason)

    async def send() -> None:
        async with ControlPlane(config, f"fleetrl-control-{os.getpid()}", watch_nodes=False) as cp:
            await cp.send_control(args.region, command)

    try:
        asyncio.run(send())
    except BrokerError as exc:
        print(f"fleetrl: {exc}", file=sys.stderr)
        return 1
    print(f"sent {command.cmd} to region {args.region}" + (f" ({command.reason})" if command.reason else ""))
    return 0
