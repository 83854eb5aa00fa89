"""The record types of the data plane (DESIGN.md §3) and their bounds.

In memory, token arrays are numpy arrays (`int32` ids, `float32` logprobs, `int32` per-token
policy versions, one per token). `fleetrl.broker.codec` turns records into msgpack bytes and back;
`check_record` enforces the bounds that are part of the schema, so a record outside them is refused
with the field at fault, and the consumer sends it to `dead-letter` with that reason.
"""

from __future__ import annotations

import itertools
import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetrl.broker.errors import RecordError

SCHEMA_PROMPT = "fleetrl.prompt/1"
SCHEMA_PROMPT_V2 = "fleetrl.prompt/2"
"""A prompt with `messages` (chat form) or `columns` (the dataset row's other fields); readers accept both."""
MAX_COLUMNS_BYTES = 64 * 1024
"""Bound of a prompt's `columns`, packed."""
SCHEMA_PARTIAL = "fleetrl.partial/1"
SCHEMA_PARTIAL_V2 = "fleetrl.partial/2"
"""A partial whose samples carry `segments` and `contexts` (an agent run's captured calls, replayed where it
resumes); readers accept both."""
SCHEMA_GROUP = "fleetrl.group/1"
SCHEMA_GROUP_V2 = "fleetrl.group/2"
"""A group whose samples carry `segments` (episodes: policy and environment tokens); readers accept both."""
SOURCE_POLICY, SOURCE_ENV = 0, 1
"""`segments` sources: a token the policy generated, a token the environment wrote (tool result, observation)."""
ENV_VERSION = -1
"""The per-token version of an environment token (its logprob is 0): no policy produced it."""
FINISH_REASONS = frozenset({"stop", "length", "abort"})

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float32]


def ids(values: Any) -> IntArray:
    """Token ids as the record's array type."""
    return np.ascontiguousarray(values, dtype=np.int32)


def floats(values: Any) -> FloatArray:
    """Logprobs as the record's array type."""
    return np.ascontiguousarray(values, dtype=np.float32)


