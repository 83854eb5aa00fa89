"""Token sampling shared by the engines: temperature, top-p, and the behaviour log-probability.

Randomness is counter-based: the uniform number that picks token `t` of sample `i` of group `g`
is a hash of `(seed, g, i, t)`, not a draw from a stream. So the token sampled at a position does
not depend on which other samples share the batch, on how many steps ran before, or on whether the
sample was handed over and resumed on another node: a resumed partial reproduces the continuation
an uninterrupted run would have produced (up to floating-point ties in the logits).

Sampling is inverse-CDF after temperature scaling: over the probabilities sorted in descending
order (ties broken by token id) and truncated to the top-p set when `top_p < 1`, in token-id order
when `top_p == 1` (no sort needed); both are fixed functions of the logits and the uniform. The
recorded behaviour log-probability is that of the distribution actually sampled from:

    logprob = log_softmax(logits / T)[token] - log(mass kept by top-p)

which is exactly `log_softmax(logits / T)[token]` when `top_p == 1` (docs/rollout.md).

The uniforms exist twice, bit for bit the same: `hashed_uniforms` in numpy on the host, and
`device_uniforms` in int64 torch ops on the engine's device (the static decode step draws its
tokens there, so no uniform crosses to the device per step).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S11, _S27, _S30, _S31 = np.uint64(11), np.uint64(27), np.uint64(30), np.uint64(31)


def sample_key(seed: int, group_id: str, index: int) -> int:
    """A stable 64-bit key of one sample (same on every node and Python process)."""
    digest = hashlib.blake2b(f"{seed}\x00{group_id}\x00{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # Array arithmetic wraps modulo 2**64 silently (scalars would warn), which is what we want; the
    # constants are module-level uint64 scalars and the steps in place (this runs every step).
    z = x + _GOLDEN
    z ^= z >> _S30
    z *= _MIX1
    z ^= z >> _S27
    z *= _MIX2
    z ^= z >> _S31
    return z


def uniforms(keys: Sequence[int] | np.ndarray[Any, Any], positions: Sequence[int]) -> np.ndarray:
    """One uniform in [0, 1) per (sample key, token position), as float64."""
    return hashed_uniforms(hash_keys(keys), positions)


def hash_keys(keys: Sequence[int] | np.ndarray[Any, Any]) -> np.ndarray:
    """The per-sample half of `uniforms`: an engine hashes a sample's key once, not every step."""
    return _splitmix64(np.asarray(keys, dtype=np.uint64))


def hashed_uniforms(hashed: np.ndarray, positions: Sequence[int] | np.ndarray[Any, Any]) -> np.ndarray:
    """`uniforms` of keys already passed through `hash_keys`."""
    p = np.asarray(positions, dtype=np.uint64)
    bits = _splitmix64(hashed ^ (p * _GOLDEN))
    out: np.ndarray = (bits >> _S11).astype(np.float64) * (1.0 / 9007199254740992.0)
    return out


def _signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no full uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


