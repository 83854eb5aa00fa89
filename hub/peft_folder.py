"""A LoRA adapter version as a peft adapter folder: what `PeftModel.from_pretrained` and vLLM's
`LoRARequest` load (`adapter_config.json` + `adapter_model.safetensors`).

The tensors keep the names the hub stores them under, which are peft's own
(`base_model.model.<module>.lora_A.weight`); the config is written by peft's `LoraConfig`, naming
each adapted module in full, so that exactly those modules (and no namesake elsewhere) get one.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from fleetrl.hub.errors import HubError
from fleetrl.hub.manifest import AdapterInfo

if TYPE_CHECKING:
    import torch

WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def adapted_modules(names: list[str]) -> list[str]:
    """The modules (base model names) an adapter's tensor names adapt."""
    modules = set()
    for name in names:
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None or not name.startswith(_PREFIX):
            raise HubError(f"adapter tensor {name!r} is not named as peft names LoRA weights "
                           f"({_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
        modules.add(name[len(_PREFIX): -len(suffix)])
    return sorted(modules)


def save_peft_adapter(folder: str | os.PathLike[str], info: AdapterInfo, tensors: Mapping[str, torch.Tensor],
                      base_model: str | None = None) -> pathlib.Path:
    """Write `tensors` (one adapter version) and its peft config into `folder` (created if needed)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(r=info.r, lora_alpha=info.lora_alpha, lora_dropout=info.lora_dropout,
                        target_modules=adapted_modules(list(tensors)), task_type="CAUSAL_LM",
                        base_model_name_or_path=base_model)
    config.save_pretrained(str(out))
    # Copies: the hub hands equal tensors out as one (all B matrices of a shape are zero at first), and
    # safetensors refuses tensors that share memory.
    save_file({name: t.detach().cpu().clone() for name, t in tensors.items()}, str(out / WEIGHTS_FILE))
    return out
