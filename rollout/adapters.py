"""LoRA adapters in the torch engine: a version of the policy is its base plus `scaling * B @ A` on
each target linear layer (hub versions of a LoRA run, DESIGN.md §5; trainer/lora.py).

Two ways to serve one, switched between decoding steps like any weights (engine.py), both without
reading the base again:

* `MergedLora` writes `W = W0 + scaling * B @ A` into each target weight. It keeps W0, the base's
  weight as loaded, for every target (one more copy of the targets), so that the next version is
  merged into W0 again rather than into the last merge: `(W0 + d1) - d1 + d2` in bf16 is not
  `W0 + d2`, and the error would grow with every version. The sum is taken in fp32 and rounded once,
  so a version's merged weights are bit for bit the same whichever versions came before.
* `UnmergedLora` leaves the weights alone and adds `(x @ A^T) @ (scaling * B)^T` to each target's
  output (a forward hook), in the engine's dtype: no copy of the base, two thin matmuls per target
  per step. Its buffers are written in place, so a captured CUDA graph stays valid across versions.

Adapters arrive under peft's names (`base_model.model.<module>.lora_A.weight`); `LoraWeights.pairs`
maps them to the engine model's module names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fleetrl.hub import AdapterInfo
from fleetrl.rollout.errors import EngineError

_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


@dataclass(frozen=True)
class LoraWeights:
    """One adapter version as the hub hands it out: its tensors (peft's names) and how to apply them."""

    version: int
    info: AdapterInfo
    tensors: Mapping[str, torch.Tensor]

    @property
    def base(self) -> int:
        return self.info.base

    def pairs(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Module name (as in the base model) -> (A [r, in], B [out, r])."""
        a: dict[str, torch.Tensor] = {}
        b: dict[str, torch.Tensor] = {}
        for name, t in self.tensors.items():
            module = name.removeprefix(_PREFIX)
            if module.endswith(_A):
                a[module[: -len(_A)]] = t
            elif module.endswith(_B):
                b[module[: -len(_B)]] = t
            else:
                raise EngineError(f"adapter version {self.version}: tensor {name!r} is neither a lora_A nor a "
                                  f"lora_B weight")
        if a.keys() != b.keys():
            odd = sorted(a.keys() ^ b.keys())
            raise EngineError(f"adapter version {self.version}: module {odd[0]!r} has only one of lora_A, lora_B")
        return {m: (a[m], b[m]) for m in sorted(a)}


def _linear(model: torch.nn.Module, name: str, version: int) -> torch.nn.Linear:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise EngineError(f"adapter version {version}: the engine's model has no module {name!r}") from None
    if not isinstance(module, torch.nn.Linear):
        raise EngineError(f"adapter version {version}: module {name!r} is a {type(module).__name__}, not a "
                          f"linear layer")
    return module


def _check(layer: torch.nn.Linear, a: torch.Tensor, b: torch.Tensor, name: str, version: int) -> None:
    out, inp = layer.weight.shape
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inp or b.shape[0] != out or a.shape[0] != b.shape[1]:
        raise EngineError(f"adapter version {version}: module {name!r} ({out}x{inp}) cannot take A "
                          f"{tuple(a.shape)} and B {tuple(b.shape)}")


class MergedLora:
    """Serves an adapter merged into the weights; keeps each target's base weight to merge into."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._base: dict[str, torch.Tensor] = {}
        """Target module -> its weight as the base has it (taken before the first merge into it)."""

    @torch.no_grad()
    def apply(self, adapter: LoraWeights | None) -> None:
        """Serve `adapter` (None: the base alone) in place of the adapter merged now."""
        pairs = {} if adapter is None else adapter.pairs()
        version = -1 if adapter is None else adapter.version
        layers = {name: _linear(self.model, name, version) for name in pairs}
        for name, (a, b) in pairs.items():  # every check before the first write: a refused version changes nothing
            _check(layers[name], a, b, name, version)
        for name in list(self._base):
            if name not in pairs:  # a target the new version does not have: back to the base
                _linear(self.model, name, version).weight.copy_(self._base.pop(name))
        for name, (a, b) in pairs.items():
            weight = layers[name].weight
            base = self._base.get(name)
            if base is None:
                base = self._base[name] = weight.detach().clone()
            assert adapter is not None
            delta = (b.to(weight.device, torch.float32) @ a.to(weight.device, torch.float32)) * adapter.info.scaling
            weight.copy_(torch.add(base.float(), delta))  # out of place: `base` stays W0

    @property
    def extra_bytes(self) -> int:
        """Memory held beside the model: the targets' base weights."""
        return sum(t.numel() * t.element_size() for t in self._base.values())


class UnmergedLora:
    """Serves an adapter beside the weights: each target's output gains `(x @ A^T) @ (scaling B)^T`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """Target module -> (A, scaling * B) in the engine's dtype and device, written in place."""
        self._hooks: dict[str, Any] = {}

    @torch.no_grad()
    def apply(self, adapter: LoraWeights | None) -> None:
        """Serve `adapter` (None: the base alone)."""
        pairs = {} if adapter is None else adapter.pairs()
        version = -1 if adapter is None else adapter.version
        layers = {name: _linear(self.model, name, version) for name in pairs}
        for name, (a, b) in pairs.items():
            _check(layers[name], a, b, name, version)
        for name in list(self._hooks):
            if name not in pairs:
                self._hooks.pop(name).remove()
                del self._buffers[name]
        for name, (a, b) in pairs.items():
            assert adapter is not None
            weight = layers[name].weight
            scaled = b.to(weight.device, torch.float32) * adapter.info.scaling
            held = self._buffers.get(name)
            if held is not None and held[0].shape == a.shape and held[1].shape == b.shape:
                held[0].copy_(a)
                held[1].copy_(scaled)
                continue
            buffers = (a.to(weight.device, weight.dtype, copy=True), scaled.to(weight.dtype))
            self._buffers[name] = buffers
            if name not in self._hooks:
                self._hooks[name] = layers[name].register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def add_adapter(_module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            a, b = self._buffers[name]
            return output + (args[0] @ a.t()) @ b.t()

        return add_adapter

    @property
    def extra_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self._buffers.values())


AdapterServer = MergedLora | UnmergedLora


def adapter_server(model: torch.nn.Module, mode: str) -> AdapterServer:
    """The way `mode` (`merged` or `unmerged`) serves adapters on `model`."""
    if mode == "merged":
        return MergedLora(model)
    if mode == "unmerged":
        return UnmergedLora(model)
    raise EngineError(f"unknown LoRA serving mode {mode!r}; known: merged, unmerged")
