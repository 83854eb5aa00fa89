"""Advantages and losses against values worked out by hand (in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.trainer.advantages import group_advantages
from fleetrl.trainer.losses import ClipConfig, aggregate, kl_k3, ppo_tis_token_loss, token_logprobs

CLIP = ClipConfig(clip_low=0.2, clip_high=0.28, tis_cap=2.0)


def t(*v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def test_grpo_normalises_by_sample_std() -> None:
    # rewards 1,0,0,1: mean 0.5, centred ±0.5; sample std = sqrt(4 * 0.25 / 3) = 0.57735
    # so advantages are ±0.5 / 0.57735 = ±0.866025
    adv = group_advantages(t(1, 0, 0, 1), "grpo")
    assert torch.allclose(adv, t(0.866025, -0.866025, -0.866025, 0.866025), atol=1e-5)


def test_grpo_no_std_only_centres() -> None:
    # rewards 3,1,2: mean 2 -> 1,-1,0 whatever the spread
    assert torch.allclose(group_advantages(t(3, 1, 2), "grpo_no_std"), t(1, -1, 0))


def test_leave_one_out_baseline_is_the_others_mean() -> None:
    # r=1: others (2+3)/2 = 2.5 -> -1.5;  r=2: others 2 -> 0;  r=3: others 1.5 -> +1.5
    assert torch.allclose(group_advantages(t(1, 2, 3), "leave_one_out"), t(-1.5, 0, 1.5))


@pytest.mark.parametrize("kind", ["grpo", "grpo_no_std", "leave_one_out"])
def test_identical_rewards_and_single_samples_give_zero(kind: str) -> None:
    assert torch.allclose(group_advantages(t(0.7, 0.7, 0.7), kind), t(0, 0, 0), atol=1e-6)  # type: ignore[arg-type]
    assert torch.equal(group_advantages(t(0.7), kind), t(0))  # type: ignore[arg-type]


def _loss(ratio: float, adv: float, old_over_beh: float = 1.0) -> float:
    logp_old = torch.tensor([[math.log(0.4)]])
    logp = logp_old + math.log(ratio)
    logp_beh = logp_old - math.log(old_over_beh)
    loss, _ = ppo_tis_token_loss(logp, logp_old, logp_beh, t(adv), CLIP)
    return float(loss.item())


def test_ppo_clip_on_both_sides() -> None:
    # A=+1, r=1.5: max(-1.5, -clip(1.5)=-1.28) = -1.28           (clipped above at 1 + 0.28)
    assert _loss(1.5, 1.0) == pytest.approx(-1.28, abs=1e-5)
    # A=-1, r=0.5: max(0.5, clip(0.5)=0.8) = 0.8                  (clipped below at 1 - 0.2)
    assert _loss(0.5, -1.0) == pytest.approx(0.8, abs=1e-5)
    # A=+1, r=0.5: max(-0.5, -0.8) = -0.5: the pessimistic side is the unclipped one
    assert _loss(0.5, 1.0) == pytest.approx(-0.5, abs=1e-5)
    # A=-1, r=1.5: max(1.5, 1.28) = 1.5
    assert _loss(1.5, -1.0) == pytest.approx(1.5, abs=1e-5)


def test_a_later_update_gets_no_gradient_where_the_clip_acts() -> None:
    # A later update of a step: pi_old is the step's start, pi has moved. Per token, with w = 1,
    # d loss / d logp = -A * r where the unclipped side is the max, and 0 where the clipped one is:
    #   A=+1, r=1.5 (> 1.28): clipped above -> 0      A=-1, r=0.5 (< 0.8): clipped below -> 0
    #   A=+1, r=1.1 (inside):  -1 * 1.1 = -1.1        A=-1, r=0.9 (inside): +1 * 0.9 = 0.9
    #   A=+1, r=0.5 (below, A>0): the unclipped side is the max -> -0.5 (still pushed up)
    ratios, adv = t(1.5, 0.5, 1.1, 0.9, 0.5), t(1.0, -1.0, 1.0, -1.0, 1.0)
    logp_old = torch.full((5, 1), math.log(0.4))
    logp = (logp_old + torch.log(ratios).unsqueeze(-1)).requires_grad_(True)
    loss, stats = ppo_tis_token_loss(logp, logp_old, logp_old.clone(), adv, CLIP)
    loss.sum().backward()
    assert logp.grad is not None
    assert torch.allclose(logp.grad.squeeze(-1), t(0.0, 0.0, -1.1, 0.9, -0.5), atol=1e-5)
    assert stats["clipped"].squeeze(-1).tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_truncated_importance_weight() -> None:
    # r=1, A=+1 -> surrogate -1, scaled by w = min(pi_old/pi_beh, 2)
    assert _loss(1.0, 1.0, old_over_beh=1.5) == pytest.approx(-1.5, abs=1e-5)  # 1.5 < cap: kept
    assert _loss(1.0, 1.0, old_over_beh=3.0) == pytest.approx(-2.0, abs=1e-5)  # 3 > cap: truncated to 2
    assert _loss(1.0, 1.0, old_over_beh=0.25) == pytest.approx(-0.25, abs=1e-5)  # below 1 is never raised
    _, stats = ppo_tis_token_loss(
        torch.zeros(1, 2), torch.zeros(1, 2), -torch.log(t(1.5, 3.0)).unsqueeze(0), t(1.0), CLIP
    )
    assert stats["truncated"].tolist() == [[0.0, 1.0]]


def test_aggregations() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # token mean: (1+2+3+4) / 4 tokens = 2.5 ; the masked 0 and 9 do not count
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(2.5)
    # seq mean: mean(1,2,3)=2 and mean(4)=4 -> (2+4)/2 = 3
    assert aggregate(values, mask, "seq_mean").item() == pytest.approx(3.0)
    # with step-wide totals (a micro-batch of a larger step): 10/8 tokens, 6/4 sequences
    assert aggregate(values, mask, "token_mean", total_tokens=8).item() == pytest.approx(1.25)
    assert aggregate(values, mask, "seq_mean", total_seqs=4).item() == pytest.approx(1.5)


def test_kl_k3() -> None:
    # pi=0.5, pi_ref=0.25: d = ln(0.25/0.5) = -0.693147; exp(d) - d - 1 = 0.5 + 0.693147 - 1 = 0.193147
    kl = kl_k3(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert kl.item() == pytest.approx(0.193147, abs=1e-5)
    assert kl_k3(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0


def test_token_logprobs_with_temperature() -> None:
    # logits (0, ln 3): softmax (0.25, 0.75); at T=2 logits (0, ln 3 / 2): p1 = sqrt3 / (1 + sqrt3)
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    target = torch.tensor([[1]])
    assert token_logprobs(logits, target).item() == pytest.approx(math.log(0.75), abs=1e-6)
    s3 = math.sqrt(3.0)
    assert token_logprobs(logits, target, 2.0).item() == pytest.approx(math.log(s3 / (1 + s3)), abs=1e-6)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean"])
def test_ppo_gradient_on_policy_equals_policy_gradient(mode: str) -> None:
    """With behaviour = old = current logprobs, the PPO-TIS gradient is the REINFORCE gradient."""
    torch.manual_seed(0)
    w = torch.randn(5, 7, requires_grad=True)
    x = torch.randn(3, 4, 5)
    targets = torch.randint(0, 7, (3, 4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([0.7, -1.2, 0.4])

    def logp() -> torch.Tensor:
        return token_logprobs(x @ w, targets)

    lp = logp()
    tok, _ = ppo_tis_token_loss(lp, lp.detach(), lp.detach(), adv, CLIP)
    (g_ppo,) = torch.autograd.grad(aggregate(tok, mask, mode), w)  # type: ignore[arg-type]
    pg = -adv.unsqueeze(-1) * logp()
    (g_pg,) = torch.autograd.grad(aggregate(pg, mask, mode), w)  # type: ignore[arg-type]
    assert torch.allclose(g_ppo, g_pg, atol=1e-6)
    assert g_pg.abs().sum() > 0
