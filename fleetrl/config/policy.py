"""The policy model (`model`): which weights, which tokenizer, what dtype is published, LoRA or not.

`ModelConfig.build()` hands the fields to `_model_factory.build_model`, imported only when called, so
that loading a config never imports torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from fleetrl.config.base import Model
from fleetrl.config.tiny_model import TinyModelConfig


class LoraAdapterConfig(Model):
    """Train a low-rank adapter (LoRA, through peft) instead of every weight: the base stays frozen, the
    optimizer holds state for the adapter alone, and every version the hub publishes after the base is
    the adapter alone (docs/trainer.md, LoRA). Field names and defaults are peft's `LoraConfig`'s."""

    r: int = Field(8, ge=1, le=4096)
    """Rank of the adapter's matrices (A is r x in, B is out x r)."""
    lora_alpha: int = Field(8, ge=1)
    """Scale numerator: the adapter adds `lora_alpha / r * B @ A` to each target weight."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (engines never apply it)."""
    target_modules: list[str] | str | None = None
    """Modules that get an adapter: a list of names (a module matches when its name is one of them or
    ends with `.` + one), `all-linear` (every linear layer but the output head), or a regular expression
    matched against whole module names, as peft reads it. None: peft's default for the architecture
    (`q_proj` and `v_proj` for Llama, Qwen2 and Mistral)."""
    base_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the frozen base in the learner. `bfloat16` halves its memory; the adapter (and its
    optimizer state) stays fp32."""
    seed: int = 0
    """Seed of the adapter's initial A matrices (B starts at zero, so the first version is the base's
    policy): a restarted trainer builds the same initial adapter."""

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: list[str] | str | None) -> list[str] | str | None:
        if isinstance(value, list) and not value:
            raise ValueError("target_modules is an empty list; leave it out for peft's default, or name modules")
        return value


class ModelConfig(Model):
    """The policy model."""

    path: str | None = None
    """A local Hugging Face causal-LM folder (Llama, Qwen2/3, Mistral; fp32, bf16 or fp16 safetensors, one
    file or shards with an index); relative to the config file. None builds `tiny` from its config. Stop
    tokens come from its `generation_config.json` (every `eos_token_id` listed there)."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Architecture of the model built from a config when `path` is unset."""
    publish_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype the trainer casts its fp32 master weights to when it publishes a version."""
    tokenizer: str | None = None
    """`char` (the character tokenizer shipped in code) or a local tokenizer folder (relative to the config
    file). None: the tokenizer (and chat template) of `path`, or `char` for the tiny model."""
    lora: LoraAdapterConfig | None = None
    """Train a LoRA adapter on the frozen base instead of every weight (`{r, lora_alpha, lora_dropout,
    target_modules}`, peft's names and defaults). None: full fine-tuning."""

    @property
    def tokenizer_source(self) -> str:
        """What the rollout worker loads: `char` or a tokenizer folder."""
        if self.tokenizer is not None:
            return self.tokenizer
        return self.path if self.path is not None else "char"

    def build(self) -> Any:
        """Build the torch model (fp32). Imports torch and transformers lazily."""
        from fleetrl.config._model_factory import build_model

        return build_model(self.path, self.tiny)
