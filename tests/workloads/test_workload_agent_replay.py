"""An agent run handed over mid-episode and replayed from its capture (rollout/agent_replay.py, docs/agents.md).

A run captured on one worker's endpoint (a real engine, the real `openai` SDK) is cancelled between two calls,
as a preempted worker's runs are; its completed calls leave as a `fleetrl.partial/2` (through the codec), and a
second worker (its own engine) restarts the agent with those calls answered from the capture: they never reach
its engine, the sample keeps the first worker's ids, logprobs and versions for them, and the run goes on live.
An agent that asks something else at a replayed call goes live from there; a run that had finished replays
in full with no engine work. The calls of a capture are split at the environment's ids and at each new context;
a replay goes live for good at the first call it cannot answer (another prompt, n > 1, a smaller max_tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib

import numpy as np
from agent_kit import Served, agent_prompt, agent_runner, serve
from slowdown import scaled

from fleetrl.broker import (
    SCHEMA_PARTIAL,
    SCHEMA_PARTIAL_V2,
    SOURCE_ENV,
    SOURCE_POLICY,
    HandedOverBy,
    PartialRecord,
    PartialSample,
    PromptRecord,
    RecordLimits,
    decode_record,
    encode_record,
    expand_segments,
)
from fleetrl.rollout.agent_capture import SampleCapture
from fleetrl.rollout.agent_episodes import AgentRunner
from fleetrl.rollout.agent_replay import handover_sample, recorded_calls


def _runner(s: Served, resume: list[PartialSample] | None = None) -> AgentRunner:
    return agent_runner(s, "pauses", resume=resume)


def _prompt(n: int) -> PromptRecord:
    return agent_prompt(n)


async def _handed_over(model: pathlib.Path, n: int, pause_at: int) -> tuple[list[PartialSample], Served]:
    """Run `n` runs on a first worker until each stops before call `pause_at`, cancel the group (a preemption),
    and hand its runs over through the codec."""
    async with serve(model, open_keys=False) as s:
        runner, paused = _runner(s), asyncio.Queue[int]()
        group = asyncio.ensure_future(runner.run_group("g-1", _prompt(n), [], {"pause_at": pause_at,
                                                                             "paused": paused}))
        for _ in range(n):
            await asyncio.wait_for(paused.get(), scaled(120))
        group.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await group
        samples = runner.handover_samples(n)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    limits = RecordLimits(vocab_size=vocab, known_tasks=frozenset({"reverse"}))
    record = PartialRecord(_prompt(n), samples, HandedOverBy("r1", "n1", "preempted"))
    back = decode_record(encode_record(record, limits), limits, expect=SCHEMA_PARTIAL)
    assert isinstance(back, PartialRecord) and back.schema == SCHEMA_PARTIAL_V2
    return back.samples, s


async def test_handed_over_calls_are_replayed_then_the_run_goes_live(agent_folder: pathlib.Path) -> None:
    partial, first = await _handed_over(agent_folder, n=2, pause_at=2)
    assert len(first.turns) == 4  # two calls of each run decoded on the first worker
    for p in partial:
        calls = recorded_calls(p, [])
        assert len(calls) == 2 and expand_segments(p.segments, len(p.completion_ids))[-1] == SOURCE_POLICY
        assert {tuple(int(t) for t in c.completion.completion_ids) for c in calls} <= {
            tuple(int(t) for t in out[0].completion_ids) for _, out in first.turns}  # the engine's own ids
    async with serve(agent_folder, open_keys=False) as s:
        s.engine._version = 7  # the second worker runs newer weights: the replayed tokens keep their version 0
        results = await _runner(s, resume=partial).run_group("g-1", _prompt(2), [], {})
    assert s.endpoint.calls_replayed == 4 and len(s.turns) == 2  # only each run's third call reached the engine
    for p, res in zip(partial, results, strict=True):
        n = len(p.completion_ids)
        policy = int((expand_segments(p.segments, n) == SOURCE_POLICY).sum())
        assert (res.calls_replayed, res.tokens_replayed, res.tokens_regenerated, res.turns) == (2, policy, 0, 3)
        assert list(res.sample.completion_ids[:n]) == list(p.completion_ids)  # the first worker's, as recorded
        assert np.array_equal(res.sample.logprobs[:n], p.logprobs)
        assert list(res.sample.versions[:n]) == list(p.versions)
        assert res.segments[:n] == expand_segments(p.segments, n).tolist()
        assert p.contexts is not None and res.contexts is not None and len(res.contexts) == 1
        assert res.contexts[0][1] == list(p.contexts[0][1])
        # then live: the engine decoded the third call from exactly the sample so far (one environment turn on)
        (prompt, (out,)) = next((t, o) for t, o in s.turns if t[:len(res.contexts[0][1]) + n] ==
                                res.contexts[0][1] + [int(x) for x in p.completion_ids])
        start = len(prompt) - len(res.contexts[0][1])
        assert set(res.segments[n:start]) == {SOURCE_ENV}
        assert list(res.sample.completion_ids[start:]) == list(out.completion_ids)
        assert set(p.versions.tolist()) <= {0, -1} and set(res.sample.versions[start:].tolist()) == {7}


async def test_a_call_that_differs_goes_live_from_there(agent_folder: pathlib.Path) -> None:
    (partial,), _ = await _handed_over(agent_folder, n=1, pause_at=2)
    first, second = recorded_calls(partial, [])
    async with serve(agent_folder, open_keys=False) as s:
        (res,) = await _runner(s, resume=[partial]).run_group("g-1", _prompt(1), [], {"ask_at": 1})
    assert s.endpoint.calls_replayed == 1 and len(s.turns) == 2  # the second and third calls were decoded
    recorded = len(second.completion.completion_ids)
    assert (res.calls_replayed, res.tokens_regenerated) == (1, recorded)
    k = len(first.completion.completion_ids)
    assert list(res.sample.completion_ids[:k]) == list(first.completion.completion_ids)
    assert s.turns[0][0] != second.prompt_ids  # it asked something else: the engine answered that


async def test_a_finished_run_replays_in_full_without_the_engine(agent_folder: pathlib.Path) -> None:
    (partial,), _ = await _handed_over(agent_folder, n=1, pause_at=3)
    assert len(recorded_calls(partial, [])) == 3
    async with serve(agent_folder, open_keys=False) as s:
        (res,) = await _runner(s, resume=[partial]).run_group("g-1", _prompt(1), [], {})
    assert s.turns == [] and s.endpoint.calls_replayed == 3
    assert list(res.sample.completion_ids) == list(partial.completion_ids) and res.reward == 1.0
    assert res.sample.finish_reason in {"stop", "length"}


def test_a_call_still_decoding_is_not_handed_over() -> None:
    """The environment ids a call added before it was cut off are not sent: the receiving run adds them
    again when it makes that call; a run that captured nothing hands over what it came with."""
    capture = SampleCapture("k", max_calls=8, max_tokens=100, name="g#0")
    capture.tokens, capture.logprobs = [5, 6, 7, 8], [-0.5, -0.5, 0.0, 0.0]
    capture.versions, capture.sources, capture.contexts = [2, 2, -1, -1], [0, 0, 1, 1], [(0, [1, 2])]
    sample = handover_sample(capture, None)
    assert list(sample.completion_ids) == [5, 6] and list(sample.versions) == [2, 2]
    assert sample.contexts is not None and [(at, list(p)) for at, p in sample.contexts] == [(0, [1, 2])]
    assert len(handover_sample(None, None).completion_ids) == 0
    assert handover_sample(SampleCapture("k2", 8, 100), sample) is sample


def test_recorded_calls_split_at_environment_ids_and_at_each_new_context() -> None:
    """Two calls that extend one context (environment ids between them), then a call with a context of its own
    (the agent rewrote its history): three calls, each with the prompt the engine decoded from."""
    from fleetrl.broker import floats, ids, segments_of

    sources = [0, 0, 1, 1, 0, 0, 0, 0]
    sample = PartialSample(ids([10, 11, 20, 21, 12, 13, 30, 31]), floats([-0.5, -0.5, 0, 0, -0.5, -0.5, -1, -1]),
                           ids([1, 1, -1, -1, 2, 2, 3, 3]), segments=segments_of(sources),
                           contexts=[(0, ids([1, 2])), (6, ids([7]))])
    calls = recorded_calls(sample, [99])
    assert [c.prompt_ids for c in calls] == [[1, 2], [1, 2, 10, 11, 20, 21], [7]]
    assert [c.completion.completion_ids.tolist() for c in calls] == [[10, 11], [12, 13], [30, 31]]
    assert [c.completion.versions.tolist() for c in calls] == [[1, 1], [2, 2], [3, 3]]
    plain = PartialSample(ids([5, 6]), floats([-0.1, -0.2]), ids([0, 0]))  # no structure: one call on the prompt
    assert [(c.prompt_ids, c.completion.completion_ids.tolist()) for c in recorded_calls(plain, [99])] == [
        ([99], [5, 6])]


def test_a_replay_goes_live_for_good_at_the_first_call_it_cannot_answer() -> None:
    from fleetrl.broker import floats, ids
    from fleetrl.rollout.agent_replay import RecordedCall, Replay

    calls = [RecordedCall([1], PartialSample(ids([5, 9]), floats([-0.1, -0.2]), ids([0, 0]))),
             RecordedCall([1, 5, 9, 3], PartialSample(ids([6]), floats([-0.3]), ids([1])))]
    replay = Replay(calls, frozenset({9}))
    assert replay.answer([1], n=2, max_new_tokens=8) is None and replay.live  # two choices: live
    assert replay.answer([1], n=1, max_new_tokens=8) is None  # and live for good
    replay = Replay(calls, frozenset({9}))
    assert replay.answer([1], n=1, max_new_tokens=1) is None  # its max_tokens cannot hold the recorded answer
    replay = Replay(calls, frozenset({9}))
    first = replay.answer([1], n=1, max_new_tokens=8)
    assert first is not None and first.completion_ids.tolist() == [5, 9] and first.finish_reason == "stop"
    last = replay.answer([1, 5, 9, 3], n=1, max_new_tokens=1)
    assert last is not None and last.finish_reason == "length" and replay.live  # the last recorded call: then live
    assert (replay.calls_replayed, replay.tokens_replayed, replay.tokens_regenerated) == (2, 3, 0)
    assert replay.answer([1, 5, 9, 3, 6, 4], n=1, max_new_tokens=8) is None
