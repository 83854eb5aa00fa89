"""Builds the policy model described by `ModelConfig` (torch imported only here)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetrl.config.models import ModelConfig


def build_model(config: ModelConfig) -> Any:
    """An fp32 `transformers` causal LM: a local checkpoint, or a tiny Qwen2 built from config.

    The tiny model's weights come from `tiny.seed`, so the trainer and every rollout node that
    build it start from bit-identical weights without copying them.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if config.path is not None:
        return AutoModelForCausalLM.from_pretrained(config.path, dtype=torch.float32, local_files_only=True)
    t = config.tiny
    qcfg = Qwen2Config(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=t.tie_word_embeddings,
        initializer_range=t.initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(t.seed)
        model = Qwen2ForCausalLM(qcfg)
    return model.float()
