"""The transformers model under the torch engine: which models it runs, how they are prepared.

The torch engine (`torch_engine.py`) runs a causal LM's attention through `_kv.slot_attention`, so
the model must dispatch attention via transformers' AttentionInterface with full attention in every
layer (`check_attention`). For the plain Llama-family decoders (`PLAIN`) it calls embed -> rotary ->
decoder layers -> norm -> lm_head itself (`plain_decoder`). Here too: the cast into the engine's
dtype that keeps RoPE frequencies in fp32 (`cast_model`), the index of state-dict names the engine's
weights are written into (`param_index`), and the model's stop tokens (`model_eos_ids`).
"""

from __future__ import annotations

from typing import Any

import torch

from fleetrl.rollout.errors import EngineError


def cast_model(model: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """The model on `device` in `dtype`, its RoPE frequencies kept in fp32: `Module.to` casts every float
    buffer, but transformers loads a bf16/fp16 checkpoint with `inv_freq` in fp32 and computes the
    rotary angles in fp32, so a cast `inv_freq` would shift the logits off what the same checkpoint
    gives under `from_pretrained` (by ~4e-3 on a tiny bf16 Qwen2)."""
    kept = {name: buf.detach().float().clone() for name, buf in model.named_buffers() if name.endswith("inv_freq")}
    model = model.to(device=device, dtype=dtype)
    for name, value in kept.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        persistent = attr not in getattr(module, "_non_persistent_buffers_set", set())
        module.register_buffer(attr, value.to(device), persistent=persistent)
    return model


def param_index(model: Any) -> dict[str, torch.Tensor]:
    """Every state-dict name (tied aliases included) mapped to the live tensor it loads into."""
    live = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    return {name: live[name] for name in model.state_dict() if name in live}


def check_attention(model: Any) -> None:
    """The engine runs the model's attention through `_kv.slot_attention`: it must dispatch via
    transformers' AttentionInterface and use full attention in every layer."""
    if not getattr(model, "_supports_attention_backend", False):
        raise EngineError(f"model {type(model).__name__} does not dispatch attention through transformers' "
                          "AttentionInterface; the torch engine cannot batch it")
    kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise EngineError(f"model layer types {sorted(kinds)} are not supported by the torch engine "
                          "(full attention only)")


PLAIN = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
"""Causal LMs whose forward is embed -> rotary -> decoder layers -> norm -> lm_head, nothing else
(no embedding or logit scaling, no soft-capping): the engine may run those steps itself."""


def plain_decoder(model: Any) -> Any | None:
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "rotary_emb", "layers", "norm")
    if type(model).__name__ not in PLAIN or inner is None or not all(hasattr(inner, p) for p in parts):
        return None
    return inner


def model_eos_ids(model: Any) -> list[int]:
    """Stop tokens: every `eos_token_id` of the generation config (several are common: Llama 3's
    `<|eot_id|>` beside `<|end_of_text|>`, Qwen2's `<|im_end|>` beside `<|endoftext|>`), else the config's."""
    generation = getattr(model, "generation_config", None)
    found = _as_list(getattr(generation, "eos_token_id", None)) if generation is not None else []
    return found or _as_list(model.config.eos_token_id)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]