_T_GOLDEN, _T_MIX1, _T_MIX2 = _signed(int(_GOLDEN)), _signed(int(_MIX1)), _signed(int(_MIX2))


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` is arithmetic on signed integers)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _splitmix64_t(x: torch.Tensor) -> torch.Tensor:
    # int64 addition and multiplication wrap modulo 2**64 on CPU and CUDA: the same bits as uint64.
    z = x + _T_GOLDEN
    z = z ^ _shr(z, 30)
    z = z * _T_MIX1
    z = z ^ _shr(z, 27)
    z = z * _T_MIX2
    return z ^ _shr(z, 31)


def device_keys(hashed: np.ndarray) -> torch.Tensor:
    """`hash_keys` output (uint64) as the int64 tensor `device_uniforms` takes (same bits)."""
    return torch.from_numpy(np.ascontiguousarray(hashed, dtype=np.uint64).view(np.int64))


def device_uniforms(hashed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`hashed_uniforms` in torch on any device: int64 keys (`device_keys`) and int64 positions of the
    same shape (or broadcastable) -> float64 uniforms, bit for bit the host's. No host sync, no
    data-dependent shape: it runs inside a captured CUDA graph."""
    bits = _splitmix64_t(hashed ^ (positions * _T_GOLDEN))
    return _shr(bits, 11).to(torch.float64) * (1.0 / 9007199254740992.0)


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (token ids [B] int64, behaviour logprobs [B] float32).

    `logits` [B, V] (any float dtype; computed in float32), `temperature`, `top_p`, `u` [B].
    """
    logp = torch.log_softmax(logits.float() / temperature.float()[:, None], dim=-1)
    probs = logp.exp()
    full = top_p >= 1.0
    if bool(full.all()):
        return _sample_full(logp, probs, u)
    tokens, behaviour = _sample_top_p(logp, probs, top_p, u)
    if bool(full.any()):
        # Each row's rule depends only on its own top_p, never on the rest of the batch.
        tokens_f, behaviour_f = _sample_full(logp, probs, u)
        tokens, behaviour = torch.where(full, tokens_f, tokens), torch.where(full, behaviour_f, behaviour)
    return tokens, behaviour


def sample_tokens_fixed(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, nucleus: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` without a host sync, for a captured step: the caller says whether any row has
    `top_p < 1` (`nucleus`; then every row is sampled both ways and keeps its own rule). The same tokens
    and logprobs as `sample_tokens`, row for row."""
    logp = torch.log_softmax(logits.float() / temperature.float()[:, None], dim=-1)
    probs = logp.exp()
    tokens, behaviour = _sample_full(logp, probs, u)
    if nucleus:
        tokens_p, behaviour_p = _sample_top_p(logp, probs, top_p, u)
        full = top_p >= 1.0
        tokens, behaviour = torch.where(full, tokens, tokens_p), torch.where(full, behaviour, behaviour_p)
    return tokens, behaviour


def _sample_top_p(
    logp: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    # Keep the smallest prefix whose mass reaches top_p; the most likely token is always kept.
    keep = before < top_p.float()[:, None]
    keep[:, 0] = True
    kept = sorted_p * keep
    kept_cum = kept.cumsum(dim=-1)
    mass = kept_cum[:, -1]
    target = (u.to(kept_cum.dtype) * mass)[:, None]
    pos = torch.searchsorted(kept_cum, target, right=True)
    last_kept = keep.sum(dim=-1, keepdim=True) - 1
    pos = torch.minimum(pos, last_kept)
    tokens = order.gather(1, pos).squeeze(1)
    token_logp = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens, (token_logp - mass.log()).clamp(max=0.0)


def _sample_full(logp: torch.Tensor, probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with top_p == 1: inverse CDF in token-id order, no sort needed."""
    cum = probs.cumsum(dim=-1)
    target = (u.to(cum.dtype) * cum[:, -1])[:, None]
    tokens = torch.searchsorted(cum, target, right=True).clamp(max=probs.shape[1] - 1).squeeze(1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1).clamp(max=0.0)


def behaviour_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """Logprobs of given `tokens` [N] under `logits` [N, V] by the same convention as `sample_tokens`.

    A token outside the top-p set gets -inf. The trainer's pi_old is `log_softmax(logits / T)`;
    with `top_p == 1` the two agree exactly (docs/rollout.md).
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    token_logp = logp.gather(1, tokens[:, None].long()).squeeze(1)
    if top_p >= 1.0:
        return token_logp
    probs = logp.exp()
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = (sorted_p.cumsum(dim=-1) - sorted_p) < top_p
    keep[:, 0] = True
    kept_mask = torch.zeros_like(keep).scatter(1, order, keep)
    mass = (sorted_p * keep).sum(dim=-1)
    inside = kept_mask.gather(1, tokens[:, None].long()).squeeze(1)
    out = token_logp - mass.log()
    return torch.where(inside, out, torch.full_like(out, float("-inf")))
