"""The agent of `examples/fleet.agent.yaml`: a calculator tool on arithmetic prompts, written with the plain
`openai` SDK, as one writes an agent for any OpenAI-compatible server. FleetRL runs it unchanged
(`dataset.env: {kind: openai_agent, name: calculator_agent:run}`): once per sample, with a client bound to
the worker's endpoint; every call it makes is decoded by the policy and recorded token for token.

A run has two calls. The first offers the `calculator` tool. When the model calls it (a `<tool_call>`
in Hermes / Qwen format, parsed by the endpoint into `tool_calls`), the agent runs the tool and answers
with a `tool` message; when it does not, the agent runs the calculator itself on the question and tells
the model the result in a `user` message. The second call is the answer. The reward is the share of the
answer's digits that the result has, plus 0.5 for the exact result: only the tool knows it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from openai import AsyncOpenAI

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate a sum or a difference of two integers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def calculator(expression: str) -> str:
    """The tool: `a + b` or `a - b` on integers; anything else is an error message, as a tool would say."""
    match = re.fullmatch(r"\s*(-?\d+)\s*([+-])\s*(-?\d+)\s*", expression)
    if match is None:
        return f"error: cannot evaluate {expression!r}"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str(a + b if op == "+" else a - b)


def score(answer: str, result: str) -> float:
    digits = [ch for ch in answer if ch.isdigit() or ch == "-"]
    share = sum(ch in result for ch in digits) / len(digits) if digits else 0.0
    return share + (0.5 if re.search(rf"(?<!\d){re.escape(result)}(?!\d)", answer) else 0.0)


async def run(client: AsyncOpenAI, prompt: list[dict[str, Any]], expression: str, answer: str, **row: Any) -> float:
    messages: list[Any] = list(prompt)
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=12,
                                                 temperature=1.0)
    reply = first.choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    if reply.tool_calls:
        for call in reply.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                expr = str(args.get("expression", "")) if isinstance(args, dict) else ""
                result = calculator(expr) if expr else "error: no expression"
            except json.JSONDecodeError:
                result = "error: arguments are not JSON"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    else:
        messages.append({"role": "user", "content": f"The calculator says {expression} = {calculator(expression)}."})
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6,
                                                  temperature=1.0)
    return score(second.choices[0].message.content or "", answer)