@dataclass(slots=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64


@dataclass(frozen=True, slots=True)
class EvalTag:
    """Marks a prompt, a partial and a group as held-out evaluation (`fleetrl.prompt/2`, `fleetrl.group/2`):
    generated only with the weights of `version`, never trained on (DESIGN.md §12)."""

    set_name: str
    """The eval set (`eval.sets[].name`)."""
    version: int
    """The pinned policy version: every token of every sample is generated with exactly these weights."""


@dataclass(slots=True)
class PromptRecord:
    """`fleetrl.prompt/1`: one group of work (one prompt, n samples), produced by the dispatcher."""

    group_id: str
    run: str
    task: str
    n_samples: int
    sampling: Sampling
    prompt: str | None = None
    prompt_ids: IntArray | None = None
    reference: Any = None
    """Opaque to the worker except for the task's reward function (msgpack-able)."""
    min_version: int = 0
    dispatched_at: float = 0.0
    attempt: int = 0
    messages: list[dict[str, Any]] | None = None
    """`fleetrl.prompt/2`: the chat form, `[{role, content}]`, rendered by the worker's chat template."""
    columns: dict[str, Any] | None = None
    """`fleetrl.prompt/2`: the dataset row's other fields, handed to reward functions (msgpack-able)."""
    env: dict[str, Any] | None = None
    """`fleetrl.prompt/2`: the environment that runs the episode, `{name, args}` (DESIGN.md §11); None:
    the run's `dataset.env`, if any."""
    eval: EvalTag | None = None
    """`fleetrl.prompt/2`: an eval prompt, pinned to `eval.version` (None: training work)."""

    @property
    def schema(self) -> str:
        """`/2` only when a /2 field is set, so that /1 readers keep reading plain prompts."""
        v2 = self.messages is not None or self.columns is not None or self.env is not None or self.eval is not None
        return SCHEMA_PROMPT_V2 if v2 else SCHEMA_PROMPT


@dataclass(slots=True)
class PartialSample:
    """A sample as far as it got: resumable token for token."""

    completion_ids: IntArray
    logprobs: FloatArray
    versions: IntArray
    finish_reason: str | None = None
    """None while the sample is unfinished; a finished sample keeps its reason (and is not resumed)."""
    segments: IntArray | None = None
    """`fleetrl.partial/2`: run-length sources as in `Sample.segments` (an agent run's policy and environment
    tokens, so that its calls can be replayed); None: every token is the policy's."""
    contexts: list[tuple[int, IntArray]] | None = None
    """`fleetrl.partial/2`: the sample's segments of context, as in `Sample.contexts`."""


@dataclass(slots=True)
class HandedOverBy:
    region: str
    node: str
    reason: str
    """`preempted`, `sigterm`, `drain`, `stop` (operator commands), `deadline` (long-tail cut) or `min_version`."""


@dataclass(slots=True)
class PartialRecord:
    """`fleetrl.partial/1`: an unfinished group handed over on preemption or a long-tail cut."""

    prompt: PromptRecord
    samples: list[PartialSample]
    handed_over_by: HandedOverBy

    @property
    def schema(self) -> str:
        """`/2` only when a sample carries segments or contexts (an agent run's capture), so that /1 readers
        keep reading partials of plain completions."""
        v2 = any(s.segments is not None or s.contexts is not None for s in self.samples)
        return SCHEMA_PARTIAL_V2 if v2 else SCHEMA_PARTIAL

    @property
    def group_id(self) -> str:
        return self.prompt.group_id


@dataclass(slots=True)
class Sample:
    completion_ids: IntArray
    logprobs: FloatArray
    """Behaviour log-probability of each sampled token under the engine's policy."""
    versions: IntArray
    """Policy version that produced each token (run-length coded on the wire)."""
    reward: float
    finish_reason: str
    segments: IntArray | None = None
    """`fleetrl.group/2`: run-length sources, shape (runs, 2) of (first token index, source); None: every
    token is the policy's. Environment tokens carry logprob 0 and version -1 and never enter the loss."""

    contexts: list[tuple[int, IntArray]] | None = None
    """`fleetrl.group/2`, optional: the sample's segments of context, each (index of its first completion
    token, the prompt ids it continues). An agent run (DESIGN.md §13) whose calls did not all extend one
    context is several segments of one sample; each is its own loss context with the sample's reward.
    None: one segment, continuing the group's `prompt_ids`."""

    def sources(self) -> IntArray:
        """The source of every token (0 policy, 1 environment)."""
        return expand_segments(self.segments, len(self.completion_ids))

    def policy_mask(self) -> npt.NDArray[np.bool_]:
        """True where the policy generated the token."""
        return self.sources() == SOURCE_POLICY


def expand_segments(segments: IntArray | None, n_tokens: int) -> IntArray:
    """Per-token sources of run-length `segments` (already bounds-checked)."""
    if segments is None or len(segments) == 0:
        return np.zeros(n_tokens, dtype=np.int32)
    seg = np.asarray(segments, dtype=np.int32).reshape(-1, 2)
    ends = np.append(seg[1:, 0], n_tokens)
    out: IntArray = np.repeat(seg[:, 1], ends - seg[:, 0]).astype(np.int32)
    return out


def segments_of(sources: Any) -> IntArray:
    """Run-length `segments` of per-token sources: one (first index, source) row per run."""
    src = np.asarray(sources, dtype=np.int32)
    if len(src) == 0:
        return np.zeros((0, 2), dtype=np.int32)
    starts = np.concatenate([[0], np.flatnonzero(src[1:] != src[:-1]) + 1]).astype(np.int32)
    return np.stack([starts, src[starts]], axis=1).astype(np.int32)


@dataclass(slots=True)
class Timings:
    """When the worker that finished a group (its wall clock, seconds since the epoch)..."""

    queued: float = 0.0
    """... received the prompt (or the partial it resumed);"""
    started: float = 0.0
    """... started it on its engine (its `min_version` weights in);"""
    finished: float = 0.0
    """... had the group complete and scored."""


@dataclass(slots=True)
class GroupRecord:
    """`fleetrl.group/1`: a finished group, consumed by the trainer."""

    group_id: str
    run: str
    task: str
    attempt: int
    region: str
    node: str
    prompt_ids: IntArray
    samples: list[Sample]
    timings: Timings = field(default_factory=Timings)
    reward_parts: dict[str, float] | None = None
    """Optional: each custom reward function's mean over the samples (the trainer's step log shows them)."""
    eval: EvalTag | None = None
    """`fleetrl.group/2`: an eval group (the collector never batches it), from the prompt's tag."""
    regenerated: dict[str, int] | None = None
    """`fleetrl.group/2`: policy tokens of a handed-over agent capture that its worker could not replay (generated
    again), by the region that first sampled them: preemption waste (docs/agents.md, docs/cost.md)."""

    @property
    def schema(self) -> str:
        """`/2` only when a sample carries segments or contexts or the group is an eval's, so that /1 readers
        keep reading single completions of training."""
        v2 = self.eval is not None or self.regenerated is not None or any(
            s.segments is not None or s.contexts is not None for s in self.samples)
        return SCHEMA_GROUP_V2 if v2 else SCHEMA_GROUP

    @property
    def min_version(self) -> int:
        """Oldest policy version any policy token of the group was sampled from (environment tokens,
        version -1, are nobody's)."""
        olds = [int(v.min()) for v in (s.versions[s.versions >= 0] for s in self.samples) if len(v)]
        return min(olds, default=0)


Record = PromptRecord | PartialRecord | GroupRecord


@dataclass(frozen=True, slots=True)
class RecordLimits:
    """Bounds that are part of the schema; a record outside them is dead-lettered with the reason."""

    vocab_size: int
    known_tasks: frozenset[str]
    max_tokens_per_sample: int = 32768
    max_prompt_tokens: int = 32768
    max_samples_per_group: int = 1024

    @classmethod
    def from_config(cls, config: Any) -> RecordLimits:
        """Limits of a run: vocab from the model, tasks from the dataset, tokens from the algorithm."""
        return cls(
            vocab_size=_vocab_size(config.model),
            known_tasks=config.dataset.known_tasks,
            max_tokens_per_sample=max(config.algorithm.max_new_tokens, _episode_tokens(config.dataset),
                                      *(s.max_new_tokens or 0 for s in _eval_sets(config))),
            max_prompt_tokens=config.dataset.max_prompt_tokens,
            max_samples_per_group=max([config.algorithm.n_samples,
                                       *(s.samples_per_prompt for s in _eval_sets(config))]),
        )


def _eval_sets(config: Any) -> list[Any]:
    """The run's eval sets (`eval.sets`): their groups may hold more samples and tokens than training's."""
    eval_cfg = getattr(config, "eval", None)
    return list(eval_cfg.sets) if eval_cfg is not None else []


def _episode_tokens(dataset: Any) -> int:
    """An episode (`dataset.env`) may run longer than one completion: up to `env.max_episode_tokens`."""
    env = getattr(dataset, "env", None)
    return int(env.max_episode_tokens or 0) if env is not None else 0


def _vocab_size(model: Any) -> int:
    if model.path is None:
        return int(model.tiny.vocab_size)
    cfg = json.loads((pathlib.Path(model.path) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {})["vocab_size"])


def check_record(record: Record, limits: RecordLimits) -> None:
    """Raise `RecordError` naming the first field outside the schema's bounds."""
    if isinstance(record, GroupRecord):
        _check_group(record, limits)
    elif isinstance(record, PartialRecord):
        _check_prompt(record.prompt, limits)
        _check_count(len(record.samples), limits, record.group_id)
        for i, s in enumerate(record.samples):
            _check_tokens(f"samples[{i}]", s.completion_ids, s.logprobs, s.versions, limits, record.group_id,
                          s.segments)
            if s.contexts is not None:
                _check_contexts(f"samples[{i}].contexts", s.contexts, len(s.completion_ids), limits,
                                record.group_id)
    else:
        _check_prompt(record, limits)


def _check_prompt(p: PromptRecord, limits: RecordLimits) -> None:
    g = p.group_id
    _check_task(p.task, limits, g)
    if p.prompt is None and p.prompt_ids is None and p.messages is None:
        raise RecordError("missing_prompt", "none of prompt, prompt_ids, messages is set", field="prompt", group_id=g)
    if p.messages is not None:
        _check_messages(p.messages, g)
    if p.columns is not None:
        _check_columns(p.columns, g)
    if p.env is not None:
        _check_env(p.env, g)
    if p.eval is not None:
        _check_eval(p.eval, g)
    if p.prompt_ids is not None:
        _check_ids("prompt_ids", p.prompt_ids, limits, limits.max_prompt_tokens, g)
    if not 1 <= p.n_samples <= limits.max_samples_per_group:
        raise RecordError(
            "samples_bound", f"n_samples {p.n_samples} outside 1..{limits.max_samples_per_group}",
            field="n_samples", group_id=g,
        )
    s = p.sampling
    if not (s.temperature > 0 and 0 < s.top_p <= 1 and 1 <= s.max_new_tokens <= limits.max_tokens_per_sample):
        raise RecordError("sampling_bound", f"sampling {s} outside bounds", field="sampling", group_id=g)


def _check_group(r: GroupRecord, limits: RecordLimits) -> None:
    g = r.group_id
    _check_task(r.task, limits, g)
    _check_ids("prompt_ids", r.prompt_ids, limits, limits.max_prompt_tokens, g)
    _check_count(len(r.samples), limits, g)
    # The arrays of all the samples at once (a few reductions for the group instead of a few per sample:
    # the trainer's ingest is bound by them); where that finds a fault, the per-sample checks name it.
    whole = _plain_samples_in_bounds(r.samples, limits)
    for i, s in enumerate(r.samples):
        if not whole:
            _check_tokens(f"samples[{i}]", s.completion_ids, s.logprobs, s.versions, limits, g, s.segments)
        if s.contexts is not None:
            _check_contexts(f"samples[{i}].contexts", s.contexts, len(s.completion_ids), limits, g)
        if s.finish_reason not in FINISH_REASONS:
            raise RecordError("finish_reason", f"unknown finish_reason {s.finish_reason!r}",
                              field=f"samples[{i}].finish_reason", group_id=g)
        if not math.isfinite(s.reward):
            raise RecordError("reward", f"reward {s.reward} is not finite", field=f"samples[{i}].reward", group_id=g)
    if r.eval is not None:
        _check_eval(r.eval, g)
        pinned = {int(v) for s in r.samples for v in np.unique(s.versions[s.versions >= 0])}
        if pinned - {r.eval.version}:
            raise RecordError("version_bound", f"eval group pinned to version {r.eval.version} holds tokens of "
                              f"version(s) {sorted(pinned - {r.eval.version})}", field="samples.versions", group_id=g)
    if r.regenerated is not None and not all(isinstance(k, str) and type(v) is int and v >= 0
                                             for k, v in r.regenerated.items()):
        raise RecordError("malformed", "regenerated must map regions to token counts >= 0", field="regenerated",
                          group_id=g)
    for name, value in (r.reward_parts or {}).items():
        if not isinstance(value, float | int) or not math.isfinite(value):
            raise RecordError("reward", f"reward part {name!r} is {value!r}, not a finite number",
                              field="reward_parts", group_id=g)


def _plain_samples_in_bounds(samples: list[Sample], limits: RecordLimits) -> bool:
    """True when every sample is a plain completion (no segments) within the bounds `_check_tokens`
    checks; False says only that one of them must be checked alone."""
    if any(s.segments is not None or s.contexts is not None
           or not len(s.completion_ids) == len(s.logprobs) == len(s.versions)
           or len(s.completion_ids) > limits.max_tokens_per_sample for s in samples):
        return False
    if not any(len(s.completion_ids) for s in samples):
        return True
    ids = np.concatenate([s.completion_ids for s in samples])
    logprobs = np.concatenate([s.logprobs for s in samples])
    versions = np.concatenate([s.versions for s in samples])
    # NaN fails every comparison: `max <= 0` refuses NaN and +inf, `min > -inf` refuses -inf.
    return bool(int(ids.min()) >= 0 and int(ids.max()) < limits.vocab_size and float(logprobs.max()) <= 0.0
                and float(logprobs.min()) > -math.inf and int(versions.min()) >= 0)


def _check_task(task: str, limits: RecordLimits, g: str) -> None:
    if task not in limits.known_tasks:
        raise RecordError("unknown_task", f"unknown task {task!r}; known: {sorted(limits.known_tasks)}",
                          field="task", group_id=g)


def _check_count(n: int, limits: RecordLimits, g: str) -> None:
    if not 1 <= n <= limits.max_samples_per_group:
        raise RecordError("samples_bound", f"{n} samples outside 1..{limits.max_samples_per_group}",
                          field="samples", group_id=g)


def _check_contexts(name: str, contexts: list[tuple[int, IntArray]], n_tokens: int, limits: RecordLimits,
                    g: str) -> None:
    """Segments start at token 0, increase, stay below the sample's length; each context is token ids
    no longer than a prompt and a whole sample (an agent's later call carries its earlier turns)."""
    starts = [at for at, _ in contexts]
    if not starts or starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)) \
            or starts[-1] >= max(n_tokens, 1):
        raise RecordError("segment_bound", f"contexts must start at token 0, increase, stay below {n_tokens}",
                          field=name, group_id=g)
    for j, (_, prompt) in enumerate(contexts):
        if len(prompt) == 0:
            raise RecordError("segment_bound", "a context holds no prompt token", field=f"{name}[{j}]", group_id=g)
        _check_ids(f"{name}[{j}]", prompt, limits, limits.max_prompt_tokens + limits.max_tokens_per_sample, g)


