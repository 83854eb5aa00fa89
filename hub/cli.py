"""Handlers of `fleetrl hub ...` and `fleetrl replicator` (named in fleetrl/cli.py).

Each takes `(args, config)` and returns an exit code. Long transfers show a rich progress bar on a
terminal; the replicator daemon logs JSON events and, on SIGTERM, finishes the version it is copying,
releases its lease and exits 0 (or exits 3 if that takes longer than the lease TTL).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from fleetrl.config import FleetConfig
from fleetrl.hub.errors import HubError, UnknownVersion
from fleetrl.hub.hub import Hub
from fleetrl.hub.reader import Progress
from fleetrl.hub.replicator import Holding, Replicator, VersionHints
from fleetrl.log import get_logger

log = get_logger(__name__)


@contextlib.contextmanager
def _progress(label: str, total: int | None) -> Iterator[Progress]:
    """A byte-counting callback drawing a rich progress bar on a terminal (silent otherwise)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _version(hub: Hub, asked: int | str, argument: str = "version") -> int:
    """The version `asked` (a number or 'latest', as fleetrl/cli_args.py parsed it); a number the store
    does not hold is refused as the bad `argument` it is (UnknownVersion), naming what the store has."""
    if asked == "latest":
        latest = hub.latest()
        if latest is None:
            raise HubError(f"{hub.store.where(hub.run + '/latest')}: no version published yet")
        return latest
    try:
        version = int(asked)
    except ValueError:
        raise HubError(f"version {asked!r} is neither a number nor 'latest'") from None
    held = hub.versions()
    if version not in held:
        has = f"it holds no version of run {hub.run!r}" if not held else (
            f"newest is {held[-1]}" if version > held[0] else f"oldest is {held[0]}, newest is {held[-1]}")
        raise UnknownVersion(f"{version} not in store {hub.store.name!r} ({has})", argument=argument)
    return version


def _load_safetensors(path: pathlib.Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise HubError(f"{path}: no .safetensors files")
    state: dict[str, Any] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def publish(args: argparse.Namespace, config: FleetConfig) -> int:
    with Hub.from_config(config) as hub:
        pv = hub.publish(_load_safetensors(pathlib.Path(args.path)))
    print(json.dumps({"version": pv.version, "anchor": pv.anchor, "manifest": pv.manifest_key,
                      "sha256": pv.sha256, "bytes_written": pv.bytes_written, "anchor_reason": pv.anchor_reason}))
    return 0


def pull(args: argparse.Namespace, config: FleetConfig) -> int:
    with Hub.from_config(config, store=args.store) as hub:
        version = _version(hub, args.hub_version)
        with _progress(f"v{version}", hub.reader.bytes_to_read(version)) as progress:
            out = hub.materialize_to_safetensors(version, args.out, progress=progress)
    print(json.dumps({"version": version, "path": str(out), "bytes": out.stat().st_size}))
    return 0


def export(args: argparse.Namespace, config: FleetConfig) -> int:
    from fleetrl.hub.export import export_version

    with Hub.from_config(config, store=args.store) as hub:
        summary = export_version(hub, config, _version(hub, args.hub_version, "--version"), args.out,
                                 args.max_shard_size, merged=args.merged)
    print(json.dumps(summary))
    return 0


def verify(args: argparse.Namespace, config: FleetConfig) -> int:
    if (args.hub_version is None) == (not args.all):
        print(f"{args.command_prog}: error: argument version: give a version (a number or 'latest') or --all, "
              f"one of them", file=sys.stderr)
        return 2
    if args.all:
        return _verify_all(args, config)
    with Hub.from_config(config, store=args.store) as hub:
        version = _version(hub, args.hub_version)
        with _progress(f"verify v{version}", hub.reader.bytes_to_read(version)) as progress:
            state = hub.materialize(version, progress=progress)  # checks signature, parts and tensors
    print(json.dumps({"version": version, "store": args.store, "tensors": len(state), "ok": True}))
    return 0


def _verify_all(args: argparse.Namespace, config: FleetConfig) -> int:
    """Every version of every named store (default: the home store); exit 1 when any is not ok."""
    stores = args.store.split(",") if args.store != "all" else list(config.stores())
    reports = []
    for name in stores:
        with Hub.from_config(config, store=name) as hub:
            n = len(hub.versions())
            with _progress(f"verify {name} ({n} versions)", n) as progress:
                check = hub.verify_store(lambda _v: progress(1))
        reports.append(check.as_dict())
    print(json.dumps(reports if len(reports) > 1 or args.store == "all" else reports[0]))
    return 0 if all(r["ok"] for r in reports) else 1


def ls(args: argparse.Namespace, config: FleetConfig) -> int:
    with Hub.from_config(config, store=args.store) as hub:
        latest = hub.latest()
        rows: list[dict[str, Any]] = []
        for v in hub.versions():
            m = hub.manifest(v)
            encodings: dict[str, int] = {}
            for t in m.tensors:
                encodings[t.encoding] = encodings.get(t.encoding, 0) + 1
            rows.append({"version": v, "anchor": m.anchor, "base": m.base, "latest": v == latest,
                         "bytes": sum(m.objects.values()),
                         "encodings": encodings, "holders": hub.holders(v),
                         "published_at": datetime.datetime.fromtimestamp(m.published_at, datetime.UTC).isoformat()})
    if args.json:
        print(json.dumps(rows))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("version", "anchor", "base", "bytes", "encodings", "holders", "published (UTC)",
                  title=f"{config.run} in {args.store}")
    for r in rows:
        base = "" if r["base"] is None else str(r["base"])  # the base version of a LoRA adapter version
        table.add_row(f"{r['version']}{' *' if r['latest'] else ''}", str(r["anchor"]), base, f"{r['bytes']:,}",
                      " ".join(f"{k}:{n}" for k, n in sorted(r["encodings"].items())), ",".join(r["holders"]),
                      r["published_at"][:19])
    Console().print(table)
    return 0


def gc(args: argparse.Namespace, config: FleetConfig) -> int:
    with Hub.from_config(config, store=args.store) as hub:
        report = hub.gc(dry_run=args.dry_run)
    print(json.dumps({"store": args.store, "dry_run": args.dry_run, "kept_versions": report.kept_versions,
                      "deleted_versions": report.deleted_versions, "deleted_objects": len(report.deleted_objects),
                      "freed_bytes": report.freed_bytes}))
    return 0


def run_replicator(args: argparse.Namespace, config: FleetConfig, on_holding: Holding | None = None,
                   hints: VersionHints | None = None) -> int:
    """The region's replicator daemon: contend for the lease, replicate, drain on SIGTERM. `on_holding`
    hears the newest version the region store holds after each pass (`fleetrl replicator` announces it);
    `hints` carries the versions heard on the control plane (policy and peers' replica announcements)."""
    try:
        config.region(args.region)
    except KeyError as exc:
        raise HubError(str(exc.args[0])) from None
    replicator = Replicator(config, args.region, hints=hints)
    replicator.on_holding = on_holding
    if config.hub.replicator_metrics_port is not None:
        port = replicator.metrics.serve(config.hub.replicator_metrics_port)
        log.info("replicator.metrics", region=args.region, port=port)
    stop = threading.Event()
    bound_s = config.hub.lease_ttl_s

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("replicator.draining", region=args.region, signal=signum, bound_s=bound_s)
        stop.set()
        # Past the bound our lease may be someone else's: leave without writing anything more.
        timer = threading.Timer(bound_s, lambda: os._exit(3))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("replicator.started", region=args.region, holder=replicator.lease.holder)
    with _progress(f"replicate {args.region}", None) as progress:
        replicator.progress = progress
        try:
            replicator.serve(stop, once=args.once)
        finally:
            replicator.metrics.close()
    log.info("replicator.stopped", region=args.region)
    return 0
