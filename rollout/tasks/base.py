"""What a task is: a deterministic prompt generator by seed plus an exact reward function."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TaskPrompt:
    prompt: str
    reference: Any
    """What the reward compares against; travels in the prompt record (msgpack-able)."""


class Task(ABC):
    """A verifiable task. `prompts(seed)` is an endless, deterministic stream."""

    name: str
    max_new_tokens: int
    """A completion length that fits every answer of the task (a hint for configs and tests)."""

    @abstractmethod
    def prompts(self, seed: int) -> Iterator[TaskPrompt]:
        """The same seed gives the same prompts in the same order, on every machine."""

    @abstractmethod
    def reward(self, completion_text: str, reference: Any) -> float:
        """Score one completion (its text up to EOS) in [0, 1]."""
