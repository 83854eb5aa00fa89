"""verifiers environments (`dataset.env.kind: verifiers`, rollout/verifiers_env.py): environments built here from
verifiers' own classes (tests/workloads/vf_envs: a taskset, a task with a rubric of weighted `@vf.reward`s, an
in-process `vf.Harness`), loaded through `verifiers.v1.load_environment`, their episodes run against the agent
endpoint over a real engine. Each sample is the engine's ids call by call (the capture of rollout/agent_capture.py,
through verifiers' interception server), and its reward is the rubric's score of the completion the capture
holds. Their taskset becomes the run's prompts through the dataset loader; a worker on real tansu runs the
tool-using one end to end; `fleetrl config check` refuses a module that does not load, naming it."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import pathlib
from typing import Any

import pytest
import yaml
from agent_kit import Served, serve
from slowdown import scaled

from fleetrl.broker import SOURCE_ENV, SOURCE_POLICY, PromptRecord, Sampling
from fleetrl.config import ConfigError, EnvConfig, FleetConfig, parse_config
from fleetrl.rollout.episodes import EpisodeResult

pytest.importorskip("verifiers.v1", reason="needs the `verifiers` extra (pip install 'fleetrl[verifiers]')")
ENVS = pathlib.Path(__file__).parent / "vf_envs"
LOCAL = {"agent": {"runtime": {"type": "subprocess"}}}
"""The harness runs here (verifiers' default runtime is a Prime sandbox, which needs an account and the network)."""


def _rubric(reply: str, answer: str) -> float:
    """The test environments' rubric, recomputed (the module is importable once an environment was loaded)."""
    import vf_single

    return float(vf_single.rubric(reply, answer))


def _env_cfg(name: str, **config: Any) -> EnvConfig:
    config = {**config, "agent": {**LOCAL["agent"], **config.get("agent", {})}}
    return EnvConfig(kind="verifiers", name=name, python_path=[str(ENVS)], config=config, max_turns=4,
                     wall_time_s=120.0)


def _fleet(name: str, model: pathlib.Path, **extra: Any) -> dict[str, Any]:
    return {"run": "vf-test", "model": {"path": str(model)},
            "algorithm": {"n_samples": 3, "max_new_tokens": 6},
            "dataset": {"task": "sums", "max_prompt_tokens": 128,
                        "env": {"kind": "verifiers", "name": name, "python_path": [str(ENVS)], "config": LOCAL,
                                **extra}},
            "regions": [{"name": "r1", "kafka": "127.0.0.1:1", "store": "/nonexistent",
                         "engine": {"kind": "torch", "max_batch": 16, "dtype": "bfloat16"}}]}


def _record(env: Any, idx: int, n: int) -> PromptRecord:
    """The record the dispatcher sends for the taskset's task `idx` (its row through the dataset loader)."""
    from fleetrl.rollout.verifiers_env import TASK_COLUMN, taskset_rows

    row = taskset_rows(env, "vf")[idx]
    return PromptRecord(group_id=f"g-{idx}", run="vf-test", task="sums", n_samples=n,
                        sampling=Sampling(max_new_tokens=6), messages=row["prompt"],
                        columns={TASK_COLUMN: row[TASK_COLUMN]})


async def _run(s: Served, cfg: EnvConfig, record: PromptRecord) -> list[EpisodeResult]:
    from fleetrl.rollout.verifiers_env import VerifiersRunner, load_verifiers_env

    runner = VerifiersRunner(cfg, load_verifiers_env(cfg), s.server, max_tokens=64)
    return await runner.run_group(record.group_id, record, [], {})


def _completions(res: EpisodeResult) -> list[list[int]]:
    """The sample's model calls: each run of policy tokens."""
    tokens = [int(t) for t in res.sample.completion_ids]
    out: list[list[int]] = []
    for src, run in itertools.groupby(zip(tokens, res.segments, strict=True), key=lambda p: p[1]):
        if src == SOURCE_POLICY:
            out.append([t for t, _ in run])
    return out


def _answers(s: Served) -> list[list[int]]:
    return [[int(t) for t in out[0].completion_ids] for _, out in s.turns]


async def test_single_turn_rewards_are_the_rubrics_and_ids_the_engines(agent_folder: pathlib.Path) -> None:
    from fleetrl.rollout.verifiers_env import load_verifiers_env

    cfg = _env_cfg("vf_single")
    env = load_verifiers_env(cfg)
    record = _record(env, 2, n=4)
    async with serve(agent_folder, open_keys=False) as s:
        results = await _run(s, cfg, record)
    assert len(results) == 4 and len(s.turns) == 4  # one call per episode, each decoded by the engine
    answers = _answers(s)
    for res in results:
        assert res.turns == 1 and res.contexts is not None and len(res.contexts) == 1
        assert set(res.segments) == {SOURCE_POLICY}
        (ids,) = _completions(res)
        assert ids in answers  # the engine's ids, never re-tokenized
        assert res.sample.logprobs.tolist() == pytest.approx(
            [float(x) for x in s.turns[answers.index(ids)][1][0].logprobs])
        reply = s.codec.decode(ids).strip()
        assert res.reward == pytest.approx(_rubric(reply, "16"))  # task 2: 5 + 8
    assert len({r.reward for r in results}) > 1 or len({tuple(_completions(r)[0]) for r in results}) == 1


async def test_a_tool_using_environment_keeps_the_tool_result_out_of_the_loss(agent_folder: pathlib.Path) -> None:
    from fleetrl.rollout.verifiers_env import load_verifiers_env

    cfg = _env_cfg("vf_tools", agent={"harness": {"id": "vf_tools", "max_tokens": 5}})
    env = load_verifiers_env(cfg)
    record = _record(env, 0, n=2)
    async with serve(agent_folder, open_keys=False) as s:
        results = await _run(s, cfg, record)
    answers = _answers(s)
    assert len(s.turns) == 4  # two calls per episode
    for res in results:
        assert res.turns == 2 and res.contexts is not None and len(res.contexts) == 1  # the second call extends
        first, second = _completions(res)
        assert first in answers and second in answers and len(first) <= 5
        env_ids = [t for t, src in zip(res.sample.completion_ids.tolist(), res.segments, strict=True)
                   if src == SOURCE_ENV]
        said = s.codec.decode_all(env_ids)
        assert "The calculator says 7." in said or "<tool_response>" in said  # what the harness wrote back
        start = len(first) + len(env_ids)
        assert res.sample.logprobs.tolist()[len(first):start] == [0.0] * len(env_ids)
        assert res.reward == pytest.approx(_rubric(s.codec.decode(second).strip(), "7"))


async def test_an_episode_that_fails_fails_its_group_with_verifiers_error(agent_folder: pathlib.Path) -> None:
    from fleetrl.rollout.errors import EnvError
    from fleetrl.rollout.verifiers_env import load_verifiers_env

    cfg = _env_cfg("vf_single", agent={"harness": {"id": "vf_failing"}})
    record = _record(load_verifiers_env(cfg), 0, n=2)
    async with serve(agent_folder, open_keys=False) as s:
        with pytest.raises(EnvError, match=r"vf_single \(g-0#\d\) failed: .*the harness's own bug"):
            await _run(s, cfg, record)
        assert not s.endpoint.captures  # every sample's key is gone with its episode


def test_a_dataset_row_becomes_a_task_of_the_taskset() -> None:
    from fleetrl.rollout.verifiers_env import load_verifiers_env, task_of

    env = load_verifiers_env(_env_cfg("vf_single"))
    ask = [{"role": "user", "content": "What is 1 + 2?"}]
    record = PromptRecord(group_id="g-9", run="vf-test", task="sums", n_samples=1, sampling=Sampling(),
                          messages=ask, columns={"answer": "3", "difficulty": "easy"})
    task = task_of(env, record)
    assert type(task).__name__ == "SumTask" and task.data.answer == "3" and task.data.prompt_text == "What is 1 + 2?"
    with pytest.raises(Exception, match=r"record g-9: not a task of SumData.*answer"):
        task_of(env, dataclasses.replace(record, columns={"difficulty": "easy"}))


def test_the_taskset_becomes_the_runs_prompts(agent_folder: pathlib.Path) -> None:
    from fleetrl.trainer_cli import prompt_source

    config = parse_config(yaml.safe_dump(_fleet("vf_single", agent_folder, config={**LOCAL, "taskset": {"count": 3}})),
                          source="vf.yaml", env={})
    items = list(prompt_source(config)())
    assert [i.messages for i in items] == [
        [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": f"What is {a} + {b}?"}]
        for a, b in [(3, 4), (4, 6), (5, 8)]]
    assert all(i.task == "sums" and set(i.columns or {}) == {"verifiers_task"} for i in items)


def test_config_check_refuses_an_environment_that_does_not_load(agent_folder: pathlib.Path,
                                                               tmp_path: pathlib.Path) -> None:
    from fleetrl.workload import check_workload

    (tmp_path / "vf_broken.py").write_text("raise RuntimeError('the module is broken')\n")
    data = _fleet("vf_broken", agent_folder)
    data["dataset"]["env"]["python_path"].append(str(tmp_path))
    with pytest.raises(ConfigError, match=r"dataset\.env\.name.*vf_broken.*the module is broken"):
        check_workload(parse_config(yaml.safe_dump(data), source="vf.yaml", env={}), "vf.yaml")
    for bad, field in [({"name": "vf_single:run"}, "not a function"), ({"config": {"taskset": {"id": "x"}}},
                                                                        "config.taskset.id")]:
        data = _fleet("vf_single", agent_folder)
        data["dataset"]["env"].update(bad)
        with pytest.raises(ConfigError, match=field):
            parse_config(yaml.safe_dump(data), source="vf.yaml", env={})
    check_workload(parse_config(yaml.safe_dump(_fleet("vf_tools", agent_folder)), source="vf.yaml", env={}),
                   "vf.yaml")


@pytest.mark.integration
async def test_a_worker_runs_a_verifiers_environment_end_to_end(
        run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path, agent_folder: pathlib.Path) -> None:
    import torch
    from fleet_testkit import read_stream

    from fleetrl.broker import GroupRecord, Producer, ensure_topics
    from fleetrl.hub import Hub
    from fleetrl.rollout.verifiers_env import load_verifiers_env
    from fleetrl.rollout.worker import RolloutWorker

    data = _fleet("vf_tools", agent_folder, max_episode_tokens=64)
    data.update(run=run_id, hub={"home_store": (tmp_path / "store").as_uri(), "threads": 2, "poll_interval_s": 0.1},
                kafka={"partitions": {"prompts": 1, "partials": 1, "trajectories": 1, "dead_letter": 1}},
                rollout={"weight_fallback_poll_s": 0.2, "idle_poll_s": 0.1, "stats_interval_s": 0.5})
    data["regions"][0].update(kafka=tansu_bootstrap, store=(tmp_path / "store").as_uri())
    config: FleetConfig = parse_config(yaml.safe_dump(data), source="vf.yaml", env={})
    with Hub.from_config(config) as hub:
        hub.publish({k: v.to(torch.bfloat16) for k, v in config.model.build().state_dict().items()})
    await ensure_topics(config, "r1")
    assert config.dataset.env is not None
    record = _record(load_verifiers_env(config.dataset.env), 1, n=3)
    record = dataclasses.replace(record, group_id=f"{run_id}-g1", run=run_id)
    async with Producer(config, "r1", "test-dispatcher") as producer:
        await producer.send("prompts", record.group_id, record)
    worker, stop = RolloutWorker(config, "r1", "n1"), asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        async with asyncio.timeout(scaled(120)):
            while worker.groups_done + sum(worker.dead_lettered.values()) < 1:
                assert not task.done(), "the worker stopped"
                await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=scaled(30))
    assert worker.groups_done == 1, worker.dead_lettered
    (group,) = [d.record for d in await read_stream(config, "r1", "trajectories", 1, timeout_s=20)]
    assert isinstance(group, GroupRecord) and group.schema == "fleetrl.group/2" and len(group.samples) == 3
    codec = worker.codec
    for sample in group.samples:
        assert sample.segments is not None and [src for _, src in sample.segments.tolist()] == [
            SOURCE_POLICY, SOURCE_ENV, SOURCE_POLICY]  # the first call, the tool's result, the answer
        assert sample.contexts is not None and len(sample.contexts) == 1
        last = _last_policy_run(sample)
        assert sample.reward == pytest.approx(_rubric(codec.decode(last).strip(), "10"))  # 4 + 6


def _last_policy_run(sample: Any) -> list[int]:
    """The ids of the sample's last model call (after its last environment run)."""
    begin, source = sample.segments.tolist()[-1]  # (first token, source) pairs
    assert source == SOURCE_POLICY
    return [int(t) for t in sample.completion_ids.tolist()[begin:]]
