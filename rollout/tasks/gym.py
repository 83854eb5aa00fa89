"""Procedural, verifiable tasks from `reasoning-gym`, named `reasoning_gym:<dataset>` (`dataset.task`).

    task = get_task("reasoning_gym:leg_counting")
    p = next(task.prompts(seed=0))        # the question, with the instruction to answer in <answer> tags
    task.reward(completion_text, p.reference)

Prompts are generated offline from the seed (reasoning-gym builds each entry from `seed + index`), so
the stream is endless and the same on every machine. The reference is the whole entry (question,
answer, metadata: what the dataset's `score_answer` reads); the reward is the dataset's own score of
the text inside the completion's last `<answer>...</answer>`, in [0, 1]. The library is imported only
when such a task is used.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from fleetrl.rollout.errors import TaskError
from fleetrl.rollout.tasks.base import Task, TaskPrompt

PREFIX = "reasoning_gym:"
_SIZE = 1 << 30  # entries are built on demand from seed + index: the size only bounds the index
INSTRUCTION = ("Answer the question. Give only the final answer inside <answer></answer> tags, "
               "for example <answer>42</answer>.\n\n")


class ReasoningGymTask(Task):
    max_new_tokens = 256

    def __init__(self, dataset: str) -> None:
        try:
            import reasoning_gym
        except ImportError as exc:
            raise TaskError(f"task {PREFIX}{dataset} needs reasoning-gym (pip install reasoning-gym)") from exc
        try:
            self._scorer = reasoning_gym.create_dataset(dataset, seed=0, size=1)
        except (KeyError, ValueError) as exc:
            known = sorted(getattr(reasoning_gym.factory, "DATASETS", {}))
            raise TaskError(f"unknown reasoning-gym dataset {dataset!r}; known: {known[:12]}... "
                            f"({len(known)} in all)") from exc
        self.name, self.dataset = PREFIX + dataset, dataset

    def prompts(self, seed: int) -> Iterator[TaskPrompt]:
        import reasoning_gym

        data = reasoning_gym.create_dataset(self.dataset, seed=seed, size=_SIZE)
        for i in itertools.count():
            entry = data[i]
            yield TaskPrompt(INSTRUCTION + entry["question"], _plain(entry))

    def reward(self, completion_text: str, reference: Any) -> float:
        from reasoning_gym.utils import extract_answer

        if not isinstance(reference, dict) or "answer" not in reference:
            raise TaskError(f"task {self.name}: the reference is not a reasoning-gym entry")
        answer = extract_answer(completion_text)
        if answer is None:
            return 0.0
        return float(self._scorer.score_answer(answer, reference))


def _plain(value: Any) -> Any:
    """The entry as msgpack-able data (tuples become lists)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
