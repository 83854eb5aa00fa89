"""Scoring a finished group: the task's built-in reward, or the user's functions and endpoint (DESIGN.md §11).

A custom reward has the signature TRL's GRPOTrainer uses for `reward_funcs`, so a function written
for TRL runs unchanged:

    def my_reward(prompts, completions, completion_ids, **columns) -> list[float]: ...
    async def my_reward(prompts, completions, **kwargs) -> list[float]: ...

It is called once per group, with one entry per sample in every list: `prompts` repeats the prompt
(text, or for a chat row its messages), `completions` holds the completion texts (for a chat row
`[{"role": "assistant", "content": text}]` each, as TRL passes them), and each dataset column not
used as the prompt arrives as a keyword argument holding a list (the row's value, repeated). A
sample's reward is the weighted sum of the functions' results (`None` counts as 0, as in TRL),
plus the remote endpoint's (`reward.url`) times `reward.url_weight`.

Any failure (an exception, a call slower than `reward.timeout_s`, a result that is not a list of
one finite float per sample) raises `RewardError` with the traceback's last line; the worker sends
the group to `dead-letter` with reason `reward_error` and goes on. A synchronous function runs in
a thread: one that overruns is abandoned (Python cannot stop a thread), not stopped.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import sys
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetrl.config import RewardConfig
from fleetrl.log import get_logger
from fleetrl.rollout.errors import RewardError, TaskError
from fleetrl.rollout.tasks import Task

log = get_logger(__name__)

RewardFn = Callable[..., Any]


@dataclass(slots=True)
class GroupInput:
    """What a reward sees of one finished group."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    completions: list[str]
    """Completion texts, decoded up to EOS without special tokens."""
    completion_ids: list[list[int]]
    reference: Any = None
    columns: dict[str, Any] = field(default_factory=dict)
    queries: list[str] | None = None
    """Per sample, the prompt as the model saw it (chat template and special tokens included) followed by
    the completion: OpenRLHF's `query`, sent to `reward.url` only."""


@dataclass(slots=True)
class Scores:
    """A group's rewards, and each custom function's unweighted mean over the group (none for a task)."""

    rewards: list[float]
    parts: dict[str, float] | None = None


@dataclass(slots=True)
class FunctionStats:
    """Running totals of one reward function (or `url`) on this worker: worker.stats reports them."""

    groups: int = 0
    samples: int = 0
    total: float = 0.0
    errors: int = 0

    def as_dict(self) -> dict[str, float | int]:
        return {"mean": round(self.total / self.samples, 4) if self.samples else 0.0, "groups": self.groups,
                "errors": self.errors}


def load_function(spec: str, python_path: Sequence[str] = ()) -> RewardFn:
    """Import `package.module:function`, searching `python_path` first; RewardError naming it otherwise."""
    module_name, _, name = spec.partition(":")
    for folder in reversed(python_path):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import runs arbitrary code: any error means "cannot use it"
        raise RewardError(f"{spec}: cannot import {module_name!r}: {_last_line(exc)}") from exc
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardError(f"{spec}: module {module_name!r} has no attribute {name!r}")
    if not callable(fn):
        raise RewardError(f"{spec}: {type(fn).__name__} is not callable")
    return fn


class TaskRewards:
    """The built-in reward of the record's task, per sample (fast: runs inline). A bad reference is a
    `TaskError` (dead letter `reward`); anything else its scorer raises, a `RewardError`."""

    def __init__(self, get_task: Callable[[str], Task]) -> None:
        self._get_task = get_task
        self.stats: dict[str, FunctionStats] = {}

    async def score(self, task: str, group: GroupInput) -> Scores:
        t = self._get_task(task)
        try:
            return Scores([float(t.reward(text, group.reference)) for text in group.completions])
        except TaskError:
            raise
        except Exception as exc:  # a library's scorer (reasoning-gym, math-verify) failed on this group only
            raise RewardError(f"task {task}: {_last_line(exc)}") from exc


