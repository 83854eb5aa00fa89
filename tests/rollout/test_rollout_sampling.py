"""Sampling: temperature and top-p shape the distribution; the recorded logprob is of that distribution."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.rollout.sampling import (
    behaviour_logprobs,
    device_keys,
    device_uniforms,
    hash_keys,
    hashed_uniforms,
    sample_key,
    sample_tokens,
    uniforms,
)

N = 2000
GRID = torch.tensor([(k + 0.5) / N for k in range(N)], dtype=torch.float64)  # evenly spread u


def _frequencies(probs: list[float], temperature: float, top_p: float) -> tuple[np.ndarray, torch.Tensor]:
    logits = torch.log(torch.tensor(probs)).repeat(N, 1)
    tokens, logprobs = sample_tokens(logits, torch.full((N,), temperature), torch.full((N,), top_p), GRID)
    return np.bincount(tokens.numpy(), minlength=len(probs)) / N, logprobs


def test_top_p_keeps_the_smallest_prefix_reaching_p_and_renormalises() -> None:
    # p = [.5, .3, .15, .05]; top_p .7 keeps {0, 1} (0.5 < .7, 0.8 >= .7) -> 0.625 / 0.375.
    freq, logprobs = _frequencies([0.5, 0.3, 0.15, 0.05], 1.0, 0.7)
    np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=1.5 / N)
    assert math.isclose(float(logprobs[0]), math.log(0.625), abs_tol=1e-5)  # u small -> token 0
    assert math.isclose(float(logprobs[-1]), math.log(0.375), abs_tol=1e-5)  # u large -> token 1


def test_top_p_one_is_the_full_distribution() -> None:
    freq, _ = _frequencies([0.5, 0.3, 0.15, 0.05], 1.0, 1.0)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=1.5 / N)


def test_temperature_flattens_and_sharpens() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    for t in (0.5, 2.0):
        expected = torch.softmax(torch.log(torch.tensor(probs)) / t, dim=0).numpy()
        freq, logprobs = _frequencies(probs, t, 1.0)
        np.testing.assert_allclose(freq, expected, atol=1.5 / N)
        assert math.isclose(float(logprobs[0]), math.log(expected[0]), abs_tol=1e-5)
    freq, _ = _frequencies(probs, 0.05, 1.0)
    assert freq[0] > 0.99  # near-greedy


def test_top_p_always_keeps_the_most_likely_token() -> None:
    freq, logprobs = _frequencies([0.9, 0.05, 0.05], 1.0, 0.1)
    np.testing.assert_allclose(freq, [1, 0, 0])
    assert float(logprobs.abs().max()) < 1e-6  # log(1): the truncated distribution is a point mass


def test_behaviour_logprobs_match_what_was_sampled() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen) * 3
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    for t, p in ((1.0, 1.0), (0.7, 0.9), (1.3, 0.5)):
        tokens, lp = sample_tokens(logits, torch.full((64,), t), torch.full((64,), p), u)
        torch.testing.assert_close(behaviour_logprobs(logits, tokens, t, p), lp, atol=1e-5, rtol=0)
    outside = behaviour_logprobs(torch.log(torch.tensor([[0.9, 0.1]])), torch.tensor([1]), 1.0, 0.5)
    assert outside.item() == float("-inf")


def test_uniforms_are_counter_based() -> None:
    keys = [sample_key(7, "g1", i) for i in range(4)]
    a = uniforms(keys, [0, 1, 2, 3])
    b = uniforms(keys[::-1], [3, 2, 1, 0])[::-1]
    np.testing.assert_array_equal(a, b)  # independent of batch order
    assert sample_key(7, "g1", 0) != sample_key(8, "g1", 0) != sample_key(7, "g2", 0)
    many = uniforms([keys[0]] * 20000, list(range(20000)))
    assert many.min() >= 0.0 and many.max() < 1.0
    assert abs(many.mean() - 0.5) < 0.01 and abs(many.var() - 1 / 12) < 0.005


def test_a_rows_token_does_not_depend_on_the_other_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    logits, u = torch.randn(8, 30, generator=gen), torch.rand(8, generator=gen, dtype=torch.float64)
    temp, mixed = torch.ones(8), torch.tensor([1.0, 0.8] * 4)
    alone, _ = sample_tokens(logits, temp, torch.ones(8), u)
    together, _ = sample_tokens(logits, temp, mixed, u)
    torch.testing.assert_close(together[0::2], alone[0::2])
    truncated, _ = sample_tokens(logits[1::2], temp[1::2], mixed[1::2], u[1::2])
    torch.testing.assert_close(together[1::2], truncated)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40), st.integers(0, 2**31))
def test_device_uniforms_equal_the_hosts_bit_for_bit(keys: list[int], first: int) -> None:
    positions = np.arange(first, first + len(keys), dtype=np.int64)
    host = hashed_uniforms(hash_keys(keys), positions)
    device = device_uniforms(device_keys(hash_keys(keys)), torch.from_numpy(positions))
    assert device.dtype == torch.float64
    np.testing.assert_array_equal(device.numpy().view(np.uint64), host.view(np.uint64))


def test_a_sampled_token_is_a_pure_function_of_seed_group_sample_and_position() -> None:
    # Extreme keys and positions (every top bit set) go through the same wrapping arithmetic.
    keys = [sample_key(s, g, i) for s in (0, 2**40) for g in ("g", "h") for i in (0, 63)] + [2**64 - 1, 0]
    positions = torch.tensor([0, 1, 2**31, 2**62, 7, 8, 9, 10, 11, 12], dtype=torch.int64)
    hashed = hash_keys(keys)
    u = device_uniforms(device_keys(hashed), positions)
    np.testing.assert_array_equal(u.numpy(), hashed_uniforms(hashed, positions.numpy()))
    logits = torch.randn(len(keys), 50, generator=torch.Generator().manual_seed(3))
    tokens, _ = sample_tokens(logits, torch.ones(len(keys)), torch.ones(len(keys)), u)
    # Each row alone, in another order, at the same (key, position): the same token.
    for row in (9, 0, 4):
        alone = device_uniforms(device_keys(hashed[row:row + 1]), positions[row:row + 1])
        t, _ = sample_tokens(logits[row:row + 1], torch.ones(1), torch.ones(1), alone)
        assert int(t) == int(tokens[row])
