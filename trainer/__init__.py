"""The central trainer (DESIGN.md §1, §6): dispatcher, collector, learner, publisher, checkpoints.

Public surface; other packages import only these names. The maths (`advantages`, `losses`) and the
state machines (`Dispatcher`, `Collector`, checkpoints) import no server client; torch-heavy names
load lazily so that `fleetrl audit` starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fleetrl.trainer.dispatcher import PromptItem, admission_budget, group_id
from fleetrl.trainer.errors import AuditError, CheckpointError, DatasetError, TrainerError

if TYPE_CHECKING:
    from fleetrl.trainer.daemon import run_daemon
    from fleetrl.trainer.dataset import dataset_prompts, file_prompts, is_chat, load_rows
    from fleetrl.trainer.dist import DistContext
    from fleetrl.trainer.learner import Learner, StepStats
    from fleetrl.trainer.metrics import TrainerMetrics
    from fleetrl.trainer.service import Trainer, TrainerResult

_LAZY = {
    "run_daemon": "fleetrl.trainer.daemon",
    "file_prompts": "fleetrl.trainer.dataset",
    "dataset_prompts": "fleetrl.trainer.dataset",
    "load_rows": "fleetrl.trainer.dataset",
    "is_chat": "fleetrl.trainer.dataset",
    "DistContext": "fleetrl.trainer.dist",
    "Learner": "fleetrl.trainer.learner",
    "StepStats": "fleetrl.trainer.learner",
    "TrainerMetrics": "fleetrl.trainer.metrics",
    "Trainer": "fleetrl.trainer.service",
    "TrainerResult": "fleetrl.trainer.service",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fleetrl.trainer' has no attribute {name!r}")


__all__ = [
    "AuditError",
    "CheckpointError",
    "DatasetError",
    "DistContext",
    "Learner",
    "PromptItem",
    "StepStats",
    "Trainer",
    "TrainerError",
    "TrainerMetrics",
    "TrainerResult",
    "admission_budget",
    "dataset_prompts",
    "file_prompts",
    "group_id",
    "is_chat",
    "load_rows",
    "run_daemon",
]
