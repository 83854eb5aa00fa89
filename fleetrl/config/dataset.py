"""Where prompts come from (`dataset`): a task's generator or a dataset file in TRL's layouts, its
column mapping, and the optional environment that runs each sample as an episode (DESIGN.md §11)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from fleetrl.config.base import Model

_MODULE_RE = re.compile(r"^([\w.-]+/)?[\w.-]+(@[\w.+-]+)?$")
"""A verifiers taskset id: its module (`my_env`, `my-env`), or a hub id `owner/name[@version]`."""


class DatasetColumns(Model):
    """Which column of a dataset row is what. The defaults read TRL's formats with no mapping: a `prompt`
    column of text, or of messages (`[{role, content}]`, TRL's conversational form)."""

    prompt: str = "prompt"
    """Column of the prompt: text, or a list of chat messages."""
    messages: str | None = None
    """Column of chat messages to use instead of `prompt` (a `messages` layout); None: not used."""
    reference: str | None = None
    """Column sent as the record's `reference` (what a built-in task's reward compares against)."""
    task: str = "task"
    """Column naming a row's task, where present (else `dataset.task`)."""


class EnvConfig(Model):
    """The environment that runs each sample as an episode (multi-turn, tools): a skyrl-gym text environment
    (`skyrl_gym.envs.BaseTextEnv`), written for SkyRL and run unchanged (DESIGN.md §11), or an agent written
    against the OpenAI API, run against the worker's own endpoint (`kind: openai_agent`, DESIGN.md §13), or a
    verifiers environment (`kind: verifiers`, its rollouts against the same endpoint, docs/agents.md)."""

    kind: Literal["skyrl_gym", "openai_agent", "verifiers"] = "skyrl_gym"
    """`skyrl_gym`: `name` is a skyrl-gym environment. `openai_agent`: `name` is an agent function
    `package.module:function`, `async def run(client, prompt, **row) -> float | None`, called once per
    sample with an `openai.AsyncOpenAI` client bound to the worker's endpoint and to that sample
    (docs/agents.md); needs the `agents` extra and a tokenizer with a chat template. An agent that raises
    sends its group to `dead-letter` (`env_error`) whatever `on_error` says; `tool_timeout_s` and
    `threads` do not apply (the agent runs its own tools). `verifiers`: `name` is a verifiers (>= 0.4) taskset
    module, loaded through `verifiers.v1.load_environment` with `config` as the environment's `[env]` block;
    its tasks are the prompts (unless `dataset.path` is set), each sample is one episode whose model calls
    go to the worker's endpoint, and the reward is the rubric's (the trace's weighted `@vf.reward`s); needs
    the `verifiers` extra; the budgets, `wall_time_s`, `failure_reward` and `endpoint_port` apply as for
    `openai_agent`."""
    name: str = Field(min_length=1)
    """A skyrl-gym registered id (`gsm8k`, `gsm8k_multi_turn`, or one your module registers), or
    `package.module:Class` (a `BaseTextEnv` subclass or a factory) imported from `python_path`, then the
    Python path. Built per episode as SkyRL does: `Class(env_config=config, extras=row)`, where `row` is
    the dataset row's other columns plus `reward_spec: {ground_truth: reference}` when the row has none."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The environment's `env_config` (its own arguments). `verifiers`: the environment's `[env]` block as
    verifiers takes it (`taskset: {...}` its taskset's arguments, `agent: {harness: {id: ...}}`, ...); the
    taskset `id` is `name`."""
    python_path: list[str] = Field(default_factory=list)
    """Folders (relative to the config file) searched first when importing `name`."""
    max_turns: int = Field(8, ge=1)
    """Model turns per episode at most; past it the episode ends (finish reason `length`)."""
    max_episode_tokens: int | None = Field(None, ge=1)
    """Tokens of one episode after the prompt (model and environment turns together). None:
    `algorithm.max_new_tokens`, which bounds a sample on the wire either way."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """Bound of one environment step (a tool call, an observation); past it the step counts as an error."""
    on_error: Literal["failure_reward", "dead_letter"] = "failure_reward"
    """What an environment error (an exception, a timeout, a malformed step) does: end the episode with
    `failure_reward` (the group goes on), or send the whole group to `dead-letter` with reason `env_error`."""
    failure_reward: float = 0.0
    """Reward of an episode that ended on an environment error (`on_error: failure_reward`)."""
    threads: int = Field(16, ge=1, le=1024)
    """Threads that run environment steps beside the engine; a hanging tool holds one until it returns."""
    wall_time_s: float = Field(300.0, gt=0)
    """`openai_agent`, `verifiers`: bound of one run's (episode's) wall time; past it the run is cancelled and its
    sample ends with what it captured, finish reason `length` and `failure_reward`."""
    endpoint_port: int = Field(0, ge=0, le=65535)
    """`openai_agent`, `verifiers`: the loopback port of the worker's endpoint; 0: a free port the kernel picks."""

    @model_validator(mode="after")
    def _verifiers_names_a_module(self) -> EnvConfig:
        if self.kind == "verifiers" and not _MODULE_RE.match(self.name):
            raise ValueError(f"name {self.name!r}: a verifiers environment is named by its taskset module "
                             f"(`my_env`, or a hub id `owner/my-env`, as `verifiers.v1.load_environment` imports it), "
                             f"not a function")
        if self.kind == "verifiers" and "id" in (self.config.get("taskset") or {}):
            raise ValueError("config.taskset.id: the taskset's id is `name`; leave it out of config")
        return self


class DatasetConfig(Model):
    """Where prompts come from."""

    task: str = "reverse"
    """Name of a task in the rollout task registry (prompt generator + reward). With `dataset.path` and a
    custom reward (`reward.functions` / `reward.url`) it is only the label the records carry."""
    tasks: list[str] = Field(default_factory=list)
    """Extra task names records may carry; the schema refuses any other. `task` is always known."""
    path: str | None = None
    """A JSONL or Parquet file, or a folder written by `datasets.save_to_disk`, read with the `datasets`
    library (local files only); relative to the config file. None: the task's generator."""
    split: str = "train"
    """Split to read from a `save_to_disk` folder that holds several."""
    columns: DatasetColumns = Field(default_factory=DatasetColumns)
    """Column mapping (TRL's `prompt` layouts need none). Columns not mapped travel to reward functions."""
    system_prompt: str | None = None
    """Prepended as a `system` message to chat rows that have none (and turns text rows into chat rows)."""
    shuffle: bool = False
    """Shuffle the rows (each epoch with its own seed derived from `seed`)."""
    epochs: int = Field(1, ge=1)
    """Passes over the dataset file before the dispatcher runs out of prompts."""
    seed: int = 0
    """Seed of the task's prompt generator and of the shuffle."""
    num_prompts: int | None = Field(None, ge=1)
    """Stop dispatching after this many groups. None: as many as training needs."""
    max_prompt_tokens: int = Field(2048, ge=1)
    """Longest prompt (in tokens, after the chat template) a record may carry; longer ones are dead-lettered."""
    env: EnvConfig | None = None
    """Run every sample as an episode in this environment (a row's `env_class` column overrides the name
    per record). None: single completions scored by the reward."""

    @property
    def known_tasks(self) -> frozenset[str]:
        return frozenset([self.task, *self.tasks])
