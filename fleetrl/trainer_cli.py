"""`fleetrl trainer`: wires the rollout task registry into the trainer as its prompt source.

The trainer package never imports rollout (DESIGN.md §2); this thin handler in `fleetrl/` may.
Prompts come from `dataset.path` (JSONL, Parquet or a `save_to_disk` folder) when set, else from the task registry's
deterministic generator for `dataset.task` and `dataset.seed`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

from fleetrl.config import FleetConfig
from fleetrl.trainer import PromptItem


def prompt_source(config: FleetConfig) -> Callable[[], Iterator[PromptItem]]:
    """A factory of identical prompt iterators (resume re-creates one and skips what was drawn)."""
    d = config.dataset
    if d.path is not None:
        from fleetrl.trainer import dataset_prompts, load_rows

        rows = load_rows(d)  # once: each restart of the iterator reads the same rows again
        keep = config.reward.custom or config.dataset.env is not None  # rewards and environments read rows
        return lambda: dataset_prompts(d, rows, keep_columns=keep)
    from fleetrl.rollout import get_task

    task = get_task(d.task)

    def generated() -> Iterator[PromptItem]:
        for p in task.prompts(d.seed):
            yield PromptItem(task.name, p.prompt, p.reference)

    return generated


def run_trainer(args: argparse.Namespace, config: FleetConfig) -> int:
    from fleetrl.trainer import run_daemon

    return run_daemon(config, prompt_source(config), max_steps=args.steps)
