"""Episode wall time through the agent endpoint vs the direct episode path, on one engine and one workload.

The same two-turn episodes, G groups of n samples at once, on one torch engine (the tiny Qwen2 with the
tool-calling template, built locally): the model answers a question, a fixed "calculator" message
comes back, the model answers again.

* endpoint: each sample is an `openai_agent` run (rollout/agent_episodes.py): two
  `client.chat.completions.create` calls over HTTP to the worker's endpoint (Starlette under uvicorn),
  rendered through the chat template and recorded token for token (rollout/agent_capture.py);
* direct (the baseline): each sample is a skyrl-gym episode through `rollout/episodes.py`, its turns
  handed to the engine in-process, the environment's message appended as template ids.

Both paths decode with the same engine, the same turn bounds and the same batch; rounds alternate
between them and the median round counts. The ratio is endpoint / direct wall time of one round of
episodes (target <= 1.15), and per generated token (the paths sample different random streams, so
their completions differ in length). It is measured twice: with the tiny model's own CPU step (a few
ms: the endpoint's fixed cost per call, HTTP, the SDK, the template, weighs most), and with an
emulated accelerator step (`--step-delay-s`, `engine.emulate.step_delay_s`) of a real model's size.

    .venv/bin/python bench/agent_endpoint.py [--quick]

Last line: `result: ratio=... ratio_per_token=... ratio_step=... step_delay_s=... endpoint_s=... direct_s=...
episodes=...`
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import yaml

from fleetrl.broker import PartialSample, PromptRecord, Sampling
from fleetrl.config import EnvConfig, RewardConfig, parse_config
from fleetrl.demo.hf_inputs import build_model_folder
from fleetrl.rollout.agent_episodes import AgentRunner
from fleetrl.rollout.episodes import EpisodeRunner, TurnTemplate
from fleetrl.rollout.openai_server import AgentEndpoint, EndpointServer
from fleetrl.rollout.rewards import build_rewards
from fleetrl.rollout.tasks import get_task
from fleetrl.rollout.tokenize import load_codec
from fleetrl.rollout.torch_engine import TorchEngine
from fleetrl.rollout.turns import EngineTurns, drive

QUESTION = [{"role": "user", "content": "What is 12 + 7? Use the calculator."}]
ANSWER = "The calculator says 12 + 7 = 19."
TOKENS = 16


class CalculatorEnv:
    """The direct path's environment, skyrl-gym's contract (`init`, `step` -> {observations, reward, done})."""

    def __init__(self) -> None:
        self.turns = 0

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        return prompt, {}

    def step(self, action: str) -> dict[str, Any]:
        self.turns += 1
        if self.turns == 1:
            return {"observations": [{"role": "user", "content": ANSWER}], "reward": 0.0, "done": False,
                    "metadata": {}}
        return {"observations": [], "reward": 1.0, "done": True, "metadata": {}}

    def close(self) -> None:
        pass


async def calculator_agent(client: Any, prompt: list[dict[str, Any]], **row: Any) -> float:
    """The endpoint path's agent: the same two turns with the plain openai SDK."""
    messages: list[Any] = list(prompt)
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=TOKENS)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": ANSWER}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=TOKENS)
    return 1.0


