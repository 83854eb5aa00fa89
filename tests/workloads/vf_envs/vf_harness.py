"""An in-process chat harness written with verifiers' own classes (`vf.Harness`), shared by the test environments.

verifiers 0.4's built-in harnesses run a program in a runtime (`uv` and their packages, fetched at run time); its
`Harness.launch` contract allows a loop in-process as long as every model call goes through the interception
`endpoint` with its `secret`, which is what this one does, with the plain `openai` SDK. With `tools`, it offers
a `calculator` tool: a tool call is run and answered with a `tool` message; a reply without one gets the
calculator's result as a `user` message; then the model answers again.
"""

from __future__ import annotations

import json
import re
from typing import Any, Generic, TypeVar

import openai
import verifiers.v1 as vf

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate a sum of two integers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def calculator(expression: str) -> str:
    match = re.fullmatch(r"\s*(-?\d+)\s*\+\s*(-?\d+)\s*", expression)
    return str(int(match.group(1)) + int(match.group(2))) if match else f"error: cannot evaluate {expression!r}"


class ChatHarnessConfig(vf.HarnessConfig):
    max_tokens: int = 6
    tools: bool = False


ConfigT = TypeVar("ConfigT", bound=ChatHarnessConfig)


class ChatLoop(vf.Harness[ConfigT], Generic[ConfigT]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData, tool_interception_url: str | None = None,
                     ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(exclude_none=True) for m in prompt or []]
        tools = TOOLS if self.config.tools else None
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, timeout=120.0) as client:
            kwargs: dict[str, Any] = {"tools": tools} if tools else {}
            reply = await client.chat.completions.create(model=ctx.model, messages=messages,  # type: ignore[arg-type]
                                                         max_tokens=self.config.max_tokens, **kwargs)
            if not tools:
                return vf.ProgramResult(exit_code=0, stdout="", stderr="")
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if message.tool_calls:
                for call in message.tool_calls:
                    args = json.loads(call.function.arguments or "{}")  # type: ignore[union-attr]
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": calculator(str(args.get("expression", "")))})
            else:
                expression = str(data.prompt_text).split("?")[0].removeprefix("What is ")
                messages.append({"role": "user", "content": f"The calculator says {calculator(expression)}."})
            await client.chat.completions.create(model=ctx.model, messages=messages,  # type: ignore[arg-type]
                                                 max_tokens=self.config.max_tokens, **kwargs)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


class ChatHarness(ChatLoop[ChatHarnessConfig]):
    """One call: a single-turn environment."""


class ToolHarnessConfig(ChatHarnessConfig):
    tools: bool = True


class ToolHarness(ChatLoop[ToolHarnessConfig]):
    """The calculator tool, two calls."""
