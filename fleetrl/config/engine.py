"""The rollout engines (`regions[].engine`, `regions[].nodes[].engine`): torch or vLLM, picked by
`kind`, with the torch engine's speculative decoding and the emulated hardware benchmarks use."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from fleetrl.config.base import Model


class EngineEmulation(Model):
    """Emulated hardware and workload for benchmarks and fault drills on CPU (`bench/pipeline.py`):
    the real engine, made slower per token or given a long-tailed completion-length law. Off unless
    set; never needed in production."""

    step_delay_s: float = Field(0.0, ge=0, le=10)
    """Added to every decoding step: a region of slower GPUs (per-token speed)."""
    tail_p: float = Field(0.0, ge=0, le=1)
    """Long-tailed completion lengths: each sample runs to `max_new_tokens` with this probability..."""
    short_tokens: int = Field(4, ge=1)
    """...and otherwise stops (`stop`) after a length drawn uniformly from 1 to this. Drawn from the
    sample's key, so a handed-over sample keeps its length in the worker that resumes it."""
    weight_transfer_s: float = Field(0.0, ge=0, le=600)
    """Added to pulling each new policy version, before the engine stages it (in the background,
    while decoding goes on): a version's copy across a WAN into the region."""

    tail_by_prompt: bool = False
    """Whether a sample runs to `max_new_tokens` is drawn from its prompt, not its key: every sample of
    a prompt is long, every time the prompt comes back (real lengths follow the prompt; length-aware
    scheduling learns them from history)."""


class SpeculativeConfig(Model):
    """History-drafted speculative decoding of the torch engine (docs/rollout.md): drafts come from the
    engine's earlier responses to the same prompt, are verified by the policy in the step's forward pass
    and accepted by the speculative-sampling rule, so what is sampled is exactly the policy's
    distribution. It pays where prompts come back (epochs) and the policy answers them alike."""

    enabled: bool = True
    """Draft and verify; False decodes one token per sample per step (the history still predicts lengths)."""
    max_draft_tokens: int = Field(8, ge=1, le=64)
    """Most tokens drafted for one sample in one step."""
    min_acceptance: float = Field(0.2, ge=0, le=1)
    """A prompt's drafts stop while the moving share of its drafted tokens the policy accepts is below
    this (the policy moved away from its old answers); a new answer to it lets it try again."""
    max_ngram: int = Field(4, ge=1, le=16)
    """Longest suffix of a sample's context looked up in the history (longest match wins)."""
    min_ngram: int = Field(1, ge=1, le=16)
    """Shortest suffix that may match."""
    across_prompts: bool = True
    """Also draft from the answers to other prompts: where a sample's own prompt has no earlier answer
    that continues its last two tokens (it left the paths it took before), the newest answer of any
    prompt that does. Prompts share phrases (and a prompt never seen drafts this way only). Costs a
    table of the newest position after each pair of tokens, written when an answer is recorded."""
    history_prompts: int = Field(4096, ge=1)
    """Prompts the history keeps (least recently used go first)."""
    history_responses: int = Field(8, ge=1, le=256)
    """Latest responses kept per prompt."""
    history_tokens: int = Field(1 << 20, ge=1024)
    """Tokens the history holds in all (about 60 bytes each with their index, and up to 100 more for
    `across_prompts`' table); least recently used
    prompts go first beyond it."""
    region_history: bool = True
    """With `enabled`, also record the answers every worker of the region gives: each worker reads its
    region's `trajectories` topic (without a consumer group; the trainer's reads are untouched), so it
    drafts from any prompt its region answered, and a restarted worker warms its history from the newest
    records there. Each worker then reads the region's whole stream of finished groups."""
    region_history_window: int = Field(16, ge=0)
    """Newest records per partition of `trajectories` a worker reads when it starts (its warm-up);
    0: only the groups finished afterwards."""
    region_history_tokens_per_step: int = Field(8192, ge=1)
    """Most tokens of the region's answers the engine records per decoding step (whole answers, at least
    one; the rest wait, the oldest dropped beyond `history_tokens`): bounds what the region history adds
    to a step (a copy of the tokens; a prompt's answers are indexed at its first draft)."""

    @model_validator(mode="after")
    def _ngrams_ordered(self) -> SpeculativeConfig:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) is above max_ngram ({self.max_ngram})")
        return self


class TorchEngineConfig(Model):
    """PyTorch/transformers engine: batched decoding with a KV cache; CPU or CUDA."""

    kind: Literal["torch"] = "torch"
    """Engine kind."""
    device: str = "cpu"
    """Torch device of the engine."""
    max_batch: int = Field(32, ge=1)
    """Samples decoded together; finished slots are refilled with waiting samples."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the engine runs in (published weights are cast to it)."""
    threads: int = Field(1, ge=1)
    """torch intra-op threads (1 avoids 100x slow-downs on shared cores)."""
    devices: list[str] = Field(default_factory=list)
    """One engine (a supervised worker process) per entry, on that torch device (`["cuda:0", "cuda:1"]`).
    Empty: one engine on `device`."""
    refill_fraction: float = Field(0.125, gt=0, le=1)
    """Admit waiting samples once this fraction of the slots is free (at least one): admitting has a fixed
    cost per step, so batching admissions trades a little occupancy for fewer of them."""
    emulate: EngineEmulation | None = None
    """Emulated slowness and completion lengths for benchmarks on CPU (see `EngineEmulation`)."""
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    """History-drafted speculative decoding (see `SpeculativeConfig`); `enabled: false` turns it off."""
    static_step: bool | None = None
    """Decode with the static step (docs/rollout.md): fixed-size device buffers, sampling on the device, a
    CUDA graph per batch bucket on a GPU. None: on for CUDA devices (where an eager step is host-bound),
    off on CPU (where the packed pass, one forward for decode, prefill and drafts together, is faster)."""
    cuda_graphs: bool = True
    """With the static step on CUDA, capture each bucket's step as a CUDA graph and replay it; false runs the
    same step eagerly (slower; for debugging)."""
    prefill_tokens: int = Field(8192, ge=16)
    """Most tokens (prompts padded to a power of two) one captured prefill pass of the static step holds; a
    step's admissions are split into as few passes as fit."""
    lora_mode: Literal["merged", "unmerged"] = "merged"
    """How a LoRA run's adapter versions are served (`model.lora`): `merged` writes W0 + scale * B @ A into
    each target weight (no cost per step; keeps a copy of the targets' base weights), `unmerged` adds the
    adapter's output beside each target (no copy; two thin matmuls per target per step)."""


class VllmEngineConfig(Model):
    """vLLM engine (extra `gpu`)."""

    kind: Literal["vllm"] = "vllm"
    """Engine kind."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """Share of GPU memory vLLM may take."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one vLLM engine spans."""
    max_num_seqs: int = Field(256, ge=1)
    """Sequences vLLM decodes together."""
    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    """Dtype vLLM runs in."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower, starts faster)."""
    devices: list[str] = Field(default_factory=list)
    """One engine (a supervised worker process) per entry; each entry is the `CUDA_VISIBLE_DEVICES` of
    that engine (`"0"`, or `"0,1"` with tensor_parallel_size 2). Empty: one engine on every visible GPU."""


EngineConfig = Annotated[TorchEngineConfig | VllmEngineConfig, Field(discriminator="kind")]
