"""Predicted completion lengths per prompt, for length-aware region placement (`rollout.length_aware`).

Every trained group's tokens pass through the trainer, so it knows how long each prompt's
completions ran the last time it was answered. `PromptLengths` keeps the mean completion length
(tokens per sample) of the latest answers to each prompt, keyed by the prompt's content (task, text
or messages: the same row in a later epoch has a new group id), in a bounded least-recently-used
table. A prompt never answered is predicted at the mean of everything seen (1.0 in relative terms).
The dispatcher weighs groups by `relative_work` (predicted / mean), so a region's backlog counts
long groups for more than short ones (`credits.py`).

Predictions only steer placement; a wrong or missing one costs speed, never correctness, and the
table is not checkpointed (it refills within an epoch).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

_DECAY = 0.5
"""Weight of the newest answer in a prompt's mean (the policy's lengths drift as it trains)."""


def content_key(task: str, prompt: str, messages: list[dict[str, Any]] | None) -> bytes:
    """The key of a prompt's content (the same row in any epoch, under any group id)."""
    body = json.dumps([task, prompt, messages], sort_keys=True, default=str).encode()
    return hashlib.blake2b(body, digest_size=16).digest()


class PromptLengths:
    def __init__(self, max_prompts: int = 65536) -> None:
        self.max_prompts = max_prompts
        self._mean: OrderedDict[bytes, float] = OrderedDict()
        self._sum = 0.0
        self._count = 0

    def observe(self, key: bytes, tokens_per_sample: float) -> None:
        """A group of the prompt came back with this mean completion length."""
        old = self._mean.pop(key, None)
        self._mean[key] = tokens_per_sample if old is None else old + _DECAY * (tokens_per_sample - old)
        while len(self._mean) > self.max_prompts:
            self._mean.popitem(last=False)
        self._sum += tokens_per_sample
        self._count += 1

    def mean(self) -> float | None:
        return self._sum / self._count if self._count else None

    def relative_work(self, key: bytes) -> float:
        """The prompt's predicted length over the mean length seen (1.0 when either is unknown)."""
        mean = self.mean()
        predicted = self._mean.get(key)
        if mean is None or predicted is None or mean <= 0:
            return 1.0
        return max(predicted, 1.0) / mean
