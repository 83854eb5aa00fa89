"""The learning algorithm (`algorithm`): GRPO/PPO with truncated importance sampling, its optimizer,
the staleness bound and the sampling parameters sent with every prompt (DESIGN.md §6)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fleetrl.config.base import Model


class AlgorithmConfig(Model):
    """GRPO/PPO with truncated importance sampling (DESIGN.md §6)."""

    mode: Literal["async", "sync"] = "async"
    """`async`: workers generate up to `max_staleness` versions ahead while the learner trains. `sync`:
    the on-policy baseline: the trainer dispatches one step's groups, waits for all of them, trains,
    publishes, and only then dispatches the next step's (staleness 0; workers idle while it trains)."""
    groups_per_step: int = Field(8, ge=1)
    """Groups (one prompt, n samples) consumed by one optimizer step."""
    n_samples: int = Field(8, ge=1, le=1024)
    """Samples per group."""
    max_staleness: int = Field(1, ge=0)
    """Versions a group may lag behind the learner; admission keeps it within s+1."""
    dispatch_ahead_steps: int = Field(1, ge=0, le=16)
    """Steps' worth of prompts sent past the staleness window, each asking (`min_version`) for the
    version that will be the newest when it may start: the prompt waits at its worker, so the engine
    starts it the moment those weights land instead of a link round trip and a Kafka fetch later.
    They generate no staler than `max_staleness` allows; 0 sends nothing ahead."""
    advantage: Literal["grpo", "grpo_no_std", "leave_one_out"] = "grpo"
    """Group-normalized advantage: (r-mean)/std, r-mean, or leave-one-out baseline."""
    aggregation: Literal["token_mean", "seq_mean"] = "token_mean"
    """Loss aggregation: DAPO token-mean over the batch, or mean of per-sequence means."""
    clip_low: float = Field(0.2, ge=0, le=1)
    """PPO ratio clip below 1 (1 - clip_low)."""
    clip_high: float = Field(0.28, ge=0, le=10)
    """PPO ratio clip above 1 (1 + clip_high); DAPO's clip-higher default."""
    tis_cap: float = Field(2.0, ge=1)
    """Truncated importance weight cap on pi_old/pi_behaviour."""
    kl_coef: float = Field(0.0, ge=0)
    """Coefficient of a KL penalty to the initial (reference) policy; 0 disables it."""
    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global grad norm."""
    micro_batch_samples: int = Field(64, ge=1)
    """Samples per forward/backward micro-batch (gradient accumulation)."""
    logprob_chunk_tokens: int = Field(1024, ge=0)
    """Scored tokens whose logits the learner holds at once: the output head and the log-softmax run chunk
    by chunk, forward and backward, so a micro-batch's `[tokens, vocab]` fp32 logits never exist whole
    (trainer/logprobs.py; only completion tokens go through the head). 0: the whole logits at once, at every
    position (about 4 bytes x tokens x vocab, several times over in the backward pass)."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input in the forward pass and recompute the layer in the backward
    (transformers' gradient checkpointing, non-reentrant): a micro-batch's activations shrink about as many
    times as the model has layers, for about one more forward pass of compute."""
    activation_memory_gib: float | None = Field(None, gt=0)
    """Selective activation checkpointing: the GiB a micro-batch's decoder activations may keep from the
    forward pass to the backward. Before each micro-batch the learner estimates a layer's activations
    (tokens x hidden size x the activation dtype's bytes, times a per-architecture factor:
    trainer/activations.py) and checkpoints the fewest layers, the first ones, that bring the total within
    this budget; the rest keep theirs and are not recomputed. None: no selective checkpointing (every layer
    with `activation_checkpointing`, else none). Not together with `activation_checkpointing`."""
    fused_kernels: bool | None = None
    """Liger Kernel's fused RMSNorm, RoPE and SwiGLU in the policy (through Liger's own patching of the Hugging
    Face model: Qwen2/3, Llama, Mistral) and its fused linear + cross-entropy as the output head, so that the
    scored tokens' log-probabilities come from the hidden states without whole logits (with
    `logprob_chunk_tokens` > 0). Needs the learner on CUDA and the `gpu` extra (`liger-kernel`, Triton).
    None (auto): on where the learner runs on CUDA, liger-kernel imports and `compile` is off (compiled layers
    were measured faster: 9.9 against 16.0 ms per 1k tokens for a 0.5 B Qwen2 on an H200, docs/trainer.md).
    True: asked for; where it cannot apply (a CPU learner, liger-kernel missing, another architecture) the
    learner logs why once and runs the plain modules. False: off."""
    compile: bool | None = None
    """`torch.compile` each decoder layer of the policy in place (its parameter names stay; the first steps of
    each new micro-batch shape pay the compilation). None (auto): on where the learner runs on CUDA, off
    elsewhere (on the CPU it needs a C++ compiler and pays more in compilation than it wins). True: on
    everywhere. False: off."""
    ppo_epochs: int = Field(1, ge=1, le=64)
    """Passes over each step's samples. Above 1 (or with `mini_batches` above 1) the step makes several
    optimizer updates, the PPO ratio is taken against the logprobs of the weights before the step's
    first update, and the clip acts; 1 and 1 make one update with ratio 1 (the clip never acts)."""
    mini_batches: int = Field(1, ge=1, le=1024)
    """Optimizer updates per pass: the step's samples are shuffled and split into this many parts."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature sent with every prompt."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass sent with every prompt."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest completion; also the schema's bound on tokens per sample."""
    max_steps: int = Field(1000, ge=1)
    """The trainer stops after this many optimizer steps."""

    @model_validator(mode="after")
    def _one_checkpointing(self) -> AlgorithmConfig:
        if self.activation_memory_gib is not None and self.activation_checkpointing:
            raise ValueError(f"activation_memory_gib is {self.activation_memory_gib} and activation_checkpointing is "
                             f"true: checkpointing every layer leaves no budget to choose by; set one of them")
        return self

    @model_validator(mode="after")
    def _sync_is_on_policy(self) -> AlgorithmConfig:
        if self.mode == "sync" and self.max_staleness != 0:
            if "max_staleness" in self.model_fields_set:
                raise ValueError(f"max_staleness is {self.max_staleness} but mode is sync, which trains on-policy: "
                                 f"set max_staleness to 0 or leave it out")
            self.max_staleness = 0
        return self
