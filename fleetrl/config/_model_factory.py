"""Builds the policy model described by `ModelConfig` (torch imported only here).

`ModelConfig.build()` (policy.py) imports this module when called; it reads only the tiny model's
config (tiny_model.py), so no module of the config package imports policy.py back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetrl.config.tiny_model import TinyModelConfig


def build_model(path: str | None, tiny: TinyModelConfig) -> Any:
    """An fp32 `transformers` causal LM: a local checkpoint, or a tiny Qwen2 built from config.

    `path` is `model.path`, `tiny` is `model.tiny`. The tiny model's weights come from `tiny.seed`, so
    the trainer and every rollout node that build it start from bit-identical weights without copying
    them.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if path is not None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    qcfg = Qwen2Config(
        vocab_size=tiny.vocab_size,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=tiny.tie_word_embeddings,
        initializer_range=tiny.initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = Qwen2ForCausalLM(qcfg)
    return model.float()
