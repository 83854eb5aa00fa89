"""Episodes: a sample as several turns of a skyrl-gym text environment (DESIGN.md §3, §11).

A group whose prompt names an environment (`dataset.env`, or the record's `env`) runs each of its n
samples as an episode: the policy writes a turn, the environment answers (`env.step(text)` returns
`{observations, reward, done, metadata}`, the `skyrl_gym.envs.BaseTextEnv` contract, so environments
written for SkyRL run unchanged), and the episode goes on until the environment says `done`, or
`env.max_turns`, the episode's token budget or an error ends it.

Token-exact: a sample is the concatenation of the turns as ids. The policy's ids are the engine's,
never re-tokenized; an environment turn is appended as the ids its messages add to a conversation
under the chat template (`TurnTemplate`), so what the trainer learns from is exactly what the engine
decoded from. `segments` marks the environment's ids (logprob 0, version -1) for the learner's mask.

Each turn is one engine request of one sample; the worker's engine decodes it in its continuous
batch beside every other sample, and an environment step runs in a thread pool of its own, bounded
by `env.tool_timeout_s`: the engine never waits on one episode's tool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import sys
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fleetrl.broker import ENV_VERSION, SOURCE_ENV, SOURCE_POLICY, PartialSample, PromptRecord, Sampling, floats, ids
from fleetrl.config import EnvConfig
from fleetrl.log import get_logger
from fleetrl.rollout.errors import EnvError, TaskError
from fleetrl.rollout.tokenize import TextCodec

log = get_logger(__name__)
Generate = Callable[[str, list[int], Sampling], Awaitable[PartialSample]]
"""The worker's engine as an episode sees it: (request id, context ids, sampling) -> one finished turn."""
EnvFactory = Callable[[dict[str, Any], dict[str, Any]], Any]


