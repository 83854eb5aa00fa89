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
from fleetrl.trainer.audit import AuditReport, read_topics, reconcile


def audit(args: argparse.Namespace, config: FleetConfig) -> int:
    """Exit 0 when every dispatched group is accounted for and none was trained twice, else 1."""
    ckpt = checkpoint.latest(config.trainer.checkpoint_dir, config.run)
    state = ckpt.state if ckpt else None
    view = asyncio.run(read_topics(config, timeout_s=config.kafka.request_timeout_s, state=state))
    report = reconcile(view, state, config.run)
    if getattr(args, "json", False):
        print(json.dumps({**dataclasses.asdict(report), "problems": report.problems(),
                          "checkpoint": str(ckpt.path) if ckpt else None}, indent=2))
    else:
        where = f"checkpoint step {report.checkpoint_step}" if ckpt else "no checkpoint"
        print(f"audit of run {config.run!r} ({where}): {report.dispatched} dispatched, {report.trained} trained "
              f"once, {report.stale} stale, {report.dead_lettered} dead-lettered, {report.pending} buffered, "
              f"{report.in_flight} in flight, {report.after_checkpoint} dispatched after the checkpoint")
        print(_watermark_line(report))
        e = report.eval
        if e.scheduled or e.after_checkpoint:
            print(f"eval books: {e.scheduled} evaluation(s) scheduled, {e.complete} complete"
                  f"{f' (unfinished: {e.unfinished})' if e.unfinished else ''}; {e.dispatched} eval prompt(s) "
                  f"dispatched, {e.returned} returned once, {e.in_flight} in flight, {e.dead_lettered} "
                  f"dead-lettered, {e.resent} re-sent, {len(e.lost)} lost, {e.after_checkpoint} dispatched after "
                  f"the checkpoint")
        if e.requests:
            print(f"fleetrl eval requests (apart from the books): {e.requests} request(s), {e.request_prompts} eval "
                  f"prompt(s)")
        if report.foreign_prompts:
            print(f"{report.foreign_prompts} prompt record(s) with group ids the trainer never issues (not "
                  f"'{config.run}-<index>'): written by another producer; not counted as dispatched")
        for problem in report.problems():
            print(f"PROBLEM: {problem}")
        print("ok" if report.ok else "FAILED")
    return 0 if report.ok else 1


def _watermark_line(report: AuditReport) -> str:
    """Where the proof starts: the settled watermark per region (lowest and highest partition)."""
    if not report.watermarks:
        return "proved from the beginning of every topic (the checkpoint has no settled watermark)"
    spans = ", ".join(f"{region} offsets {min(marks.values())}..{max(marks.values())} over {len(marks)} partition(s)"
                      for region, marks in sorted(report.watermarks.items()) if marks)
    return (f"proved from the settled watermark on ({spans}); {report.settled_folded} settled group(s) below "
            f"it are kept folded in the ledger, {report.skipped_below_watermark} prompt record(s) below it not read")
