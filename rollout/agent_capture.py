"""Token-exact capture of an agent's calls: one sample built from what the engine decoded (DESIGN.md §13).

Every call an agent makes through the endpoint with its sample's key is recorded here: the prompt ids
the engine decoded from, the completion ids, their logprobs and versions. The sample is the calls in
order. A call whose prompt extends the previous call's context (its prompt and the answer the agent
kept) joins the current segment: the ids between the two are the environment's (tool results, the
next user turn), with logprob 0, version -1 and source 1, kept out of the loss. A call that does not
extend it (the agent rewrote its history, or the template renders earlier turns differently) starts a
new segment of the same sample, with its own context. Nothing is re-tokenized: when the agent sends
back the conversation it had, plus new messages, the prompt is built as the previous context plus the
ids the new messages add under the chat template (`AgentTemplate.observation_ids`), so the model's
earlier turns keep the engine's ids.

A call answered with n > 1 choices is held until the next call shows which one the agent kept (the
first one when none matches, or at the end); the others are not trained.

A run handed over from another worker carries that worker's capture (`replay`): the endpoint answers its
calls from it while they match, and records them here as any call (rollout/agent_replay.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetrl.broker import ENV_VERSION, SOURCE_ENV, SOURCE_POLICY, PartialSample, floats, ids
from fleetrl.rollout.agent_replay import Replay
from fleetrl.rollout.errors import TaskError
from fleetrl.rollout.tokenize import TextCodec

_BASE = ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"})


class AgentTemplate:
    """The chat template of the worker's tokenizer, with tools (Hermes / Qwen style)."""

    def __init__(self, codec: TextCodec, eos_ids: Sequence[int]) -> None:
        self.codec, self.eos = codec, frozenset(int(e) for e in eos_ids)
        self.tok = getattr(codec, "tok", None)
        if not getattr(self.tok, "chat_template", None):
            raise TaskError("the agent endpoint needs a tokenizer with a chat template (model.tokenizer)")
        prefix = self.render(list(_BASE), None, generation_prompt=False)
        last = max((i for i, t in enumerate(prefix) if t in self.eos), default=None)
        self._end = [prefix[last]] if last is not None else []
        self._tail = prefix[last + 1:] if last is not None else []
        self._bases: dict[str, list[int]] = {}  # tools (as JSON) -> the fixed conversation rendered with them

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               generation_prompt: bool = True) -> list[int]:
        try:
            out = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,  # type: ignore[union-attr]
                                               tokenize=True, return_dict=False)
        except Exception as exc:  # a Jinja template can raise anything
            raise TaskError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return [int(i) for i in out]

    def observation_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        stopped: bool) -> list[int] | None:
        """The ids `messages` add after a model turn (`stopped`: it ended with an end token); None when the
        template renders a conversation's start differently once it grows (no exact append)."""
        key = json.dumps(tools, sort_keys=True)
        prefix = self._bases.get(key)
        if prefix is None:
            prefix = self._bases[key] = self.render(list(_BASE), tools, generation_prompt=False)
            if len(self._bases) > 64:  # agents with ever-changing tools: keep the newest few
                self._bases.pop(next(iter(self._bases)))
        full = self.render(list(_BASE) + messages, tools, generation_prompt=True)
        if full[:len(prefix)] != prefix:
            return None
        return ([] if stopped else self._end) + self._tail + full[len(prefix):]


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two template messages that render the same (tool call arguments compared as JSON)."""
    def key(m: dict[str, Any]) -> Any:
        calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                 for c in m.get("tool_calls") or []]
        return m["role"], m.get("content") or "", calls, m.get("tool_call_id") or ""
    return bool(key(a) == key(b))


@dataclass(slots=True)
class Choice:
    sample: PartialSample
    reply: dict[str, Any] | None = None
    """The assistant message answered (as the template takes it), for chat calls."""
    text: str = ""


@dataclass(slots=True)
class Call:
    prompt_ids: list[int]
    choices: list[Choice]
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    new_segment: bool = True


@dataclass(slots=True)
class SampleCapture:
    """The calls of one sample (one agent run), bounded by `max_calls` and `max_tokens`."""

    key: str
    max_calls: int
    max_tokens: int
    name: str = ""
    """The sample's id (`<group id>#<index>`): its engine requests are `<name>#<call>` (a handover finds them)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    contexts: list[tuple[int, list[int]]] = field(default_factory=list)
    """Per segment: (index of its first token, the prompt ids it continues)."""
    calls: int = 0
    exhausted: str | None = None
    """Which budget ended the run (`env.max_turns`, the token budget), or None."""
    pending: Call | None = None
    finish: str = "stop"
    final_messages: list[dict[str, Any]] | None = None
    final_text: str = ""
    replay: Replay | None = None
    """A run handed over to this worker: its calls answered from the first worker's capture while they match
    (rollout/agent_replay.py), None: every call is decoded live."""
    _extends: bool = False

    # -- a call ---------------------------------------------------------------------------------------

    def prompt_for(self, template: AgentTemplate, messages: list[dict[str, Any]] | None,
                   tools: list[dict[str, Any]] | None, prompt_ids: list[int] | None) -> tuple[list[int], int, bool]:
        """The prompt ids of a new call -> (ids, which choice of the previous call it continues, whether it
        extends that context). Chat: built token-exactly when the messages continue the conversation."""
        last = self.pending
        if messages is not None:
            if last is not None and last.messages is not None and tools == last.tools:
                k = len(last.messages)
                for j, ch in enumerate(last.choices):
                    if ch.reply is None or len(messages) <= k + 1 or not _prefix(messages, [*last.messages, ch.reply]):
                        continue
                    stopped = len(ch.sample.completion_ids) > 0 and int(ch.sample.completion_ids[-1]) in template.eos
                    added = template.observation_ids(messages[k + 1:], tools, stopped)
                    if added is not None:
                        return last.prompt_ids + [int(t) for t in ch.sample.completion_ids] + added, j, True
            prompt_ids = template.render(messages, tools)
        assert prompt_ids is not None
        if last is not None:
            context = last.prompt_ids + [int(t) for t in last.choices[0].sample.completion_ids]
            if len(prompt_ids) > len(context) and prompt_ids[:len(context)] == context:
                return prompt_ids, 0, True
        return prompt_ids, 0, False

    def room(self, prompt_ids: list[int], choice: int, extends: bool) -> int:
        """Tokens this call may generate under the token budget."""
        used = len(self.tokens)
        if self.pending is not None:
            used += len(self.pending.choices[choice].sample.completion_ids)
            if extends:
                used += len(prompt_ids) - len(self.pending.prompt_ids) - len(
                    self.pending.choices[choice].sample.completion_ids)
        return self.max_tokens - used

    def begin(self, prompt_ids: list[int], choice: int, extends: bool) -> None:
        """Commit the previous call (the choice kept) and, when this call extends it, the environment's ids."""
        last = self.pending
        self.pending = None
        extends = extends and last is not None and len(last.choices[choice].sample.completion_ids) > 0
        if last is not None:
            self._commit(last, choice)
            if extends and last is not None:
                context = last.prompt_ids + [int(t) for t in last.choices[choice].sample.completion_ids]
                added = prompt_ids[len(context):]
                self._append(added, [0.0] * len(added), [ENV_VERSION] * len(added), SOURCE_ENV)
        self.calls += 1
        self._extends = extends and bool(self.contexts)

    def answered(self, call: Call) -> None:
        call.new_segment = not self._extends
        self.pending = call

    def close(self) -> None:
        """The run ended: commit its last call (its first choice)."""
        if self.pending is not None:
            last, self.pending = self.pending, None
            self._commit(last, 0)
            ch = last.choices[0]
            self.final_text = ch.text
            if last.messages is not None:
                self.final_messages = last.messages + ([ch.reply] if ch.reply is not None else [])
        if self.exhausted is not None:
            self.finish = "length"

    def sample(self) -> PartialSample:
        return PartialSample(ids(self.tokens), floats(self.logprobs), ids(self.versions), self.finish)

    def _commit(self, call: Call, choice: int) -> None:
        s = call.choices[choice].sample
        if len(s.completion_ids) == 0:
            return
        if call.new_segment or not self.contexts:
            self.contexts.append((len(self.tokens), list(call.prompt_ids)))
        self._append([int(t) for t in s.completion_ids], [float(x) for x in s.logprobs],
                     [int(v) for v in s.versions], SOURCE_POLICY)
        self.finish = s.finish_reason or "stop"

    def _append(self, tokens: list[int], logprobs: list[float], versions: list[int], source: int) -> None:
        self.tokens += tokens
        self.logprobs += logprobs
        self.versions += versions
        self.sources += [source] * len(tokens)


def _prefix(messages: list[dict[str, Any]], head: list[dict[str, Any]]) -> bool:
    return len(messages) >= len(head) and all(same_message(a, b) for a, b in zip(messages, head, strict=False))
