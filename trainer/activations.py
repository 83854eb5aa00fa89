"""Selective activation checkpointing by memory budget (`algorithm.activation_memory_gib`, issue 50).

Checkpointing every decoder layer (`activation_checkpointing`) keeps only each layer's input from the
forward pass to the backward and recomputes the layer there: the activations shrink about as many times
as there are layers, for one more forward pass of the decoder (1.16x the step on the H200). Most of that
memory is not needed to fit a budget: checkpointing k of L layers keeps `(L - k) x full + k x input`
bytes, so the learner checkpoints the fewest layers that fit and recomputes only those.

It checkpoints the *first* k layers. The backward pass reaches them last, after the layers above have
freed their activations, so the one layer being recomputed never adds to the peak of the forward pass's
end (checkpointing the last layers would recompute while every other layer still holds its own).

The estimate is coarse on purpose, a count of the tensors a Llama/Qwen-style layer saves for backward per
token: in the activation dtype about 6 hidden-sized ones (q, k, v, rotated q and k, the attention output)
and 4 intermediate-sized ones (gate, up, the activation, the product), and in fp32 whatever the
precision is: 4 hidden-sized ones (the two RMSNorms' fp32 inputs and normalised values; the master
weights are fp32, and autocast leaves the residual adds and the norms in fp32). On bench/learner.py's
50 M shape (hidden 512, intermediate 1,408, all fp32) that is 42 KB per token and layer, against ~44 KB
measured; on the 0.5 B Qwen2 under bf16 autocast 62.5 KB, against ~65 KB measured (issue 37). The input a
checkpointed layer keeps is the fp32 residual stream.

The choice is made per micro-batch (its padded tokens), through transformers' own checkpointing of
decoder layers (`GradientCheckpointingLayer`, non-reentrant), switched on or off per layer.
"""

from __future__ import annotations

from typing import Any

import torch

HIDDEN_TENSORS = 6
"""Hidden-sized activations in the activation dtype a decoder layer saves for backward, per token."""
INTERMEDIATE_TENSORS = 4
"""Intermediate-sized (MLP) activations in the activation dtype it saves, per token."""
FP32_HIDDEN_TENSORS = 4
"""Hidden-sized activations it saves in fp32 whatever the activation dtype (the norms'), per token."""
INPUT_BYTES = 4
"""Bytes per element of a checkpointed layer's kept input (the fp32 residual stream)."""


def layer_activation_bytes(tokens: int, hidden: int, intermediate: int, dtype_bytes: int) -> int:
    """Estimated bytes one decoder layer keeps for its backward pass over `tokens` tokens."""
    in_dtype = (HIDDEN_TENSORS * hidden + INTERMEDIATE_TENSORS * intermediate) * dtype_bytes
    return tokens * (in_dtype + FP32_HIDDEN_TENSORS * hidden * 4)


def checkpointed_layers(n_layers: int, layer_bytes: int, input_bytes: int, budget_bytes: float) -> int:
    """The fewest of `n_layers` layers to checkpoint so that the kept activations, `layer_bytes` for each
    layer that is not checkpointed and `input_bytes` for each that is, fit `budget_bytes`; every layer when
    even that does not fit (the budget is then missed, by as little as it can be)."""
    saved = layer_bytes - input_bytes  # what checkpointing one layer gives back
    over = n_layers * layer_bytes - budget_bytes
    if over <= 0:
        return 0
    if saved <= 0:
        return n_layers
    return min(n_layers, -int(-over // saved))  # ceil(over / saved)


class SelectiveCheckpointing:
    """Switches checkpointing of the model's first k decoder layers on, and of the rest off, per micro-batch."""

    def __init__(self, model: Any, budget_gib: float, dtype_bytes: int) -> None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        config = model.config
        self.hidden, self.intermediate = int(config.hidden_size), int(config.intermediate_size)
        self.budget_bytes = budget_gib * 2**30
        self.dtype_bytes = dtype_bytes
        enable_checkpointing(model)  # sets every layer's recompute function; switched per layer below
        self.layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        self.checkpointed = len(self.layers)
        """Layers checkpointed in the last micro-batch planned."""
        self.plan(0)

    def plan(self, tokens: int) -> int:
        """Checkpoint the fewest first layers that fit the budget for a micro-batch of `tokens` (padded)
        tokens; returns how many."""
        full = layer_activation_bytes(tokens, self.hidden, self.intermediate, self.dtype_bytes)
        k = checkpointed_layers(len(self.layers), full, tokens * self.hidden * INPUT_BYTES, self.budget_bytes)
        for i, layer in enumerate(self.layers):
            layer.gradient_checkpointing = i < k
        self.checkpointed = k
        return k


def enable_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing of every decoder layer (transformers renamed the method in
    5.2x; the lent GPU machines run 5.17)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def activation_dtype_bytes(device: torch.device) -> int:
    """Bytes of the learner's activations: bf16 under CUDA autocast, fp32 elsewhere (trainer/learner.py)."""
    return 2 if device.type == "cuda" else 4
