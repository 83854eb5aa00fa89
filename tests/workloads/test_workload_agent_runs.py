"""Agent runs (`dataset.env.kind: openai_agent`, rollout/agent_episodes.py) through the endpoint over a real
engine: the recorded sample is the engine's ids turn by turn, with the environment's ids between them
(logprob 0, version -1, source 1); a history rewrite makes a second segment with its own context and no
re-tokenized id; budgets end a run without failing it; an agent that raises fails its group with the
traceback's last line; 64 runs share one engine. The trainer reads a multi-segment sample as one loss
context per segment."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import pytest
from agent_kit import HERE, Served, agent_prompt, agent_runner, serve

from fleetrl.broker import (
    ENV_VERSION,
    SOURCE_ENV,
    SOURCE_POLICY,
    GroupRecord,
    PromptRecord,
    RecordLimits,
    Timings,
    check_record,
    decode_record,
    encode_record,
)
from fleetrl.config import RewardConfig
from fleetrl.rollout.agent_episodes import AgentRunner
from fleetrl.rollout.episodes import EpisodeResult
from fleetrl.rollout.errors import EnvError
from fleetrl.rollout.jobs import Job, group_record
from fleetrl.trainer.batch import build_step_batch


def _runner(s: Served, agent: str, max_turns: int = 8, max_tokens: int = 200,
            reward: RewardConfig | None = None) -> AgentRunner:
    return agent_runner(s, agent, max_turns, max_tokens, reward)


def _prompt(n: int, **columns: object) -> PromptRecord:
    return agent_prompt(n, columns=dict(columns) or None, reference="olleh")


async def test_the_sample_is_the_engines_ids_turn_by_turn(agent_folder: pathlib.Path) -> None:
    async with serve(agent_folder, open_keys=False) as s:
        (res,) = await _runner(s, "three_turns").run_group("g-1", _prompt(1, bonus=0.75), [], {})
    assert res.reward == 0.75 and res.turns == 3
    assert res.contexts is not None and len(res.contexts) == 1  # every call extended the one before
    first_prompt = res.contexts[0][1]
    tokens, lp, ver = list(res.sample.completion_ids), list(res.sample.logprobs), list(res.sample.versions)
    assert len(s.turns) == 3 and s.turns[0][0] == first_prompt
    end = 0
    for prompt, (out,) in s.turns:
        start = len(prompt) - len(first_prompt)
        assert prompt == first_prompt + tokens[:start]  # the engine decoded from exactly the sample so far
        # Between two calls: the environment's ids (the template's end of turn, the next user message).
        assert all(src == SOURCE_ENV for src in res.segments[end:start]) and lp[end:start] == [0.0] * (start - end)
        assert ver[end:start] == [ENV_VERSION] * (start - end)
        end = start + len(out.completion_ids)
        assert tokens[start:end] == [int(t) for t in out.completion_ids]  # the engine's ids, never re-tokenized
        assert lp[start:end] == pytest.approx([float(x) for x in out.logprobs])
        assert ver[start:end] == [int(v) for v in out.versions]
        assert res.segments[start:end] == [SOURCE_POLICY] * (end - start)
    assert end == len(tokens) and start > 0


async def test_a_history_rewrite_makes_a_second_segment(agent_folder: pathlib.Path) -> None:
    async with serve(agent_folder, open_keys=False) as s:
        (res,) = await _runner(s, "rewrite_history").run_group("g-1", _prompt(1), [], {})
        fresh = s.endpoint.template.render([{"role": "user", "content": "Start over: 2 + 2?"}], None)
    (p0, (c0,)), (p1, (c1,)) = s.turns
    assert p1 == fresh  # the new context as the template renders it
    assert res.contexts == [(0, p0), (len(c0.completion_ids), p1)]
    assert list(res.sample.completion_ids) == [int(t) for t in [*c0.completion_ids, *c1.completion_ids]]
    assert set(res.segments) == {SOURCE_POLICY}  # no environment id: nothing joined the two calls
    # On the wire and in the trainer: one sample, two loss contexts with their own prompts, one reward.
    record = _record([res])
    vocab = json.loads((agent_folder / "config.json").read_text())["vocab_size"]
    limits = RecordLimits(vocab_size=vocab, known_tasks=frozenset({"reverse"}))
    back = decode_record(encode_record(record, limits), limits)
    assert isinstance(back, GroupRecord) and back.schema == "fleetrl.group/2"
    ctx = back.samples[0].contexts
    assert ctx is not None and [(at, list(p)) for at, p in ctx] == [(at, list(p)) for at, p in res.contexts]
    batch = build_step_batch([back, _record([res], gid="g-2")], "grpo", version=0)
    inputs = [list(t.input_ids) for t in batch.samples[:2]]
    assert inputs == [p0 + list(c0.completion_ids), p1 + list(c1.completion_ids)]


def _record(results: list[EpisodeResult], gid: str = "g-1") -> GroupRecord:
    job = Job.__new__(Job)
    job.prompt, job.prompt_ids = _prompt(len(results)), [1, 2, 3]
    job.prompt.group_id = gid
    job.received_wall = job.started_wall = 0.0
    record = group_record(job, [r.sample for r in results], [r.reward for r in results], "r1", "n1",
                          sources=[r.segments for r in results], contexts=[r.contexts for r in results])
    record.timings = Timings()
    return record


def test_contexts_out_of_bounds_are_refused() -> None:
    from fleetrl.broker import RecordError, Sample, floats, ids

    limits = RecordLimits(vocab_size=400, known_tasks=frozenset({"reverse"}))
    sample = Sample(ids([5, 6, 7]), floats([-1.0] * 3), ids([0] * 3), reward=1.0, finish_reason="stop",
                    contexts=[(0, ids([1, 2])), (3, ids([4]))])  # the second segment starts past the last token
    record = GroupRecord("g", "r", "reverse", 0, "r1", "n1", ids([1]), [sample])
    with pytest.raises(RecordError) as refused:
        check_record(record, limits)
    assert refused.value.reason == "segment_bound" and refused.value.field == "samples[0].contexts"


async def test_budgets_end_a_run_and_keep_what_it_captured(agent_folder: pathlib.Path) -> None:
    async with serve(agent_folder, open_keys=False) as s:
        by_turns = await _runner(s, "keeps_calling", max_turns=2).run_group("g-1", _prompt(1), [], {})
        by_tokens = await _runner(s, "keeps_calling", max_tokens=30).run_group("g-2", _prompt(1), [], {})
    assert by_turns[0].turns == 2 and by_turns[0].sample.finish_reason == "length" and by_turns[0].reward == 0.25
    assert by_tokens[0].sample.finish_reason == "length" and len(by_tokens[0].sample.completion_ids) <= 30


async def test_an_agent_that_raises_fails_its_group_with_the_last_line(agent_folder: pathlib.Path) -> None:
    async with serve(agent_folder, open_keys=False) as s:
        with pytest.raises(EnvError, match=r"agent_fns:breaks .* raised: ValueError: the agent's own bug"):
            await _runner(s, "breaks").run_group("g-1", _prompt(2), [], {})
        assert s.endpoint.captures == {}  # its keys are gone with it


async def test_a_prompt_over_the_records_bound_is_refused(agent_folder: pathlib.Path) -> None:
    """A recorded call's context travels in the group record: one longer than its bound is a 400 (the
    agent that does not handle it fails its group), never a record the producer would refuse."""
    async with serve(agent_folder, open_keys=False, max_record_prompt=10) as s:
        with pytest.raises(EnvError, match=r"BadRequestError: .*a recorded call.s context holds at most 10"):
            await _runner(s, "three_turns").run_group("g-1", _prompt(1), [], {})
        assert s.turns == []


async def test_none_is_scored_by_the_runs_reward_functions(agent_folder: pathlib.Path) -> None:
    reward = RewardConfig(functions=[{"fn": "reward_fns:length_reward"}], python_path=[str(HERE)])
    async with serve(agent_folder, open_keys=False) as s:
        results = await _runner(s, "leaves_it_to_the_reward", reward=reward).run_group("g-1", _prompt(2), [], {})
        texts = [s.codec.decode(out[0].completion_ids) for _, out in s.turns]
    assert sorted(r.reward for r in results) == sorted(float(len(t)) for t in texts)


async def test_64_agent_runs_share_one_engine(agent_folder: pathlib.Path) -> None:
    async with serve(agent_folder, open_keys=False, max_batch=64) as s:
        running: list[int] = []
        step = s.engine.step

        def step_and_count() -> Any:  # a tap on the real engine: how many samples each step decoded
            running.append(int(s.engine._slots.running))
            return step()

        s.engine.step = step_and_count  # type: ignore[method-assign]
        results = await _runner(s, "three_turns").run_group("g-64", _prompt(64), [], {})
    assert len(results) == 64 and all(r.turns == 3 and len(r.contexts or []) == 1 for r in results)
    assert len(s.turns) == 64 * 3
    assert max(running) >= 32  # the runs' calls shared the continuous batch
    assert len({np.asarray(r.sample.completion_ids).tobytes() for r in results}) > 1
