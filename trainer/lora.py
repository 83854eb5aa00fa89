"""LoRA policies in the learner: the frozen base wrapped in a peft model (`model.lora`, DESIGN.md §6).

peft injects a low-rank adapter (A: r x in, B: out x r, B zero at first) beside each target linear
layer; the learner trains only those, so its optimizer holds state for the adapter alone. What the
rest of the trainer sees:

* `adapter_state`: the adapter's tensors under the names peft saves them with
  (`base_model.model.<module>.lora_A.weight`): what the hub publishes as every version after the base;
* `base_state`: the frozen base under its Hugging Face names (peft's `.base_layer` taken out): what
  the hub publishes once, as the version the adapters apply to;
* `base_policy`: the reference policy of the KL penalty, the same model with its adapter switched off
  (no second copy of the weights).

Checkpoints hold the trainable tensors only (`dist.py` leaves frozen ones out): the base is rebuilt
from `model.path` / `model.tiny` on every start, bit for bit.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from fleetrl.config import LoraAdapterConfig
from fleetrl.trainer.errors import TrainerError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ADAPTER_PARTS = (".lora_A.", ".lora_B.")


def wrap(model: torch.nn.Module, cfg: LoraAdapterConfig) -> Any:
    """`model` (fp32, as built) as a peft model: base frozen in `cfg.base_dtype`, adapter fp32 and
    initialized from `cfg.seed`."""
    import peft

    with torch.no_grad():  # parameters only: RoPE's `inv_freq` stays fp32, as transformers keeps it
        for p in model.parameters():
            p.data = p.data.to(_DTYPES[cfg.base_dtype])
    config = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                             target_modules=cfg.target_modules, task_type="CAUSAL_LM")
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(cfg.seed)
            # peft 0.21 asks transformers 5 `is_gradient_checkpointing`, which warns that it was renamed.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            # A tied head among the targets: refused below, with the field named.
            warnings.filterwarnings("ignore", message=".*a tied layer is part of the adapter.*", category=UserWarning)
            # autocast_adapter_dtype: the adapter (and so its optimizer state) is fp32 whatever the base.
            wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as exc:  # peft's words for target modules the model does not have
        raise TrainerError(f"model.lora: {exc}") from exc
    _check_targets(wrapped)
    return wrapped


def _check_targets(wrapped: Any) -> None:
    """Engines serve adapters on the linear layers inside the model: not on the output head (tied to the
    embeddings, peft would publish the base's weight with the adapter), nor on other layer kinds."""
    from peft.tuners.lora import LoraLayer

    head = wrapped.get_base_model().get_output_embeddings()
    for name, module in wrapped.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        is_head = module is head or base is head
        if is_head or not isinstance(base, torch.nn.Linear):
            what = "the output head" if is_head else f"a {type(base).__name__}"
            raise TrainerError(f"model.lora.target_modules: {name.removeprefix('base_model.model.')!r} is "
                               f"{what}; adapters go on the linear layers inside the model")


def is_adapter(name: str) -> bool:
    """Whether a parameter or state-dict name is an adapter's (peft's `lora_A` / `lora_B`)."""
    return any(part in name for part in _ADAPTER_PARTS)


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors as peft saves them (its adapter name taken out), live (not copies)."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model))


def base_state(model: Any) -> dict[str, torch.Tensor]:
    """The frozen base under its Hugging Face names (tied weights as the base model has them), live."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.get_base_model().state_dict(keep_vars=False).items():
        if not is_adapter(name):
            out[name.replace(".base_layer.", ".")] = t
    return out


def scaling(cfg: LoraAdapterConfig) -> float:
    """What each adapter's B @ A is multiplied by (peft's `lora_alpha / r`)."""
    return cfg.lora_alpha / cfg.r


@contextlib.contextmanager
def base_policy(model: Any) -> Iterator[torch.nn.Module]:
    """The base alone: `model` with its adapter switched off while the block runs."""
    with model.disable_adapter():
        yield model


def frozen(model: torch.nn.Module) -> bool:
    """Whether some parameter of `model` is frozen (then only the others are training state)."""
    return any(not p.requires_grad for p in model.parameters())
