"""verifiers environments as episodes: each sample one episode of the environment, its model calls decoded by
the worker's engine through its OpenAI-compatible endpoint (DESIGN.md §11, §13).

`dataset.env.kind: verifiers` names a verifiers (>= 0.4) taskset module; the environment is loaded through
verifiers' own entry point, `verifiers.v1.load_environment(resolve_env_config({taskset: {id: name, ...}, ...}))`,
with `dataset.env.config` as its `[env]` block. Its taskset's tasks are the run's prompts (`taskset_rows`:
one row per task, the task's wire data in the `verifiers_task` column, read by the dispatcher through the
dataset loader like any dataset's rows); a row of a `dataset.path` file instead becomes a task through the
taskset's `TaskData` type (its columns named like the data's fields).

A group runs its n samples as n episodes (`Env.run_episode(task, ModelContext)`), concurrently, inside one
`Env.serving()`. Each episode's `ModelContext` points verifiers' client at the worker's endpoint with a key
unique to the sample, exactly as an `openai_agent` run's client: verifiers' interception server relays
every call the harness makes, the endpoint decodes it in the engine and records it into that sample
(rollout/agent_capture.py), so the sample is the engine's ids and the capture's segments apply unchanged.
The reward is the rubric's: the trace's weighted `@vf.reward`s (`Trace.reward`; the mean over the traces of
a multi-agent episode). An episode that ends with an error sends its group to `dead-letter` (`env_error`),
unless a budget of the sample refused a call first (then `failure_reward`, finish `length`, as for agents).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fleetrl.broker import PromptRecord
from fleetrl.config import EnvConfig
from fleetrl.log import get_logger
from fleetrl.rollout.agent_capture import SampleCapture
from fleetrl.rollout.agent_episodes import episode_result, gather_or_cancel
from fleetrl.rollout.episodes import EpisodeResult
from fleetrl.rollout.errors import EnvError
from fleetrl.rollout.openai_server import EndpointServer

log = get_logger(__name__)
TASK_COLUMN = "verifiers_task"
"""The row column that carries a task's wire data (`TaskData` as JSON) from the dispatcher to the worker."""
MODEL_NAME = "policy"
"""The model name verifiers' calls carry (the endpoint serves its engine under any name)."""


def load_verifiers_env(cfg: EnvConfig) -> Any:
    """The `verifiers.v1.Env` of `dataset.env` (`kind: verifiers`); EnvError naming the module when it does not load."""
    for folder in reversed(cfg.python_path):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise EnvError(f"{cfg.name}: kind verifiers needs the `verifiers` extra "
                       f"(pip install 'fleetrl[verifiers]'): {exc}") from exc
    block = {**cfg.config, "taskset": {**(cfg.config.get("taskset") or {}), "id": cfg.name}}
    try:
        return vf.load_environment(vf.resolve_env_config(block))
    except Exception as exc:  # loading imports and runs the user's module
        raise EnvError(f"{cfg.name}: verifiers cannot load the environment (dataset.env.name, dataset.env.config): "
                       f"{type(exc).__name__}: {_first_line(exc)}") from exc


def taskset_rows(env: Any, name: str, limit: int | None = None) -> list[dict[str, Any]]:
    """One dataset row per task of the environment's taskset: `prompt` (chat messages) and `verifiers_task`
    (the task's data as JSON). `limit` bounds an infinite taskset (`dataset.num_prompts`)."""
    taskset = env.taskset
    if not taskset.bounded:
        if limit is None:
            raise EnvError(f"{name}: the taskset is infinite: set dataset.num_prompts to bound it")
        taskset = taskset.take(limit)
    rows = [{"prompt": task_messages(task.data, name), TASK_COLUMN: task.data.model_dump_json(exclude_none=True)}
            for task in _tasks(taskset, name)]
    if not rows:
        raise EnvError(f"{name}: the taskset holds no tasks")
    return rows


def _tasks(taskset: Any, name: str) -> Iterator[Any]:
    try:
        yield from taskset
    except Exception as exc:  # the taskset's load() is user code
        raise EnvError(f"{name}: the taskset's load() raised {type(exc).__name__}: {_first_line(exc)}") from exc


