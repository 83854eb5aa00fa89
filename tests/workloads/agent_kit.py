"""The agent endpoint on a real engine, without Kafka: a tiny Qwen2 torch engine, its turns driven by
`fleetrl.rollout.turns.drive`, and the endpoint served by uvicorn on loopback."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import yaml

from fleetrl.broker import PartialSample, Sampling
from fleetrl.config import parse_config
from fleetrl.rollout.openai_server import AgentEndpoint, EndpointServer
from fleetrl.rollout.tokenize import TextCodec, load_codec
from fleetrl.rollout.torch_engine import TorchEngine
from fleetrl.rollout.turns import EngineTurns, drive


@dataclass
class Served:
    engine: TorchEngine
    codec: TextCodec
    endpoint: AgentEndpoint
    server: EndpointServer
    turns: list[tuple[list[int], list[PartialSample]]] = field(default_factory=list)
    """Every request the engine answered: (prompt ids it decoded from, its samples), in order."""


@asynccontextmanager
async def serve(model: pathlib.Path, max_batch: int = 64, open_keys: bool = True,
                default_max_tokens: int = 8, max_record_prompt: int | None = None) -> AsyncIterator[Served]:
    config = parse_config(yaml.safe_dump({
        "run": "agent-test", "model": {"path": str(model)},
        "regions": [{"name": "r1", "kafka": "127.0.0.1:1", "store": "/nonexistent",
                     "engine": {"kind": "torch", "max_batch": max_batch, "dtype": "bfloat16"}}]}),
        source="agent-test.yaml", env={})
    engine = TorchEngine.from_config(config.model, config.regions[0].engine)
    codec = load_codec(config.model, sorted(engine.eos_ids))
    turns = EngineTurns(engine, seed=0)
    served: Served

    async def generate(rid: str, prompt: list[int], sampling: Sampling, n: int, key: str | None) -> Any:
        out = await turns.generate(rid, prompt, sampling, n, key)
        served.turns.append((list(prompt), out))  # a tap on what the real engine answered
        return out

    endpoint = AgentEndpoint(codec, sorted(engine.eos_ids), generate, max_context=engine.max_context,
                             default_max_tokens=default_max_tokens, open_keys=open_keys,
                             max_record_prompt=max_record_prompt)
    server = await EndpointServer(endpoint).start()
    served = Served(engine, codec, endpoint, server)
    stop = asyncio.Event()
    loop = asyncio.create_task(drive(engine, turns, stop))
    try:
        yield served
    finally:
        stop.set()
        await loop
        await server.stop()
        engine.close()
