"""The OpenAI request schema as the agent endpoint honours it (rollout/openai_server.py, docs/agents.md).

A request body is checked field by field before anything reaches the engine. A field the engine
honours is read (`messages`, `tools` and `tool_choice` through the chat template, `max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `stop`, `n`, `logprobs`, `seed`); a field it cannot
honour is refused with `Refusal`, which the server answers as an OpenAI-shaped 400 naming the field
(`param`). Nothing is silently ignored: a field is accepted only at the value that asks for nothing
(`stream: false`, `presence_penalty: 0`, ...). Replies are built here too, with the Hermes / Qwen
`<tool_call>{json}</tool_call>` blocks of a completion parsed into `tool_calls`.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

MIN_TEMPERATURE = 0.01
"""The engine samples (its logprobs are the behaviour policy's): greedy decoding is not served."""
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class Refusal(Exception):
    """A request the endpoint cannot honour: answered with `status` and an OpenAI error naming `param`."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param, self.message, self.status, self.code, self.kind = param, message, status, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _is_neutral(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == {} or value == [] or value == ""


# Fields the engine cannot honour, accepted only at the value that asks for nothing.
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "stream": lambda v: v in (None, False),
    "stream_options": _is_neutral,
    "presence_penalty": _is_neutral,
    "frequency_penalty": _is_neutral,
    "logit_bias": _is_neutral,
    "response_format": lambda v: v is None or v == {"type": "text"},
    "parallel_tool_calls": lambda v: v in (None, True),
    "store": _is_neutral,
    "metadata": _is_neutral,
    "user": lambda v: True,  # an end-user id for abuse monitoring: nothing to honour
    "service_tier": lambda v: v in (None, "auto", "default"),
    "modalities": lambda v: v in (None, ["text"]),
    "reasoning_effort": lambda v: v is None,
    "prediction": lambda v: v is None,
    "audio": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "functions": lambda v: v is None,
    "function_call": lambda v: v is None,
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v is None,
    "best_of": lambda v: v in (None, 1),
}


@dataclass(slots=True)
class ParsedRequest:
    """What a request asks of the engine, checked."""

    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    seed: int | None = None
    messages: list[dict[str, Any]] | None = None
    """Chat: the messages as the template takes them (`template_message`)."""
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = True
    """`tool_choice` is not `none`: `<tool_call>` blocks become `tool_calls`."""
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    """Completions: the prompt as text, or as token ids (token-exact)."""


def parse_chat(body: Any) -> ParsedRequest:
    """A `/v1/chat/completions` body -> Request; Refusal naming the field the engine cannot honour."""
    body = _object(body)
    known = {"model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "temperature",
             "top_p", "stop", "n", "logprobs", "top_logprobs", "seed"}
    _check_rest(body, known)
    if body.get("top_logprobs") not in (None, 0):
        raise Refusal("top_logprobs", "top_logprobs is not served: the engine records the sampled token's "
                                      "logprob only (set logprobs: true, top_logprobs 0 or absent)")
    req = _common(body, "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens")
    req.logprobs = _bool(body, "logprobs")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Refusal("messages", "messages must be a non-empty list")
    req.messages = [template_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    req.tools, req.parse_tools = _tools(body.get("tools"), body.get("tool_choice"))
    return req


def parse_completion(body: Any) -> ParsedRequest:
    """A `/v1/completions` body -> Request; Refusal naming the field the engine cannot honour."""
    body = _object(body)
    _check_rest(body, {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "n", "logprobs", "seed"})
    req = _common(body, "max_tokens")
    if req.max_tokens is None:
        req.max_tokens = 16  # OpenAI's default for completions
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0):
        raise Refusal("logprobs", "logprobs > 0 asks for the top alternatives, which the engine does not record: "
                                  "use 0 (the sampled token's logprob)")
    req.logprobs = logprobs == 0
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        req.prompt_ids = [int(t) for t in prompt]
    else:
        raise Refusal("prompt", "prompt must be one string or one list of token ids (batches of prompts are not "
                                "served: send one request per prompt)")
    return req


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise Refusal(None, "the request body must be a JSON object")
    return body


def _check_rest(body: Mapping[str, Any], known: set[str]) -> None:
    for name, value in body.items():
        if name in known:
            continue
        neutral = _NEUTRAL.get(name)
        if neutral is None:
            raise Refusal(name, f"unknown field {name!r}: the endpoint serves the OpenAI fields it can honour only")
        if not neutral(value):
            raise Refusal(name, f"{name}={json.dumps(value)[:80]} is not served by this endpoint's engine")


def _common(body: Mapping[str, Any], max_field: str) -> ParsedRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise Refusal("model", "model must be a non-empty string")
    req = ParsedRequest(model=model)
    req.n = _int(body, "n", 1, low=1, high=64)
    max_tokens = body.get(max_field)
    req.max_tokens = None if max_tokens is None else _int(body, max_field, 0, low=1)
    req.temperature = _float(body, "temperature", 1.0, low=0.0, high=2.0)
    if req.temperature < MIN_TEMPERATURE:
        raise Refusal("temperature", f"temperature {req.temperature} asks for greedy decoding; the engine samples "
                                     f"(temperature >= {MIN_TEMPERATURE}), as RL needs its behaviour logprobs")
    req.top_p = _float(body, "top_p", 1.0, low=0.0, high=1.0)
    if req.top_p <= 0.0:
        raise Refusal("top_p", "top_p must be > 0")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                             or not all(isinstance(s, str) and s for s in stop)):
        raise Refusal("stop", "stop must be a string or a list of up to 4 non-empty strings")
    req.stop = list(stop or [])
    seed = body.get("seed")
    req.seed = None if seed is None else _int(body, "seed", 0)
    return req


def _int(body: Mapping[str, Any], name: str, default: int, low: int | None = None, high: int | None = None) -> int:
    value = body.get(name, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool):
        raise Refusal(name, f"{name} must be an integer")
    if (low is not None and value < low) or (high is not None and value > high):
        raise Refusal(name, f"{name}={value} is out of range [{low}, {high}]")
    return value


def _float(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        value = default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise Refusal(name, f"{name} must be a number in [{low}, {high}]")
    return float(value)


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise Refusal(name, f"{name} must be true or false")
    return bool(value)


def _tools(tools: Any, choice: Any) -> tuple[list[dict[str, Any]] | None, bool]:
    if choice not in (None, "auto", "none"):
        raise Refusal("tool_choice", "tool_choice 'required' or a named function would need constrained decoding, "
                                     "which the engine does not do: use 'auto' or 'none'")
    if tools is None:
        return None, choice != "none"
    if not isinstance(tools, list):
        raise Refusal("tools", "tools must be a list")
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict) \
                or not isinstance(t["function"].get("name"), str):
            raise Refusal(f"tools[{i}]", "each tool must be {type: function, function: {name, parameters}}")
    return (tools or None), choice != "none"


def template_message(m: Any, where: str) -> dict[str, Any]:
    """An OpenAI message as a chat template takes it: content as text, tool call arguments as objects."""
    if not isinstance(m, dict):
        raise Refusal(where, "a message must be an object")
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise Refusal(f"{where}.role", f"role {role!r} is not served (system, developer, user, assistant, tool)")
    for name, value in m.items():
        if name not in ("role", "content", "tool_calls", "tool_call_id") and not _is_neutral(value):
            raise Refusal(f"{where}.{name}", f"message field {name!r} is not served by the chat template")
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [_template_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(m["tool_calls"])]
    if role == "tool":
        out["tool_call_id"] = str(m.get("tool_call_id") or "")
    return out


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise Refusal(f"{where}[{j}]", "only text content parts are served (the engine reads text)")
            parts.append(part["text"])
        return "".join(parts)
    raise Refusal(where, "content must be a string or a list of text parts")


def _template_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise Refusal(where, "a tool call must be {type: function, function: {name, arguments}}")
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: the template renders the string as it is
            args = json.loads(args) if args.strip() else {}
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes / Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks -> (the text before
    them, OpenAI `tool_calls`). A block that is not JSON with a name leaves the text as plain content."""
    calls: list[dict[str, Any]] = []
    for match in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", {})
        arguments = args if isinstance(args, str) else json.dumps(args)
        calls.append({"id": f"call_{len(calls)}", "type": "function",
                      "function": {"name": obj["name"], "arguments": arguments}})
    if not calls:
        return text, []
    before = text[:text.index("<tool_call>")].strip()
    return (before or None), calls


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, int | None]:
    """The text before the first stop string, and where that string ends in `text` (None: no stop)."""
    hits = [(text.find(s), s) for s in stop if s in text]
    if not hits:
        return text, None
    at, s = min(hits)
    return text[:at], at + len(s)


def response_id(prefix: str, counter: int) -> str:
    return f"{prefix}-{counter}"


def created() -> int:
    return int(time.time())
