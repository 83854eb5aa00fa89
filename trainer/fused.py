"""Faster decoder layers for the learner on a GPU: Liger Kernel and `torch.compile` (issue 50).

* `algorithm.fused_kernels`: Liger Kernel (the `gpu` extra, Triton) patches the Hugging Face model in
  place through its own `apply_liger_kernel_to_<model type>` (fused RMSNorm, RoPE and SwiGLU), and its
  fused linear + cross-entropy (`reduction="none"`: per token, -log softmax[target]) becomes the output
  head of the chunked log-prob path (trainer/logprobs.py, `fused_head`): the scored tokens'
  log-probabilities come from the hidden states without whole logits, forward or backward. Liger runs on
  CUDA only, so it applies only where the learner is on CUDA, `fused_kernels` is not false, liger-kernel
  imports and the model type is one Liger patches; otherwise the plain modules run and the learner logs
  why, once, when it is built. Liger's class swaps in the model type's module are undone (they would
  reach every model built later); its RoPE stays in the module (transformers has no per-instance RoPE),
  for tensors on CUDA only.
* `algorithm.compile`: each decoder layer compiled in place (`Module.compile`: the parameter names, and so
  the published state and checkpoints, stay as they are). Auto (the default) compiles where the learner
  runs on CUDA; auto Liger then stays off: on an H200 the compiled layers ran a 0.5 B Qwen2's step of 16,384
  tokens at 9.9 ms per 1k tokens, Liger's at 16.0 and the plain ones at 13.7 (docs/trainer.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fleetrl.config import AlgorithmConfig
from fleetrl.log import get_logger

log = get_logger(__name__)

LIGER_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Hugging Face model types patched through `liger_kernel.transformers.apply_liger_kernel_to_<type>`."""


@dataclass(frozen=True, slots=True)
class LigerChoice:
    applied: bool
    reason: str
    """Why it is (or is not) applied, for the log line."""


def compiles(algo: AlgorithmConfig, device: torch.device) -> bool:
    """Whether the learner compiles its decoder layers: `algorithm.compile`, auto meaning on CUDA."""
    return algo.compile if algo.compile is not None else device.type == "cuda"


def choose_liger(algo: AlgorithmConfig, device: torch.device, model_type: str) -> LigerChoice:
    """Whether the learner applies Liger Kernel, and why (see the module docstring)."""
    if algo.fused_kernels is False:
        return LigerChoice(False, "algorithm.fused_kernels is false")
    asked = "algorithm.fused_kernels is true" if algo.fused_kernels else "algorithm.fused_kernels is auto"
    if algo.fused_kernels is None and compiles(algo, device):
        return LigerChoice(False, f"{asked} and the decoder layers are compiled (algorithm.compile), which was "
                                  f"measured faster; set fused_kernels: true to have both")
    if device.type != "cuda":
        return LigerChoice(False, f"{asked}, but the learner runs on {device.type}: Liger's Triton kernels need CUDA")
    if model_type not in LIGER_MODEL_TYPES:
        return LigerChoice(False, f"{asked}, but Liger is not wired for model type {model_type!r} "
                                  f"(wired: {', '.join(LIGER_MODEL_TYPES)})")
    try:
        importlib.import_module("liger_kernel.transformers")
    except ImportError as exc:
        return LigerChoice(False, f"{asked}, but liger-kernel does not import ({exc}); install the gpu extra: "
                                  f"pip install 'fleetrl[gpu]'")
    return LigerChoice(True, f"{asked}, the learner runs on CUDA and liger-kernel imports")


def apply_liger(model: Any) -> None:
    """Liger's fused RMSNorm, RoPE and SwiGLU patched into `model` (a Hugging Face causal LM) by Liger's own
    function for its type. Its fused linear cross-entropy forward is left out: FleetRL's loss needs
    log-probabilities, not a mean cross-entropy, and takes them from `liger_head_logprobs`.

    Given the model, Liger rebinds the forward of its norms and MLPs (this instance only), but it also
    swaps the classes and the RoPE function in the model type's module, which would reach every model of
    the type built or run later in the process (an engine, a CPU model, where Triton cannot run). The
    classes are put back; RoPE has no per-instance hook, so the module keeps Liger's for tensors on CUDA
    and the original for any other."""
    liger = importlib.import_module("liger_kernel.transformers")
    apply = getattr(liger, f"apply_liger_kernel_to_{model.config.model_type}")
    module = importlib.import_module(type(model).__module__)
    before = dict(vars(module))
    apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model)
    for name, value in list(vars(module).items()):
        if name in before and before[name] is not value:
            setattr(module, name, _on_cuda(value, before[name]) if name == "apply_rotary_pos_emb" else before[name])


def _on_cuda(fused: Callable[..., Any], plain: Callable[..., Any]) -> Callable[..., Any]:
    """A RoPE function that runs `fused` for queries on CUDA and `plain` for any other."""
    plain = getattr(plain, "plain", plain)  # a second learner in the process: wrap the original once

    def apply_rotary_pos_emb(q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return (fused if q.is_cuda else plain)(q, *args, **kwargs)

    apply_rotary_pos_emb.plain = plain  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def liger_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        temperature: float) -> torch.Tensor:
    """log_softmax(hidden @ weight.T / T)[targets] per row through Liger's fused linear + cross-entropy
    (`reduction="none"` recomputes its chunks in the backward pass and weighs each row's gradient there;
    liger-kernel >= 0.8.2). The gradient of the head is accumulated in fp32."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    if hidden.shape[0] == 0:  # Liger sizes its chunks from the row count; keep the graph as the chunked head does
        return hidden[:, 0].float() * 0
    h = hidden / temperature if temperature != 1.0 else hidden
    nll = liger_fused_linear_cross_entropy(h, weight, targets, reduction="none", accum_dtype=torch.float32)
    return -nll.float()


def compile_layers(model: Any) -> int:
    """Compile every decoder layer of `model` in place; returns how many."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer.compile()
    return len(layers)
