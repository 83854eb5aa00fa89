"""The figures of one evaluation (one eval set at one pinned version), from its returned groups.

Pure functions, tested against cases worked out by hand (tests/trainer/test_eval_figures.py):

* pass@k, the unbiased estimator of Chen et al. 2021 (HumanEval, eq. 1): for a prompt with `n`
  samples of which `c` pass, `1 - C(n - c, k) / C(n, k)`, computed as the numerically stable product
  `1 - prod_{i = n - c + 1}^{n} (1 - k / i)`; 1 when `n - c < k` (every k-subset holds a pass). The
  figure is its mean over prompts. pass@1 is the mean pass rate.
* mean reward, mean completion length (tokens), truncation rate (samples cut at `max_new_tokens`,
  finish reason `length`), and per-region counts of groups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetrl.broker import GroupRecord


@dataclass(frozen=True, slots=True)
class ReturnedGroup:
    """What the figures need of one returned eval group (kept in the trainer's checkpoint)."""

    region: str
    rewards: tuple[float, ...]
    lengths: tuple[int, ...]
    finishes: tuple[str, ...]

    @classmethod
    def of(cls, g: GroupRecord) -> ReturnedGroup:
        return cls(g.region, tuple(float(s.reward) for s in g.samples),
                   tuple(len(s.completion_ids) for s in g.samples), tuple(s.finish_reason for s in g.samples))

    def state(self) -> list[Any]:
        return [self.region, list(self.rewards), list(self.lengths), list(self.finishes)]

    @classmethod
    def from_state(cls, row: Sequence[Any]) -> ReturnedGroup:
        region, rewards, lengths, finishes = row
        return cls(str(region), tuple(float(r) for r in rewards), tuple(int(n) for n in lengths),
                   tuple(str(f) for f in finishes))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `n` samples, `c` of them passing (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    fail_all = 1.0
    for i in range(n - c + 1, n + 1):
        fail_all *= 1.0 - k / i
    return 1.0 - fail_all


@dataclass(slots=True)
class EvalFigures:
    """What one evaluation of one set at one version measured."""

    set_name: str
    version: int
    prompts: int
    samples: int
    k: int
    pass_at_1: float
    pass_at_k: float
    reward_mean: float
    length_mean: float
    truncated: float
    """Share of samples cut at `max_new_tokens`."""
    regions: dict[str, int] = field(default_factory=dict)
    """Groups generated per region."""

    def scalars(self) -> dict[str, float]:
        """The figures under the names trackers get (`eval/<set>/pass@1`, ...)."""
        p = f"eval/{self.set_name}"
        out = {f"{p}/pass@1": self.pass_at_1, f"{p}/reward_mean": self.reward_mean,
               f"{p}/length_mean": self.length_mean, f"{p}/truncated": self.truncated,
               f"{p}/prompts": float(self.prompts)}
        if self.k > 1:
            out[f"{p}/pass@{self.k}"] = self.pass_at_k
        for region, n in sorted(self.regions.items()):
            out[f"{p}/groups/{region}"] = float(n)
        return out

    def row(self) -> dict[str, object]:
        """One row of the eval table (`summary.json`'s `eval`, `fleetrl eval`'s output)."""
        return {"set": self.set_name, "version": self.version, "prompts": self.prompts, "samples": self.samples,
                "k": self.k, "pass@1": round(self.pass_at_1, 4), f"pass@{self.k}": round(self.pass_at_k, 4),
                "reward_mean": round(self.reward_mean, 4), "length_mean": round(self.length_mean, 3),
                "truncated": round(self.truncated, 4), "regions": dict(sorted(self.regions.items()))}


def figures(set_name: str, version: int, groups: Iterable[GroupRecord | ReturnedGroup], k: int,
            pass_threshold: float) -> EvalFigures:
    """The figures of one evaluation from its groups (one per prompt, each with `k` or more samples)."""
    gs = [g if isinstance(g, ReturnedGroup) else ReturnedGroup.of(g) for g in groups]
    if not gs:
        raise ValueError(f"eval set {set_name!r} at version {version}: no groups to measure")
    rewards = [r for g in gs for r in g.rewards]
    lengths = [n for g in gs for n in g.lengths]
    cut = sum(f == "length" for g in gs for f in g.finishes)
    passes = [(len(g.rewards), sum(r >= pass_threshold for r in g.rewards)) for g in gs]
    return EvalFigures(
        set_name=set_name, version=version, prompts=len(gs), samples=len(rewards), k=k,
        pass_at_1=_mean([pass_at_k(n, c, 1) for n, c in passes]),
        pass_at_k=_mean([pass_at_k(n, c, min(k, n)) for n, c in passes]),
        reward_mean=_mean(rewards), length_mean=_mean([float(x) for x in lengths]),
        truncated=cut / len(rewards), regions=dict(Counter(g.region for g in gs)),
    )


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
