"""The tiny model (`model.tiny`): a Qwen2-architecture policy built from a config, no download.

Its own module so that the builder (`_model_factory.py`, the only place torch is imported) can name
its type without importing the rest of the model section.
"""

from __future__ import annotations

from pydantic import Field

from fleetrl.config.base import Model


class TinyModelConfig(Model):
    """A Qwen2-architecture model built from a config, no download (tests, demo, benchmarks)."""

    vocab_size: int = Field(128, ge=16)
    """Vocabulary size; must cover the tokenizer of the task (the char tokenizer uses 128)."""
    hidden_size: int = Field(64, ge=8)
    """Width of the residual stream."""
    intermediate_size: int = Field(128, ge=8)
    """Width of the MLP."""
    num_hidden_layers: int = Field(2, ge=1)
    """Transformer blocks."""
    num_attention_heads: int = Field(4, ge=1)
    """Query heads; must divide hidden_size."""
    num_key_value_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention); must divide num_attention_heads."""
    max_position_embeddings: int = Field(512, ge=16)
    """Longest prompt + completion the model handles."""
    tie_word_embeddings: bool = True
    """Share input and output embeddings (stored once in the hub, as in HF checkpoints)."""
    initializer_range: float = Field(0.02, gt=0, le=1)
    """Standard deviation of the initial weights (Qwen2's default). A LoRA run trains adapters on a frozen
    base: with the default, the frozen random head keeps every logit within about +-1.3, so no adapter can
    make the policy confident; a wider range (0.1) stands in for a pretrained base's scale."""
    seed: int = 0
    """Seed of the initial weights: every process that builds the model gets the same ones."""
