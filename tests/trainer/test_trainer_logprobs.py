"""Chunked token logprobs (trainer/logprobs.py): the plain path's values and gradients, without its logits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fleetrl.broker import GroupRecord, Sample, floats, ids
from fleetrl.config import AlgorithmConfig, ModelConfig
from fleetrl.trainer.batch import build_step_batch, collate
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner
from fleetrl.trainer.logprobs import causal_lm_logprobs, head_logprobs
from fleetrl.trainer.losses import token_logprobs

torch.set_num_threads(1)


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor with a last dimension of `width` that an op produced,
    other than the head's weight (`[width, hidden]`, also seen transposed) and its gradient."""

    def __init__(self, width: int, weight_numel: int) -> None:
        super().__init__()
        self.width, self.weight_numel = width, weight_numel
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.width and t.numel() != self.weight_numel:
                self.largest = max(self.largest, t.numel())
        return out


def _plain_and_fused(temperature: float, chunk: int, head: torch.nn.Module) -> tuple[list[torch.Tensor], ...]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 16, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 40, (11,), generator=gen)
    results = []
    for fused in (False, True):
        h = hidden.clone().requires_grad_(True)
        head.zero_grad()
        if fused:
            logp = head_logprobs(h, head, targets, temperature, chunk)
        else:
            logp = token_logprobs(head(h)[None], targets[None], temperature)[0]
        weights = torch.linspace(-1, 2, 11, dtype=logp.dtype)  # a loss that weighs tokens differently
        (logp * weights).sum().backward()
        assert h.grad is not None and head.weight.grad is not None
        results.append([logp.detach(), h.grad.clone(), head.weight.grad.clone()])
    return results[0], results[1]


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_head_gives_the_plain_values_and_gradients(chunk: int, temperature: float) -> None:
    head = torch.nn.Linear(16, 40, bias=False).double()
    plain, fused = _plain_and_fused(temperature, chunk, head)
    for a, b in zip(plain, fused, strict=True):
        torch.testing.assert_close(b.double(), a.double(), rtol=1e-6, atol=1e-6)


def test_a_head_with_a_bias_goes_through_the_module_chunk_by_chunk() -> None:
    head = torch.nn.Linear(16, 40, bias=True).double()
    plain, fused = _plain_and_fused(0.9, 3, head)
    for a, b in zip(plain, fused, strict=True):
        torch.testing.assert_close(b.double(), a.double(), rtol=1e-6, atol=1e-6)


def _batch(vocab: int) -> Any:
    gen = np.random.default_rng(0)
    samples = []
    for k, n in enumerate((9, 14, 5)):
        completion = gen.integers(3, vocab, n).tolist()
        samples.append(Sample(ids(completion), floats(np.full(n, -2.0, np.float32)), np.zeros(n, np.int32),
                              float(k), "stop"))
    group = GroupRecord("g", "r", "t", 0, "a", "n", ids([1, 5, 6, 7]), samples)
    return collate(build_step_batch([group], "grpo", 0).samples, "cpu")


def test_the_models_logprobs_equal_the_plain_path_at_scored_positions_and_never_build_the_logits() -> None:
    vocab = 256  # no other dimension of the tiny model is this wide
    model = ModelConfig(tiny={"vocab_size": vocab}).build()
    mb = _batch(vocab)
    scored = mb.loss_mask > 0
    grads = []
    values = []
    largest = []
    for chunk in (0, 4):
        model.zero_grad()
        with LargestTensor(vocab, model.lm_head.weight.numel()) as seen:
            logp = causal_lm_logprobs(model, mb.input_ids, mb.attention_mask, mb.targets, scored, 1.0, chunk)
            (logp * mb.loss_mask).sum().backward()
        largest.append(seen.largest)
        values.append(logp.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    plain, chunked = values
    torch.testing.assert_close(chunked[scored], plain[scored], rtol=0, atol=1e-5)
    assert (chunked[~scored] == 0).all()
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)
    positions = mb.targets.numel()
    assert largest[0] >= positions * vocab  # the plain path holds every position's logits
    assert largest[1] < positions * vocab / 4  # chunks of 4 scored tokens: never the whole logits


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_learner_step_is_the_same_with_chunks_and_activation_checkpointing(checkpointing: bool) -> None:
    mb_groups = []
    gen = np.random.default_rng(1)
    for g in range(2):
        samples = [Sample(ids(gen.integers(3, 128, 6 + i).tolist()), floats(np.full(6 + i, -3.0, np.float32)),
                          np.zeros(6 + i, np.int32), float(i % 2), "stop") for i in range(4)]
        mb_groups.append(GroupRecord(f"g{g}", "r", "t", 0, "a", "n", ids([1, 9, 8]), samples))
    params = []
    losses = []
    for chunk, ckpt in ((0, False), (5, checkpointing)):
        algo = AlgorithmConfig(lr=1e-2, micro_batch_samples=3, logprob_chunk_tokens=chunk,
                               activation_checkpointing=ckpt, kl_coef=0.1)
        learner = Learner(ModelConfig(), algo, DistContext())
        stats = learner.train_step(build_step_batch(mb_groups, "grpo", 0))
        losses.append(stats.loss)
        params.append(torch.cat([p.detach().flatten() for p in learner.model.parameters()]))
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)
    # Adam's first update is about lr x sign(grad): where a gradient is ~0, fp32 rounding of the two
    # orders of summation moves the update by a small share of lr (measured: 2e-5 of 1e-2).
    torch.testing.assert_close(params[1], params[0], rtol=0, atol=1e-4)
    assert (params[1] - params[0]).abs().mean() < 1e-7


@pytest.mark.parametrize("chunk", [0, 4])
def test_the_learners_forward_builds_no_kv_cache(chunk: int) -> None:
    """The model config says `use_cache: true` (the engine's default); a training forward must not build a
    cache: it is memory for nothing, and its per-layer guards defeat `algorithm.compile`."""
    vocab = 256
    model = ModelConfig(tiny={"vocab_size": vocab}).build()
    assert model.config.use_cache
    mb = _batch(vocab)
    caches: list[Any] = []
    handle = model.get_decoder().register_forward_hook(
        lambda module, args, output: caches.append(getattr(output, "past_key_values", None)))
    try:
        causal_lm_logprobs(model, mb.input_ids, mb.attention_mask, mb.targets, mb.loss_mask > 0, 1.0, chunk)
    finally:
        handle.remove()
    assert caches == [None]
