"""The engine interface: a continuous-batching scheduler over the samples of many groups.

A rollout worker submits groups (one prompt, n samples) to an engine and calls `step()` in a loop.
Each step decodes one token for every running sample (a pool of up to `max_batch` slots decoded
together); slots freed by finished samples are refilled with waiting samples at the next step, so
the batch stays full on long-tailed workloads. A group comes back from `step()` once all its
samples have finished.

Every sampled token carries its behaviour log-probability (`fleetrl.rollout.sampling` states the
convention) and the policy version of the weights that produced it. `stage_weights` hands the
engine a new version at any time (`stage_changes`: only the elements it changed, for an engine
that `accepts_changes`); it is applied *between* decoding steps, so the per-token versions
of a sample switch exactly at the step after which the weights changed (in-flight update; the KV
cache of earlier tokens is kept, as PipelineRL does). Staged updates apply in the order given: a
complete set of weights replaces whatever waits before it, changes and parts follow each other. A
LoRA run's versions are adapters on a base version: `stage_adapter` hands one over the same way (with
its base's full weights when the engine does not hold that base yet), and an adapter of a base the
engine does not hold is refused. `take(group_id)` withdraws an unfinished group and returns its
samples as far as they got (token-level handover); `submit` with `resume=` continues them where they
stopped, keeping finished samples as they are.

Answers that other workers of the region gave (read from its `trajectories`,
`rollout/region_history.py`) reach the engine through `observe_responses`: an engine with a response
history records them in its own thread, a bounded number of tokens per step; the others ignore them.

Engines are driven from one thread at a time (the worker runs `step` in `asyncio.to_thread`);
`stage_weights` and `observe_responses` alone may be called from any thread.
"""

from __future__ import annotations

import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fleetrl.broker import PartialSample, Sampling, floats, ids
from fleetrl.config import EngineEmulation
from fleetrl.rollout.adapters import LoraWeights
from fleetrl.rollout.errors import EngineError
from fleetrl.rollout.sampling import sample_key


@dataclass(slots=True)
class GroupRequest:
    """One group of work for an engine."""

    group_id: str
    prompt_ids: Sequence[int]
    sampling: Sampling
    n_samples: int
    seed: int = 0
    """With (group_id, sample index, token position), fixes every sampled token."""
    resume: Sequence[PartialSample] | None = None
    """Samples as far as a previous worker got (n_samples of them); finished ones are kept as is."""
    key: str | None = None
    """The name the sampling randomness is keyed by (with `seed` and the sample index); None: `group_id`.
    The agent endpoint keys a request that sets OpenAI's `seed` by that seed alone, so it repeats."""


@dataclass(frozen=True, slots=True)
class TensorChanges:
    """The elements of one tensor (Hugging Face name) that a version changed."""

    positions: Any
    """Flat positions (sorted int64 numpy array) into the tensor's elements."""
    values: Any
    """Their new values (a 1-D torch tensor in the published dtype, as long as `positions`)."""


@dataclass(slots=True)
class FinishedGroup:
    group_id: str
    samples: list[PartialSample]
    """Every sample with its `finish_reason` set (`stop` at EOS, `length` at max_new_tokens)."""


@dataclass(slots=True, eq=False)
class SeqState:
    """One sample being decoded: the prompt and its completion so far."""

    group_id: str
    index: int
    key: int
    prompt_ids: list[int]
    sampling: Sampling
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_at: int | None = None
    """An emulated completion length (`engine.emulate`): the sample stops after this many tokens."""
    history_key: bytes | None = None
    """The prompt's key in the engine's response history (`rollout/history.py`), when it keeps one."""
    draft_at: int = -1
    """Where in the history its next draft likely continues (`ResponseHistory.draft`'s hint)."""

    def to_partial(self) -> PartialSample:
        return PartialSample(ids(self.tokens), floats(self.logprobs), ids(self.versions), self.finish_reason)

    @property
    def position(self) -> int:
        """Index of the next completion token (the counter of its sampling randomness)."""
        return len(self.tokens)