def import_user_module(name: str, module_name: str, python_path: Sequence[str]) -> Any:
    """Import a user's module (an environment, an agent), searching `python_path` first; `EnvError`
    naming `name` when the import fails (it runs arbitrary code)."""
    for folder in reversed(python_path):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # an import runs arbitrary code
        raise EnvError(f"{name}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc


def load_env_factory(name: str, python_path: Sequence[str] = ()) -> EnvFactory:
    """`name`: a skyrl-gym registered id, or `package.module:Class` (or a factory); EnvError when it cannot be used."""
    import skyrl_gym

    if ":" in name:
        module_name, _, attr = name.partition(":")
        module = import_user_module(name, module_name, python_path)
        creator = getattr(module, attr, None)
        if not callable(creator):
            raise EnvError(f"{name}: module {module_name!r} has no environment class or factory {attr!r}")
        return lambda config, extras: creator(env_config=config, extras=extras)
    if name not in skyrl_gym.registry:
        raise EnvError(f"{name}: not a skyrl-gym environment id; registered: {sorted(skyrl_gym.registry)}")
    return lambda config, extras: skyrl_gym.make(name, env_config=config, extras=extras)


def env_extras(prompt: PromptRecord) -> dict[str, Any]:
    """What SkyRL hands an environment as `extras`: the dataset row (its other columns), with a
    `reward_spec.ground_truth` from the record's reference when the row brings none."""
    extras = dict(prompt.columns or {})
    if "reward_spec" not in extras and prompt.reference is not None:
        extras["reward_spec"] = {"ground_truth": prompt.reference}
    extras.setdefault("extra_info", {})
    return extras


class TurnTemplate:
    """The ids an environment turn adds after a model turn, under the tokenizer's chat template.

    A chat template renders a whole conversation; rendering the episode again after each turn would
    re-tokenize the model's turns (and can change their ids). Instead the environment's messages are
    rendered after a fixed two-message conversation and only the ids they add are kept, plus the
    template's end of an assistant turn (its end token when the model stopped without it, and what
    follows it, e.g. ChatML's newline)."""

    _BASE = ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"})

    def __init__(self, codec: TextCodec, eos_ids: Sequence[int]) -> None:
        self.codec, self.eos = codec, frozenset(int(e) for e in eos_ids)
        tok = getattr(codec, "tok", None)
        self._chat = bool(getattr(tok, "chat_template", None))
        self._end: list[int] = []  # the template's end-of-assistant-turn token
        self._tail: list[int] = []  # what the template writes after it
        if self._chat:
            prefix = self._apply(list(self._BASE), generation_prompt=False)
            last = max((i for i, t in enumerate(prefix) if t in self.eos), default=None)
            if last is not None:
                self._end, self._tail = [prefix[last]], prefix[last + 1:]

    def _apply(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        tok = self.codec.tok  # type: ignore[attr-defined]
        try:
            out = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                          return_dict=False)
        except Exception as exc:  # a Jinja template can raise anything
            raise TaskError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return [int(i) for i in out]

    def observation_ids(self, observations: list[dict[str, Any]], stopped: bool) -> list[int]:
        """Ids to append after a model turn (`stopped`: it ended with an end token) so that the next
        model turn starts where the chat template would start it."""
        if not self._chat:  # a plain-text tokenizer: the messages' text, one line each
            text = "".join(f"\n{m.get('content', '')}" for m in observations) + "\n"
            return self.codec.encode(text)[1:] if observations else []
        base = list(self._BASE)
        prefix = self._apply(base, generation_prompt=False)
        full = self._apply(base + list(observations), generation_prompt=True)
        if full[:len(prefix)] != prefix:
            raise TaskError("the chat template renders a conversation's start differently once it grows: "
                            "environment turns cannot be appended token-exactly")
        return ([] if stopped else self._end) + self._tail + full[len(prefix):]


@dataclass(slots=True)
class EpisodeResult:
    sample: PartialSample
    segments: list[int] = field(default_factory=list)
    """Per-token sources (0 policy, 1 environment)."""
    reward: float = 0.0
    turns: int = 0
    error: str | None = None
    """Why the environment failed (the episode ended with the failure reward), or None."""
    contexts: list[tuple[int, list[int]]] | None = None
    """An agent run's segments of context (`Sample.contexts`); None: one, continuing the group's prompt."""
    calls_replayed: int = 0
    """An agent run handed over to this worker: calls answered from its capture (rollout/agent_replay.py)."""
    tokens_replayed: int = 0
    """Their policy tokens (the engine did not generate them again)."""
    tokens_regenerated: int = 0
    """Policy tokens the capture held that were not replayed (generated again, or others instead)."""


@dataclass(slots=True)
class EpisodeRunner:
    """Runs one group's episodes against `generate` (the worker's engine)."""

    cfg: EnvConfig
    factory: EnvFactory
    codec: TextCodec
    template: TurnTemplate
    pool: ThreadPoolExecutor
    generate: Generate
    max_tokens: int
    """The episode's token budget after the prompt (model and environment turns)."""
    tokens_generated: int = 0
    """Model tokens of this group's finished turns so far (what a restart elsewhere generates again)."""

    async def run_group(self, group_id: str, prompt: PromptRecord, prompt_ids: list[int],
                        args: dict[str, Any]) -> list[EpisodeResult]:
        """Every sample's episode, concurrently. Raises EnvError (with `on_error: dead_letter`)."""
        config = {**self.cfg.config, **args}
        return list(await asyncio.gather(*(
            self._episode(f"{group_id}#{i}", prompt, prompt_ids, config) for i in range(prompt.n_samples))))

    async def _step(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One environment call in the pool, bounded by `tool_timeout_s` (a hanging call keeps its thread)."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self.pool, fn, *args), self.cfg.tool_timeout_s)
        except TimeoutError:
            raise EnvError(f"environment call {getattr(fn, '__name__', fn)} timed out after "
                           f"{self.cfg.tool_timeout_s}s (env.tool_timeout_s)") from None
        except Exception as exc:  # the environment is user code: any error is an environment error
            raise EnvError(f"environment call {getattr(fn, '__name__', fn)} raised "
                           f"{type(exc).__name__}: {exc}") from exc

    async def _episode(self, eid: str, prompt: PromptRecord, prompt_ids: list[int],
                       config: dict[str, Any]) -> EpisodeResult:
        res = EpisodeResult(PartialSample(ids([]), floats([]), ids([]), "stop"))
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        env: Any = None
        try:
            env = await self._step(self.factory, config, env_extras(prompt))
            messages = prompt.messages or [{"role": "user", "content": prompt.prompt or ""}]
            await self._step(env.init, [dict(m) for m in messages])
            finish = "length"
            for turn in range(self.cfg.max_turns):
                budget = self.max_tokens - len(tokens)
                if budget <= 0:
                    break
                sampling = dataclasses.replace(prompt.sampling, max_new_tokens=min(prompt.sampling.max_new_tokens,
                                                                                   budget))
                out = await self.generate(f"{eid}#{turn}", prompt_ids + tokens, sampling)
                self.tokens_generated += len(out.completion_ids)
                tokens += [int(t) for t in out.completion_ids]
                logprobs += [float(x) for x in out.logprobs]
                versions += [int(v) for v in out.versions]
                res.segments += [SOURCE_POLICY] * len(out.completion_ids)
                res.turns = turn + 1
                step = await self._step(env.step, self.codec.decode(out.completion_ids))
                res.reward += _reward(step)
                if step.get("done"):
                    finish = out.finish_reason or "stop"
                    break
                stopped = bool(len(out.completion_ids)) and int(out.completion_ids[-1]) in self.template.eos
                obs = self.template.observation_ids(list(step.get("observations") or []), stopped)
                room = self.max_tokens - len(tokens)
                tokens += obs[:room]
                logprobs += [0.0] * len(obs[:room])
                versions += [ENV_VERSION] * len(obs[:room])
                res.segments += [SOURCE_ENV] * len(obs[:room])
                if len(obs) > room:
                    break
            res.sample = PartialSample(ids(tokens), floats(logprobs), ids(versions), finish)
        except EnvError as exc:
            if self.cfg.on_error == "dead_letter":
                raise
            res.sample = PartialSample(ids(tokens), floats(logprobs), ids(versions), "abort")
            res.segments = res.segments[:len(tokens)]
            res.reward, res.error = self.cfg.failure_reward, str(exc)
        finally:
            if env is not None:
                self.pool.submit(_close, env)
        return res


def _reward(step: Any) -> float:
    if not isinstance(step, dict) or "reward" not in step:
        raise EnvError(f"env.step returned {type(step).__name__}, not {{observations, reward, done, metadata}}")
    try:
        value = float(step["reward"] or 0.0)
    except (TypeError, ValueError) as exc:
        raise EnvError(f"env.step returned a reward of {step['reward']!r}, not a number") from exc
    if value != value or value in (float("inf"), float("-inf")):
        raise EnvError(f"env.step returned a non-finite reward {value}")
    return value


def _close(env: Any) -> None:
    try:
        env.close()
    except Exception as exc:  # closing is best effort: the episode's result is already final
        log.warning("episode.env_close_failed", env=str(env), error=f"{type(exc).__name__}: {exc}")
