"""The worker's OpenAI-compatible endpoint (rollout/openai_server.py) against the real `openai` SDK, served
by uvicorn over a real torch engine: chat and completions, n > 1, logprobs, seed, tools through the chat
template, and an OpenAI-shaped 400 naming each field the engine cannot honour."""

from __future__ import annotations

import pathlib
from typing import Any

import openai
import pytest
from agent_kit import serve
from slowdown import scaled

from fleetrl.rollout.openai_schema import parse_tool_calls

TIMEOUT_S = scaled(60.0)  # an HTTP call's bound: only a hang reaches it
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "What is 12 + 7?"}]


def _client(base_url: str, key: str = "test") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=TIMEOUT_S)


async def test_chat_and_completions(agent_folder: pathlib.Path) -> None:
    async with serve(agent_folder) as s:
        client = _client(s.server.base_url)
        chat = await client.chat.completions.create(model="policy", messages=ASK, max_tokens=6)
        assert chat.object == "chat.completion" and len(chat.choices) == 1
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].finish_reason in ("stop", "length")
        prompt, (sample,) = s.turns[-1]
        assert chat.usage is not None and chat.usage.prompt_tokens == len(prompt)
        assert chat.usage.completion_tokens == len(sample.completion_ids) <= 6
        assert chat.choices[0].message.content == s.codec.decode(sample.completion_ids)
        assert prompt == s.endpoint.template.render(ASK, None)  # the chat template, add_generation_prompt

        text = await client.completions.create(model="policy", prompt="What is 3 + 4?", max_tokens=5)
        assert text.object == "text_completion"
        assert text.choices[0].text == s.codec.decode(s.turns[-1][1][0].completion_ids)
        assert s.turns[-1][0] == s.codec.encode("What is 3 + 4?")
        ids = await client.completions.create(model="policy", prompt=[5, 6, 7, 8], max_tokens=3)
        assert s.turns[-1][0] == [5, 6, 7, 8] and ids.usage is not None and ids.usage.prompt_tokens == 4
        models = await client.models.list()
        assert [m.id for m in models.data] == ["fleetrl-policy"]
        await client.close()


async def test_n_samples_logprobs_and_seed(agent_folder: pathlib.Path) -> None:
    async with serve(agent_folder) as s:
        client = _client(s.server.base_url)
        chat = await client.chat.completions.create(model="policy", messages=ASK, max_tokens=6, n=3, logprobs=True)
        _, samples = s.turns[-1]
        assert len(chat.choices) == 3 == len(samples)
        for choice, sample in zip(chat.choices, samples, strict=True):
            assert choice.logprobs is not None and choice.logprobs.content is not None
            got = [t.logprob for t in choice.logprobs.content]
            assert got == pytest.approx([float(x) for x in sample.logprobs])  # the engine's behaviour logprobs
            assert all(lp <= 0.0 for lp in got)
        text = await client.completions.create(model="policy", prompt="What is 3 + 4?", max_tokens=5, logprobs=0)
        assert text.choices[0].logprobs is not None
        assert text.choices[0].logprobs.token_logprobs == pytest.approx(
            [float(x) for x in s.turns[-1][1][0].logprobs])
        # A seed fixes the sampling: the same request twice decodes the same tokens.
        first = await client.chat.completions.create(model="policy", messages=ASK, max_tokens=8, seed=11)
        again = await client.chat.completions.create(model="policy", messages=ASK, max_tokens=8, seed=11)
        assert first.choices[0].message.content == again.choices[0].message.content
        assert list(s.turns[-1][1][0].completion_ids) == list(s.turns[-2][1][0].completion_ids)
        await client.close()


