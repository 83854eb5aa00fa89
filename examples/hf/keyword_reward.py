"""The reward of `examples/fleet.hf.yaml`, written for TRL's GRPOTrainer (`reward_funcs`): FleetRL runs it unchanged.

Each function gets one entry per completion: `completions` as chat messages (the dataset's prompts are
conversational), and the dataset's `keyword` column as a list. It returns one float per completion.
"""

from __future__ import annotations

from typing import Any


def _text(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def keyword_letters(completions: list[Any], keyword: list[str], **kwargs: Any) -> list[float]:
    """Share of the completion's letters that belong to the keyword: partial credit from the first step."""
    scores = []
    for completion, k in zip(completions, keyword, strict=True):
        letters = [ch for ch in _text(completion).lower() if ch.isalpha()]
        scores.append(sum(ch in k for ch in letters) / len(letters) if letters else 0.0)
    return scores


async def says_keyword(completions: list[Any], keyword: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the keyword appears in the completion (an `async def` reward, as TRL allows)."""
    return [1.0 if k in _text(c).lower() else 0.0 for c, k in zip(completions, keyword, strict=True)]