async def measure(model: pathlib.Path, groups: int, n: int, rounds: int, step_delay_s: float) -> dict[str, float]:
    engine_cfg: dict[str, Any] = {"kind": "torch", "max_batch": groups * n, "dtype": "bfloat16"}
    if step_delay_s:  # an accelerator's decoding step, the same for both paths (lengths stay the model's own)
        engine_cfg["emulate"] = {"step_delay_s": step_delay_s, "short_tokens": 10_000}
    config = parse_config(yaml.safe_dump({"run": "bench", "model": {"path": str(model)}, "regions": [
        {"name": "r", "kafka": "127.0.0.1:1", "store": "/nonexistent", "engine": engine_cfg}]}),
        source="bench.yaml", env={})
    engine = TorchEngine.from_config(config.model, config.regions[0].engine)
    codec = load_codec(config.model, sorted(engine.eos_ids))
    turns = EngineTurns(engine, seed=0)
    endpoint = AgentEndpoint(codec, sorted(engine.eos_ids), turns.generate, max_context=engine.max_context,
                             default_max_tokens=TOKENS)
    server = await EndpointServer(endpoint).start()
    stop = asyncio.Event()
    loop = asyncio.create_task(drive(engine, turns, stop))
    cfg = EnvConfig(kind="openai_agent", name="bench:calculator_agent", max_turns=2, wall_time_s=600)
    rewards = build_rewards(RewardConfig(), get_task)
    pool = ThreadPoolExecutor(16)

    async def one_turn(rid: str, context: list[int], sampling: Sampling) -> PartialSample:
        return (await turns.generate(rid, context, sampling))[0]

    prompt = PromptRecord(group_id="g", run="bench", task="reverse", n_samples=n,
                          sampling=Sampling(max_new_tokens=TOKENS), messages=QUESTION)
    prompt_ids = codec.render(QUESTION)

    async def endpoint_round(r: int) -> int:
        runners = [AgentRunner(cfg, calculator_agent, server, rewards, 4 * TOKENS + 64)
                   for _ in range(groups)]
        out = await asyncio.gather(*(x.run_group(f"e{r}-{g}", prompt, prompt_ids, {}) for g, x in enumerate(runners)))
        return sum(int((res.sample.versions >= 0).sum()) for group in out for res in group)

    async def direct_round(r: int) -> int:
        runners = [EpisodeRunner(cfg, lambda c, e: CalculatorEnv(), codec, TurnTemplate(codec, sorted(engine.eos_ids)),
                                 pool, one_turn, 4 * TOKENS + 64) for _ in range(groups)]
        out = await asyncio.gather(*(x.run_group(f"d{r}-{g}", prompt, prompt_ids, {}) for g, x in enumerate(runners)))
        return sum(int((res.sample.versions >= 0).sum()) for group in out for res in group)

    times: dict[str, list[float]] = {"endpoint": [], "direct": []}
    tokens: dict[str, list[int]] = {"endpoint": [], "direct": []}
    await endpoint_round(-1)  # warm both paths (uvicorn's first request, the engine's first steps)
    await direct_round(-1)
    for r in range(rounds):
        for name, fn in (("direct", direct_round), ("endpoint", endpoint_round)) if r % 2 else \
                (("endpoint", endpoint_round), ("direct", direct_round)):
            started = time.perf_counter()
            tokens[name].append(await fn(r))
            times[name].append(time.perf_counter() - started)
    stop.set()
    await loop
    await server.stop()
    pool.shutdown()
    engine.close()
    e, d = statistics.median(times["endpoint"]), statistics.median(times["direct"])
    per_e = sum(times["endpoint"]) / max(1, sum(tokens["endpoint"]))
    per_d = sum(times["direct"]) / max(1, sum(tokens["direct"]))
    return {"ratio": e / d, "ratio_per_token": per_e / per_d, "endpoint_s": e, "direct_s": d,
            "episodes": groups * n, "tokens_endpoint": statistics.mean(tokens["endpoint"]),
            "tokens_direct": statistics.mean(tokens["direct"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (under two minutes on 2 cores)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--step-delay-s", type=float, default=0.02,
                        help="the emulated accelerator step of the second measurement (FACTS.md: a 0.5 B Qwen2 at "
                             "batch 64 takes 5 ms with CUDA graphs, 84 ms eager)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    rounds = args.rounds or (4 if args.quick else 10)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model_folder(pathlib.Path(tmp) / "model", agent=True)
        raw = asyncio.run(measure(model, args.groups, args.n, rounds, 0.0))
        slow = asyncio.run(measure(model, args.groups, args.n, rounds, args.step_delay_s))
    for label, res in (("tiny model, CPU step", raw), (f"{args.step_delay_s * 1e3:.0f} ms step", slow)):
        print(f"{label}: endpoint {res['endpoint_s']:.3f} s a round ({res['tokens_endpoint']:.0f} model tokens), "
              f"direct {res['direct_s']:.3f} s ({res['tokens_direct']:.0f}), {res['episodes']} episodes a round, "
              f"ratio {res['ratio']:.3f}")
    print(f"result: ratio={raw['ratio']:.3f} ratio_per_token={raw['ratio_per_token']:.3f} "
          f"ratio_step={slow['ratio']:.3f} step_delay_s={args.step_delay_s} endpoint_s={raw['endpoint_s']:.3f} "
          f"direct_s={raw['direct_s']:.3f} episodes={raw['episodes']}")


if __name__ == "__main__":
    main()