class CustomRewards:
    """`reward.functions` and `reward.url`, with their weights, bounded by `reward.timeout_s`."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.functions = [(f.fn, _adapted(load_function(f.fn, config.python_path), f.signature), f.weight)
                          for f in config.functions]
        self.stats: dict[str, FunctionStats] = {name: FunctionStats() for name, _, _ in self.functions}
        if config.url is not None:
            self.stats["url"] = FunctionStats()

    async def score(self, task: str, group: GroupInput) -> Scores:
        n = len(group.completions)
        kwargs = trl_arguments(group)
        totals, parts = [0.0] * n, {}
        for name, fn, weight in self.functions:
            values = await self._counted(name, self._call(name, fn, kwargs), n)
            totals = [t + weight * v for t, v in zip(totals, values, strict=True)]
            parts[name] = sum(values) / n
        if self.config.url is not None:
            payload = {**kwargs, **openrlhf_fields(group)}
            values = await self._counted("url", self._remote(self.config.url, payload), n)
            totals = [t + self.config.url_weight * v for t, v in zip(totals, values, strict=True)]
            parts["url"] = sum(values) / n
        return Scores(totals, parts)

    async def _counted(self, name: str, result: Any, n: int) -> list[float]:
        stats = self.stats[name]
        try:
            values = _checked(name, await result, n)
        except RewardError:
            stats.errors += 1
            raise
        stats.groups, stats.samples, stats.total = stats.groups + 1, stats.samples + n, stats.total + sum(values)
        return values

    async def _call(self, name: str, fn: RewardFn, kwargs: dict[str, Any]) -> Any:
        timeout = self.config.timeout_s
        try:
            if inspect.iscoroutinefunction(fn):
                return await asyncio.wait_for(fn(**kwargs), timeout)
            result = await asyncio.wait_for(asyncio.to_thread(fn, **kwargs), timeout)
            return await asyncio.wait_for(result, timeout) if inspect.isawaitable(result) else result
        except TimeoutError as exc:
            raise RewardError(f"{name}: TimeoutError: took longer than reward.timeout_s={timeout}") from exc
        except Exception as exc:  # the user's code: anything it raises fails this group only
            raise RewardError(f"{name}: {_last_line(exc)}") from exc

    async def _remote(self, url: str, kwargs: dict[str, Any]) -> Any:
        """POST the group as JSON (TRL's arguments plus OpenRLHF's `query` and `labels`); retry (bounded) on
        connection errors, timeouts and 5xx answers."""
        body = json.dumps(kwargs, default=str).encode()
        timeout, last = self.config.timeout_s, "no attempt"
        for attempt in range(self.config.retries + 1):
            try:
                answer = await asyncio.wait_for(asyncio.to_thread(_post, url, body, timeout), timeout + 1)
            except _Retriable as exc:
                last = str(exc)
            except TimeoutError:
                last = f"TimeoutError: no answer within reward.timeout_s={timeout}"
            else:
                rewards = answer.get("rewards") if isinstance(answer, dict) else None
                if rewards is None:
                    raise RewardError(f"url: the answer has no 'rewards' list: {str(answer)[:200]}")
                return rewards
            log.warning("reward.url_retry", url=url, attempt=attempt + 1, error=last)
            await asyncio.sleep(min(0.2 * 2**attempt, 2.0))
        raise RewardError(f"url: {last} (after {self.config.retries + 1} attempts)")


class _Retriable(Exception):
    pass


def _post(url: str, body: bytes, timeout_s: float) -> Any:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:  # it holds the connection: close it, whatever is raised next
            if exc.code >= 500:
                raise _Retriable(f"HTTP {exc.code} from {url}") from exc
            raise RewardError(f"url: HTTP {exc.code} from {url}: {exc.read()[:200]!r}") from exc
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise _Retriable(f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}") from exc
    except json.JSONDecodeError as exc:
        raise RewardError(f"url: the answer is not JSON: {exc.msg}") from exc


def _adapted(fn: RewardFn, signature: str) -> RewardFn:
    """The function called with TRL's arguments: itself, or verl's per-completion form behind a wrapper."""
    if signature == "trl":
        return fn

    def verl(completions: list[Any], **columns: Any) -> list[float]:
        out = []
        for i, completion in enumerate(completions):
            row = {k: v[i] for k, v in columns.items() if isinstance(v, list)}
            spec = row.get("reward_model") or {}
            truth = spec.get("ground_truth") if isinstance(spec, dict) else None
            result = fn(data_source=row.get("data_source"), solution_str=_completion_text(completion),
                        ground_truth=truth if truth is not None else row.get("reference"),
                        extra_info=row.get("extra_info"))
            out.append(result["score"] if isinstance(result, dict) else result)
        return out

    return verl


def _completion_text(completion: Any) -> str:
    return str(completion[0]["content"]) if isinstance(completion, list) else str(completion)


def trl_arguments(group: GroupInput) -> dict[str, Any]:
    """The keyword arguments TRL's GRPOTrainer passes its `reward_funcs`, for one group."""
    n = len(group.completions)
    if group.messages is not None:
        prompts: list[Any] = [group.messages] * n
        completions: list[Any] = [[{"role": "assistant", "content": c}] for c in group.completions]
    else:
        prompts, completions = [group.prompt] * n, list(group.completions)
    columns = {k: [v] * n for k, v in group.columns.items() if k not in ("prompts", "completions", "completion_ids")}
    if "reference" not in columns and group.reference is not None:
        columns["reference"] = [group.reference] * n
    return {"prompts": prompts, "completions": completions, "completion_ids": group.completion_ids, **columns}


def openrlhf_fields(group: GroupInput) -> dict[str, Any]:
    """What an OpenRLHF reward server (`openrlhf.cli.serve_rm`, `--remote_rm_url`) reads: `query` (prompt
    with template + completion, per sample) and `labels` (the reference, per sample)."""
    n = len(group.completions)
    return {"query": group.queries if group.queries is not None else list(group.completions),
            "labels": [group.reference] * n}


def _checked(name: str, values: Any, n: int) -> list[float]:
    if not isinstance(values, list | tuple):
        raise RewardError(f"{name}: returned {type(values).__name__}, expected a list of {n} floats")
    if len(values) != n:
        raise RewardError(f"{name}: returned {len(values)} rewards for {n} completions")
    out = []
    for i, v in enumerate(values):
        if v is None:  # TRL: this function does not apply to the sample
            out.append(0.0)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise RewardError(f"{name}: reward {i} is {v!r}, not a number") from None
        if not math.isfinite(f):
            raise RewardError(f"{name}: reward {i} is {f}, not finite")
        out.append(f)
    return out


def _last_line(exc: BaseException) -> str:
    """The traceback's last line: `ValueError: the message`."""
    return traceback.format_exception_only(exc)[-1].strip()


Rewards = TaskRewards | CustomRewards


def build_rewards(config: RewardConfig, get_task: Callable[[str], Task]) -> Rewards:
    """The worker's scorer: the custom reward when one is configured, else the tasks' built-ins."""
    return CustomRewards(config) if config.custom else TaskRewards(get_task)
