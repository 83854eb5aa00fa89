"""Verifiable tasks: the registry the dispatcher (prompts) and the rollout worker (rewards) share.

    task = get_task(config.dataset.task)
    for p in task.prompts(seed): ...           # TaskPrompt(prompt, reference)
    r = task.reward(completion_text, p.reference)
"""

from __future__ import annotations

from fleetrl.rollout.errors import TaskError
from fleetrl.rollout.tasks.base import Task, TaskPrompt
from fleetrl.rollout.tasks.gym import PREFIX, ReasoningGymTask
from fleetrl.rollout.tasks.math import MathTask, extract_answer
from fleetrl.rollout.tasks.strings import StringTask, copy_task, reverse_task, sort_task
from fleetrl.rollout.tasks.tokenizer import BOS_ID, EOS_ID, PAD_ID, CharTokenizer

TASKS: dict[str, Task] = {t.name: t for t in (reverse_task(), copy_task(), sort_task(), MathTask())}
_GYM: dict[str, Task] = {}


def get_task(name: str) -> Task:
    """The registered task called `name`, or a reasoning-gym dataset (`reasoning_gym:<dataset>`, built on
    first use); TaskError naming the known ones otherwise."""
    task = TASKS.get(name) or _GYM.get(name)
    if task is not None:
        return task
    if name.startswith(PREFIX):
        _GYM[name] = ReasoningGymTask(name.removeprefix(PREFIX))
        return _GYM[name]
    raise TaskError(f"unknown task {name!r}; known tasks: {sorted(TASKS)} and reasoning_gym:<dataset>")


__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "TASKS",
    "CharTokenizer",
    "MathTask",
    "StringTask",
    "Task",
    "TaskError",
    "TaskPrompt",
    "extract_answer",
    "get_task",
]