def _check_ids(name: str, arr: IntArray, limits: RecordLimits, max_len: int, g: str) -> None:
    if len(arr) > max_len:
        raise RecordError("tokens_bound", f"{len(arr)} tokens > {max_len}", field=name, group_id=g)
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= limits.vocab_size):
        raise RecordError("token_range", f"token id outside [0, {limits.vocab_size})", field=name, group_id=g)


def _check_tokens(
    name: str, tokens: IntArray, logprobs: FloatArray, versions: IntArray, limits: RecordLimits, g: str,
    segments: IntArray | None = None,
) -> None:
    _check_ids(f"{name}.completion_ids", tokens, limits, limits.max_tokens_per_sample, g)
    if not len(logprobs) == len(versions) == len(tokens):
        raise RecordError("length_mismatch", f"{len(tokens)} tokens, {len(logprobs)} logprobs, "
                          f"{len(versions)} versions", field=name, group_id=g)
    if len(logprobs) and not (np.isfinite(logprobs).all() and float(logprobs.max()) <= 0.0):
        raise RecordError("logprob_bound", "logprobs must be finite and <= 0", field=f"{name}.logprobs", group_id=g)
    if segments is None:
        if len(versions) and int(versions.min()) < 0:
            raise RecordError("version_bound", "negative policy version", field=f"{name}.versions", group_id=g)
        return
    _check_segments(f"{name}.segments", segments, len(tokens), g)
    env = expand_segments(segments, len(tokens)) == SOURCE_ENV
    if (versions[~env] < 0).any():
        raise RecordError("version_bound", "negative policy version", field=f"{name}.versions", group_id=g)
    if (versions[env] != ENV_VERSION).any() or (logprobs[env] != 0.0).any():
        raise RecordError("segment_bound", "environment tokens must carry logprob 0 and version -1",
                          field=f"{name}.segments", group_id=g)


