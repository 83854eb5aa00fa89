"""`fleetrl trainer`: wires the rollout task registry into the trainer as its prompt source.

The trainer package never imports rollout (DESIGN.md §2); this thin handler in `fleetrl/` may.
Prompts come from `dataset.path` (JSONL, Parquet or a `save_to_disk` folder) when set, else from a verifiers
environment's taskset (`dataset.env.kind: verifiers`), else from the task registry's deterministic generator for
`dataset.task` and `dataset.seed`.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Iterator

from fleetrl.config import DatasetConfig, FleetConfig
from fleetrl.trainer import PromptItem


def prompt_source(config: FleetConfig, d: DatasetConfig | None = None,
                  keep_columns: bool | None = None) -> Callable[[], Iterator[PromptItem]]:
    """A factory of identical prompt iterators (resume re-creates one and skips what was drawn); `d`: another
    source than `dataset` (an eval set's)."""
    d = d or config.dataset
    if d.path is None and d.env is not None and d.env.kind == "verifiers":
        return _verifiers_prompts(d)
    if d.path is not None:
        from fleetrl.trainer import dataset_prompts, load_rows

        rows = load_rows(d)  # once: each restart of the iterator reads the same rows again
        keep = config.reward.custom or config.dataset.env is not None  # rewards and environments read rows
        keep = keep if keep_columns is None else keep_columns
        return lambda: dataset_prompts(d, rows, keep_columns=keep)
    from fleetrl.rollout import get_task

    task = get_task(d.task)

    def generated() -> Iterator[PromptItem]:
        for p in task.prompts(d.seed):
            yield PromptItem(task.name, p.prompt, p.reference)

    return generated


def _verifiers_prompts(d: DatasetConfig) -> Callable[[], Iterator[PromptItem]]:
    """A verifiers environment's tasks as dataset rows (`prompt` messages, `verifiers_task` data), read by the
    dataset loader like a file's rows: `dataset.system_prompt`, `shuffle`, `epochs` and `task` apply."""
    import datasets

    from fleetrl.rollout.verifiers_env import load_verifiers_env, taskset_rows
    from fleetrl.trainer import dataset_prompts

    assert d.env is not None
    rows = datasets.Dataset.from_list(taskset_rows(load_verifiers_env(d.env), d.env.name, limit=d.num_prompts))
    return lambda: dataset_prompts(d, rows, keep_columns=True)


def eval_prompts(config: FleetConfig) -> dict[str, list[PromptItem]]:
    """Each eval set's prompts (`eval.sets`): its first `num_prompts`, read by the training prompts' loaders."""
    out: dict[str, list[PromptItem]] = {}
    for s in config.eval.sets:
        keep = (s.reward or config.reward).custom
        source = prompt_source(config, s.dataset(config.dataset), keep_columns=keep)
        out[s.name] = list(itertools.islice(source(), s.num_prompts))
    return out


def run_trainer(args: argparse.Namespace, config: FleetConfig) -> int:
    from fleetrl.trainer import run_daemon

    return run_daemon(config, prompt_source(config), max_steps=args.steps, eval_prompts=eval_prompts(config))
