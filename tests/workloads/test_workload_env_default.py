"""A record that names its own environment, in a run without `dataset.env`, runs as that environment's
episodes; the prompts after it that name none stay plain completions (the environment used to leak: the
first record's became the default of every later one)."""

from __future__ import annotations

import yaml

from fleetrl.broker import PartialSample, PromptRecord, Sampling
from fleetrl.config import parse_config
from fleetrl.rollout.commits import Committer
from fleetrl.rollout.episode_groups import EpisodeGroups
from fleetrl.rollout.episodes import EpisodeRunner
from fleetrl.rollout.jobs import Job
from fleetrl.rollout.publisher import GroupPublisher
from fleetrl.rollout.rewards import build_rewards
from fleetrl.rollout.scheduling import JobQueue
from fleetrl.rollout.stats import WorkerCounters
from fleetrl.rollout.tasks import get_task
from fleetrl.rollout.tokenize import load_codec
from fleetrl.rollout.torch_engine import TorchEngine


def _job(name: str, env: dict[str, object] | None) -> Job:
    prompt = PromptRecord(group_id=name, run="leak", task="reverse", n_samples=1, sampling=Sampling(), prompt="abc",
                          env=env)
    return Job(None, prompt, [1, 2, 3], None)  # type: ignore[arg-type]


async def test_a_records_environment_does_not_become_the_default_of_later_records() -> None:
    config = parse_config(yaml.safe_dump({"run": "leak", "regions": [{"name": "r1", "kafka": "127.0.0.1:1",
                                                                       "store": "/nonexistent"}]}),
                          source="leak.yaml", env={})
    engine = TorchEngine.from_config(config.model, config.regions[0].engine)
    codec = load_codec(config.model, sorted(engine.eos_ids))
    counters = WorkerCounters()
    publisher = GroupPublisher("r1", "n1", build_rewards(config.reward, get_task), codec, Committer(), counters, None)
    queue = JobQueue(engine, config.rollout, publisher, counters)

    async def no_turns(rid: str, context: list[int], sampling: Sampling) -> PartialSample:
        raise AssertionError("no turn is decoded here")

    groups = EpisodeGroups(config, engine, codec, queue, publisher, counters, no_turns)
    named = _job("named", {"name": "skyrl_envs:LookupEnv", "args": {}})
    named.resolve_env(groups.env_cfg)
    assert named.env is not None and named.env["name"] == "skyrl_envs:LookupEnv"
    assert isinstance(await groups._runner(named), EpisodeRunner)  # it runs as that environment's episodes
    plain = _job("plain", None)
    plain.resolve_env(groups.env_cfg)  # what the intake does with the next record
    assert groups.env_cfg is None and plain.env is None
    engine.close()