def _check_segments(name: str, segments: IntArray, n_tokens: int, g: str) -> None:
    seg = np.asarray(segments).reshape(-1, 2) if np.asarray(segments).size % 2 == 0 else None
    ok = seg is not None and (
        (n_tokens == 0 and len(seg) == 0)
        or (len(seg) > 0 and seg[0, 0] == 0 and bool((np.diff(seg[:, 0]) > 0).all())
            and int(seg[-1, 0]) < n_tokens and bool(np.isin(seg[:, 1], (SOURCE_POLICY, SOURCE_ENV)).all()))
    )
    if not ok:
        raise RecordError("segment_bound", f"segments must start at token 0, increase, stay below {n_tokens} "
                          "and name source 0 (policy) or 1 (environment)", field=name, group_id=g)


def _check_messages(messages: Any, g: str) -> None:
    ok = isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise RecordError("malformed", "messages must be a non-empty list of {role: str, content: str}",
                          field="messages", group_id=g)


def _check_columns(columns: dict[str, Any], g: str) -> None:
    import msgpack

    try:
        size = len(msgpack.packb(columns, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as exc:
        raise RecordError("unencodable", f"columns cannot be packed: {exc}", field="columns", group_id=g) from exc
    if size > MAX_COLUMNS_BYTES:
        raise RecordError("columns_bound", f"columns pack to {size} bytes > {MAX_COLUMNS_BYTES}", field="columns",
                          group_id=g)


def _check_eval(tag: EvalTag, g: str) -> None:
    if not tag.set_name or tag.version < 0:
        raise RecordError("malformed", f"eval must be {{set: non-empty str, version: int >= 0}}, got {tag}",
                          field="eval", group_id=g)


def _check_env(env: Any, g: str) -> None:
    ok = isinstance(env, dict) and isinstance(env.get("name"), str) and bool(env["name"]) \
        and isinstance(env.get("args", {}), dict) and set(env) <= {"name", "args"}
    if not ok:
        raise RecordError("malformed", "env must be {name: str, args: {...}}", field="env", group_id=g)
