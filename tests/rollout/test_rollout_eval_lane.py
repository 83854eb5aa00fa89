"""Eval prompts on a real worker (tansu, a directory hub): each generated with exactly its pinned version."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import threading

import pytest
import torch
from rollout_testkit import (
    HUB_KEY,
    REGION,
    fleet_dict,
    groups,
    make_config,
    prompts,
    publish_tiny,
    read_stream,
    send_prompts,
    setup_topics,
)
from slowdown import scaled

from fleetrl.broker import SCHEMA_GROUP_V2, EvalTag
from fleetrl.rollout.worker import RolloutWorker
from fleetrl.trainer.eval_book import eval_group_id

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    torch.set_num_threads(1)


async def test_eval_groups_carry_exactly_their_pinned_version_while_newer_ones_land(
    run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path
) -> None:
    """Versions 0 and 1 are in the store; eval prompts pinned to 1 and training prompts arrive together,
    and the trainer (here: a thread) publishes versions 2..6 while they are generated. The training
    groups follow the newest weights; every token of every eval sample carries version 1, and the
    group says which eval it belongs to."""
    data = fleet_dict(run_id, tansu_bootstrap, tmp_path / "store", max_new_tokens=24, max_groups_in_flight=4)
    data["eval"] = {"sets": [{"name": "held", "num_prompts": 4, "samples_per_prompt": 2, "temperature": 1.0}],
                    "every_versions": 1}
    config = make_config(data)
    publish_tiny(config)
    publish_tiny(config, seed=1)
    await setup_topics(config)
    evals = [dataclasses.replace(p, group_id=eval_group_id(run_id, "held", 1, i), min_version=1, n_samples=2,
                                 eval=EvalTag("held", 1))
             for i, p in enumerate(prompts(config, 4, max_new_tokens=24))]
    training = prompts(config, 8, max_new_tokens=24)[4:]
    await send_prompts(config, evals + training)
    published: list[int] = []
    done = threading.Event()

    def publish_more() -> None:  # a trainer publishing newer versions meanwhile
        for seed in range(2, 7):
            if done.is_set():
                return
            published.append(publish_tiny(config, seed=seed))

    worker, stop = RolloutWorker(config, REGION, "n1"), asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    publishing = asyncio.ensure_future(asyncio.to_thread(publish_more))
    loop = asyncio.get_running_loop()
    try:
        deadline = loop.time() + scaled(90)
        while (worker.groups_done < 8 or not publishing.done()) and loop.time() < deadline and not task.done():
            await asyncio.sleep(0.05)
    finally:
        done.set()
        stop.set()
        await asyncio.wait_for(task, timeout=scaled(30))
        await publishing
    assert published == [2, 3, 4, 5, 6]
    out = groups(await read_stream(config, "trajectories", 8, timeout_s=20))
    by_id = {g.group_id: g for g in out}
    assert sorted(by_id) == sorted(p.group_id for p in evals + training)  # none lost, none twice
    for p in evals:
        g = by_id[p.group_id]
        assert g.eval == EvalTag("held", 1) and g.schema == SCHEMA_GROUP_V2 and len(g.samples) == 2
        for s in g.samples:
            assert len(s.versions) == len(s.completion_ids) >= 1
            assert (s.versions == 1).all(), f"{g.group_id}: versions {sorted(set(s.versions.tolist()))}"
    assert worker.eval_lane.groups_done == 4 and worker.eval_lane.version == 1
    assert all(by_id[p.group_id].eval is None for p in training)
    assert worker.engine.version >= 2  # the training engine moved on while the eval lane stayed at 1
