"""A group of work inside the worker, and the records it becomes (DESIGN.md §3).

A `Job` is one consumed delivery (a `fleetrl.prompt/1` or a `fleetrl.partial/1`) from the moment
it is polled until the record it owes is acknowledged: a finished `fleetrl.group/1` on
`trajectories`, or a `fleetrl.partial/1` handed over on `partials`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from fleetrl.broker import (
    Delivery,
    GroupRecord,
    HandedOverBy,
    PartialRecord,
    PartialSample,
    PromptRecord,
    Sample,
    Timings,
    floats,
    ids,
    segments_of,
)
from fleetrl.rollout.rewards import GroupInput
from fleetrl.rollout.tokenize import TextCodec


@dataclass(slots=True)
class Job:
    delivery: Delivery
    prompt: PromptRecord
    prompt_ids: list[int]
    resume: list[PartialSample] | None
    env: dict[str, Any] | None = None
    """The environment that runs this group's episodes, `{name, args}` (set by the worker), or None."""
    received_mono: float = field(default_factory=time.monotonic)
    received_wall: float = field(default_factory=time.time)
    started_mono: float | None = None
    started_wall: float = 0.0

    @property
    def group_id(self) -> str:
        return self.prompt.group_id

    @classmethod
    def from_delivery(cls, d: Delivery, codec: TextCodec) -> Job:
        record = d.record
        if isinstance(record, PartialRecord):
            prompt, resume = record.prompt, list(record.samples)
        elif isinstance(record, PromptRecord):
            prompt, resume = record, None
        else:
            raise TypeError(f"{d.topic}[{d.partition}]@{d.offset}: a {type(record).__name__} is not rollout work")
        if prompt.prompt_ids is not None:
            prompt_ids = [int(t) for t in prompt.prompt_ids]
        elif prompt.messages is not None:
            prompt_ids = codec.render(prompt.messages)
            prompt = dataclasses.replace(prompt, prompt_ids=ids(prompt_ids))
        else:
            prompt_ids = codec.encode(prompt.prompt or "")
            # Carry the ids on: a later handover then never depends on re-tokenizing the same way.
            prompt = dataclasses.replace(prompt, prompt_ids=ids(prompt_ids))
        return cls(d, prompt, prompt_ids, resume)

    def resolve_env(self, default: Any) -> None:
        """The record's `env`, else the row's `env_class` column (SkyRL's datasets name it per row), else
        `dataset.env` (`default`, an EnvConfig or None)."""
        p = self.prompt
        if p.env is not None:
            self.env = {"name": p.env["name"], "args": dict(p.env.get("args") or {})}
        elif default is not None:
            row_env = (p.columns or {}).get("env_class")
            self.env = {"name": row_env if isinstance(row_env, str) and row_env else default.name, "args": {}}

    def start(self) -> None:
        self.started_mono, self.started_wall = time.monotonic(), time.time()


def reward_input(job: Job, samples: list[PartialSample], codec: TextCodec) -> GroupInput:
    """What the reward sees of a finished group: the prompt as sent, the completions as text."""
    p = job.prompt
    completions = [codec.decode(s.completion_ids) for s in samples]
    prompt_text = codec.decode_all(job.prompt_ids)
    return GroupInput(prompt=p.prompt, messages=p.messages, completions=completions,
                      completion_ids=[[int(t) for t in s.completion_ids] for s in samples], reference=p.reference,
                      columns=dict(p.columns or {}), queries=[prompt_text + c for c in completions])


def group_record(job: Job, samples: list[PartialSample], rewards: list[float], region: str, node: str,
                 reward_parts: dict[str, float] | None = None,
                 sources: list[list[int]] | None = None,
                 contexts: list[list[tuple[int, list[int]]] | None] | None = None) -> GroupRecord:
    """Build the `fleetrl.group/1` record of finished, scored samples (`/2` with `sources`: each episode's
    per-token sources, 0 policy, 1 environment; and `contexts`: an agent run's segments of context)."""
    p = job.prompt
    segs = [segments_of(src) for src in sources] if sources is not None else [None] * len(samples)
    ctxs = contexts if contexts is not None else [None] * len(samples)
    scored = [
        Sample(s.completion_ids, s.logprobs, s.versions, reward=float(r), finish_reason=s.finish_reason or "abort",
               segments=seg, contexts=None if ctx is None else [(at, ids(prompt)) for at, prompt in ctx])
        for s, r, seg, ctx in zip(samples, rewards, segs, ctxs, strict=True)
    ]
    return GroupRecord(
        group_id=p.group_id, run=p.run, task=p.task, attempt=p.attempt, region=region, node=node,
        prompt_ids=ids(job.prompt_ids), samples=scored,
        timings=Timings(queued=job.received_wall, started=job.started_wall, finished=time.time()),
        reward_parts=reward_parts, eval=p.eval,
    )


def partial_record(job: Job, samples: list[PartialSample] | None, region: str, node: str,
                   reason: str) -> PartialRecord:
    """Hand a group over as `fleetrl.partial/1`: the samples as far as they got on this worker."""
    if samples is None:  # never started here: pass on what it came with
        samples = job.resume or [_empty() for _ in range(job.prompt.n_samples)]
    return PartialRecord(prompt=job.prompt, samples=samples,
                         handed_over_by=HandedOverBy(region=region, node=node, reason=reason))


def _empty() -> PartialSample:
    return PartialSample(ids([]), floats([]), ids([]))
