"""Selective activation checkpointing (trainer/activations.py): the choice worked out by hand, and the
gradients of a step with some layers checkpointed equal those with none."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fleetrl.broker import GroupRecord, Sample, floats, ids
from fleetrl.config import AlgorithmConfig, ModelConfig
from fleetrl.trainer.activations import SelectiveCheckpointing, checkpointed_layers, layer_activation_bytes
from fleetrl.trainer.batch import build_step_batch
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner

torch.set_num_threads(1)
GIB = 2**30


def test_a_layers_activations_are_counted_from_tokens_hidden_and_dtype() -> None:
    # bench/learner.py's shape, fp32: 4,096 tokens x ((6 x 512 + 4 x 1,408) x 4 + 4 x 512 x 4)
    # = 4,096 x (34,816 + 8,192) = 4,096 x 43,008 (42 KB per token; ~44 KB measured).
    assert layer_activation_bytes(4096, 512, 1408, 4) == 176_160_768
    # The 0.5 B step under bf16 autocast: 16,384 x ((6 x 896 + 4 x 4,864) x 2 + 4 x 896 x 4)
    # = 16,384 x (49,664 + 14,336) = 16,384 x 64,000 (62.5 KB per token; ~65 KB measured).
    assert layer_activation_bytes(16384, 896, 4864, 2) == 1_048_576_000


@pytest.mark.parametrize(("layers", "full", "kept", "budget", "want"), [
    (12, 100, 10, 1200, 0),   # everything fits: nothing is recomputed
    (12, 100, 10, 1199, 1),   # 1 byte over: one layer gives back 90
    (12, 100, 10, 1110, 1),   # 11 x 100 + 10 = 1,110: exactly fits with one
    (12, 100, 10, 1109, 2),   # 10 x 100 + 2 x 10 = 1,020 <= 1,109; one (1,110) does not fit
    (12, 100, 10, 400, 9),    # 3 x 100 + 9 x 10 = 390 <= 400; 8 (480) does not fit
    (12, 100, 10, 120, 12),   # every layer checkpointed: 12 x 10 = 120
    (12, 100, 10, 50, 12),    # not even that fits: every layer, the least there is
    (24, 1_048_576_000, 58_720_256, 6 * GIB, 19),  # 0.5 B: 5 x 0.977 + 19 x 0.055 = 5.92 GiB; 18: 6.84 GiB
    (0, 100, 10, 10, 0),      # no layers
])
def test_the_fewest_layers_that_fit_the_budget_are_checkpointed(layers: int, full: int, kept: int, budget: float,
                                                                 want: int) -> None:
    assert checkpointed_layers(layers, full, kept, budget) == want


def test_the_first_layers_are_the_checkpointed_ones() -> None:
    model = ModelConfig(tiny={"num_hidden_layers": 4}).build()
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    full, kept = layer_activation_bytes(100, hidden, inter, 4), 100 * hidden * 4
    sel = SelectiveCheckpointing(model, budget_gib=(2 * full + 2 * kept) / GIB, dtype_bytes=4)
    assert [layer.gradient_checkpointing for layer in sel.layers] == [False] * 4  # set up, nothing planned
    assert sel.plan(100) == 2
    assert [layer.gradient_checkpointing for layer in sel.layers] == [True, True, False, False]
    assert sel.plan(10) == 0 and not any(layer.gradient_checkpointing for layer in sel.layers)


def _step(**algo: object) -> tuple[float, dict[str, torch.Tensor], Learner]:
    torch.manual_seed(0)
    gen = np.random.default_rng(2)
    groups = []
    for g in range(2):
        samples = [Sample(ids(gen.integers(3, 128, 7 + i).tolist()), floats(np.full(7 + i, -3.0, np.float32)),
                          np.zeros(7 + i, np.int32), float(i % 2), "stop") for i in range(4)]
        groups.append(GroupRecord(f"g{g}", "r", "t", 0, "a", "n", ids([1, 9, 8]), samples))
    learner = Learner(ModelConfig(), AlgorithmConfig(lr=1e-2, micro_batch_samples=8, **algo),  # type: ignore[arg-type]
                      DistContext())
    grads: dict[str, torch.Tensor] = {}
    step = learner.optimizer.step

    def keep_grads() -> None:  # the update's gradients, as the optimizer sees them
        grads.update({n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None})
        step()

    learner.optimizer.step = keep_grads  # type: ignore[method-assign]
    loss = learner.train_step(build_step_batch(groups, "grpo", 0)).loss
    return loss, grads, learner


def test_gradients_with_some_layers_checkpointed_equal_those_with_none() -> None:
    plain_loss, plain, _ = _step()
    tokens = 8 * (3 + 10)  # one micro-batch: 8 samples padded to the longest (3 prompt + 10 completion tokens)
    cfg = ModelConfig().build().config
    full = layer_activation_bytes(tokens, cfg.hidden_size, cfg.intermediate_size, 4)
    # A budget that fits one of the 2 layers with its activations and the other checkpointed.
    loss, grads, learner = _step(activation_memory_gib=(full + tokens * cfg.hidden_size * 4) / GIB)
    assert learner._selective is not None and learner._selective.checkpointed == 1
    assert loss == plain_loss
    assert grads.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=0, atol=0, msg=name)
