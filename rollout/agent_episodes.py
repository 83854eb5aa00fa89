"""Agent runs as episodes: a user's OpenAI-API agent, once per sample, against the worker's endpoint (§13).

`dataset.env.kind: openai_agent` names a function `package.module:function`:

    async def run(client: openai.AsyncOpenAI, prompt, **row) -> float | None

`prompt` is the record's messages (a chat row) or its text, `row` the row's other columns with
`dataset.env.config` (and the record's `env.args`) under them. The worker calls it once for each of
a group's n samples, concurrently, with a client whose `base_url` is its own endpoint
(rollout/openai_server.py) and whose API key is unique to the sample: every call the agent makes is
decoded by the worker's engine and recorded into that sample (rollout/agent_capture.py). A float
returned is the sample's reward; None: the run's `reward.functions` (or the task's reward) score the
final answer. A run is bounded by `env.max_turns` calls, `env.max_episode_tokens` tokens and
`env.wall_time_s` seconds: a call past a budget is refused (400 `budget_exhausted`); a run past its wall
time is cancelled; either way the sample keeps what it captured, with finish `length` (the reward
the agent returns, or `failure_reward` when it raised on the refusal or was cancelled). An agent that
raises otherwise sends the group to `dead-letter` (`env_error`) with the traceback's last line.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import secrets
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fleetrl.broker import PartialSample, PromptRecord
from fleetrl.config import EnvConfig
from fleetrl.log import get_logger
from fleetrl.rollout.agent_capture import SampleCapture
from fleetrl.rollout.agent_replay import handover_sample, replay_of
from fleetrl.rollout.episodes import EpisodeResult, import_user_module
from fleetrl.rollout.errors import EnvError
from fleetrl.rollout.openai_server import EndpointServer
from fleetrl.rollout.rewards import GroupInput, Rewards

log = get_logger(__name__)
AgentFn = Callable[..., Awaitable[float | None]]


def load_agent(name: str, python_path: Sequence[str] = ()) -> AgentFn:
    """Import `package.module:function` (an `async def`), searching `python_path` first; EnvError otherwise."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise EnvError(f"{name}: an openai_agent is named `package.module:function` (dataset.env.name)")
    module = import_user_module(name, module_name, python_path)
    fn = getattr(module, attr, None)
    if not inspect.iscoroutinefunction(fn):
        raise EnvError(f"{name}: module {module_name!r} has no `async def {attr}(client, prompt, **row)`")
    return fn


def last_line(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return lines[-1].strip() if lines else type(exc).__name__


T = TypeVar("T")

@dataclass(slots=True)
class AgentRunner:
    """Runs one group's agent runs against the worker's endpoint (`server`)."""

    cfg: EnvConfig
    agent: AgentFn
    server: EndpointServer
    rewards: Rewards
    max_tokens: int
    """The run's token budget after its first prompt (model and environment tokens)."""
    resume: list[PartialSample] | None = None
    """A group handed over to this worker: each run's captured calls, replayed to its agent (agent_replay.py)."""
    _captures: dict[int, SampleCapture] = field(default_factory=dict)

    @property
    def tokens_generated(self) -> int:
        """Model tokens captured so far (what a restart elsewhere generates again)."""
        return sum(c.sources.count(0) for c in self._captures.values())

    def handover_samples(self, n: int) -> list[PartialSample]:
        """Each run's completed calls, with the structure to replay them (`fleetrl.partial/2`); call it once
        the runs are cancelled (each capture closed)."""
        resume = self.resume or []
        return [handover_sample(self._captures.get(i), resume[i] if i < len(resume) else None) for i in range(n)]

    async def run_group(self, group_id: str, prompt: PromptRecord, prompt_ids: list[int],
                        args: dict[str, Any]) -> list[EpisodeResult]:
        row = {**self.cfg.config, **args, **(prompt.columns or {})}
        tasks = [asyncio.ensure_future(self._run(f"{group_id}#{i}", prompt, row, i, prompt_ids))
                 for i in range(prompt.n_samples)]
        runs = await gather_or_cancel(tasks)
        missing = [i for i, (_, reward) in enumerate(runs) if reward is None]
        if missing:
            scores = await self._score(prompt, [runs[i][0] for i in missing])
            for i, score in zip(missing, scores, strict=True):
                runs[i] = (runs[i][0], score)
        return [episode_result(c, r) for c, r in runs]

    async def _run(self, sample_id: str, prompt: PromptRecord, row: dict[str, Any], index: int,
                   prompt_ids: list[int]) -> tuple[SampleCapture, float | None]:
        import openai

        key = f"fleetrl-{secrets.token_hex(12)}"
        capture = SampleCapture(key, max_calls=self.cfg.max_turns, max_tokens=self.max_tokens, name=sample_id)
        recorded = self.resume[index] if self.resume is not None and index < len(self.resume) else None
        capture.replay = replay_of(recorded, prompt_ids, self.server.endpoint.template.eos)
        self._captures[index] = capture
        self.server.endpoint.captures[key] = capture
        client = openai.AsyncOpenAI(base_url=self.server.base_url, api_key=key, max_retries=0,
                                    timeout=self.cfg.wall_time_s, http_client=self.server.http_client())
        reward: float | None
        try:
            value = await asyncio.wait_for(self.agent(client, prompt.messages or prompt.prompt or "", **row),
                                           self.cfg.wall_time_s)
            reward = _reward(value, self.cfg.name)
        except TimeoutError:
            capture.exhausted, reward = "env.wall_time_s", self.cfg.failure_reward
        except EnvError:
            raise
        except Exception as exc:  # the agent is user code: any error is the agent's
            if capture.exhausted is None:
                raise EnvError(f"agent {self.cfg.name} ({sample_id}) raised: {last_line(exc)}") from exc
            reward = self.cfg.failure_reward  # it gave up when a budget refused its call
        finally:
            self.server.endpoint.captures.pop(key, None)
            capture.close()  # the client's HTTP pool is the server's: it stays open for the next runs
        return capture, reward

    async def _score(self, prompt: PromptRecord, captures: list[SampleCapture]) -> list[float]:
        """The rewards of runs that returned None: the run's reward functions on each final answer."""
        group = GroupInput(prompt=prompt.prompt, messages=prompt.messages, completions=[c.final_text for c in captures],
                           completion_ids=[[t for t, s in zip(c.tokens, c.sources, strict=True) if s == 0]
                                           for c in captures],
                           reference=prompt.reference, columns=dict(prompt.columns or {}))
        return list((await self.rewards.score(prompt.task, group)).rewards)


def _reward(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EnvError(f"agent {name} returned {value!r}: a finite float (the reward) or None")
    return float(value)


async def gather_or_cancel(tasks: Sequence[asyncio.Future[T]]) -> list[T]:
    """The group's sample runs' results; when one fails (or the group is cancelled) the others stop with it."""
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def episode_result(capture: SampleCapture, reward: float | None) -> EpisodeResult:
    """A finished sample run as the episode the group record is built from (with what it replayed)."""
    replay = capture.replay
    return EpisodeResult(capture.sample(), list(capture.sources), float(reward or 0.0), capture.calls,
                         contexts=list(capture.contexts) if capture.tokens else None,
                         calls_replayed=replay.calls_replayed if replay is not None else 0,
                         tokens_replayed=replay.tokens_replayed if replay is not None else 0,
                         tokens_regenerated=replay.tokens_regenerated if replay is not None else 0)
