"""Errors of the rollout layer.

    RolloutError                base; `retriable` says whether the same call may succeed later
    ├── EngineError             an engine that cannot load a model, weights or a request
    ├── TaskError               an unknown task name, or a prompt/reference a task cannot use
    │   └── RewardError         a reward function or endpoint that failed on a group (`reward_error`)
    ├── EnvError                an environment that failed an episode: raised, hung, answered nonsense (`env_error`)
    └── WorkerError             the worker loop: a dependency (Kafka, hub) failed beyond its retries

Messages name the object at fault: the group id, the task name, the tensor name, the version.
"""

from __future__ import annotations


class RolloutError(Exception):
    """Base of every rollout-layer error."""

    retriable: bool = False


class EngineError(RolloutError):
    """An engine refused a model, a weight version or a request."""


class TaskError(RolloutError):
    """An unknown task, or a reference a task's reward cannot read."""


class RewardError(TaskError):
    """A custom reward that raised, timed out, or returned a non-finite or wrong-length result; or a
    reward function that cannot be imported. The group goes to `dead-letter` with reason `reward_error`."""


class EnvError(RolloutError):
    """An environment (skyrl-gym) that cannot be built, raised in a step, took longer than
    `env.tool_timeout_s`, or returned something that is not a step. The episode ends with the failure
    reward, or the group goes to `dead-letter` with reason `env_error` (`env.on_error`)."""


class WorkerError(RolloutError):
    """The worker loop cannot go on; `retriable` when a restart may succeed."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable
