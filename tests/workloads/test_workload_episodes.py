"""Episodes through a real worker against real tansu: skyrl-gym environments run unchanged (the library's
own single-turn `gsm8k` and multi-turn `gsm8k_multi_turn`, a guessing game and a tool environment written
against its API in skyrl_envs.py); every token the trainer learns is the engine's, turn by turn, or the
chat template's rendering of an environment turn (marked in `segments`); a raising tool and a hanging
tool end their episodes with the failure reward (or dead-letter the group with `env_error`) while the
worker goes on.

The hanging tool hangs until the test lets it go, once the other groups are done: they finish while it
hangs by construction, however slow the machine. Where `env.tool_timeout_s` is not what a test checks it
is generous (an ordinary step never reaches it); the short timeout is tested on a group of its own."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from slowdown import scaled

from fleetrl.broker import SOURCE_ENV, GroupRecord, PartialSample, Producer, PromptRecord, Sampling, ensure_topics
from fleetrl.config import FleetConfig, parse_config
from fleetrl.hub import Hub
from fleetrl.rollout.episodes import TurnTemplate
from fleetrl.rollout.worker import RolloutWorker

pytestmark = pytest.mark.integration
REGION = "r1"
HERE = pathlib.Path(__file__).parent
TURN_TOKENS = 6
GENEROUS_TOOL_TIMEOUT_S = scaled(60.0)  # only a hang reaches it: scaled like the tests' own hang bounds


@pytest.fixture(autouse=True)
def _hanging_tool() -> Iterator[None]:
    """The hanging tool hangs until a test lets it go; whatever a test did, it goes at the end."""
    from skyrl_envs import RELEASE

    RELEASE.clear()
    yield
    RELEASE.set()


def _config(run_id: str, bootstrap: str, store: pathlib.Path, model: pathlib.Path, on_error: str,
            tool_timeout_s: float = GENEROUS_TOOL_TIMEOUT_S) -> FleetConfig:
    data: dict[str, Any] = {
        "run": run_id,
        "model": {"path": str(model)},
        "algorithm": {"n_samples": 2, "max_new_tokens": 64},
        "dataset": {"task": "tools", "max_prompt_tokens": 64,
                    "env": {"name": "skyrl_envs:LookupEnv", "python_path": [str(HERE)], "max_turns": 3,
                            "max_episode_tokens": 200, "tool_timeout_s": tool_timeout_s, "on_error": on_error,
                            "failure_reward": -1.0, "config": {"max_turns": 3}}},
        "hub": {"home_store": store.as_uri(), "threads": 2, "poll_interval_s": 0.1},
        "kafka": {"partitions": {"prompts": 2, "partials": 1, "trajectories": 2, "dead_letter": 1}},
        "rollout": {"weight_fallback_poll_s": 0.2, "idle_poll_s": 0.1, "handover_timeout_s": 15.0,
                    "stats_interval_s": 0.5},
        "regions": [{"name": REGION, "kafka": bootstrap, "store": store.as_uri(),
                     "engine": {"kind": "torch", "max_batch": 16, "dtype": "bfloat16"}}],
    }
    return parse_config(yaml.safe_dump(data), source="episodes-test.yaml", env={})


def _publish_folder(config: FleetConfig) -> None:
    state = {k: v.to(torch.bfloat16) for k, v in config.model.build().state_dict().items()}
    with Hub.from_config(config) as hub:
        hub.publish(state)


def _prompt(config: FleetConfig, name: str, env: dict[str, Any] | None, mode: str = "ok",
            reference: str = "7") -> PromptRecord:
    return PromptRecord(group_id=f"{config.run}-{name}", run=config.run, task="tools", n_samples=2,
                        sampling=Sampling(max_new_tokens=TURN_TOKENS), reference=reference, env=env,
                        messages=[{"role": "user", "content": f"Play {name}."}], columns={"tool_mode": mode})


async def _run(worker: RolloutWorker, expected: int, release_at: int | None = None) -> None:
    """Run `worker` until `expected` groups are done or dead-lettered. With `release_at`: let the hanging
    tool go once that many are, and not before (the hanging group cannot end until then)."""
    from skyrl_envs import RELEASE

    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        async with asyncio.timeout(scaled(90)):
            while (ended := worker.groups_done + sum(worker.dead_lettered.values())) < expected:
                assert not task.done(), "the worker stopped"
                if release_at is not None and ended >= release_at and not RELEASE.is_set():
                    assert ended == release_at, "the hanging group ended before the test let its tool go"
                    RELEASE.set()
                await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=scaled(30))


def _record_turns(worker: RolloutWorker) -> dict[str, list[tuple[list[int], PartialSample]]]:
    """Every model turn the engine decoded, by episode: (context ids it decoded from, what it sampled)."""
    turns: dict[str, list[tuple[list[int], PartialSample]]] = {}
    generate = worker._generate_turn

    async def spy(request_id: str, context: list[int], sampling: Sampling) -> PartialSample:
        out = await generate(request_id, context, sampling)
        turns.setdefault(request_id.rsplit("#", 1)[0], []).append((list(context), out))
        return out

    worker._generate_turn = spy  # type: ignore[method-assign]
    return turns


async def test_skyrl_environments_run_token_exact_episodes_and_failing_tools_end_theirs(
        run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path, qwen2_folder: pathlib.Path) -> None:
    from fleet_testkit import read_stream

    config = _config(run_id, tansu_bootstrap, tmp_path / "store", qwen2_folder, "failure_reward")
    _publish_folder(config)
    await ensure_topics(config, REGION)
    guess = {"name": "skyrl_envs:GuessGame", "args": {"max_turns": 3}}
    sent = [
        _prompt(config, "single", {"name": "gsm8k"}),  # skyrl-gym's own, unchanged
        _prompt(config, "gsm8k-multi", {"name": "gsm8k_multi_turn", "args": {}}),  # skyrl-gym's own
        _prompt(config, "guess", guess),
        _prompt(config, "tool", None),  # dataset.env
        _prompt(config, "raise", None, mode="raise"),
        _prompt(config, "hang", None, mode="hang"),
    ]
    async with Producer(config, REGION, "test-dispatcher") as producer:
        for r in sent:
            await producer.send("prompts", r.group_id, r)
    worker = RolloutWorker(config, REGION, "n1")
    turns = _record_turns(worker)
    await _run(worker, len(sent), release_at=len(sent) - 1)  # the engine went on while the tool hung
    assert worker.groups_done == len(sent) and not worker.dead_lettered
    assert worker.episodes_failed == 4  # the raising and the hanging tool's episodes, 2 each

    out = {d.record.group_id.removeprefix(f"{run_id}-"): d.record
           for d in await read_stream(config, REGION, "trajectories", len(sent), timeout_s=20)}
    assert all(isinstance(g, GroupRecord) and g.schema == "fleetrl.group/2" for g in out.values())
    template = TurnTemplate(worker.codec, sorted(worker.engine.eos_ids))
    n_turns: dict[str, int | tuple[int, int]] = {"single": 1, "gsm8k-multi": (1, 3), "guess": (1, 3), "tool": 3,
                                                 "raise": 1, "hang": 1}
    for name, g in out.items():
        assert isinstance(g, GroupRecord)
        for i, s in enumerate(g.samples):
            episode = turns[f"{g.group_id}#{i}"]
            want = n_turns[name]
            assert len(episode) == want if isinstance(want, int) else want[0] <= len(episode) <= want[1]
            _assert_token_exact(g, s, episode, template)
            if name in ("raise", "hang"):
                assert s.reward == -1.0 and s.finish_reason == "abort"
            elif name == "tool":
                assert s.reward == 1.5 and s.finish_reason in ("stop", "length")  # 0.5 per tool call
                env_text = worker.codec.decode_all(s.completion_ids[s.sources() == SOURCE_ENV])
                assert "<result>value of" in env_text and "tool" in env_text  # the tool's answer, as a tool turn
    for name in ("gsm8k-multi", "guess"):  # multi-turn: the environment answered and the model went on
        assert max(len(turns[f"{run_id}-{name}#{i}"]) for i in range(2)) >= 2
    # The engine never waited on the hanging tool: the other groups, turns and all, finished meanwhile.
    assert max(g.timings.finished for n, g in out.items() if n != "hang") < out["hang"].timings.finished


def _assert_token_exact(g: GroupRecord, s: Any, episode: list[tuple[list[int], PartialSample]],
                        template: TurnTemplate) -> None:
    """The record is the engine's turns, exactly, with the template's environment turns between them."""
    prompt = g.prompt_ids.tolist()
    completion = s.completion_ids.tolist()
    src = s.sources()
    at = 0
    for t, (context, out) in enumerate(episode):
        assert context == prompt + completion[:at]  # each turn decoded from exactly the ids so far
        n = len(out.completion_ids)
        assert completion[at:at + n] == out.completion_ids.tolist()  # ... and its ids are the engine's
        assert np.array_equal(s.logprobs[at:at + n], out.logprobs)
        assert (src[at:at + n] == 0).all() and (s.versions[at:at + n] >= 0).all()
        at += n
        if t + 1 < len(episode):  # an environment turn follows: logprob 0, version -1
            nxt = len(episode[t + 1][0]) - len(prompt)
            assert (src[at:nxt] == SOURCE_ENV).all() and nxt > at
            assert (s.logprobs[at:nxt] == 0).all() and (s.versions[at:nxt] == -1).all()
            at = nxt
    # An environment turn cut by the episode's token budget may end the sample.
    assert at == len(completion) or (s.finish_reason == "length" and (src[at:] == SOURCE_ENV).all())


async def test_env_errors_dead_letter_the_group_when_configured(
        run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path, qwen2_folder: pathlib.Path) -> None:
    from fleet_testkit import read_stream

    config = _config(run_id, tansu_bootstrap, tmp_path / "store", qwen2_folder, "dead_letter")
    _publish_folder(config)
    await ensure_topics(config, REGION)
    sent = [_prompt(config, "raise", None, mode="raise"), _prompt(config, "hang", None, mode="hang"),
            _prompt(config, "unknown", {"name": "no_such_env"}), _prompt(config, "tool", None)]
    async with Producer(config, REGION, "test-dispatcher") as producer:
        for r in sent:
            await producer.send("prompts", r.group_id, r)
    worker = RolloutWorker(config, REGION, "n1")
    await _run(worker, len(sent), release_at=len(sent) - 1)
    assert worker.groups_done == 1 and worker.dead_lettered == {"env_error": 3}
    out = await read_stream(config, REGION, "trajectories", 1, timeout_s=20)
    assert [d.record.group_id for d in out] == [f"{run_id}-tool"]
    from fleetrl.broker import read_dead_letters

    reasons = {d.key.decode() if d.key else "": d.message for d in await read_dead_letters(config, REGION)}
    assert "KeyError" in reasons[f"{run_id}-raise"]
    assert "RuntimeError: the lookup of" in reasons[f"{run_id}-hang"]  # a tool error, after the others ended
    assert "not a skyrl-gym environment id" in reasons[f"{run_id}-unknown"]


@pytest.mark.parametrize("on_error", ["failure_reward", "dead_letter"])
async def test_tool_timeout_ends_a_hanging_tools_episodes(
        on_error: str, run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path, qwen2_folder: pathlib.Path) -> None:
    """`env.tool_timeout_s` bounds an environment call: a tool that never returns (the test lets it go only
    at the end) ends its episodes with the failure reward, or dead-letters its group. The group runs alone,
    so the short timeout races nothing: whichever call of its episodes it cuts, the outcome is the same."""
    from fleet_testkit import read_stream
    from structlog.testing import capture_logs

    from fleetrl.broker import read_dead_letters

    config = _config(run_id, tansu_bootstrap, tmp_path / "store", qwen2_folder, on_error, tool_timeout_s=1.0)
    _publish_folder(config)
    await ensure_topics(config, REGION)
    hang = _prompt(config, "hang", None, mode="hang")
    async with Producer(config, REGION, "test-dispatcher") as producer:
        await producer.send("prompts", hang.group_id, hang)
    worker = RolloutWorker(config, REGION, "n1")
    with capture_logs() as logs:
        await _run(worker, 1)
    if on_error == "dead_letter":
        assert worker.groups_done == 0 and worker.dead_lettered == {"env_error": 1}
        reasons = {d.key.decode() if d.key else "": d.message for d in await read_dead_letters(config, REGION)}
        assert "timed out after 1.0s (env.tool_timeout_s)" in reasons[hang.group_id]
        return
    assert worker.groups_done == 1 and not worker.dead_lettered and worker.episodes_failed == 2
    failed = [e["error"] for e in logs if e["event"] == "worker.episode_failed"]
    assert len(failed) == 2 and all("timed out after 1.0s (env.tool_timeout_s)" in e for e in failed)
    (g,) = [d.record for d in await read_stream(config, REGION, "trajectories", 1, timeout_s=20)]
    assert isinstance(g, GroupRecord) and g.group_id == hang.group_id
    assert all(s.reward == -1.0 and s.finish_reason == "abort" for s in g.samples)


async def test_episode_handed_over_mid_way_restarts_on_another_worker(
        run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path, qwen2_folder: pathlib.Path) -> None:
    """A worker stopped mid-episode hands the group over; the next worker plays its episodes again from the
    start (skyrl-gym environments cannot replay a transcript) and the first counts the tokens it gave up."""
    from fleet_testkit import read_stream

    config = _config(run_id, tansu_bootstrap, tmp_path / "store", qwen2_folder, "failure_reward")
    _publish_folder(config)
    await ensure_topics(config, REGION)
    slow = _prompt(config, "slow", {"name": "skyrl_envs:GuessGame", "args": {"max_turns": 3, "delay_s": 0.4}},
                   reference="no such guess")
    async with Producer(config, REGION, "test-dispatcher") as producer:
        await producer.send("prompts", slow.group_id, slow)
    first, stop = RolloutWorker(config, REGION, "n1"), asyncio.Event()
    turns = _record_turns(first)
    task = asyncio.create_task(first.run(stop))
    try:
        async with asyncio.timeout(scaled(60)):  # mid-episode: a model turn done, the game's answer awaited
            while not turns:
                assert not task.done(), "the worker stopped"
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=scaled(30))
    assert first.groups_handed_over == 1 and first.groups_done == 0
    assert first.episode_tokens_discarded >= sum(len(out.completion_ids) for e in turns.values() for _, out in e) > 0

    second = RolloutWorker(config, REGION, "n2")
    again = _record_turns(second)
    await _run(second, 1)
    out = await read_stream(config, REGION, "trajectories", 1, timeout_s=20)
    assert len(out) == 1 and isinstance(out[0].record, GroupRecord)
    g = out[0].record
    assert g.node == "n2" and g.group_id == slow.group_id
    for i, s in enumerate(g.samples):  # every episode played again in full: 3 turns, token-exact
        assert len(again[f"{g.group_id}#{i}"]) == 3
        _assert_token_exact(g, s, again[f"{g.group_id}#{i}"], TurnTemplate(second.codec, sorted(second.engine.eos_ids)))
