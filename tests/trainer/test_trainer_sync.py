"""`algorithm.mode: sync`, the on-policy baseline, through the real trainer and a real worker.

Everything is real and in this process: tansu, the MQTT broker, a directory hub, the torch engine.
Sync mode must be synchronous in fact, not in name: every trained token was sampled with the
version the step trains from, and no group was being generated while the trainer stepped.
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from slowdown import scaled

from fleetrl.broker import GroupRecord, ensure_topics
from fleetrl.config import AlgorithmConfig, FleetConfig, parse_config
from fleetrl.rollout.worker import RolloutWorker
from fleetrl.trainer.batch import StepBatch
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner, StepStats
from fleetrl.trainer.round_trips import PHASES
from fleetrl.trainer.service import Trainer
from fleetrl.trainer_cli import prompt_source

pytestmark = [pytest.mark.integration]
REGION = "local-a"
STEPS = 4


def _config(run: str, bootstrap: str, mqtt_port: int, tmp: pathlib.Path) -> FleetConfig:
    store = (tmp / "store").as_uri()
    data: dict[str, Any] = {
        "run": run,
        "model": {"tiny": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}},
        "algorithm": {"mode": "sync", "groups_per_step": 4, "n_samples": 4, "lr": 1e-2, "max_new_tokens": 8},
        "dataset": {"task": "reverse"},
        "hub": {"home_store": store, "threads": 1, "poll_interval_s": 0.05},
        "mqtt": {"url": f"mqtt://127.0.0.1:{mqtt_port}"},
        "kafka": {"partitions": {"prompts": 2, "partials": 1, "trajectories": 2, "dead_letter": 1}},
        "rollout": {"weight_fallback_poll_s": 0.1, "max_groups_in_flight": 8},
        "trainer": {"checkpoint_dir": str(tmp / "ckpt"), "checkpoint_every": 2},
        "regions": [{"name": REGION, "kafka": bootstrap, "store": store, "nodes": [{"name": "node-1"}],
                     "engine": {"kind": "torch", "max_batch": 16}}],
    }
    return parse_config(yaml.safe_dump(data), source="sync-test.yaml", env={})


def test_sync_mode_trains_on_policy_and_refuses_a_staleness() -> None:
    assert AlgorithmConfig(mode="sync").max_staleness == 0
    assert AlgorithmConfig(mode="async").max_staleness == 1
    with pytest.raises(ValidationError, match="max_staleness is 2 but mode is sync"):
        AlgorithmConfig(mode="sync", max_staleness=2)


async def test_sync_mode_trains_each_step_on_its_own_version_and_nothing_generates_while_it_steps(
    run_id: str, tansu_bootstrap: str, mqtt_server: Any, tmp_path: pathlib.Path,
) -> None:
    config = _config(run_id, tansu_bootstrap, mqtt_server.port, tmp_path)
    await ensure_topics(config, REGION)
    learner = Learner(config.model, config.algorithm, DistContext())
    trainer = Trainer(config, prompt_source(config), learner)
    trained: list[tuple[int, set[int]]] = []
    arrived: list[GroupRecord] = []
    train_step, offer = learner.train_step, trainer.collector.offer

    def recording_step(batch: StepBatch) -> StepStats:
        trained.append((batch.version, {int(v) for s in batch.samples for v in s.versions}))
        return train_step(batch)

    def recording_offer(record: GroupRecord, version: int) -> Any:
        arrived.append(record)
        return offer(record, version)

    learner.train_step = recording_step  # type: ignore[method-assign]
    trainer.collector.offer = recording_offer  # type: ignore[method-assign]
    stop = asyncio.Event()
    rollout = RolloutWorker(config, REGION, "node-1")
    worker = asyncio.create_task(rollout.run(stop))
    try:
        result = await asyncio.wait_for(trainer.run(max_steps=STEPS), scaled(300))
    finally:
        stop.set()
        await asyncio.wait_for(worker, scaled(60))
    assert result.steps == STEPS and len(trained) == STEPS
    # The worker's engine-busy time (what bench/pipeline.py reads as engine idle) is real and bounded.
    stats = rollout.stats()
    assert 0 < stats["engine_busy_s"] <= stats["uptime_s"], stats
    assert stats["tokens_sampled"] >= sum(len(s.completion_ids) for g in arrived for s in g.samples) > 0
    # Every token of step k was sampled with version k: the step's own version, nothing older or newer.
    assert [versions for _, versions in trained] == [{v} for v, _ in trained], trained
    assert [v for v, _ in trained] == list(range(STEPS))
    assert all(e.lag == 0 for e in trainer.collector.trained)
    # Every trained group's round trip was split into its phases (trainer/round_trips.py).
    m = trainer.metrics.registry
    counts = {ph: m.get_sample_value("fleetrl_trainer_group_round_trip_seconds_count", {"region": REGION, "phase": ph})
              for ph in PHASES}
    assert len(set(counts.values())) == 1 and (counts["wait"] or 0) >= STEPS * config.algorithm.groups_per_step
    # No group was being generated while the trainer stepped (trained and published).
    assert len(arrived) >= STEPS * config.algorithm.groups_per_step
    for g in arrived:
        assert 0 < g.timings.queued <= g.timings.started <= g.timings.finished
        for start, end in result.step_spans:
            assert g.timings.finished <= start or g.timings.started >= end, (g.group_id, g.timings, start, end)
