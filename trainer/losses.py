"""Policy losses (DESIGN.md §6): PPO-clip with truncated importance weights, aggregation, KL.

Three policies meet in an asynchronous learner:

* the behaviour policy that sampled each token (the engine's logprobs, possibly several versions
  old, one version per token),
* the proximal ("old") policy the PPO trust region is drawn around: the learner's weights before
  this update, i.e. the current logprobs detached,
* the policy being optimised (current logprobs, with gradient).

The loss per token is `w * max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))` with
`r = pi / pi_old` and the truncated importance weight `w = min(pi_old / pi_behaviour, tis_cap)`
(detached). `w` corrects for staleness and engine/trainer numeric mismatch per token, so a token
sampled under an older version is weighted by how far the policy has moved since; the cap bounds the
variance. All tensors are `[batch, tokens]` with a 0/1 `mask` of real completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean"]


@dataclass(frozen=True, slots=True)
class ClipConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] per position; logits `[B, T, V]`, targets `[B, T]`.

    The engine samples from logits / temperature and records those logprobs, so the learner must
    score tokens under the same distribution for the importance ratio to mean anything.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def tis_weights(logp_old: torch.Tensor, logp_behaviour: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_old / pi_behaviour, cap), without gradient."""
    return torch.exp(logp_old.detach() - logp_behaviour).clamp(max=cap)


def ppo_tis_token_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    clip: ClipConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss `[B, T]` and per-token diagnostics (clipped, truncated as 0/1 floats).

    `advantages` is `[B]` (one per sample) or `[B, T]`.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - logp_old.detach())
    clipped_ratio = ratio.clamp(1.0 - clip.clip_low, 1.0 + clip.clip_high)
    surrogate = torch.maximum(-adv * ratio, -adv * clipped_ratio)
    w = tis_weights(logp_old, logp_behaviour, clip.tis_cap)
    stats = {
        "clipped": ((-adv * clipped_ratio) > (-adv * ratio)).float(),
        "truncated": (torch.exp(logp_old.detach() - logp_behaviour) > clip.tis_cap).float(),
        "tis_weight": w,
    }
    return w * surrogate, stats


def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate k3 = exp(d) - d - 1 with d = logp_ref - logp (>= 0)."""
    d = logp_ref.detach() - logp
    return torch.exp(d) - d - 1.0


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation,
    *,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values `[B, T]` to the scalar loss.

    `token_mean` (DAPO): sum over every token / number of tokens; long samples weigh more.
    `seq_mean`: mean over sequences of each sequence's token mean; every sample weighs the same.
    The totals default to this tensor's; the learner passes the whole step's totals so that
    micro-batches and ranks add up to the loss of the full batch.
    """
    mask = mask.to(values.dtype)
    if mode == "token_mean":
        denom = total_tokens if total_tokens is not None else mask.sum().clamp(min=1.0)
        return (values * mask).sum() / denom
    if mode == "seq_mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        denom = total_seqs if total_seqs is not None else float(values.shape[0])
        return per_seq.sum() / denom
    raise ValueError(f"unknown aggregation {mode!r}; known: token_mean, seq_mean")
