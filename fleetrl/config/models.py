"""The pydantic models of `fleet.yaml` (DESIGN.md §7).

Every field is documented right under it and defaulted where a default is sensible; the README's
configuration reference is generated from these models (`fleetrl config reference`) and a test
checks that it is current. Models forbid unknown keys so that a typo names itself.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from fleetrl.config.base import MIB, NAME_RE, Model, ReferenceProblem
from fleetrl.config.preemption import NoPreemptionConfig, PreemptionConfig
from fleetrl.config.pricing import Capacity, NodePoolConfig, PlacementConfig, PriceConfig
from fleetrl.config.transport import (
    HubConfig,
    KafkaClusterConfig,
    KafkaConfig,
    MqttConfig,
    SigningConfig,
    StoreConfig,
    TopicPartitions,
)

__all__ = [
    "MIB", "NAME_RE", "HubConfig", "KafkaClusterConfig", "KafkaConfig", "Model", "MqttConfig",
    "ReferenceProblem", "SigningConfig", "StoreConfig", "TopicPartitions",
]


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

        return build_model(self)


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
    def _sync_is_on_policy(self) -> AlgorithmConfig:
        if self.mode == "sync" and self.max_staleness != 0:
            if "max_staleness" in self.model_fields_set:
                raise ValueError(f"max_staleness is {self.max_staleness} but mode is sync, which trains on-policy: "
                                 f"set max_staleness to 0 or leave it out")
            self.max_staleness = 0
        return self


class DatasetColumns(Model):
    """Which column of a dataset row is what. The defaults read TRL's formats with no mapping: a `prompt`
    column of text, or of messages (`[{role, content}]`, TRL's conversational form)."""

    prompt: str = "prompt"
    """Column of the prompt: text, or a list of chat messages."""
    messages: str | None = None
    """Column of chat messages to use instead of `prompt` (a `messages` layout); None: not used."""
    reference: str | None = None
    """Column sent as the record's `reference` (what a built-in task's reward compares against)."""
    task: str = "task"
    """Column naming a row's task, where present (else `dataset.task`)."""


class EnvConfig(Model):
    """The environment that runs each sample as an episode (multi-turn, tools): a skyrl-gym text environment
    (`skyrl_gym.envs.BaseTextEnv`), written for SkyRL and run unchanged (DESIGN.md §11)."""

    name: str = Field(min_length=1)
    """A skyrl-gym registered id (`gsm8k`, `gsm8k_multi_turn`, or one your module registers), or
    `package.module:Class` (a `BaseTextEnv` subclass or a factory) imported from `python_path`, then the
    Python path. Built per episode as SkyRL does: `Class(env_config=config, extras=row)`, where `row` is
    the dataset row's other columns plus `reward_spec: {ground_truth: reference}` when the row has none."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The environment's `env_config` (its own arguments)."""
    python_path: list[str] = Field(default_factory=list)
    """Folders (relative to the config file) searched first when importing `name`."""
    max_turns: int = Field(8, ge=1)
    """Model turns per episode at most; past it the episode ends (finish reason `length`)."""
    max_episode_tokens: int | None = Field(None, ge=1)
    """Tokens of one episode after the prompt (model and environment turns together). None:
    `algorithm.max_new_tokens`, which bounds a sample on the wire either way."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """Bound of one environment step (a tool call, an observation); past it the step counts as an error."""
    on_error: Literal["failure_reward", "dead_letter"] = "failure_reward"
    """What an environment error (an exception, a timeout, a malformed step) does: end the episode with
    `failure_reward` (the group goes on), or send the whole group to `dead-letter` with reason `env_error`."""
    failure_reward: float = 0.0
    """Reward of an episode that ended on an environment error (`on_error: failure_reward`)."""
    threads: int = Field(16, ge=1, le=1024)
    """Threads that run environment steps beside the engine; a hanging tool holds one until it returns."""


class DatasetConfig(Model):
    """Where prompts come from."""

    task: str = "reverse"
    """Name of a task in the rollout task registry (prompt generator + reward). With `dataset.path` and a
    custom reward (`reward.functions` / `reward.url`) it is only the label the records carry."""
    tasks: list[str] = Field(default_factory=list)
    """Extra task names records may carry; the schema refuses any other. `task` is always known."""
    path: str | None = None
    """A JSONL or Parquet file, or a folder written by `datasets.save_to_disk`, read with the `datasets`
    library (local files only); relative to the config file. None: the task's generator."""
    split: str = "train"
    """Split to read from a `save_to_disk` folder that holds several."""
    columns: DatasetColumns = Field(default_factory=DatasetColumns)
    """Column mapping (TRL's `prompt` layouts need none). Columns not mapped travel to reward functions."""
    system_prompt: str | None = None
    """Prepended as a `system` message to chat rows that have none (and turns text rows into chat rows)."""
    shuffle: bool = False
    """Shuffle the rows (each epoch with its own seed derived from `seed`)."""
    epochs: int = Field(1, ge=1)
    """Passes over the dataset file before the dispatcher runs out of prompts."""
    seed: int = 0
    """Seed of the task's prompt generator and of the shuffle."""
    num_prompts: int | None = Field(None, ge=1)
    """Stop dispatching after this many groups. None: as many as training needs."""
    max_prompt_tokens: int = Field(2048, ge=1)
    """Longest prompt (in tokens, after the chat template) a record may carry; longer ones are dead-lettered."""
    env: EnvConfig | None = None
    """Run every sample as an episode in this environment (a row's `env_class` column overrides the name
    per record). None: single completions scored by the reward."""

    @property
    def known_tasks(self) -> frozenset[str]:
        return frozenset([self.task, *self.tasks])


class RewardFunctionConfig(Model):
    """A reward function by import path, with the signature of TRL GRPOTrainer's `reward_funcs`."""

    fn: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """`package.module:function`, `(prompts, completions, **columns) -> list[float]`, sync or `async def`;
    imported (from `reward.python_path`, then the Python path) when the config is checked."""
    weight: float = 1.0
    """Weight of this function in the sample's reward (a weighted sum, as TRL's `reward_weights`)."""
    signature: Literal["trl", "verl"] = "trl"
    """`trl`: TRL's `reward_funcs`, once per group. `verl`: verl's custom reward function,
    `(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float, ...}`, once per
    completion, with `ground_truth` from the row's `reward_model.ground_truth` (verl's parquet layout)."""


class RewardConfig(Model):
    """Custom rewards, scored in the rollout worker. Unset: the task's built-in reward."""

    functions: list[RewardFunctionConfig] = Field(default_factory=list)
    """Reward functions; a sample's reward is the weighted sum of theirs (a `None` counts as 0, as in TRL)."""
    url: str | None = Field(None, pattern=r"^https?://")
    """A remote reward endpoint: POST JSON `{prompts, completions, ...columns}` of one group, answer
    `{"rewards": [float, ...]}`; added to the functions' sum with `url_weight`."""
    url_weight: float = 1.0
    """Weight of the remote reward."""
    timeout_s: float = Field(30.0, gt=0)
    """Bound of one group's scoring by one function (one HTTP attempt for `url`); past it the group is
    dead-lettered with reason `reward_error`."""
    retries: int = Field(2, ge=0, le=10)
    """Extra attempts of a failed or timed-out HTTP request to `url`."""
    python_path: list[str] = Field(default_factory=lambda: ["."])
    """Folders (relative to the config file) searched first for the functions' modules."""

    @property
    def custom(self) -> bool:
        return bool(self.functions) or self.url is not None


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


class LearnerEmulation(Model):
    """Emulated training hardware for benchmarks on CPU (`bench/pipeline.py --profile production`):
    the real learner step, made as long as a larger model's on real GPUs would be, the way
    `EngineEmulation` slows the real engine's decoding. Off unless set; never needed in production."""

    step_delay_s: float = Field(0.0, ge=0, le=600)
    """Added to every optimizer step (fixed costs: the optimizer update, gathers)."""
    token_delay_s: float = Field(0.0, ge=0, le=1)
    """Added per trained token (forward and backward over each sample's tokens)."""


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


class NodeConfig(Model):
    """A rollout node of a region."""

    name: str = Field(pattern=NAME_RE)
    """Node name, unique within its region (the agent's `--node`)."""
    engine: EngineConfig | None = None
    """Overrides the region's engine for this node."""


class RolloutConfig(Model):
    """Rollout worker behaviour, the same in every region."""

    group_deadline_s: float = Field(600.0, gt=0)
    """A group still running past this is handed over as a partial (long-tail cut)."""
    handover_timeout_s: float = Field(20.0, gt=0)
    """On SIGTERM / preemption, the time allowed to publish partials and commit."""
    min_version_wait_s: float = Field(120.0, gt=0)
    """How long a worker waits for a prompt's `min_version` before handing it back."""
    max_groups_in_flight: int = Field(4, ge=1)
    """Groups a worker decodes concurrently (their samples share the engine's batch)."""
    group_session_timeout_s: float = Field(6.0, ge=1.0, le=300.0)
    """Session timeout of a worker's membership of its region's consumer group (heartbeats every quarter
    of it, at most every second): a worker silent this long is dropped and its partitions move. Kafka
    refuses less than its brokers' `group.min.session.timeout.ms` (6 s unless set). tansu, the embedded
    broker, holds every join for half of it, so in a region of preemptible nodes, whose group changes
    members every few seconds, a shorter one (2 s) makes each rebalance shorter (docs/rollout.md,
    "Rebalances")."""
    weight_fallback_poll_s: float = Field(120.0, gt=0)
    """Fallback only: how often a worker reads its region store's `latest` by itself. Workers pull a new
    version when the region's replica announcement (`fleetrl/<run>/replicas/<region>`, or the policy
    announcement where the region reads the home store) changes; this poll covers a silent control plane."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Port of the region agent's `/metrics` and `/healthz` (0 picks a free port; None disables)."""
    seed: int = 0
    """Base seed of sampling; a sample's randomness depends only on it, the group and position."""
    idle_poll_s: float = Field(0.5, gt=0)
    """How long an idle worker waits on Kafka per poll (a busy one only takes what is already there)."""
    stats_interval_s: float = Field(10.0, gt=0)
    """How often a worker logs `worker.stats` (groups and tokens done and in flight, tokens/s)."""
    length_aware: bool = True
    """Schedule by predicted completion length (the mean of a prompt's earlier completions): the torch
    engine admits the samples with the longest predicted completion first into free slots, and the
    trainer scales each region's latency by the group's predicted length when it places the group.
    False: arrival order, and placement as for groups of average length."""


class AgentConfig(Model):
    """How the region agent supervises its node's rollout workers (one child process per engine)."""

    progress_interval_s: float = Field(2.0, gt=0)
    """How often a worker reports its progress (engine steps, groups, version) to its agent."""
    hang_timeout_s: float = Field(120.0, gt=0)
    """A worker that reports nothing this long, or has work and takes no engine step this long, is hung:
    it is killed and restarted (its uncommitted groups go back to the region's consumer group)."""
    start_timeout_s: float = Field(600.0, gt=0)
    """Bound on a worker's start (engine build, first weights) before its first progress report."""
    restart_backoff_s: float = Field(1.0, gt=0)
    """First delay before restarting a crashed or hung worker; doubles on each quick failure."""
    restart_backoff_max_s: float = Field(60.0, gt=0)
    """Cap of the restart backoff."""
    crashloop_after: int = Field(3, ge=1)
    """Consecutive quick failures after which the engine is reported `crashloop` (it keeps being
    restarted at the capped backoff, and turns `up` again once a worker stays up)."""
    healthy_after_s: float = Field(60.0, gt=0)
    """A worker that ran this long before failing was healthy: its failure resets the backoff."""


class RegionConfig(Model):
    """One rollout region: an autonomous cell with its own Kafka and object store."""

    name: str = Field(pattern=NAME_RE)
    """Region name, used in topics, MQTT paths and store names ("home" is reserved)."""
    kafka: KafkaClusterConfig
    store: StoreConfig
    """The region's object store; its nodes read weights only from here."""
    link_costs: dict[str, float] = Field(default_factory=dict)
    """Cost of reading from another store (`home` or a region name); lower is nearer."""
    nodes: list[NodeConfig] = Field(default_factory=list)
    """The region's rollout nodes (agents start with `--node NAME`)."""
    engine: EngineConfig = Field(default_factory=TorchEngineConfig)
    """Default engine of the region's nodes."""
    weight: float = Field(1.0, gt=0)
    """Initial share of admission credits before throughput is measured."""
    emulate_link_delay_s: float = Field(0.0, ge=0, le=10)
    """Emulated one-way delay of the link between home and this region, for benchmarks and drills on
    one machine (`bench/pipeline.py`): the trainer holds each prompt this long before producing it to
    the region's cluster, and each trajectory this long after fetching it. 0 (the default): off."""
    preemption: PreemptionConfig = Field(default_factory=NoPreemptionConfig)
    """Where the region's nodes learn they are about to be preempted: `{source: none | file | aws | gcp |
    azure, ...}`. On a notice the agent hands its unfinished groups over, goes offline and exits 0 inside
    the notice window."""
    capacity: Capacity = "on_demand"
    """Capacity type of the region's nodes (`on_demand` or `spot`), unless `pools` places a node in another
    pool or an auto-scaled node's heartbeat says otherwise."""
    price: PriceConfig | None = None
    """US dollars per node-hour of the region's nodes (of `capacity`), or where to read it (`{source: file |
    aws, ...}`, docs/cost.md). None, with no `pools`: the region is not priced (its cost counts as 0)."""
    pools: list[NodePoolConfig] = Field(default_factory=list)
    """Node pools of the region, each with its capacity type and price (an on-demand base and spot nodes
    above it); instead of `price`."""
    transfer_usd_per_gb: float = Field(0.0, ge=0)
    """US dollars per GB of trajectories the region's link carries to home (the bytes of each record the
    trainer reads; prompts out are a few hundred bytes and not counted): the link's part of a group's
    price (0: not counted)."""

    @field_validator("name")
    @classmethod
    def _not_home(cls, name: str) -> str:
        if name == "home":
            raise ValueError('"home" is the name of the home store, not a region')
        return name

    @model_validator(mode="after")
    def _pools_apart(self) -> RegionConfig:
        kinds = [p.capacity for p in self.pools]
        for i, kind in enumerate(kinds):
            if kinds.index(kind) != i:
                raise ReferenceProblem(("pools", i, "capacity"), f"two pools of {kind} capacity: give one its price")
        if self.pools and self.price is not None:
            raise ReferenceProblem(("price",), "set either price (for the whole region) or pools, not both")
        listed = {n.name for n in self.nodes}
        for i, pool in enumerate(self.pools):
            unknown = sorted(set(pool.nodes) - listed)
            if unknown:
                raise ReferenceProblem(("pools", i, "nodes"), f"node(s) {unknown} are not in the region's nodes")
        return self

    def price_of(self, capacity: Capacity) -> PriceConfig | None:
        """The price of the region's `capacity` nodes (None: not priced)."""
        for pool in self.pools:
            if pool.capacity == capacity:
                return pool.price
        return self.price if capacity == self.capacity and not self.pools else None

    def node_capacity(self, node: str) -> Capacity:
        """The capacity type of a listed (or unlisted) node, from the config alone."""
        for pool in self.pools:
            if node in pool.nodes:
                return pool.capacity
        return self.capacity


class TrainerConfig(Model):
    """The central trainer."""

    device: str = "cpu"
    """Torch device of the learner (`cpu`, `cuda`, `cuda:1`)."""
    checkpoint_dir: str = "./.fleetrl/checkpoints"
    """Where checkpoints go (relative to the config file)."""
    checkpoint_every: int = Field(1, ge=1)
    """Steps between checkpoints; offsets are committed only after the checkpoint is durable."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk; older ones are deleted after a new one is durable."""
    ledger_detail_groups: int = Field(1024, ge=1)
    """Settled groups (trained, and stale) the checkpoint's ledger keeps row by row; older ones are
    folded into ranges of group indices, so checkpoints stay small over any run length."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus port of the trainer (0 picks a free port; None disables)."""
    silent_region_timeout_s: float = Field(300.0, gt=0)
    """A group dispatched to a region that stays silent this long is redispatched (new attempt). A region
    whose nodes are all draining, offline or without heartbeats for two `mqtt.heartbeat_interval_s` is
    handled sooner: its partials and groups move to another region (docs/trainer.md, handover)."""
    threads: int = Field(1, ge=1)
    """torch intra-op threads of the learner on CPU."""
    drain_timeout_s: float = Field(30.0, gt=0)
    """On SIGTERM, the time allowed to finish the step, checkpoint and commit."""
    start_timeout_s: float = Field(300.0, gt=0)
    """How long a starting trainer waits for its first region's Kafka when none answers (a partition, a
    broker restarting), retrying with backoff and logging `trainer.waiting_for_regions`, before it exits
    with a fatal error. One region is enough to start; the others join when they answer."""
    publish_in_background: bool = True
    """Encode, upload and announce each version while the next step trains (one publish in flight,
    versions in order); False publishes inline, between the step and the next."""
    throughput_window_s: float = Field(60.0, gt=0)
    """Window over which each region's throughput (arrivals, heartbeats) is measured for credits."""
    emulate: LearnerEmulation | None = None
    """Emulated training time for benchmarks on CPU (see `LearnerEmulation`)."""
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """How admitted groups are placed on regions (price-aware placement is off by default; docs/cost.md)."""


class FleetConfig(Model):
    """The whole run: one `fleet.yaml`."""

    run: str = Field(pattern=NAME_RE)
    """Run id: part of every topic, MQTT path and store key."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    hub: HubConfig = Field(default_factory=HubConfig)
    mqtt: MqttConfig = Field(default_factory=MqttConfig)
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    regions: list[RegionConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_references(self) -> FleetConfig:
        names = [r.name for r in self.regions]
        stores = {"home", *names}
        for i, region in enumerate(self.regions):
            if names.index(region.name) != i:
                raise ReferenceProblem(("regions", i, "name"), f"region {region.name!r} is defined twice")
            unknown = set(region.link_costs) - stores
            if unknown:
                raise ReferenceProblem(
                    ("regions", i, "link_costs"),
                    f"unknown store(s) {sorted(unknown)}; known: {sorted(stores)}",
                )
            nodes = [n.name for n in region.nodes]
            for j, node in enumerate(nodes):
                if nodes.index(node) != j:
                    raise ReferenceProblem(("regions", i, "nodes", j), f"node {node!r} is defined twice")
        return self

    def region(self, name: str) -> RegionConfig:
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(f"no region {name!r} in config; regions: {[r.name for r in self.regions]}")

    def stores(self) -> dict[str, StoreConfig]:
        """Every store by name: `home` and one per region."""
        return {"home": self.hub.home_store, **{r.name: r.store for r in self.regions}}
