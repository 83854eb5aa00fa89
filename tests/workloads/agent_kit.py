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

from fleetrl.broker import PartialSample, PromptRecord, Sampling
from fleetrl.config import EnvConfig, RewardConfig, parse_config
from fleetrl.rollout.agent_episodes import AgentRunner, load_agent
from fleetrl.rollout.openai_server import AgentEndpoint, EndpointServer
from fleetrl.rollout.rewards import build_rewards
from fleetrl.rollout.tasks import get_task
from fleetrl.rollout.tokenize import TextCodec, load_codec
from fleetrl.rollout.torch_engine import TorchEngine
from fleetrl.rollout.turns import EngineTurns, drive

HERE = pathlib.Path(__file__).parent
ASK = [{"role": "user", "content": "What is 12 + 7?"}]


def agent_runner(s: Served, agent: str, max_turns: int = 8, max_tokens: int = 200, reward: RewardConfig | None = None,
                 resume: list[PartialSample] | None = None) -> AgentRunner:
    """An `AgentRunner` of `agent_fns:<agent>` (this folder's agents) on the served endpoint."""
    cfg = EnvConfig(kind="openai_agent", name=f"agent_fns:{agent}", python_path=[str(HERE)], max_turns=max_turns,
                    wall_time_s=120.0)
    return AgentRunner(cfg, load_agent(cfg.name, cfg.python_path), s.server,
                       build_rewards(reward or RewardConfig(), get_task), max_tokens, resume=resume)


def agent_prompt(n: int, columns: dict[str, Any] | None = None, reference: str | None = None) -> PromptRecord:
    """Group `g-1` of `n` samples asking `ASK`."""
    return PromptRecord(group_id="g-1", run="agent-test", task="reverse", n_samples=n,
                        sampling=Sampling(max_new_tokens=8), messages=ASK, columns=columns, reference=reference)


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
