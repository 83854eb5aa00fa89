"""Agents written with the plain `openai` SDK, run by the agent-run tests by import path (`agent_fns:name`)."""

from __future__ import annotations

import asyncio
from typing import Any

import openai


async def three_turns(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]], **row: Any) -> float:
    """A conversation that grows: each call sends back the answer it got and a new user turn."""
    messages = list(prompt)
    for turn in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"And then {turn}?"})
    return float(row.get("bonus", 1.0))


async def rewrite_history(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]], **row: Any) -> float:
    """The second call forgets the first answer and asks afresh: its context does not extend the first."""
    await client.chat.completions.create(model="policy", messages=list(prompt), max_tokens=5)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Start over: 2 + 2?"}],
                                         max_tokens=5)
    return 0.5


async def keeps_calling(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]], **row: Any) -> float:
    """Calls until a budget refuses it, then returns what it has."""
    messages = list(prompt)
    for _ in range(100):
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        except openai.BadRequestError as exc:
            assert isinstance(exc.body, dict) and exc.body.get("code") == "budget_exhausted"
            return 0.25
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    return 1.0


async def breaks(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]], **row: Any) -> float:
    await client.chat.completions.create(model="policy", messages=list(prompt), max_tokens=3)
    raise ValueError("the agent's own bug")


async def leaves_it_to_the_reward(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]], **row: Any) -> None:
    await client.chat.completions.create(model="policy", messages=list(prompt), max_tokens=4)
    return None


async def pauses(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]], **row: Any) -> float:
    """`three_turns`, but it can stop before a call (`pause_at`: its index, 3: after the last one; `paused`: a
    queue told there, then it waits to be cancelled, as a run of a preempted worker is), and it can ask
    something else at a call (`ask_at`: its index) than the run that was handed over did."""
    messages = list(prompt)
    for turn in range(4):
        if turn == row.get("pause_at"):
            row["paused"].put_nowait(turn)
            await asyncio.Event().wait()  # until the handover cancels the run
        if turn == 3:
            break
        if turn == row.get("ask_at"):
            messages[-1] = {"role": "user", "content": "Something else entirely?"}
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"And then {turn}?"})
    return 1.0


PAUSE: dict[str, Any] = {}
"""`pauses_in_worker`'s switches (`pause_at`, `paused`, `ask_at`, as `pauses` takes them), set by a test that
runs a worker in its own process: a record's columns cannot carry a queue."""


async def pauses_in_worker(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]], **row: Any) -> float:
    return await pauses(client, prompt, **{**row, **PAUSE})
