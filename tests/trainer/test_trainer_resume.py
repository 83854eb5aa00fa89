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
import torch
import yaml
from slowdown import scaled
from trainer_groups import HUB_KEY, answer_prompts

from fleetrl.broker import ensure_topics
from fleetrl.config import FleetConfig, LoraAdapterConfig
from fleetrl.hub import Hub
from fleetrl.trainer.checkpoint import latest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REGION = "local-a"
STEPS = 6
FLEETRL = [sys.executable, "-m", "fleetrl.cli"]


def _env() -> dict[str, str]:
    return {**os.environ, "FLEETRL_HUB_KEY": HUB_KEY, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


async def _trainer_until(cfg: pathlib.Path, event: str | None, sig: signal.Signals | None,
                         timeout_s: float = 180.0, skip: int = 0, launcher: tuple[str, ...] = (),
                         env: dict[str, str] | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Run the daemon; on the `skip+1`-th log `event`, send `sig`. Returns (exit code, events). `timeout_s`
    bounds the run on the reference machine (scaled by the machine's slowdown)."""
    command = [*launcher, "-m", "fleetrl.cli"] if launcher else FLEETRL
    proc = await asyncio.create_subprocess_exec(
        *command, "trainer", "--config", str(cfg), "--steps", str(STEPS), "--log-json",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env={**_env(), **(env or {})})
    assert proc.stderr is not None
    events: list[dict[str, Any]] = []
    seen = 0
    try:
        async with asyncio.timeout(scaled(timeout_s)):
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


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
async def test_sigkill_mid_step_then_restart_trains_every_group_once(
        make_fleet: Callable[..., FleetConfig], tmp_path: pathlib.Path, lora: bool) -> None:
    config = make_fleet(max_staleness=1)
    config.tracking.report_to = ["tensorboard"]  # read back below: no step twice across the kills and crashes
    if lora:  # a LoRA policy: the checkpoints hold its adapter, the hub its base once
        model = config.model.model_copy(update={"lora": LoraAdapterConfig(r=4, target_modules="all-linear")})
        config = config.model_copy(update={"model": model})
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    await ensure_topics(config, REGION)
    answered: list[str] = []
    finished = asyncio.Event()
    rollout = asyncio.create_task(answer_prompts(config, REGION, finished.is_set, answered))
    try:
        rc, ev = await _trainer_until(cfg, "step.started", signal.SIGKILL, skip=2)  # inside step 3
        assert rc == -signal.SIGKILL
        if not lora:  # a step trained, its checkpoint not durable: it is redone, its figures must not show twice
            crash = {"FLEETRL_CRASH_AT": "trainer.checkpoint.weights_written"}
            rc, ev = await _trainer_until(cfg, None, None, env=crash)
            assert rc == -signal.SIGKILL and any(e.get("event") == "crashpoint.hit" for e in ev), ev[-5:]
        rc, ev = await _trainer_until(cfg, "checkpoint.saved", signal.SIGKILL)  # before the commit
        assert rc == -signal.SIGKILL and any(e["event"] == "trainer.started" and e["resumed"] for e in ev)
        rc, ev = await _trainer_until(cfg, "step.done", signal.SIGTERM)
        assert rc == 0, ev[-5:]
        assert any(e["event"] == "trainer.drained" for e in ev)
        rc, ev = await _trainer_until(cfg, None, None)
        assert rc == 0, ev[-5:]
    finally:
        finished.set()
        await asyncio.wait_for(rollout, scaled(30))
    ckpt = latest(config.trainer.checkpoint_dir, config.run)
    assert ckpt is not None and ckpt.step == STEPS
    ledger = [row[0] for row in ckpt.state["collector"]["trained"]]
    assert len(ledger) == len(set(ledger)) == STEPS * config.algorithm.groups_per_step
    proc = await asyncio.create_subprocess_exec(
        *FLEETRL, "audit", "--config", str(cfg), "--json", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, env=_env())
    out, _ = await asyncio.wait_for(proc.communicate(), scaled(60))
    report = json.loads(out)
    assert proc.returncode == 0, report["problems"]
    assert report["ok"] and not report["lost"] and not report["trained_twice"]
    assert report["trained"] == STEPS * config.algorithm.groups_per_step
    assert report["dispatched"] >= report["trained"]
    _one_tensorboard_run_with_every_step_once(config)
    if lora:  # three restarts found the base again: one version of full weights, every other an adapter on it
        with Hub.from_config(config) as hub:
            bases = [v for v in hub.versions() if hub.manifest(v).adapter is None]
            assert bases == [0] and all(hub.manifest(v).base == 0 for v in hub.versions()[1:])
            assert hub.latest() == hub.versions()[-1]


def _one_tensorboard_run_with_every_step_once(config: FleetConfig) -> None:
    """The trainer processes (SIGKILLed, crashed, SIGTERMed, run to the end) wrote one TensorBoard run and one
    metrics.jsonl, each step exactly once: a step's figures leave only once a checkpoint covers it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fleetrl.trainer.tracking import tracking_dir

    folder = tracking_dir(config)
    assert [p.name for p in (folder / "tensorboard").iterdir()] == [config.run]  # the same run, continued
    # Read as TensorBoard reads it: a killed writer may have put a step on disk that its restart sends
    # again (it had not noted it flushed); the restart's `purge_step` hides the older copy. metrics.jsonl,
    # below, is exact: a step released before its checkpoint was durable would show twice there.
    acc = EventAccumulator(str(folder / "tensorboard" / config.run))
    acc.Reload()
    for tag in ("train/loss", "train/reward_mean", "train/grad_norm"):
        assert [e.step for e in acc.Scalars(tag)] == list(range(1, STEPS + 1)), tag
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "table" not in r] == list(range(1, STEPS + 1))


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
        await asyncio.wait_for(rollout, scaled(30))
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


def _store_matches_checkpoint(config: FleetConfig) -> tuple[int, int]:
    """Every version in the store is whole (its manifest verifies, its chain materializes, sha256 per
    tensor), the versions are 0..latest without a gap, and the newest checkpoint's version is either
    in flight (latest + 1) or holds exactly the checkpoint's weights in the publish dtype."""
    ckpt = latest(config.trainer.checkpoint_dir, config.run)
    with Hub.from_config(config) as hub:
        newest = hub.latest()
        assert newest is not None and hub.versions() == list(range(newest + 1))
        for v in range(newest + 1):
            hub.materialize(v)  # raises on any part, digest or sha256 that does not match
        if ckpt is None:  # killed before the first checkpoint: a restart starts over from a new version
            return -1, newest
        version = int(ckpt.state["version"])
        assert version <= newest + 1, (version, newest)
        if version <= newest:
            published = hub.materialize(version)
            model, _ = ckpt.weights()
            for name, master in model.items():
                assert torch.equal(published[name].view(torch.int16), master.to(torch.bfloat16).view(torch.int16)), name
    return version, newest


async def test_sigkill_around_background_publishes_keeps_store_and_checkpoint_consistent(
        make_fleet: Callable[..., FleetConfig], tmp_path: pathlib.Path) -> None:
    """Background publishing: kill while a publish is in flight (right after the step hands it over),
    right after a checkpoint (its version may still be uploading), and right after a version landed
    (the next step is training). Each time the store and the checkpoint agree; the run then ends
    with the audit passing and the newest version holding the final checkpoint's weights."""
    config = make_fleet(max_staleness=1)
    assert config.trainer.publish_in_background
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    await ensure_topics(config, REGION)
    answered: list[str] = []
    finished = asyncio.Event()
    rollout = asyncio.create_task(answer_prompts(config, REGION, finished.is_set, answered))
    try:
        for event, skip in (("step.done", 1), ("checkpoint.saved", 0), ("weights.published", 1)):
            rc, ev = await _trainer_until(cfg, event, signal.SIGKILL, skip=skip)
            assert rc == -signal.SIGKILL, ev[-5:]
            _store_matches_checkpoint(config)
        rc, ev = await _trainer_until(cfg, None, None)
        assert rc == 0, ev[-5:]
        assert any(e["event"] == "trainer.started" and e["resumed"] for e in ev)
    finally:
        finished.set()
        await asyncio.wait_for(rollout, scaled(30))
    version, newest = _store_matches_checkpoint(config)
    assert version == newest  # drained: the last version landed before the last checkpoint
    ckpt = latest(config.trainer.checkpoint_dir, config.run)
    assert ckpt is not None and ckpt.step == STEPS
    proc = await asyncio.create_subprocess_exec(
        *FLEETRL, "audit", "--config", str(cfg), "--json", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, env=_env())
    out, _ = await asyncio.wait_for(proc.communicate(), scaled(60))
    report = json.loads(out)
    assert proc.returncode == 0 and report["ok"], report["problems"]
    assert report["trained"] == STEPS * config.algorithm.groups_per_step and not report["trained_twice"]


async def test_a_start_killed_before_its_first_checkpoint_takes_its_version_up_again(
        make_fleet: Callable[..., FleetConfig], tmp_path: pathlib.Path) -> None:
    """Killed right after announcing version 0 (no checkpoint yet): the restart finds the store's newest
    version holding exactly its initial weights and adopts it instead of publishing version 1, which
    would make every group generated with version 0 stale. Then it trains to the end."""
    config = make_fleet(max_staleness=1)
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    await ensure_topics(config, REGION)
    answered: list[str] = []
    finished = asyncio.Event()
    rollout = asyncio.create_task(answer_prompts(config, REGION, finished.is_set, answered))
    try:
        rc, ev = await _trainer_until(cfg, None, None, env={"FLEETRL_CRASH_AT": "trainer.publish.announced"})
        assert rc == -signal.SIGKILL and any(e.get("event") == "crashpoint.hit" for e in ev), ev[-5:]
        assert latest(config.trainer.checkpoint_dir, config.run) is None
        rc, ev = await _trainer_until(cfg, None, None)
        assert rc == 0, ev[-5:]
    finally:
        finished.set()
        await asyncio.wait_for(rollout, scaled(30))
    started = next(e for e in ev if e["event"] == "trainer.started")
    assert started["version"] == 0 and not started["resumed"]
    published = [e["version"] for e in ev if e["event"] == "weights.published"]
    assert published == list(range(1, STEPS + 1))  # version 0 was not published again
    version, newest = _store_matches_checkpoint(config)
    assert version == newest == STEPS
