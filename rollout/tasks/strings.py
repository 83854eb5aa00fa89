"""String tasks that a tiny model learns from scratch on a CPU within minutes (with GRPO).

The answer is a short string fixed by the prompt. The reward gives partial credit so that a
randomly initialised model gets a learning signal long before it answers right:

    reward = 0.7 * (fraction of answer positions with the right character)
           + 0.15 * (fraction of answer positions holding a letter of the task's alphabet)
           + 0.15 * (completion has exactly the answer's length, i.e. it stopped with EOS in time)

Prompts are `<letters><sep>` (e.g. `bca=`); each task's separator differs, so a model trained on
several tasks can tell them apart.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from fleetrl.rollout.errors import TaskError
from fleetrl.rollout.tasks.base import Task, TaskPrompt

W_MATCH, W_ALPHABET, W_LENGTH = 0.7, 0.15, 0.15


class StringTask(Task):
    """Answer = `transform(letters)`; letters drawn from `alphabet`, `min_len..max_len` long."""

    def __init__(
        self, name: str, sep: str, transform: Callable[[str], str], *,
        alphabet: str = "abcd", min_len: int = 3, max_len: int = 4,
    ) -> None:
        self.name, self.sep, self.transform = name, sep, transform
        self.alphabet, self.min_len, self.max_len = alphabet, min_len, max_len
        self.max_new_tokens = max_len + 1

    def prompts(self, seed: int) -> Iterator[TaskPrompt]:
        rng = random.Random(f"{self.name}:{seed}")
        while True:
            n = rng.randint(self.min_len, self.max_len)
            letters = "".join(rng.choice(self.alphabet) for _ in range(n))
            yield TaskPrompt(prompt=f"{letters}{self.sep}", reference=self.transform(letters))

    def reward(self, completion_text: str, reference: Any) -> float:
        if not isinstance(reference, str) or not reference:
            raise TaskError(f"task {self.name!r}: reference must be a non-empty string, got {reference!r}")
        n = len(reference)
        head = completion_text[:n]
        match = sum(a == b for a, b in zip(head, reference, strict=False)) / n
        valid = sum(ch in self.alphabet for ch in head) / n
        length = 1.0 if len(completion_text) == n else 0.0
        return W_MATCH * match + W_ALPHABET * valid + W_LENGTH * length


def reverse_task() -> StringTask:
    return StringTask("reverse", "=", lambda s: s[::-1])


def copy_task() -> StringTask:
    return StringTask("copy", ":", lambda s: s)


def sort_task() -> StringTask:
    return StringTask("sort", ">", lambda s: "".join(sorted(s)))
