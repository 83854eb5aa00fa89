"""An agent run handed over mid-episode, replayed from its capture on the receiving worker (DESIGN.md §11, §13).

An agent's own state (its Python objects, its open connections) cannot travel; its captured calls can. When
a worker hands an agent group over (preemption notice, SIGTERM, drain, stop), each run's sample leaves as far
as its last completed call, with the structure to replay it: `segments` (which tokens the policy generated,
which the environment or the chat template wrote) and `contexts` (each segment's prompt ids), in a
`fleetrl.partial/2` (`handover_sample`). A call still decoding is given up (its tokens are counted as
discarded, and generated again where the run resumes).

The receiving worker starts the user's function again from the start, and its endpoint answers the run's
calls from the capture (`Replay.answer`): the k-th call is answered with the k-th recorded completion (its
ids, logprobs and versions as recorded, never re-decoded) while the call's rendered prompt ids equal the
recorded call's context and it asks for one choice within the recorded length. From the first call that
differs, or after the last recorded one, the run goes live for good: every later call is decoded by the
engine. So a run that replays in full is token for token the sample the first worker would have produced,
and an agent that samples differently after a replayed turn simply continues live. Recorded tokens that
were not replayed are generated again (`tokens_regenerated`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fleetrl.broker import SOURCE_ENV, SOURCE_POLICY, PartialSample, expand_segments, floats, ids, segments_of


@dataclass(frozen=True, slots=True)
class RecordedCall:
    """One completed call of a run: the prompt ids the engine decoded from and what it answered."""

    prompt_ids: list[int]
    completion: PartialSample


def recorded_calls(sample: PartialSample, prompt_ids: list[int]) -> list[RecordedCall]:
    """The calls of a captured sample, in order: each run of policy tokens is one call's completion, its
    prompt the segment's context plus the sample's tokens before it in that segment (`prompt_ids`: the
    context of a sample without `contexts`, the group's prompt)."""
    n = len(sample.completion_ids)
    if n == 0:
        return []
    tokens = [int(t) for t in sample.completion_ids]
    sources = expand_segments(sample.segments, n)
    contexts = [(int(at), [int(t) for t in p]) for at, p in sample.contexts] if sample.contexts else [(0, prompt_ids)]
    calls = []
    for j, (at, context) in enumerate(contexts):
        end = contexts[j + 1][0] if j + 1 < len(contexts) else n
        i = at
        while i < end:
            if sources[i] != SOURCE_POLICY:
                i += 1
                continue
            k = i
            while k < end and sources[k] == SOURCE_POLICY:
                k += 1
            done = PartialSample(sample.completion_ids[i:k], sample.logprobs[i:k], sample.versions[i:k])
            calls.append(RecordedCall(context + tokens[at:i], done))
            i = k
    return calls


class Replay:
    """Answers one run's calls from its recorded ones, in order, until the first that differs."""

    def __init__(self, calls: list[RecordedCall], eos_ids: frozenset[int]) -> None:
        self.calls, self.eos = calls, eos_ids
        self.next = 0
        self.live = not calls
        """True once a call went to the engine: every later call does too."""
        self.calls_replayed = 0
        self.tokens_replayed = 0

    @property
    def tokens_recorded(self) -> int:
        return sum(len(c.completion.completion_ids) for c in self.calls)

    @property
    def tokens_regenerated(self) -> int:
        """Recorded policy tokens not replayed: the engine generated them (or others) again."""
        return self.tokens_recorded - self.tokens_replayed

    def answer(self, prompt_ids: list[int], n: int, max_new_tokens: int) -> PartialSample | None:
        """The recorded answer of this call, or None: it goes live (so do all later calls)."""
        if self.live:
            return None
        call = self.calls[self.next]
        out = call.completion
        if n != 1 or len(out.completion_ids) > max_new_tokens or prompt_ids != call.prompt_ids:
            self.live = True
            return None
        self.next += 1
        self.live = self.next >= len(self.calls)
        self.calls_replayed += 1
        self.tokens_replayed += len(out.completion_ids)
        finish = "stop" if int(out.completion_ids[-1]) in self.eos else "length"
        return PartialSample(ids(out.completion_ids), floats(out.logprobs), ids(out.versions), finish)


def replay_of(sample: PartialSample | None, prompt_ids: list[int], eos_ids: frozenset[int]) -> Replay | None:
    """The replay of a handed-over sample, or None when it captured nothing."""
    if sample is None or len(sample.completion_ids) == 0:
        return None
    return Replay(recorded_calls(sample, prompt_ids), eos_ids)


class Captured(Protocol):
    """What a handover reads of a run's capture (`SampleCapture`, rollout/agent_capture.py)."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    sources: list[int]
    contexts: list[tuple[int, list[int]]]
    replay: Replay | None


def handover_sample(capture: Captured | None, resumed: PartialSample | None) -> PartialSample:
    """What a run hands over: its completed calls (`fleetrl.partial/2`), without the environment's ids of a
    call still decoding (the receiving run adds them again when it makes that call). A run that had not
    started, or whose replay had not yet gone live, hands over the sample it came with (`resumed`): that
    holds everything its capture holds and more."""
    sources = np.asarray(capture.sources if capture is not None else [], dtype=np.int32)
    policy = np.flatnonzero(sources != SOURCE_ENV)
    cut = int(policy[-1]) + 1 if len(policy) else 0
    replaying = capture is not None and capture.replay is not None and not capture.replay.live
    if capture is None or replaying or cut == 0:
        return resumed if resumed is not None else PartialSample(ids([]), floats([]), ids([]))
    return PartialSample(ids(capture.tokens[:cut]), floats(capture.logprobs[:cut]), ids(capture.versions[:cut]),
                         None, segments=segments_of(sources[:cut]),
                         contexts=[(at, ids(p)) for at, p in capture.contexts if at < cut])
