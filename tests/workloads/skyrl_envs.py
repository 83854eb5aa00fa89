"""Environments of the episode tests, written against skyrl-gym's own API (`BaseTextEnv`, `ToolGroup`,
`@tool`), as one would write them for SkyRL. They do not depend on what a random model writes: the game
answers every guess, the tool is called every turn."""

from __future__ import annotations

import threading
import time
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.tools.core import ToolGroup, tool
from slowdown import scaled

RELEASE = threading.Event()
"""Lets the hanging tool go (it then raises). A test sets it once the other groups are done, so that they
finished while the tool hung by construction, or at its end, after `tool_timeout_s` gave the tool up (its
thread would otherwise hold the exit)."""
HANG_BOUND_S = scaled(60.0)
"""How long the hanging tool waits for `RELEASE` at most: a bound, should a test never let it go (scaled by
the machine's slowdown, tests/slowdown.py)."""


class GuessGame(BaseTextEnv):
    """Guess a number: the environment answers each turn until `max_turns`; reward 1 for a right guess."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.secret = str(extras["reward_spec"]["ground_truth"])
        self.max_turns = int((env_config or {}).get("max_turns", 3))
        self.delay_s = float((env_config or {}).get("delay_s", 0.0))

    def step(self, action: str) -> BaseTextEnvStepOutput:
        time.sleep(self.delay_s)  # a slow game (the handover test stops a worker mid-episode)
        self.turns += 1
        won = self.secret in action
        done = won or self.turns >= self.max_turns
        obs = [] if done else [{"role": "user", "content": f"No. Guess {self.turns} was wrong, try again."}]
        return BaseTextEnvStepOutput(observations=obs, reward=1.0 if won else 0.0, done=done, metadata={})


class LookupTools(ToolGroup):
    def __init__(self, mode: str) -> None:
        self.mode = mode
        super().__init__(name="LookupTools")

    @tool
    def lookup(self, key: str) -> str:
        if self.mode == "raise":
            raise KeyError(f"no table for {key!r}")
        if self.mode == "hang":
            RELEASE.wait(timeout=HANG_BOUND_S)
            raise RuntimeError(f"the lookup of {key.strip()[:8]!r} hung until the test let it go")
        return f"value of {key.strip()[:8]!r} is {len(key) % 10}"


class LookupEnv(BaseTextEnv):
    """Calls its `lookup` tool with each turn's text and shows the result; reward 0.5 per tool call."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.max_turns = int((env_config or {}).get("max_turns", 2))
        self.init_tool_groups([LookupTools(str(extras.get("tool_mode", "ok")))])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        result = self._execute_tool("LookupTools", "lookup", [action])
        done = self.turns >= self.max_turns
        obs = [] if done else [{"role": "tool", "content": f"<result>{result}</result>"}]
        return BaseTextEnvStepOutput(observations=obs, reward=0.5, done=done, metadata={"result": result})
