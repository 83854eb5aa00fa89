"""The verifiers environment of `examples/fleet.verifiers.yaml`, written with verifiers' own classes (0.4,
`verifiers.v1`) as one writes an environment for prime-rl, and run unchanged by FleetRL
(`dataset.env: {kind: verifiers, name: vf_sums}`): a taskset of sums, a task whose rubric is two weighted
`@vf.reward`s, and its default harness.

The harness runs in-process (verifiers' `Harness.launch` contract allows it: every model call goes through the
interception `endpoint` with its `secret`), with the plain `openai` SDK: the first call offers a `calculator`
tool; a tool call is run and answered with a `tool` message, a reply without one gets the calculator's result as
a `user` message; the second call is the answer. verifiers' built-in harnesses would instead launch a program set
up with `uv` (its packages fetched at run time). Every call is decoded by the worker's engine and recorded.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from typing import Any

import openai
import verifiers.v1 as vf

__all__ = ["CalculatorHarness", "SumTaskset"]

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate a sum of two integers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def calculator(expression: str) -> str:
    match = re.fullmatch(r"\s*(-?\d+)\s*\+\s*(-?\d+)\s*", expression)
    return str(int(match.group(1)) + int(match.group(2))) if match else f"error: cannot evaluate {expression!r}"


class SumData(vf.TaskData):
    expression: str
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def digits(self, task: SumData, trace: vf.Trace) -> float:
        """Share of the answer's digits that the result has."""
        digits = [ch for ch in trace.last_reply if ch.isdigit()]
        return sum(ch in task.answer for ch in digits) / len(digits) if digits else 0.0

    @vf.reward(weight=0.5)
    async def exact(self, task: SumData, trace: vf.Trace) -> float:
        return 1.0 if re.search(rf"(?<!\d){task.answer}(?!\d)", trace.last_reply) else 0.0


class SumTasksetConfig(vf.TasksetConfig):
    count: int = 256
    seed: int = 0


class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self) -> Iterable[SumTask]:
        rng = random.Random(self.config.seed)
        for _ in range(self.config.count):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            yield SumTask(SumData(prompt=f"What is {a} + {b}?", expression=f"{a} + {b}", answer=str(a + b)),
                          self.config.task)


class CalculatorHarnessConfig(vf.HarnessConfig):
    max_tokens: int = 12


class CalculatorHarness(vf.Harness[CalculatorHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData, tool_interception_url: str | None = None,
                     ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt if isinstance(prompt, str) else data.prompt_text})
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, timeout=120.0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS,
                                                         max_tokens=self.config.max_tokens)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                args = json.loads(call.function.arguments or "{}")
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": calculator(str(args.get("expression", "")))})
            if not message.tool_calls:
                result = calculator(getattr(data, "expression", ""))
                messages.append({"role": "user", "content": f"The calculator says {result}. So the answer is?"})
            await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS,
                                                 max_tokens=self.config.max_tokens // 2)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
