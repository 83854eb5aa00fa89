"""Held-out evaluation (`eval`): eval sets, when they run, and their share of the fleet (DESIGN.md §12).

An eval set is a source of prompts read by the same loaders as `dataset` (a task's generator with a
held-out seed, or a JSONL / Parquet / `save_to_disk` file), scored by the run's reward unless the set
names its own, and generated `samples_per_prompt` times per prompt at one pinned policy version. The
trainer dispatches an eval of every set at the versions `every_versions` and `before_training` name,
through the same `prompts` topic as training, holding at most `max_share` of the fleet's credits.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from fleetrl.config.base import NAME_RE, Model, ReferenceProblem
from fleetrl.config.dataset import DatasetColumns, DatasetConfig
from fleetrl.config.reward import RewardConfig

GREEDY_TEMPERATURE = 1e-3
"""What `temperature: 0` is sent as: the engines sample by inverse CDF after dividing the logits by the
temperature, which at 1e-3 picks the most likely token (greedy, up to exact ties) with a finite logprob."""


class EvalSetConfig(Model):
    """One held-out eval set: its prompts, its reward and how each prompt is sampled."""

    name: str = Field(pattern=NAME_RE)
    """Name of the set: part of its group ids and of its figures (`eval/<name>/pass@1`)."""
    task: str | None = None
    """Task of the prompts (its generator without `path`, and the label records carry). None: `dataset.task`."""
    path: str | None = None
    """A JSONL or Parquet file, or a `datasets.save_to_disk` folder (relative to the config file), read as
    `dataset.path` is. None: the task's generator, with `seed`."""
    split: str = "test"
    """Split to read from a `save_to_disk` folder that holds several."""
    columns: DatasetColumns = Field(default_factory=DatasetColumns)
    """Column mapping, as `dataset.columns`."""
    system_prompt: str | None = None
    """As `dataset.system_prompt`."""
    seed: int = 1_000_003
    """Seed of the task's generator: a held-out stream, refused when it equals `dataset.seed` for the
    same task (the set would be the training prompts)."""
    num_prompts: int = Field(32, ge=1, le=100_000)
    """Prompts in the set (the first ones of the source)."""
    samples_per_prompt: int = Field(1, ge=1, le=1024)
    """k: samples generated per prompt; pass@k is reported for this k (and pass@1 always)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature; 0 is greedy (sent as a tiny temperature), meant with `samples_per_prompt: 1`."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Longest completion. None: `algorithm.max_new_tokens`."""
    pass_threshold: float = 1.0
    """A sample passes (counts for pass@k) when its reward is at least this."""
    reward: RewardConfig | None = None
    """The set's own reward functions / endpoint, as `reward`. None: the run's own (`reward`, else the task's)."""

    @property
    def wire_temperature(self) -> float:
        return self.temperature if self.temperature > 0 else GREEDY_TEMPERATURE

    def dataset(self, run: DatasetConfig) -> DatasetConfig:
        """The set as a `dataset` section, for the loaders of the training prompts."""
        return DatasetConfig(task=self.task or run.task, tasks=list(run.tasks), path=self.path, split=self.split,
                             columns=self.columns, system_prompt=self.system_prompt, seed=self.seed,
                             num_prompts=self.num_prompts, max_prompt_tokens=run.max_prompt_tokens)


class EvalConfig(Model):
    """Held-out evaluation on the fleet: none unless `sets` is given."""

    sets: list[EvalSetConfig] = Field(default_factory=list)
    """The eval sets; each is evaluated at every scheduled version."""
    every_versions: int | None = Field(None, ge=1)
    """Evaluate every version that is a multiple of this (and the last version of the run). None: only
    `before_training`."""
    before_training: bool = False
    """Also evaluate the version training starts from."""
    max_share: float = Field(0.25, gt=0, le=1)
    """Eval groups in flight at most this share of the fleet's credits (the training window's groups);
    at least one eval group is always allowed."""
    deadline_s: float = Field(600.0, gt=0)
    """An eval group silent this long is sent again (another attempt, another region where one serves)."""
    finish_timeout_s: float = Field(300.0, gt=0)
    """After the last step, how long the trainer waits for evaluations still out before it stops anyway
    (the unfinished ones are logged as `eval.unfinished` and stay open in the checkpoint)."""

    @property
    def enabled(self) -> bool:
        return bool(self.sets) and (self.every_versions is not None or self.before_training)

    def set(self, name: str) -> EvalSetConfig:
        for s in self.sets:
            if s.name == name:
                return s
        raise KeyError(f"no eval set {name!r}; sets: {[s.name for s in self.sets]}")

    @model_validator(mode="after")
    def _unique_names(self) -> EvalConfig:
        names = [s.name for s in self.sets]
        for i, name in enumerate(names):
            if names.index(name) != i:
                raise ReferenceProblem(("sets", i, "name"), f"eval set {name!r} is defined twice")
        return self


def check_eval(eval_cfg: EvalConfig, dataset: DatasetConfig, model: Any) -> None:
    """Cross-section checks (FleetConfig calls it): a set's task must be known to the records, a
    generated set must not be the training stream, greedy sampling is one sample, the policy is not a
    LoRA adapter (the workers' eval lane loads full weights only) and samples are not episodes."""
    if eval_cfg.sets and getattr(model, "lora", None) is not None:
        raise ReferenceProblem(("eval", "sets"), "evaluation of a LoRA run (model.lora) is not supported yet: "
                                                 "the eval lane pins full weights only")
    if eval_cfg.sets and dataset.env is not None:
        raise ReferenceProblem(("eval", "sets"), "evaluation of a run with episodes (dataset.env) is not supported "
                                                 "yet: the eval lane generates single completions")
    for i, s in enumerate(eval_cfg.sets):
        task = s.task or dataset.task
        if task not in dataset.known_tasks:
            raise ReferenceProblem(("eval", "sets", i, "task"),
                                   f"task {task!r} is not one the records may carry; add it to dataset.tasks "
                                   f"(known: {sorted(dataset.known_tasks)})")
        if s.path is None and dataset.path is None and task == dataset.task and s.seed == dataset.seed:
            raise ReferenceProblem(("eval", "sets", i, "seed"),
                                   f"seed {s.seed} is dataset.seed: the set would be the training prompts; "
                                   f"give it a held-out seed")
        if s.temperature == 0 and s.samples_per_prompt > 1:
            raise ReferenceProblem(("eval", "sets", i, "samples_per_prompt"),
                                   f"{s.samples_per_prompt} greedy samples (temperature 0) are one sample "
                                   f"{s.samples_per_prompt} times; set temperature > 0 for pass@k")
