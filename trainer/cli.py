"""Handlers of the trainer's commands that need nothing from rollout: `fleetrl audit`.

(`fleetrl trainer` is wired in `fleetrl/trainer_cli.py`, which may import the rollout task registry;
this package may not.)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json

from fleetrl.config import FleetConfig
from fleetrl.trainer import checkpoint
from fleetrl.trainer.audit import read_topics, reconcile


def audit(args: argparse.Namespace, config: FleetConfig) -> int:
    """Exit 0 when every dispatched group is accounted for and none was trained twice, else 1."""
    ckpt = checkpoint.latest(config.trainer.checkpoint_dir, config.run)
    view = asyncio.run(read_topics(config, timeout_s=config.kafka.request_timeout_s))
    report = reconcile(view, ckpt.state if ckpt else None, config.run)
    if getattr(args, "json", False):
        print(json.dumps({**dataclasses.asdict(report), "problems": report.problems(),
                          "checkpoint": str(ckpt.path) if ckpt else None}, indent=2))
    else:
        where = f"checkpoint step {report.checkpoint_step}" if ckpt else "no checkpoint"
        print(f"audit of run {config.run!r} ({where}): {report.dispatched} dispatched, {report.trained} trained "
              f"once, {report.stale} stale, {report.dead_lettered} dead-lettered, {report.pending} buffered, "
              f"{report.in_flight} in flight, {report.after_checkpoint} dispatched after the checkpoint")
        for problem in report.problems():
            print(f"PROBLEM: {problem}")
        print("ok" if report.ok else "FAILED")
    return 0 if report.ok else 1
