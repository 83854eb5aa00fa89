"""pass@k (Chen et al. 2021) and the other eval figures against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fleetrl.broker import EvalTag, GroupRecord, Sample
from fleetrl.trainer.eval_figures import figures, pass_at_k


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (5, 0, 1, 0.0),            # nothing passes
    (5, 0, 5, 0.0),            # k = n and c = 0: still nothing
    (5, 5, 5, 1.0),            # k = n, all pass
    (5, 2, 5, 1.0),            # k = n, one pass is enough: every 5-subset is the whole set
    (5, 2, 1, 0.4),            # pass@1 = c / n
    (4, 1, 2, 0.5),            # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (1, 1, 1, 1.0),
    (1, 0, 1, 0.0),
])
def test_pass_at_k_hand_computed(n: int, c: int, k: int, expected: float) -> None:
    assert math.isclose(pass_at_k(n, c, k), expected, abs_tol=1e-12)


def test_pass_at_k_matches_the_binomial_formula() -> None:
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert math.isclose(pass_at_k(n, c, k), exact, abs_tol=1e-12), (n, c, k)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, 1, 0), (3, 1, 4), (2, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def _group(gid: str, region: str, rewards: list[float], lengths: list[int], finish: list[str]) -> GroupRecord:
    samples = [Sample(np.zeros(n, np.int32), np.zeros(n, np.float32), np.full(n, 3, np.int32), reward=r,
                      finish_reason=f) for r, n, f in zip(rewards, lengths, finish, strict=True)]
    return GroupRecord(gid, "r", "reverse", 0, region, "n1", np.zeros(2, np.int32), samples, eval=EvalTag("held", 3))


def test_figures_of_two_prompts() -> None:
    # prompt a: 1 pass of 2 samples; prompt b: none of 2
    a = _group("a", "local-a", [1.0, 0.5], [4, 6], ["stop", "length"])
    b = _group("b", "local-b", [0.0, 0.3], [6, 2], ["length", "stop"])
    f = figures("held", 3, [a, b], k=2, pass_threshold=1.0)
    assert f.prompts == 2 and f.samples == 4 and f.k == 2
    assert math.isclose(f.pass_at_1, (0.5 + 0.0) / 2)          # c/n per prompt, averaged
    assert math.isclose(f.pass_at_k, (1.0 + 0.0) / 2)          # k = n: any pass counts
    assert math.isclose(f.reward_mean, (1.0 + 0.5 + 0.0 + 0.3) / 4)
    assert math.isclose(f.length_mean, (4 + 6 + 6 + 2) / 4)
    assert math.isclose(f.truncated, 2 / 4)
    assert f.regions == {"local-a": 1, "local-b": 1}
    scalars = f.scalars()
    assert scalars["eval/held/pass@1"] == f.pass_at_1 and scalars["eval/held/pass@2"] == f.pass_at_k
    assert {"eval/held/reward_mean", "eval/held/length_mean", "eval/held/truncated"} <= set(scalars)
    assert f.row()["pass@2"] == 0.5


def test_figures_threshold_is_inclusive_and_empty_is_refused() -> None:
    g = _group("a", "x", [0.7], [1], ["stop"])
    assert figures("s", 0, [g], k=1, pass_threshold=0.7).pass_at_1 == 1.0
    assert figures("s", 0, [g], k=1, pass_threshold=0.71).pass_at_1 == 0.0
    with pytest.raises(ValueError, match="no groups"):
        figures("s", 0, [], k=1, pass_threshold=1.0)
