"""Rollout: engines (torch, vllm), verifiable tasks and rewards, and the region worker loop.

Public surface; other packages import only these names. Heavy modules (torch, vllm) load lazily:
`import fleetrl.rollout` stays cheap for the CLI's `--help`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fleetrl.rollout.errors import EngineError, EnvError, RolloutError, TaskError, WorkerError
from fleetrl.rollout.nodes import engine_config, engine_devices
from fleetrl.rollout.tasks import TASKS, CharTokenizer, Task, TaskPrompt, get_task

if TYPE_CHECKING:
    from fleetrl.rollout.engine import Engine, FinishedGroup, GroupRequest
    from fleetrl.rollout.torch_engine import TorchEngine
    from fleetrl.rollout.vllm_engine import VllmEngine
    from fleetrl.rollout.worker import RolloutWorker, build_engine, run_worker

_LAZY = {
    "Engine": "fleetrl.rollout.engine",
    "FinishedGroup": "fleetrl.rollout.engine",
    "GroupRequest": "fleetrl.rollout.engine",
    "TorchEngine": "fleetrl.rollout.torch_engine",
    "VllmEngine": "fleetrl.rollout.vllm_engine",
    "run_worker": "fleetrl.rollout.worker",
    "RolloutWorker": "fleetrl.rollout.worker",
    "build_engine": "fleetrl.rollout.worker",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fleetrl.rollout' has no attribute {name!r}")


__all__ = [
    "TASKS",
    "CharTokenizer",
    "Engine",
    "EngineError",
    "EnvError",
    "FinishedGroup",
    "GroupRequest",
    "RolloutError",
    "RolloutWorker",
    "Task",
    "TaskError",
    "TaskPrompt",
    "TorchEngine",
    "VllmEngine",
    "WorkerError",
    "build_engine",
    "engine_config",
    "engine_devices",
    "get_task",
    "run_worker",
]
