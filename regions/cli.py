"""`fleetrl agent --config fleet.yaml --region R --node N [--notice-file PATH]`: the region agent daemon.

The config is parsed and the node's identity checked before torch is imported; a bad identity exits 2,
any other fatal error 1, each with one line on stderr. SIGTERM, SIGINT, a `stop` command, the region's
preemption notice source (`regions[].preemption`: aws, gcp, azure or file) or the `--notice-file`
appearing end the agent with exit 0 after the handover (see `fleetrl.regions.agent`). Leaving is
bounded: tasks or threads still there 10 s after the agent stopped are logged and abandoned
(`fleetrl.runtime.run_daemon`).
"""

from __future__ import annotations

import argparse
import sys

from fleetrl.config import FleetConfig
from fleetrl.regions.errors import AgentConfigError
from fleetrl.regions.identity import check_identity
from fleetrl.runtime import run_daemon


def run_agent(args: argparse.Namespace, config: FleetConfig) -> int:
    try:
        check_identity(config, args.region, args.node)
    except AgentConfigError as exc:
        print(f"fleetrl agent: {exc}", file=sys.stderr)
        return 2
    try:
        run_daemon(_serve(config, args.config, args.region, args.node, getattr(args, "notice_file", None)), "agent")
    except Exception as exc:  # the one place that turns a fatal error into one line
        if getattr(args, "debug", False):
            raise
        print(f"fleetrl agent: fatal: {args.region}/{args.node}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(config: FleetConfig, config_path: str, region: str, node: str, notice_file: str | None) -> None:
    from fleetrl.regions.agent import RegionAgent
    from fleetrl.regions.cloud_notices import watchers_from_config
    from fleetrl.regions.preemption import NoticeFileWatcher, PreemptionWatcher, SignalWatcher

    watchers: list[PreemptionWatcher] = [SignalWatcher(), *watchers_from_config(config.region(region).preemption)]
    if notice_file:
        watchers.append(NoticeFileWatcher(notice_file))
    await RegionAgent(config, region, node, watchers=watchers, config_path=config_path).run()