async def test_tools_round_trip_through_the_template(agent_folder: pathlib.Path) -> None:
    """The tools, the assistant's tool call and the tool's answer all reach the engine as the chat template
    renders them; the reply's `<tool_call>` JSON is parsed into `tool_calls` (parse_tool_calls)."""
    conversation: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "calculator", "arguments": '{"expression": "12 + 7"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "19"},
    ]
    async with serve(agent_folder) as s:
        client = _client(s.server.base_url)
        reply = await client.chat.completions.create(model="policy", messages=conversation, tools=TOOLS,
                                                     tool_choice="auto", max_tokens=6)
        assert reply.choices[0].message.role == "assistant"
        prompt = s.codec.decode_all(s.turns[-1][0])
        assert '"name": "calculator"' in prompt and "<tools>" in prompt  # the tool's schema
        assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\n</tool_call>' in prompt
        assert "<tool_response>\n19\n</tool_response>" in prompt
        await client.close()
    content, calls = parse_tool_calls('Let me see.\n<tool_call>\n{"name": "calculator", "arguments": '
                                      '{"expression": "2 + 3"}}\n</tool_call>')
    assert content == "Let me see." and calls == [{"id": "call_0", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "2 + 3"}'}}]
    assert parse_tool_calls("<tool_call>\nnot json\n</tool_call>") == ("<tool_call>\nnot json\n</tool_call>", [])


REFUSED_CHAT: list[tuple[str, dict[str, Any]]] = [
    ("presence_penalty", {"presence_penalty": 0.5}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("logit_bias", {"logit_bias": {"5": 10}}),
    ("stream", {"stream": True}),
    ("tool_choice", {"tool_choice": "required", "tools": TOOLS}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 3}),
    ("temperature", {"temperature": 0}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("parallel_tool_calls", {"parallel_tool_calls": False, "tools": TOOLS}),
    ("n", {"n": 0}),
    ("messages[0].name", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}),
    ("messages[0].content[0]", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}),
    ("reasoning_effort", {"reasoning_effort": "high"}),
    ("made_up_field", {"extra_body": {"made_up_field": 1}}),
]
REFUSED_COMPLETIONS: list[tuple[str, dict[str, Any]]] = [
    ("logprobs", {"logprobs": 2}),
    ("echo", {"echo": True}),
    ("suffix", {"suffix": "end"}),
    ("best_of", {"best_of": 3}),
    ("prompt", {"prompt": ["one", "two"]}),
]


async def test_a_400_names_each_field_the_engine_cannot_honour(agent_folder: pathlib.Path) -> None:
    async with serve(agent_folder) as s:
        client = _client(s.server.base_url)
        served = len(s.turns)
        for field, extra in REFUSED_CHAT:
            args: dict[str, Any] = {"model": "policy", "messages": ASK, "max_tokens": 4, **extra}
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(**args)
            body: Any = refused.value.body
            assert body["param"] == field and body["type"] == "invalid_request_error", (field, body)
            assert field.split(".")[-1].split("[")[0] in body["message"] or field.startswith("messages"), body
        for field, extra in REFUSED_COMPLETIONS:
            args = {"model": "policy", "prompt": "What is 1 + 1?", "max_tokens": 4, **extra}
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(**args)
            assert refused.value.body["param"] == field, (field, refused.value.body)  # type: ignore[index]
        assert len(s.turns) == served  # nothing refused reached the engine
        await client.close()


async def test_an_unknown_key_is_refused_when_the_endpoint_serves_agent_runs(agent_folder: pathlib.Path) -> None:
    async with serve(agent_folder, open_keys=False) as s:
        client = _client(s.server.base_url, key="not-a-sample")
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="policy", messages=ASK, max_tokens=4)
        await client.close()


async def test_a_stop_string_cuts_the_completion_after_its_token(agent_folder: pathlib.Path) -> None:
    async with serve(agent_folder) as s:
        client = _client(s.server.base_url)
        free = await client.chat.completions.create(model="policy", messages=ASK, max_tokens=12, seed=5)
        text = free.choices[0].message.content or ""
        stop = text[3:5]
        assert len(text) >= 6 and stop, text  # the seed's completion is long enough to cut
        cut = await client.chat.completions.create(model="policy", messages=ASK, max_tokens=12, seed=5, stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].message.content == text[:text.index(stop)]
        assert cut.usage is not None and free.usage is not None
        assert cut.usage.completion_tokens <= free.usage.completion_tokens  # what the answer holds
        await client.close()
