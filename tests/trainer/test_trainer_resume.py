"""SIGKILL the `fleetrl trainer` process mid-step, restart it: the audit finds every group trained once.

The trainer runs as the real daemon (`fleetrl trainer --config fleet.yaml`), fed by a stand-in
rollout region in this process. It is killed twice with SIGKILL (while a step is being taken, and
right after a checkpoint, before its offsets are committed), stopped once with SIGTERM (it must
drain and exit 0), then run to the end; `fleetrl audit` must then pass, and the last checkpoint's
ledger must hold each trained group once.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import sys
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from trainer_groups import HUB_KEY, answer_prompts

from fleetrl.broker import ensure_topics
from fleetrl.config import FleetConfig
from fleetrl.trainer.checkpoint import latest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REGION = "local-a"
STEPS = 6
FLEETRL = [sys.executable, "-m", "fleetrl.cli"]


def _env() -> dict[str, str]:
    return {**os.environ, "FLEETRL_HUB_KEY": HUB_KEY, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


async def _trainer_until(cfg: pathlib.Path, event: str | None, sig: signal.Signals | None,
                         timeout_s: float = 90.0, skip: int = 0, launcher: tuple[str, ...] = (),
                         ) -> tuple[int, list[dict[str, Any]]]:
    """Run the daemon; on the `skip+1`-th log `event`, send `sig`. Returns (exit code, events)."""
    command = [*launcher, "-m", "fleetrl.cli"] if launcher else FLEETRL
    proc = await asyncio.create_subprocess_exec(
        *command, "trainer", "--config", str(cfg), "--steps", str(STEPS), "--log-json",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=_env())
    assert proc.stderr is not None
    events: list[dict[str, Any]] = []
    seen = 0
    try:
        async with asyncio.timeout(timeout_s):
            while line := await proc.stderr.readline():
                try:
                    ev = json.loads(line)
                except ValueError:
                    ev = {"event": "raw", "line": line.decode(errors="replace")}
                events.append(ev)
                if sig is not None and ev.get("event") == event:
                    seen += 1
                    if seen > skip:
                        proc.send_signal(sig)
                        sig = None
            return await proc.wait(), events
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigkill_mid_step_then_restart_trains_every_group_once(
        make_fleet: Callable[..., FleetConfig], tmp_path: pathlib.Path) -> None:
    config = make_fleet(max_staleness=1)
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    await ensure_topics(config, REGION)
    answered: list[str] = []
    finished = asyncio.Event()
    rollout = asyncio.create_task(answer_prompts(config, REGION, finished.is_set, answered))
    try:
        rc, ev = await _trainer_until(cfg, "step.started", signal.SIGKILL, skip=2)  # inside step 3
        assert rc == -signal.SIGKILL
        rc, ev = await _trainer_until(cfg, "checkpoint.saved", signal.SIGKILL)  # before the commit
        assert rc == -signal.SIGKILL and any(e["event"] == "trainer.started" and e["resumed"] for e in ev)
        rc, ev = await _trainer_until(cfg, "step.done", signal.SIGTERM)
        assert rc == 0, ev[-5:]
        assert any(e["event"] == "trainer.drained" for e in ev)
        rc, ev = await _trainer_until(cfg, None, None)
        assert rc == 0, ev[-5:]
    finally:
        finished.set()
        await asyncio.wait_for(rollout, 30)
    ckpt = latest(config.trainer.checkpoint_dir, config.run)
    assert ckpt is not None and ckpt.step == STEPS
    ledger = [row[0] for row in ckpt.state["collector"]["trained"]]
    assert len(ledger) == len(set(ledger)) == STEPS * config.algorithm.groups_per_step
    proc = await asyncio.create_subprocess_exec(
        *FLEETRL, "audit", "--config", str(cfg), "--json", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, env=_env())
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    report = json.loads(out)
    assert proc.returncode == 0, report["problems"]
    assert report["ok"] and not report["lost"] and not report["trained_twice"]
    assert report["trained"] == STEPS * config.algorithm.groups_per_step
    assert report["dispatched"] >= report["trained"]


async def test_daemon_under_torchrun_two_ranks(make_fleet: Callable[..., FleetConfig], tmp_path: pathlib.Path) -> None:
    """`torchrun --nproc-per-node 2 -m fleetrl.cli trainer`: FSDP2 over gloo, rank 0 alone on Kafka and the hub."""
    config = make_fleet()
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    await ensure_topics(config, REGION)
    answered: list[str] = []
    finished = asyncio.Event()
    rollout = asyncio.create_task(answer_prompts(config, REGION, finished.is_set, answered))
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    try:
        rc, ev = await _trainer_until(cfg, None, None, timeout_s=120, launcher=torchrun)
    finally:
        finished.set()
        await asyncio.wait_for(rollout, 30)
    assert rc == 0, [e for e in ev if e.get("level") == "error"] or ev[-5:]
    # Both ranks write one stderr, so two simultaneous events may share a line: count raw text too.
    joined = sum(1 for e in ev if e.get("event") == "dist.joined")
    joined += sum(e["line"].count('"dist.joined"') for e in ev if e.get("event") == "raw")
    assert joined == 2
    published = [e["version"] for e in ev if e.get("event") == "weights.published"]
    assert published == list(range(STEPS + 1))  # the initial weights, then one version per step
    ckpt = latest(config.trainer.checkpoint_dir, config.run)
    assert ckpt is not None and ckpt.step == STEPS
    ledger = [row[0] for row in ckpt.state["collector"]["trained"]]
    assert len(ledger) == len(set(ledger)) == STEPS * config.algorithm.groups_per_step