def task_messages(data: Any, name: str) -> list[dict[str, str]]:
    """A task's opening as `[{role, content}]` (its system prompt, then its prompt), text content only."""
    from verifiers.v1.types import content_text

    out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        out += [{"role": str(m.role), "content": content_text(m.content) or ""} for m in data.prompt]
    if not any(m["role"] != "system" for m in out):
        raise EnvError(f"{name}: task {data.idx} has no prompt (a task the user opens is not supported)")
    return out


def task_of(env: Any, prompt: PromptRecord) -> Any:
    """The environment's task of a record: from its `verifiers_task` column, else from the row's columns and
    prompt (a `dataset.path` row whose columns name the task data's fields)."""
    task_type = type(env.taskset).task_type()
    data_type = task_type.data_type()
    columns = dict(prompt.columns or {})
    raw = columns.pop(TASK_COLUMN, None)
    try:
        if isinstance(raw, str):
            data = data_type.model_validate(json.loads(raw))
        else:
            data = data_type.model_validate({**columns, "prompt": prompt.messages or prompt.prompt})
        return task_type(data, env.taskset.config.task)
    except Exception as exc:  # pydantic's ValidationError, or the task's own constructor
        raise EnvError(f"record {prompt.group_id}: not a task of {data_type.__name__}: "
                       f"{type(exc).__name__}: {_first_line(exc)}") from exc


@dataclass(slots=True)
class VerifiersRunner:
    """Runs one group's episodes of a verifiers environment against the worker's endpoint (`server`)."""

    cfg: EnvConfig
    env: Any
    server: EndpointServer
    max_tokens: int
    """An episode's token budget after its first prompt (model and environment tokens)."""
    _captures: list[SampleCapture] = field(default_factory=list)

    @property
    def tokens_generated(self) -> int:
        """Model tokens captured so far (what a restart elsewhere generates again)."""
        return sum(c.sources.count(0) for c in self._captures)

    async def run_group(self, group_id: str, prompt: PromptRecord, prompt_ids: list[int],
                        args: dict[str, Any]) -> list[EpisodeResult]:
        task = task_of(self.env, prompt)
        async with self.env.serving():
            runs = await gather_or_cancel([asyncio.ensure_future(self._episode(f"{group_id}#{i}", task))
                                           for i in range(prompt.n_samples)])
        return [episode_result(c, reward) for c, reward in runs]

    async def _episode(self, sample_id: str, task: Any) -> tuple[SampleCapture, float]:
        import verifiers.v1 as vf

        key = f"fleetrl-{secrets.token_hex(12)}"
        capture = SampleCapture(key, max_calls=self.cfg.max_turns, max_tokens=self.max_tokens, name=sample_id)
        self._captures.append(capture)
        self.server.endpoint.captures[key] = capture
        # verifiers' client reads its API key from an environment variable: one per sample, gone at the end.
        var = f"FLEETRL_VERIFIERS_KEY_{secrets.token_hex(8).upper()}"
        os.environ[var] = key
        ctx = vf.ModelContext(model=MODEL_NAME, client=vf.EvalClientConfig(base_url=self.server.base_url,
                                                                          api_key_var=var))
        try:
            episode = await asyncio.wait_for(self.env.run_episode(task, ctx), self.cfg.wall_time_s)
            reward = self._reward(episode, capture, sample_id)
        except TimeoutError:
            capture.exhausted, reward = "env.wall_time_s", self.cfg.failure_reward
        finally:
            os.environ.pop(var, None)
            self.server.endpoint.captures.pop(key, None)
            capture.close()
        return capture, reward

    def _reward(self, episode: Any, capture: SampleCapture, sample_id: str) -> float:
        if not episode.ok:
            if capture.exhausted is not None:
                return self.cfg.failure_reward  # the harness gave up when a budget refused its call
            errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
            why = f"{errors[-1].type}: {_first_line(errors[-1].message)}" if errors else "no error recorded"
            raise EnvError(f"verifiers environment {self.cfg.name} ({sample_id}) failed: {why}")
        rewards = [float(t.reward) for t in episode.traces]
        value = sum(rewards) / len(rewards)
        if not math.isfinite(value):
            raise EnvError(f"verifiers environment {self.cfg.name} ({sample_id}) scored {value}: not finite")
        return value


def _first_line(exc: BaseException | str) -> str:
    """An error's first lines on one line (a pydantic error names the field on its second and third)."""
    lines = [line.strip() for line in str(exc).strip().splitlines()[:3] if line.strip()]
    return "; ".join(lines) if lines else type(exc).__name__
