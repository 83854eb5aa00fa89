"""An agent group through real workers and real tansu: the first worker is stopped while each run waits before its
third call; its group goes to `partials` as a `fleetrl.partial/2` carrying each run's two completed calls; the
next worker restarts the runs, whose agent now asks something else at the second call: the first calls are
answered from the capture, the rest decoded live. Its stats count both, the group it publishes holds the first
worker's tokens for the replayed calls, and names the recorded tokens it could not replay (`regenerated`, the
cost report's waste) by the region that sampled them."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import yaml
from slowdown import scaled

from fleetrl.broker import (
    SCHEMA_PARTIAL_V2,
    GroupRecord,
    PartialRecord,
    Producer,
    PromptRecord,
    Sampling,
    ensure_topics,
)
from fleetrl.config import FleetConfig, parse_config
from fleetrl.hub import Hub
from fleetrl.rollout.agent_replay import recorded_calls
from fleetrl.rollout.worker import RolloutWorker

pytestmark = pytest.mark.integration
REGION = "r1"
HERE = pathlib.Path(__file__).parent


def _config(run_id: str, bootstrap: str, store: pathlib.Path, model: pathlib.Path) -> FleetConfig:
    data: dict[str, Any] = {
        "run": run_id, "model": {"path": str(model)},
        "algorithm": {"n_samples": 2, "max_new_tokens": 8},
        "dataset": {"task": "reverse", "max_prompt_tokens": 256,
                    "env": {"kind": "openai_agent", "name": "agent_fns:pauses_in_worker", "python_path": [str(HERE)],
                            "max_turns": 8, "max_episode_tokens": 200, "wall_time_s": 120}},
        "hub": {"home_store": store.as_uri(), "threads": 2, "poll_interval_s": 0.1},
        "kafka": {"partitions": {"prompts": 1, "partials": 1, "trajectories": 1, "dead_letter": 1}},
        "rollout": {"weight_fallback_poll_s": 0.2, "idle_poll_s": 0.1, "handover_timeout_s": 15.0,
                    "stats_interval_s": 0.5},
        "regions": [{"name": REGION, "kafka": bootstrap, "store": store.as_uri(),
                     "engine": {"kind": "torch", "max_batch": 16, "dtype": "bfloat16"}}],
    }
    return parse_config(yaml.safe_dump(data), source="agent-handover-test.yaml", env={})


@pytest.fixture(autouse=True)
def _no_pause() -> Iterator[None]:
    from agent_fns import PAUSE

    yield
    PAUSE.clear()


async def test_an_agent_group_handed_over_is_replayed_by_the_next_worker(
        run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path, agent_folder: pathlib.Path) -> None:
    from agent_fns import PAUSE
    from fleet_testkit import read_stream

    config = _config(run_id, tansu_bootstrap, tmp_path / "store", agent_folder)
    with Hub.from_config(config) as hub:
        hub.publish({k: v.to(torch.bfloat16) for k, v in config.model.build().state_dict().items()})
    await ensure_topics(config, REGION)
    prompt = PromptRecord(group_id=f"{run_id}-a", run=run_id, task="reverse", n_samples=2,
                          sampling=Sampling(max_new_tokens=8), reference="olleh",
                          messages=[{"role": "user", "content": "What is 12 + 7?"}])
    async with Producer(config, REGION, "test-dispatcher") as producer:
        await producer.send("prompts", prompt.group_id, prompt)
    paused: asyncio.Queue[int] = asyncio.Queue()
    PAUSE.update(pause_at=2, paused=paused)
    first, stop = RolloutWorker(config, REGION, "n1"), asyncio.Event()
    task = asyncio.create_task(first.run(stop))
    try:
        for _ in range(2):  # both runs made two calls and wait before their third
            await asyncio.wait_for(paused.get(), scaled(90))
    finally:
        PAUSE.clear()  # the next worker's runs do not pause
        stop.set()
        await asyncio.wait_for(task, timeout=scaled(30))
    assert first.groups_handed_over == 1 and first.episode_tokens_discarded == 0  # nothing was decoding
    (handed,) = await read_stream(config, REGION, "partials", 1, timeout_s=20)
    partial = handed.record
    assert isinstance(partial, PartialRecord) and partial.schema == SCHEMA_PARTIAL_V2
    assert [len(recorded_calls(s, [])) for s in partial.samples] == [2, 2]

    second = RolloutWorker(config, REGION, "n2")
    PAUSE.update(ask_at=1)  # cleared by the fixture below
    stop = asyncio.Event()
    task = asyncio.create_task(second.run(stop))
    try:
        async with asyncio.timeout(scaled(90)):
            while second.groups_done < 1:
                assert not task.done(), "the worker stopped"
                await asyncio.sleep(0.1)
        stats = second.stats()
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=scaled(30))
    calls = [recorded_calls(s, []) for s in partial.samples]
    kept = sum(len(c[0].completion.completion_ids) for c in calls)
    lost = sum(len(c[1].completion.completion_ids) for c in calls)
    assert (stats["agent_calls_replayed"], stats["agent_tokens_replayed"], stats["agent_tokens_regenerated"]) == (
        2, kept, lost)
    endpoint = second.episodes._endpoint
    assert endpoint is not None and endpoint.endpoint.calls == 4  # the second and third calls reached its engine
    (out,) = await read_stream(config, REGION, "trajectories", 1, timeout_s=20)
    group = out.record
    assert isinstance(group, GroupRecord) and group.node == "n2" and group.regenerated == {REGION: lost}
    for c, s in zip(calls, group.samples, strict=True):
        first = c[0].completion
        n = len(first.completion_ids)
        assert s.completion_ids[:n].tolist() == first.completion_ids.tolist()
        assert s.logprobs[:n].tolist() == first.logprobs.tolist() and s.versions[:n].tolist() == first.versions.tolist()
        assert len(s.completion_ids) > n  # and the calls after it, live
