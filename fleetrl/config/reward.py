"""Custom rewards (`reward`): reward functions by import path (TRL's or verl's signature) and a
remote reward endpoint, scored in the rollout worker; unset, the task's built-in reward applies."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleetrl.config.base import Model


class RewardFunctionConfig(Model):
    """A reward function by import path, with the signature of TRL GRPOTrainer's `reward_funcs`."""

    fn: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """`package.module:function`, `(prompts, completions, **columns) -> list[float]`, sync or `async def`;
    imported (from `reward.python_path`, then the Python path) when the config is checked."""
    weight: float = 1.0
    """Weight of this function in the sample's reward (a weighted sum, as TRL's `reward_weights`)."""
    signature: Literal["trl", "verl"] = "trl"
    """`trl`: TRL's `reward_funcs`, once per group. `verl`: verl's custom reward function,
    `(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float, ...}`, once per
    completion, with `ground_truth` from the row's `reward_model.ground_truth` (verl's parquet layout)."""


class RewardConfig(Model):
    """Custom rewards, scored in the rollout worker. Unset: the task's built-in reward."""

    functions: list[RewardFunctionConfig] = Field(default_factory=list)
    """Reward functions; a sample's reward is the weighted sum of theirs (a `None` counts as 0, as in TRL)."""
    url: str | None = Field(None, pattern=r"^https?://")
    """A remote reward endpoint: POST JSON `{prompts, completions, ...columns}` of one group, answer
    `{"rewards": [float, ...]}`; added to the functions' sum with `url_weight`."""
    url_weight: float = 1.0
    """Weight of the remote reward."""
    timeout_s: float = Field(30.0, gt=0)
    """Bound of one group's scoring by one function (one HTTP attempt for `url`); past it the group is
    dead-lettered with reason `reward_error`."""
    retries: int = Field(2, ge=0, le=10)
    """Extra attempts of a failed or timed-out HTTP request to `url`."""
    python_path: list[str] = Field(default_factory=lambda: ["."])
    """Folders (relative to the config file) searched first for the functions' modules."""

    @property
    def custom(self) -> bool:
        return bool(self.functions) or self.url is not None
