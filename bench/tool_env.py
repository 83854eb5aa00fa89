"""The environment of `bench/pipeline.py --workload tools`: episodes whose tool calls wait with a long tail.

A skyrl-gym `BaseTextEnv`. Each model turn is a "tool call" that takes `latency_s` (EMULATED: a sleep), or
`tail_latency_s` for a `tail_p` share of the calls, as real tools (a sandbox, a search, a test runner)
do; the tool's answer goes back as an observation, and after `max_turns` the last turn is scored with
the `reverse` task's reward against the row's reference.
"""

from __future__ import annotations

import random
import time
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from fleetrl.rollout import get_task


class LatencyEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        cfg, extras = dict(env_config or {}), extras or {}
        self.reference = extras.get("reward_spec", {}).get("ground_truth")
        self.max_turns = int(cfg.get("max_turns", 3))
        self.latency_s = float(cfg.get("latency_s", 0.05))
        self.tail_latency_s = float(cfg.get("tail_latency_s", 1.0))
        self.tail_p = float(cfg.get("tail_p", 0.1))
        self.rng = random.Random()

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        time.sleep(self.tail_latency_s if self.rng.random() < self.tail_p else self.latency_s)
        if self.turns >= self.max_turns:
            reward = float(get_task("reverse").reward(action, self.reference))
            return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})
        return BaseTextEnvStepOutput(observations=[{"role": "tool", "content": f"ok {len(action)}"}], reward=0.0,
                                     done=False, metadata={})
