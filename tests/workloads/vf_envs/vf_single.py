"""A single-turn verifiers environment built from verifiers' own classes: a taskset of sums, a rubric of two
weighted `@vf.reward`s, and the in-process chat harness (the taskset's default harness: exported here)."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf
from vf_harness import ChatHarness

__all__ = ["ChatHarness", "SumTaskset"]


class SumData(vf.TaskData):
    answer: str


def digits(reply: str) -> float:
    """Share of the reply's characters that are digits."""
    return sum(ch.isdigit() for ch in reply) / len(reply) if reply else 0.0


def brevity(reply: str) -> float:
    return 1.0 / (1.0 + len(reply))


def rubric(reply: str, answer: str) -> float:
    """The rubric's reward, as verifiers sums it (score x weight), for the tests to recompute."""
    return digits(reply) * 1.0 + brevity(reply) * 0.5 + (1.0 if answer in reply else 0.0) * 2.0


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def digits(self, trace: vf.Trace) -> float:
        return digits(trace.last_reply)

    @vf.reward(weight=0.5)
    async def brevity(self, trace: vf.Trace) -> float:
        return brevity(trace.last_reply)

    @vf.reward(weight=2.0)
    async def exact(self, task: SumData, trace: vf.Trace) -> float:
        return 1.0 if task.answer in trace.last_reply else 0.0


class SumTasksetConfig(vf.TasksetConfig):
    count: int = 4


class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self) -> Iterable[SumTask]:
        for i in range(self.config.count):
            a, b = 3 + i, 4 + 2 * i
            yield SumTask(SumData(prompt=f"What is {a} + {b}?", answer=str(a + b),
                                  system_prompt="Answer with a number."), self.config.task)
