"""Reward functions written for TRL's GRPOTrainer (`reward_funcs`), used by the workload tests by import path."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from slowdown import scaled

RELEASE_SLOW = threading.Event()
"""Lets `picky`'s slow call return. A test sets it once the call's `reward.timeout_s` has fired: the call
blocks past any timeout, however fast or slow the machine (and its thread would otherwise hold the exit)."""
SLOW_BOUND_S = scaled(60.0)
"""How long the slow call waits for `RELEASE_SLOW` at most: a bound, should a test never let it go (scaled by
the machine's slowdown, tests/slowdown.py)."""


def _text(c: Any) -> str:
    return c[0]["content"] if isinstance(c, list) else c


def length_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """TRL's docs example shape: one float per completion."""
    return [float(len(_text(c))) for c in completions]


async def keyword_reward(completions: list[Any], keyword: list[str], **kwargs: Any) -> list[float]:
    await asyncio.sleep(0)
    return [1.0 if k in _text(c) else 0.0 for c, k in zip(completions, keyword, strict=True)]


def seen(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Records what it was called with (the test reads `seen.calls`)."""
    seen.calls.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs})
    return [0.0] * len(completions)


seen.calls = []  # type: ignore[attr-defined]


def picky(completions: list[Any], mode: list[str], **kwargs: Any) -> list[Any]:
    """Fails the way the row's `mode` column says: raise, nan, slow, short (wrong length), or not at all."""
    m = mode[0]
    if m == "raise":
        raise ValueError(f"cannot score {len(completions)} completions")
    if m == "nan":
        return [float("nan")] * len(completions)
    if m == "slow":
        RELEASE_SLOW.wait(SLOW_BOUND_S)
    if m == "short":
        return [1.0]
    return [1.0] * len(completions)


NOT_CALLABLE = 42


def verl_compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> Any:
    """verl's custom reward function form (one completion at a time; a float or a dict with `score`)."""
    hit = 1.0 if ground_truth in solution_str else 0.0
    return {"score": hit, "acc": hit} if data_source == "dict" else hit
