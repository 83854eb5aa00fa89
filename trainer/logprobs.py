"""Token log-probabilities of a causal LM without its `[tokens, vocab]` logits.

The loss needs one number per scored token, `log_softmax(logits / T)[target]`, but the plain path
builds the whole logits tensor first: 16,384 tokens of a 151,936-token vocabulary are 10 GB in fp32,
and log-softmax and its backward make two or three more of it (the 0.5 B learner's 59 GiB peak, issue
37). Here the output head and the log-softmax are one autograd function over chunks of tokens:

* forward: for each chunk of `chunk_tokens` rows, `logits = h @ W.T` (in the autocast dtype, as the
  plain path computes it), then its log-sum-exp and the target's logit; only `[tokens]` floats stay;
* backward: each chunk's logits are computed again, turned in place into `d logits = g * (onehot -
  softmax) / T`, and multiplied into the hidden states' and the head's gradients.

So one chunk's logits exist at a time, forward or backward, and the head costs one matmul more than
the plain path (the recompute) while saving several passes over gigabytes. Only the tokens the loss
scores are sent through the head (prompt and padding positions are not), which the plain path cannot
skip. The values equal the plain path's to fp32 rounding (tests/trainer/test_trainer_logprobs.py).

With Liger Kernel on (`algorithm.fused_kernels`, trainer/fused.py) the head is its fused linear +
cross-entropy kernel instead (`fused_head`): the same numbers to rounding, in Triton, over chunks of
Liger's own size (`logprob_chunk_tokens` > 0 then only selects this path).

`causal_lm_logprobs` runs the model's own forward (FSDP2's hooks, a peft wrapper and the model's
checkpointing see an ordinary call) with `logits_to_keep=1`, and takes the last hidden states where
its decoder returns them (a forward hook): the head runs there, while the root module's parameters
are gathered. Both paths pass `use_cache=False`: a training forward has no use for a KV cache, and
transformers' cache (on by the model config's default) adds a guard per layer that makes
`torch.compile` recompile each compiled decoder layer until its recompile limit, leaving the rest eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from fleetrl.trainer.losses import token_logprobs

FusedHead = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(hidden [N, H], head weight [V, H], targets [N], temperature) -> log-probabilities [N], float32."""


class _FusedHeadLogprobs(torch.autograd.Function):
    """log_softmax(h @ W.T / T)[target] per row, chunk by chunk (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                temperature: float, chunk: int, compute: torch.dtype) -> torch.Tensor:
        w = weight.to(compute)
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for s in range(0, hidden.shape[0], chunk):
            logits = _chunk_logits(hidden[s:s + chunk], w, compute, temperature)
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            out[s:s + chunk] = logits.gather(1, targets[s:s + chunk, None]).squeeze(1) - lse[s:s + chunk]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk, ctx.compute = temperature, chunk, compute
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        temperature, chunk, compute = ctx.temperature, ctx.chunk, ctx.compute
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(compute)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk].to(compute)
            g = grad_out[s:s + chunk].float() / temperature
            d = _chunk_logits(h, w, compute, temperature)
            d.sub_(lse[s:s + chunk, None]).exp_().mul_(-g[:, None])  # -g * softmax
            d.scatter_add_(1, targets[s:s + chunk, None], g[:, None])  # + g at the target
            d_c = d.to(compute)
            if grad_h is not None:
                grad_h[s:s + chunk] = d_c @ w
            if grad_w is not None:
                if compute == torch.float32:
                    grad_w.addmm_(d_c.T, h)
                else:
                    grad_w.add_(d_c.T @ h)  # the half-precision product, accumulated in fp32
        return grad_h, grad_w.to(weight.dtype) if grad_w is not None else None, None, None, None, None


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, compute: torch.dtype, temperature: float) -> torch.Tensor:
    logits = (h.to(compute) @ w.T).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float,
                  chunk_tokens: int, fused_head: FusedHead | None = None) -> torch.Tensor:
    """log_softmax(head(hidden) / T)[targets] for `hidden` [N, H] and `targets` [N], as float32 [N], with at
    most `chunk_tokens` rows of logits alive at once. `fused_head`: a kernel that does the same from the
    head's weight without whole logits (Liger's, trainer/fused.py), used for a plain bias-free head."""
    if isinstance(head, torch.nn.Linear) and type(head) is torch.nn.Linear and head.bias is None:
        if fused_head is not None:
            return fused_head(hidden, head.weight, targets, float(temperature))
        compute = _compute_dtype(hidden)
        out: torch.Tensor = _FusedHeadLogprobs.apply(hidden, head.weight, targets, float(temperature),
                                                     max(1, chunk_tokens), compute)
        return out
    # Another head (a peft-wrapped one, a bias): the same chunks through the module, each recomputed
    # in the backward pass instead of kept.
    parts = [checkpoint(_module_chunk, head, hidden[s:s + chunk_tokens], targets[s:s + chunk_tokens], temperature,
                        use_reentrant=False) for s in range(0, hidden.shape[0], max(1, chunk_tokens))]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def _module_chunk(head: torch.nn.Module, h: torch.Tensor, t: torch.Tensor, temperature: float) -> torch.Tensor:
    return token_logprobs(head(h)[None], t[None], temperature)[0]


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the plain path's head matmul would run in: the autocast dtype where autocast is on."""
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return hidden.dtype


def causal_lm_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       targets: torch.Tensor, scored: torch.Tensor, temperature: float,
                       chunk_tokens: int, fused_head: FusedHead | None = None) -> torch.Tensor:
    """Log-probabilities `[B, T-1]` of `targets` (position t predicts token t+1) where `scored` (`[B, T-1]`
    bool) is set, 0 elsewhere. `chunk_tokens` 0: the plain path (whole logits, every position; `fused_head`
    is not used there)."""
    if chunk_tokens <= 0:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
        return token_logprobs(logits, targets, temperature)
    decoder, head = model.get_decoder(), model.get_output_embeddings()  # type: ignore[operator]
    found: list[torch.Tensor] = []

    def score(module: torch.nn.Module, args: Any, output: Any) -> None:
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        found.append(head_logprobs(hidden[:, :-1][scored], head, targets[scored], temperature, chunk_tokens,
                                   fused_head))

    handle = decoder.register_forward_hook(score)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1, use_cache=False)
    finally:
        handle.remove()
    if len(found) != 1:
        raise RuntimeError(f"the model's decoder ran {len(found)} times in one forward pass; expected once")
    out = torch.zeros(scored.shape, dtype=torch.float32, device=found[0].device)
    return out.masked_scatter(scored, found[0])