class Engine(ABC):
    """Group bookkeeping, weight staging and finish rules shared by every engine."""

    def __init__(self, *, eos_ids: Sequence[int], max_context: int, version: int = 0,
                 emulate: EngineEmulation | None = None) -> None:
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.emulate = emulate
        """Emulated per-step delay and completion lengths (benchmarks on CPU), or None."""
        self.max_context = max_context
        self._version = version
        self._groups: dict[str, list[SeqState]] = {}
        self._touched: set[str] = set()
        self.tokens_sampled = 0
        """Tokens this engine sampled (resumed prefixes excluded): the work it did."""
        self._staged: list[_Staged] = []
        """Updates waiting for the next step, in the order they apply."""
        self._staged_lock = threading.Lock()
        self.base_version: int | None = None
        """The version of full weights under the adapter this engine serves (None: no adapter)."""
        self.responses_observed = 0
        """Answers of other workers (`observe_responses`) recorded into the engine's history."""
        self.responses_dropped = 0
        """Answers of other workers dropped unrecorded (more arrived than the engine had time to record)."""

    # -- public surface -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Policy version of the weights the next step decodes with (once staged ones apply)."""
        return self._version

    accepts_changes = False
    """Whether `stage_changes` works: the engine scatters a version's changed elements into its weights."""

    @property
    def staged_version(self) -> int | None:
        """Newest version staged and not applied yet, if any."""
        with self._staged_lock:
            return self._staged[-1].version if self._staged else None

    def has_staged(self) -> bool:
        return self.staged_version is not None

    def submit(self, request: GroupRequest) -> None:
        """Queue a group; its samples join the batch as slots free up."""
        if request.group_id in self._groups:
            raise EngineError(f"group {request.group_id} is already in the engine")
        seqs = self._states(request)
        self._groups[request.group_id] = seqs
        self._touched.add(request.group_id)  # a resumed group may hold only finished samples
        self._enqueue([s for s in seqs if s.finish_reason is None])

    def step(self) -> list[FinishedGroup]:
        """Apply staged weights, decode one token for every running sample, return finished groups."""
        self._apply_staged()
        if self.has_work():
            self._decode_step()
            if self.emulate is not None and self.emulate.step_delay_s:
                time.sleep(self.emulate.step_delay_s)  # a slower accelerator (the step runs in a thread)
        return self._collect_finished()

    def take(self, group_id: str) -> list[PartialSample]:
        """Withdraw a group (finished or not) and return its samples as far as they got."""
        seqs = self._groups.pop(group_id, None)
        if seqs is None:
            raise EngineError(f"group {group_id} is not in the engine")
        self._withdraw([s for s in seqs if s.finish_reason is None])
        return [s.to_partial() for s in seqs]

    def stage_weights(self, tensors: Mapping[str, Any], version: int, complete: bool = True) -> None:
        """Hand over a new weight version (any thread); it applies before the next decoding step. The
        engine reads the tensors when it applies them: the caller must not change them meanwhile.
        `complete` False: only the tensors the version changed (after what is staged already)."""
        with self._staged_lock:
            if complete:
                self._staged = [_Staged("all", tensors, version)]
            else:
                self._staged.append(_Staged("part", tensors, version))

    def stage_changes(self, changes: Mapping[str, TensorChanges], version: int) -> None:
        """Hand over the elements `version` changed from the version before it (staged or loaded); they
        are written into the weights before the next decoding step (any thread)."""
        if not self.accepts_changes:
            raise EngineError(f"{type(self).__name__} does not take sparse weight changes; stage tensors")
        with self._staged_lock:
            self._staged.append(_Staged("changes", changes, version))

    def stage_adapter(self, adapter: LoraWeights, base: Mapping[str, Any] | None = None) -> None:
        """Hand over a LoRA adapter version (any thread), applied before the next decoding step like
        `stage_weights`. `base`: the full weights of version `adapter.base`, when the engine does not
        hold that base yet. Refuses (EngineError) an adapter of another base than the one it holds."""
        with self._staged_lock:
            last = self._staged[-1] if self._staged else None
            held = self.base_version if last is None else (last.adapter.base if last.adapter is not None else None)
            if base is not None:
                self._staged = [_Staged("adapter", base, adapter.version, adapter)]
            elif held != adapter.base:
                holding = "no base" if held is None else f"base version {held}"
                raise EngineError(f"adapter version {adapter.version} applies to base version {adapter.base}; "
                                  f"the engine holds {holding} and was given none")
            elif last is not None and last.kind == "adapter":  # replaces an adapter not applied yet, keeping
                self._staged[-1] = _Staged("adapter", last.tensors, adapter.version, adapter)  # its base
            else:
                self._staged.append(_Staged("adapter", None, adapter.version, adapter))

    def group_ids(self) -> list[str]:
        return list(self._groups)

    def tokens_so_far(self, group_id: str) -> int:
        return sum(len(s.tokens) for s in self._groups.get(group_id, []))

    def generate(self, request: GroupRequest, max_steps: int = 1_000_000) -> list[PartialSample]:
        """Run one group to completion (tests, benchmarks); other queued groups progress too."""
        self.submit(request)
        for _ in range(max_steps):
            for group in self.step():
                if group.group_id == request.group_id:
                    return group.samples
        raise EngineError(f"group {request.group_id} did not finish within {max_steps} steps")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources."""

    def observe_responses(  # noqa: B027 - optional hook
        self, prompt_ids: Sequence[int], completions: Sequence[Sequence[int]]
    ) -> None:
        """Answers another worker of the region gave to `prompt_ids` (any thread). An engine with a
        response history records them later in its own thread (`record_observed`, and at each step);
        nothing depends on it but speed. The default keeps nothing (the vLLM engine has no history)."""

    @property
    def observed_waiting(self) -> int:
        """Observed answers not recorded yet."""
        return 0

    def record_observed(self) -> int:
        """Record up to one step's budget of the observed answers now (the engine's thread: the worker
        calls it while the engine has no work); returns how many it recorded."""
        return 0

    # -- for subclasses -------------------------------------------------------------------------

    @abstractmethod
    def has_work(self) -> bool:
        """Whether any sample is running or waiting."""

    @abstractmethod
    def _enqueue(self, seqs: list[SeqState]) -> None:
        """Make unfinished samples wait for a slot."""

    @abstractmethod
    def _withdraw(self, seqs: list[SeqState]) -> None:
        """Drop samples from the slots and the queue (their state so far is kept by the caller)."""

    @abstractmethod
    def _decode_step(self) -> None:
        """Decode one token for each running sample (admitting waiting ones) via `_append`."""

    @abstractmethod
    def _load_weights(self, tensors: Mapping[str, Any]) -> None:
        """Copy a full set of weights (Hugging Face names) into the model."""

    def _load_part(self, tensors: Mapping[str, Any]) -> None:
        """Copy some of the weights (the tensors a version changed) into the model."""
        raise EngineError(f"{type(self).__name__} loads complete sets of weights only")

    def _load_changes(self, changes: Mapping[str, TensorChanges]) -> None:
        """Write a version's changed elements into the model (engines that `accepts_changes`)."""
        raise EngineError(f"{type(self).__name__} does not take sparse weight changes")

    def _load_adapter(self, adapter: LoraWeights | None) -> None:
        """Serve `adapter` from the next step on (None: the base alone); engines that serve LoRA
        adapters override this."""
        if adapter is not None:
            raise EngineError(f"engine {type(self).__name__} cannot serve LoRA adapters")

    def _append(self, seq: SeqState, token: int, logprob: float) -> None:
        """Record one sampled token and decide whether the sample finished."""
        self.tokens_sampled += 1
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(self._version)
        if token in self.eos_ids or (seq.stop_at is not None and len(seq.tokens) >= seq.stop_at):
            seq.finish_reason = "stop"
        elif len(seq.tokens) >= seq.sampling.max_new_tokens or self._context_full(seq):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self._touched.add(seq.group_id)

    def _context_full(self, seq: SeqState) -> bool:
        return len(seq.prompt_ids) + len(seq.tokens) >= self.max_context

    # -- internals ------------------------------------------------------------------------------

    def _apply_staged(self) -> None:
        with self._staged_lock:
            staged, self._staged = self._staged, []
        for update in staged:
            if update.kind == "part":
                self._load_part(update.tensors)
            elif update.kind == "changes":
                self._load_changes(update.tensors)
            elif update.tensors is not None:  # full weights: a version of its own, or an adapter's base
                if self.base_version is not None:
                    self._load_adapter(None)  # back to the weights as loaded, then the new ones over them
                self._load_weights(update.tensors)
                self.base_version = None if update.adapter is None else update.adapter.base
            if update.adapter is not None:
                self._load_adapter(update.adapter)
            self._version = update.version

    def _collect_finished(self) -> list[FinishedGroup]:
        # Only groups with a sample that finished since the last step (or submitted finished) can be done.
        touched, self._touched = self._touched, set()
        done = [g for g in touched if g in self._groups
                and all(s.finish_reason is not None for s in self._groups[g])]
        return [FinishedGroup(g, [s.to_partial() for s in self._groups.pop(g)]) for g in done]

    def _states(self, r: GroupRequest) -> list[SeqState]:
        if r.n_samples < 1:
            raise EngineError(f"group {r.group_id}: n_samples must be >= 1, got {r.n_samples}")
        if len(r.prompt_ids) == 0 or len(r.prompt_ids) >= self.max_context:
            raise EngineError(f"group {r.group_id}: prompt of {len(r.prompt_ids)} tokens does not fit "
                              f"the context of {self.max_context}")
        if r.resume is not None and len(r.resume) != r.n_samples:
            raise EngineError(f"group {r.group_id}: {len(r.resume)} resumed samples for n_samples={r.n_samples}")
        prompt = [int(t) for t in r.prompt_ids]
        seqs = []
        for i in range(r.n_samples):
            seq = SeqState(r.group_id, i, sample_key(r.seed, r.key or r.group_id, i), prompt, r.sampling)
            seq.stop_at = self._emulated_length(seq)
            if r.resume is not None:
                _restore(seq, r.resume[i], self)
            seqs.append(seq)
        return seqs


    def _emulated_length(self, seq: SeqState) -> int | None:
        """The sample's emulated length (a long tail: most short, a few to `max_new_tokens`), drawn
        from its key (whether it is long: from its prompt, with `tail_by_prompt`), or None without
        emulation."""
        e = self.emulate
        if e is None or (e.tail_p <= 0 and e.short_tokens >= seq.sampling.max_new_tokens):
            return None
        draw = random.Random(seq.key)
        tail = draw.random()
        if e.tail_by_prompt:  # a property of the prompt: the same prompt is long every time it comes back
            tail = random.Random(bytes(ids(seq.prompt_ids))).random()
        if tail < e.tail_p:
            return None
        return draw.randint(1, max(1, min(e.short_tokens, seq.sampling.max_new_tokens)))


@dataclass(frozen=True, slots=True)
class _Staged:
    """An update handed over and not applied yet."""

    kind: Literal["all", "part", "changes", "adapter"]
    tensors: Any
    """`all`/`part`: weights; `changes`: {name: TensorChanges}; `adapter`: its base's full weights, or None
    to keep the weights held."""
    version: int
    adapter: LoraWeights | None = None


def _restore(seq: SeqState, partial: PartialSample, engine: Engine) -> None:
    seq.tokens = [int(t) for t in partial.completion_ids]
    seq.logprobs = [float(x) for x in partial.logprobs]
    seq.versions = [int(v) for v in partial.versions]
    seq.finish_reason = partial.finish_reason
    if seq.finish_reason is None and seq.tokens:
        # A partial whose last token already ended it (handed over between sampling and bookkeeping).
        if seq.tokens[-1] in engine.eos_ids or (seq.stop_at is not None and len(seq.tokens) >= seq.stop_at):
            seq.finish_reason = "stop"
        elif len(seq.tokens) >= seq.sampling.max_new_tokens or engine._context_full(seq):
            seq.finish_reason = "length"
