"""The environment of `examples/fleet.tools.yaml`: a lookup tool over a local table, written against
skyrl-gym's API (`BaseTextEnv`, `ToolGroup`, `@tool`), as one writes an environment for SkyRL; FleetRL
runs it unchanged (`dataset.env.name: lookup_env:LookupEnv`).

Each dataset row carries its own table (`table`: item -> colour, shuffled per row) and the `item` its
prompt asks about. An episode has two model turns. The first is a query: the environment runs the
`lookup` tool with it and shows the tool's answer as a `tool` message. The second is the answer: the
reward is the share of its letters that belong to the item's colour (partial credit from the first
step), plus 0.5 when it says the colour. The colour is in no prompt: only the tool tells it.
"""

from __future__ import annotations

from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.tools.core import ToolGroup, tool


class LookupTools(ToolGroup):
    def __init__(self, table: dict[str, str]) -> None:
        self.table = table
        super().__init__(name="LookupTools")

    @tool
    def lookup(self, query: str, item: str) -> str:
        """The table's row for the item the query names, else for the episode's item."""
        key = next((k for k in self.table if k in query), item)
        return f"{key} is {self.table[key]}"


class LookupEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.table: dict[str, str] = dict(extras["table"])
        self.item = str(extras["item"])
        self.max_turns = 2
        self.init_tool_groups([LookupTools(self.table)])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        if self.turns == 1:  # the query: run the tool, show its answer
            result = self._execute_tool("LookupTools", "lookup", [action, self.item])
            return BaseTextEnvStepOutput(observations=[{"role": "tool", "content": result}], reward=0.0,
                                         done=False, metadata={"tool": "lookup"})
        colour = self.table[self.item]
        letters = [ch for ch in action.lower() if ch.isalpha()]
        reward = (sum(ch in colour for ch in letters) / len(letters) if letters else 0.0)
        reward += 0.5 if colour in action.lower() else 0.0
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})
