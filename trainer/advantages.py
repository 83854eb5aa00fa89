"""Group-relative advantages (DESIGN.md §6): one scalar per sample, computed within its group.

The unit of work is a group (one prompt, n samples); a sample's advantage says how much better its
reward is than its siblings'. Pure functions on 1-D float tensors, so the learner and the tests
share one definition.
"""

from __future__ import annotations

from typing import Literal

import torch

AdvantageKind = Literal["grpo", "grpo_no_std", "leave_one_out"]

STD_EPS = 1e-6
"""Added to the group std so that a group with identical rewards gives zeros, not NaNs."""


def grpo(rewards: torch.Tensor) -> torch.Tensor:
    """(r - mean) / (std + eps), std with Bessel's correction as in DeepSeek's GRPO."""
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean()
    return centred / (rewards.std(unbiased=True) + STD_EPS)


def grpo_no_std(rewards: torch.Tensor) -> torch.Tensor:
    """r - mean: no std scaling (Dr. GRPO), so easy and hard prompts are not re-weighted."""
    return rewards - rewards.mean()


def leave_one_out(rewards: torch.Tensor) -> torch.Tensor:
    """r_i - mean of the other samples' rewards (RLOO); equals n/(n-1) * (r_i - mean)."""
    n = rewards.numel()
    if n < 2:
        return torch.zeros_like(rewards)
    others_mean = (rewards.sum() - rewards) / (n - 1)
    return rewards - others_mean


_KINDS = {"grpo": grpo, "grpo_no_std": grpo_no_std, "leave_one_out": leave_one_out}


def group_advantages(rewards: torch.Tensor, kind: AdvantageKind) -> torch.Tensor:
    """Advantages of one group's samples (fp32)."""
    try:
        fn = _KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown advantage kind {kind!r}; known: {sorted(_KINDS)}") from None
    return fn(rewards.to(torch.float32))
