"""An OpenAI-compatible endpoint on a rollout worker, backed by its engine (DESIGN.md §11, §13).

`AgentEndpoint` answers `/v1/chat/completions` and `/v1/completions` (Starlette under uvicorn, on a
loopback port of its own) with the worker's engine: each request is one model turn of n samples in
the continuous batch beside every other request (`EngineTurns`). Chat messages and `tools` go through
the tokenizer's chat template; the completion's Hermes / Qwen `<tool_call>` blocks come back as
`tool_calls`; a field the engine cannot honour is an OpenAI-shaped 400 naming it
(rollout/openai_schema.py).

The API key says whose call it is: an agent run's client carries the key of its sample, and every
call with that key is recorded in the sample's `SampleCapture` (rollout/agent_capture.py), bounded by
its turn and token budgets (a call past them is a 400 with code `budget_exhausted`). A key the
endpoint does not know is refused (401) unless it is `open` (tests, benchmarks). A run handed over
from another worker has its calls answered from that worker's capture while they match it
(rollout/agent_replay.py): those never reach the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fleetrl.broker import PartialSample, Sampling
from fleetrl.log import get_logger
from fleetrl.rollout.agent_capture import AgentTemplate, Call, Choice, SampleCapture
from fleetrl.rollout.errors import TaskError
from fleetrl.rollout.openai_schema import (
    ParsedRequest,
    Refusal,
    created,
    cut_at_stop,
    parse_chat,
    parse_completion,
    parse_tool_calls,
)
from fleetrl.rollout.tokenize import TextCodec

log = get_logger(__name__)
HTTP_CLIENTS = 16
"""HTTP clients (connection pools) the agent runs of one worker share in turn."""
Generate = Callable[[str, list[int], Sampling, int, str | None], Awaitable[list[PartialSample]]]
"""(request id, prompt ids, sampling, n, randomness key) -> n finished samples (`EngineTurns.generate`)."""


class AgentEndpoint:
    """What the served routes do, without HTTP (the server below calls it; tests may too)."""

    def __init__(self, codec: TextCodec, eos_ids: list[int], generate: Generate, *, max_context: int,
                 default_max_tokens: int, model: str = "fleetrl-policy", open_keys: bool = False,
                 max_record_prompt: int | None = None) -> None:
        self.codec, self.generate, self.model = codec, generate, model
        self.template = AgentTemplate(codec, eos_ids)
        self.max_context, self.default_max_tokens, self.open_keys = max_context, default_max_tokens, open_keys
        self.max_record_prompt = max_record_prompt
        """The longest prompt a recorded call may have: a segment's context travels in the group record,
        whose bound it is (`max_prompt_tokens` + a sample's tokens, docs/records.md)."""
        self.captures: dict[str, SampleCapture] = {}
        """API key -> the sample its calls build (registered by the agent runner)."""
        self._ids = itertools.count()
        self.calls = 0
        """Calls decoded by the engine."""
        self.calls_replayed = 0
        """Calls of handed-over runs answered from their capture (no engine work)."""

    # -- the routes -------------------------------------------------------------------------------

    async def chat(self, key: str | None, body: Any) -> dict[str, Any]:
        req = parse_chat(body)
        capture = self._capture(key)
        assert req.messages is not None
        if capture is None:
            prompt_ids, choice, extends = self.template.render(req.messages, req.tools), 0, False
        else:
            prompt_ids, choice, extends = capture.prompt_for(self.template, req.messages, req.tools, None)
        outs = await self._decode(req, capture, prompt_ids, choice, extends, "messages")
        choices, made = [], []
        for i, s in enumerate(outs):
            s, text, hit = self._cut(s, req.stop)
            content, calls = parse_tool_calls(text) if req.parse_tools else (text, [])
            reply: dict[str, Any] = {"role": "assistant", "content": content or ""}
            if calls:
                reply["tool_calls"] = [{"type": "function", "function": {"name": c["function"]["name"], "arguments":
                                        _loads(c["function"]["arguments"])}} for c in calls]
            made.append(Choice(s, reply, text))
            finish = "tool_calls" if calls else ("stop" if hit or s.finish_reason == "stop" else "length")
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": {"content": self._logprobs(s)} if req.logprobs else None})
        if capture is not None:
            capture.answered(Call(prompt_ids, made, req.messages, req.tools))
        return {"id": f"chatcmpl-{next(self._ids)}", "object": "chat.completion", "created": created(),
                "model": req.model, "choices": choices, "usage": _usage(prompt_ids, [c.sample for c in made])}

    async def completion(self, key: str | None, body: Any) -> dict[str, Any]:
        req = parse_completion(body)
        capture = self._capture(key)
        ids_ = req.prompt_ids if req.prompt_ids is not None else self.codec.encode(req.prompt or "")
        if capture is None:
            prompt_ids, choice, extends = ids_, 0, False
        else:
            prompt_ids, choice, extends = capture.prompt_for(self.template, None, None, ids_)
        outs = await self._decode(req, capture, prompt_ids, choice, extends, "prompt")
        choices, made = [], []
        for i, s in enumerate(outs):
            s, text, hit = self._cut(s, req.stop)
            made.append(Choice(s, None, text))
            lp = None
            if req.logprobs:
                tokens = self._logprobs(s)
                lp = {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
                      "top_logprobs": None, "text_offset": None}
            choices.append({"index": i, "text": text, "logprobs": lp,
                            "finish_reason": "stop" if hit or s.finish_reason == "stop" else "length"})
        if capture is not None:
            capture.answered(Call(prompt_ids, made))
        return {"id": f"cmpl-{next(self._ids)}", "object": "text_completion", "created": created(),
                "model": req.model, "choices": choices, "usage": _usage(prompt_ids, [c.sample for c in made])}

    # -- parts ------------------------------------------------------------------------------------

    def _capture(self, key: str | None) -> SampleCapture | None:
        capture = self.captures.get(key or "")
        if capture is None and not self.open_keys:
            raise Refusal(None, "unknown API key: the endpoint serves the agent runs of its worker only", status=401,
                          code="invalid_api_key", kind="authentication_error")
        return capture

    async def _decode(self, req: ParsedRequest, capture: SampleCapture | None, prompt_ids: list[int], choice: int,
                      extends: bool, field: str) -> list[PartialSample]:
        if len(prompt_ids) >= self.max_context:
            raise Refusal(field, f"the prompt is {len(prompt_ids)} tokens; the engine's context holds "
                                 f"{self.max_context}", code="context_length_exceeded")
        max_tokens = req.max_tokens or self.default_max_tokens
        rid = f"agent-{next(self._ids)}"
        if capture is not None and self.max_record_prompt is not None and len(prompt_ids) > self.max_record_prompt:
            raise Refusal(field, f"the prompt is {len(prompt_ids)} tokens; a recorded call's context holds at most "
                                 f"{self.max_record_prompt} (dataset.max_prompt_tokens + the sample's bound)",
                          code="context_length_exceeded")
        if capture is not None:
            room = capture.room(prompt_ids, choice, extends)
            if capture.calls >= capture.max_calls or room <= 0:
                capture.exhausted = "env.max_turns" if capture.calls >= capture.max_calls else "token budget"
                raise Refusal(None, f"this agent run is over its budget ({capture.exhausted})",
                              code="budget_exhausted")
            capture.begin(prompt_ids, choice, extends)
            max_tokens, rid = min(max_tokens, room), f"{capture.name or capture.key}#{capture.calls}"
        sampling = Sampling(temperature=req.temperature, top_p=req.top_p,
                            max_new_tokens=max(1, min(max_tokens, self.max_context - len(prompt_ids))))
        if capture is not None and capture.replay is not None:
            recorded = capture.replay.answer(prompt_ids, req.n, sampling.max_new_tokens)
            if recorded is not None:  # a handed-over run's call, answered from its capture (agent_replay.py)
                self.calls_replayed += 1
                return [recorded]
        key = None if req.seed is None else f"seed:{req.seed}"
        self.calls += 1
        return await self.generate(rid, prompt_ids, sampling, req.n, key)

    def _cut(self, s: PartialSample, stop: list[str]) -> tuple[PartialSample, str, bool]:
        """The completion's text, and the sample cut after the token that completes a stop string."""
        text = self.codec.decode(s.completion_ids)
        if not stop or cut_at_stop(text, stop)[1] is None:
            return s, text, False
        for k in range(1, len(s.completion_ids) + 1):
            if cut_at_stop(self.codec.decode(s.completion_ids[:k]), stop)[1] is not None:
                cut = PartialSample(s.completion_ids[:k], s.logprobs[:k], s.versions[:k], "stop")
                return cut, cut_at_stop(text, stop)[0], True
        return s, text, False  # unreachable: the whole completion holds the stop string

    def _logprobs(self, s: PartialSample) -> list[dict[str, Any]]:
        out = []
        for t, lp in zip(s.completion_ids, s.logprobs, strict=True):
            piece = self.codec.decode_all([int(t)])
            out.append({"token": piece, "logprob": float(lp), "bytes": list(piece.encode()), "top_logprobs": []})
        return out


def _usage(prompt_ids: list[int], outs: list[PartialSample]) -> dict[str, int]:
    completion = sum(len(s.completion_ids) for s in outs)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def build_app(endpoint: AgentEndpoint) -> Starlette:
    """The ASGI app of `endpoint` (Starlette: the routes and nothing else on the hot path), errors in
    OpenAI's shape."""

    def route(handler: Callable[[str | None, Any], Awaitable[dict[str, Any]]]) -> Callable[..., Any]:
        async def answer(request: Request) -> JSONResponse:
            auth = request.headers.get("authorization", "")
            key = auth[7:] if auth.lower().startswith("bearer ") else None
            try:
                try:
                    body = json.loads(await request.body())
                except ValueError:
                    raise Refusal(None, "the request body is not JSON") from None
                return JSONResponse(await handler(key, body))
            except Refusal as exc:
                return JSONResponse(exc.body(), status_code=exc.status)
            except TaskError as exc:  # the chat template refused the conversation
                return JSONResponse(Refusal("messages", str(exc)).body(), status_code=400)
        return answer

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": endpoint.model, "object": "model",
                                                         "owned_by": "fleetrl"}]})

    return Starlette(routes=[Route("/v1/chat/completions", route(endpoint.chat), methods=["POST"]),
                             Route("/v1/completions", route(endpoint.completion), methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"])])


def _quiet_server_class() -> Any:
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn without its signal handlers: the worker (and the region agent) own SIGTERM and SIGINT."""

        def capture_signals(self) -> Any:
            return contextlib.nullcontext()

    return QuietServer


class EndpointServer:
    """uvicorn serving `endpoint` on 127.0.0.1 (`port` 0: one the kernel picks, bound before serving)."""

    def __init__(self, endpoint: AgentEndpoint, port: int = 0) -> None:
        self.endpoint, self._port = endpoint, port
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self._http: list[Any] = []
        self._next_http = 0
        self._tls: Any = None
        self.port = 0

    def http_client(self) -> Any:
        """An HTTP client for an agent client, one of `HTTP_CLIENTS` the worker's runs share in turn (the
        server closes them). A client per run would cost ~2.5 ms of CPU to build (a fresh TLS context
        loads the CA store, ~80 ms); one for every run makes each request scan every connection."""
        if len(self._http) < HTTP_CLIENTS:
            import ssl

            import openai

            if self._tls is None:  # loopback HTTP needs none, but the client builds one: share it
                self._tls = ssl.create_default_context()
            self._http.append(openai.DefaultAsyncHttpxClient(verify=self._tls))
            return self._http[-1]
        self._next_http = (self._next_http + 1) % len(self._http)
        return self._http[self._next_http]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> EndpointServer:
        import uvicorn

        _QuietServer = _quiet_server_class()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio sets TCP_NODELAY on it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self._port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(self.endpoint), log_level="warning", lifespan="off", access_log=False,
                                backlog=1024, timeout_keep_alive=30)
        self._server = _QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="agent-endpoint")
        for _ in range(1000):  # bounded: uvicorn sets `started` once it listens
            if self._server.started or self._task.done():
                break
            await asyncio.sleep(0.005)
        if self._task.done():
            self._task.result()
        log.info("agent.endpoint_started", url=self.base_url)
        return self

    def request_stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True

    async def stop(self, timeout_s: float = 5.0) -> None:
        self.request_stop()
        clients, self._http = self._http, []
        for client in clients:
            await client.aclose()
        if self._task is not None:
            await asyncio.wait([self._task], timeout=timeout_s)
            if not self._task.done():
                self._task.cancel()
