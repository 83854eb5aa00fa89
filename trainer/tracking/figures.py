"""A training step's experiment figures and its table of sample completions, from what the step already
computed: the batch's stats (`batch.py`), the learner's `StepStats`, the step's groups, and the cost
meter's step fields (`cost.py`). Pure functions; `session.py` decides when they are released.

`train/entropy` is the Monte Carlo estimate of the behaviour policy's per-token entropy: the mean of
-logprob over the sampled policy tokens (environment tokens left out), exact in expectation for samples
drawn at temperature 1 from the recorded distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fleetrl.broker import GroupRecord

SAMPLE_COLUMNS = ("step", "version", "group_id", "region", "reward", "tokens", "completion")
_COST_KEYS = {"cost_usd": "cost/usd_step", "cost_usd_total": "cost/usd_total", "groups_per_usd": "cost/groups_per_usd",
              "tokens_per_usd": "cost/tokens_per_usd", "tokens_regenerated_total": "cost/tokens_regenerated_total",
              "groups_resent_total": "cost/groups_resent_total"}
_MAX_TEXT = 400


def step_figures(*, version: int, batch_stats: Mapping[str, float], stats: Any, groups: Sequence[GroupRecord],
                 seconds: float, cost_fields: Mapping[str, Any]) -> dict[str, float]:
    """Every figure of one step under its tracker name (`train/...`, `cost/...`); `stats` is a `StepStats`."""
    figures = {
        "train/version": float(version),
        "train/reward_mean": batch_stats["reward_mean"],
        "train/reward_std": batch_stats["reward_std"],
        "train/loss": stats.loss,
        "train/kl": stats.kl,
        "train/approx_kl": stats.approx_kl,
        "train/entropy": entropy_estimate(groups),
        "train/clip_fraction": stats.clip_fraction,
        "train/tis_truncated_fraction": stats.tis_truncated_fraction,
        "train/grad_norm": stats.grad_norm,
        "train/staleness_mean": batch_stats["lag_mean"],
        "train/staleness_max": batch_stats["lag_max"],
        "train/tokens": float(stats.tokens),
        "train/tokens_per_s": stats.tokens / seconds if seconds > 0 else 0.0,
        "train/step_seconds": seconds,
        "train/groups": float(len(groups)),
    }
    for region, n in sorted(groups_per_region(groups).items()):
        figures[f"train/groups/{region}"] = float(n)
    for key, name in _COST_KEYS.items():
        value = cost_fields.get(key)
        if isinstance(value, int | float):
            figures[name] = float(value)
    return {k: float(v) for k, v in figures.items()}


def groups_per_region(groups: Sequence[GroupRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in groups:
        out[g.region] = out.get(g.region, 0) + 1
    return out


def entropy_estimate(groups: Sequence[GroupRecord]) -> float:
    """Mean -logprob of the sampled policy tokens (nats per token); 0 without any."""
    # One concatenation and one sum (a sum per sample costs ~1 ms a step at the demo's 64 samples).
    parts = [s.logprobs if s.segments is None else s.logprobs[s.policy_mask()] for g in groups for s in g.samples]
    if not parts:
        return 0.0
    lp = np.concatenate(parts).astype(np.float64, copy=False)
    return float(-lp.sum() / len(lp)) if len(lp) else 0.0


def sample_rows(step: int, version: int, groups: Sequence[GroupRecord], n: int,
                decode: Callable[[Sequence[int]], str]) -> list[list[Any]]:
    """The first sample of each of the step's first `n` groups, decoded: rows for `SAMPLE_COLUMNS`."""
    rows: list[list[Any]] = []
    for g in groups[:n]:
        if not g.samples:
            continue
        s = g.samples[0]
        text = decode([int(i) for i in s.completion_ids])
        rows.append([step, version, g.group_id, g.region, round(float(s.reward), 4), len(s.completion_ids),
                     text[:_MAX_TEXT]])
    return rows


# The character tokenizer's table (rollout/tasks/tokenizer.py, which the trainer may not import; a test
# holds the two equal): ids 3..97 are printable ASCII, 98 newline, 2 is eos.
_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
_CHAR_EOS, _CHAR_FIRST = 2, 3


def char_decode(ids: Sequence[int]) -> str:
    out = []
    for i in ids:
        if i == _CHAR_EOS:
            break
        if _CHAR_FIRST <= i < _CHAR_FIRST + len(_CHARS):
            out.append(_CHARS[i - _CHAR_FIRST])
    return "".join(out)


def make_decoder(tokenizer_source: str) -> Callable[[Sequence[int]], str]:
    """Ids -> text with the run's tokenizer (`char`, or a local Hugging Face folder); a tokenizer that will
    not load gives the ids themselves (the table is a convenience, never a reason to fail)."""
    if tokenizer_source == "char":
        return char_decode
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_source, local_files_only=True)
    except Exception:  # any loading error: fall back to ids
        return lambda ids: " ".join(str(i) for i in ids)
    return lambda ids: str(tok.decode(list(ids), skip_special_tokens=True))
