"""The PyTorch/transformers engine: continuous batching over a slot-addressed KV cache, CPU or CUDA.

Each `step()` runs ONE forward pass (`_kv.py`, `_slots.py`): one new token for every running
sample, plus the prompt (and any completion a previous worker handed over) of the samples admitted
into free slots, packed into one row. One token is sampled per slot (`fleetrl.rollout.sampling`),
the finish rules are applied to the whole batch at once, and a finished sample's slot is free for
the next admission (its cache columns are simply overwritten).

On a GPU the packed pass is host-bound (each step's ~1,000 eager ops cost more than its kernels), so
there the engine runs the static step instead (`_static.py`): decode, prefill and draft verification
as functions of fixed-size device buffers, sampling included, each captured once per bucket as a
CUDA graph and replayed. The bookkeeping after a step (appending tokens, finish rules, the slot
table: `SlotTable.book`) is the same for both. Which models the engine can run, and how they are cast
and indexed for weight loads, is `_model.py`'s.

Weights come from the hub's materialized tensors (Hugging Face names, tied weights once) via
`stage_weights`, cast into the engine's dtype, and are copied into the parameters' own storage (a
captured graph stays valid); a version's sparse changes (`stage_changes`) are scattered into it on the
device. The model itself is built from `ModelConfig` (a tiny Qwen2 from config, or any local Hugging
Face checkpoint). A LoRA run's adapter versions come via `stage_adapter` and are served merged into
the weights (in their storage: graphs stay valid) or beside them (`adapters.py`, `engine.lora_mode`).
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fleetrl.config import EngineEmulation, SpeculativeConfig
from fleetrl.log import get_logger
from fleetrl.rollout._graphs import GraphMode
from fleetrl.rollout._kv import slot_pass
from fleetrl.rollout._model import PLAIN, cast_model, check_attention, model_eos_ids, param_index, plain_decoder
from fleetrl.rollout._slots import Finished, SlotTable
from fleetrl.rollout._static import POSITION_ONLY_ROPE, StaticStep
from fleetrl.rollout._upload import ChangeUploader
from fleetrl.rollout.adapters import AdapterServer, LoraWeights, adapter_server
from fleetrl.rollout.engine import Engine, SeqState, TensorChanges
from fleetrl.rollout.errors import EngineError
from fleetrl.rollout.history import ResponseHistory, ResponseInbox, prompt_key
from fleetrl.rollout.sampling import hashed_uniforms, sample_tokens
from fleetrl.rollout.speculative import Speculator

log = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchEngine(Engine):
    """Continuous-batching engine over a transformers causal LM."""

    accepts_changes = True

    def __init__(
        self, model: Any, *, max_batch: int = 32, device: str = "cpu", dtype: str = "float32",
        eos_ids: list[int] | None = None, pad_id: int | None = None, version: int = 0,
        refill_fraction: float = 0.125, emulate: EngineEmulation | None = None,
        speculative: SpeculativeConfig | None = None, length_aware: bool = True,
        static: bool | None = None, graphs: GraphMode | None = None, prefill_tokens: int = 8192,
        lora_mode: str = "merged",
    ) -> None:
        cfg = model.config
        eos = eos_ids if eos_ids is not None else model_eos_ids(model)
        if not eos:
            raise EngineError("model config names no eos_token_id and none was given")
        super().__init__(eos_ids=eos, max_context=int(getattr(cfg, "max_position_embeddings", 1 << 30)),
                         version=version, emulate=emulate)
        if dtype not in _DTYPES:
            raise EngineError(f"unknown engine dtype {dtype!r}; known: {sorted(_DTYPES)}")
        check_attention(model)
        self.device = torch.device(device)
        self.model = cast_model(model, self.device, _DTYPES[dtype]).eval()
        self.max_batch = max_batch
        # Admitting adds its prompts to the step's pass; waiting for a few free slots saves little now.
        self.refill_min = max(1, int(max_batch * refill_fraction))
        self.pad_id = int(pad_id if pad_id is not None else (cfg.pad_token_id or 0))
        self._params = param_index(self.model)
        self._uploader = ChangeUploader(self.device)
        self._keep_arg = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._decoder = plain_decoder(self.model)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._waiting: deque[SeqState] = deque()
        self._eos_table = np.zeros(0, dtype=bool)
        self._vocab = int(self.model.get_output_embeddings().weight.shape[0])
        spec = speculative if speculative is not None else SpeculativeConfig()
        use_static = self._use_static(static)
        # The static step keeps the slot table's last tokens on the host: they go up with its other inputs.
        self._slots = SlotTable(max_batch, int(cfg.num_hidden_layers), self.max_context,
                                torch.device("cpu") if use_static else self.device)
        self._static = StaticStep(
            self.model, self._decoder, self._slots.cache, max_batch=max_batch,
            max_tokens=1 + (spec.max_draft_tokens if spec.enabled else 0),
            mode=graphs or ("cuda" if self.device.type == "cuda" else "eager"), prefill_tokens=prefill_tokens,
            pad_id=self.pad_id) if use_static else None
        """The static-shape step (`_static.py`), or None: the packed pass."""
        self.history = ResponseHistory(max_prompts=spec.history_prompts, max_responses=spec.history_responses,
                                       max_tokens=spec.history_tokens, max_ngram=spec.max_ngram,
                                       min_ngram=spec.min_ngram, min_acceptance=spec.min_acceptance,
                                       across_prompts=spec.across_prompts)
        """Earlier responses per prompt, region-local: drafts and length predictions (rollout/history.py)."""
        self.inbox = ResponseInbox(spec.history_tokens)
        """Answers of the region's other workers (`observe_responses`) not recorded yet."""
        self.observe_tokens_per_step = spec.region_history_tokens_per_step
        self.speculator = Speculator(self.history, spec.max_draft_tokens) if spec.enabled else None
        self.length_aware = length_aware
        """Admit the waiting samples with the longest predicted completion first (else arrival order)."""
        self.lora_mode = lora_mode
        self._adapters: AdapterServer | None = None
        """Serves a LoRA run's adapter versions, once one came (rollout/adapters.py)."""

    @classmethod
    def from_config(cls, model_config: Any, engine_config: Any, version: int = 0,
                    length_aware: bool = True) -> TorchEngine:
        """Build the model of `ModelConfig` and wrap it per `TorchEngineConfig`."""
        torch.set_num_threads(engine_config.threads)
        graphs: GraphMode | None = None if engine_config.cuda_graphs else "eager"
        return cls(model_config.build(), max_batch=engine_config.max_batch, device=engine_config.device,
                   dtype=engine_config.dtype, version=version, refill_fraction=engine_config.refill_fraction,
                   emulate=engine_config.emulate, speculative=engine_config.speculative,
                   length_aware=length_aware, static=engine_config.static_step, graphs=graphs,
                   prefill_tokens=engine_config.prefill_tokens, lora_mode=engine_config.lora_mode)

    def _use_static(self, static: bool | None) -> bool:
        """Whether to run the static step: as asked, else on CUDA wherever the model allows it."""
        why = None
        if self._decoder is None:
            why = f"{type(self.model).__name__} is not one of the plain decoders {sorted(PLAIN)}"
        elif getattr(self._decoder.rotary_emb, "rope_type", "default") not in POSITION_ONLY_ROPE:
            why = f"its RoPE type {self._decoder.rotary_emb.rope_type!r} depends on more than the position"
        if static is None:
            if why is not None and self.device.type == "cuda":
                log.warning("engine.static_step_off", reason=why)
            return why is None and self.device.type == "cuda"
        if static and why is not None:
            raise EngineError(f"engine.static_step is on but the model cannot run it: {why}")
        return static

    # -- the region's answers (rollout/region_history.py) ---------------------------------------

    def observe_responses(self, prompt_ids: Sequence[int], completions: Sequence[Sequence[int]]) -> None:
        """Queue another worker's answers for the history (any thread; kept as given, not copied: the
        caller hands them over). Only the prompt's last `history_responses` could stay in the history,
        so only those are queued."""
        keep = [c for c in completions if len(c)][-self.history.max_responses:]
        for completion in keep:
            self.responses_dropped += self.inbox.put(prompt_ids, completion)

    @property
    def observed_waiting(self) -> int:
        return len(self.inbox)

    def record_observed(self) -> int:
        """Record the oldest waiting answers, up to `region_history_tokens_per_step` tokens (at least one)."""
        taken = self.inbox.take(self.observe_tokens_per_step)
        for prompt, completion in taken:
            self.history.record(prompt, completion)
        self.responses_observed += len(taken)
        return len(taken)

    # -- scheduler ------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._slots.running or self._waiting)

    def running(self) -> int:
        """Samples decoding now."""
        return self._slots.running

    def _enqueue(self, seqs: list[SeqState]) -> None:
        keys: dict[int, bytes] = {}  # a group's samples share one prompt list
        for seq in seqs:
            key = keys.get(id(seq.prompt_ids))
            if key is None:
                key = keys[id(seq.prompt_ids)] = prompt_key(seq.prompt_ids)
            seq.history_key = key
        self._waiting.extend(seqs)

    def _withdraw(self, seqs: list[SeqState]) -> None:
        gone = {id(s) for s in seqs}
        self._waiting = deque(s for s in self._waiting if id(s) not in gone)
        self._slots.free([b for b, s in enumerate(self._slots.seqs) if s is not None and id(s) in gone])

    def _drafts(self) -> list[tuple[int, list[int]]]:
        """Drafts for the running slots only (an admitted sample's pass is its prefill); each fits the
        tokens its slot may still take after this step's own one."""
        slots = self._slots
        if self.speculator is None or not slots.running:
            return []
        return self.speculator.drafts(slots.seqs[: slots.n], slots.limit[: slots.n] - slots.count[: slots.n] - 1)

    @torch.inference_mode()
    def _decode_step(self) -> None:
        if self._static is not None:
            self._static_step(self._static)
            return
        slots = self._slots
        admitted = self._admissions()
        drafts = self._drafts()
        rows = slots.free_slots(len(admitted))
        plan, input_ids, keep = slots.plan([(b, s.prompt_ids + s.tokens) for b, s in zip(rows, admitted, strict=True)],
                                           drafts)
        n_before = slots.n
        try:
            with slot_pass(self.model, slots.cache, plan):
                logits = self._forward(input_ids[None], plan.write_col[None], keep)
        except BaseException:
            # Nothing advanced (a retried step rewrites the same columns); the admitted wait again.
            self._waiting.extendleft(reversed(admitted))
            raise
        # Record some of the region's answers here: on an accelerator the pass's kernels may still be
        # running (the sampling below waits for them), so this host work can overlap them.
        self.record_observed()
        verify = logits[n_before + len(admitted):]  # one row per drafted token, after the slots' rows
        logits = logits[: n_before + len(admitted)]
        if admitted:
            slots.admit(rows, admitted)
            # Packed order (decode rows 0..n-1, then one row per admitted sample) -> slot order.
            order = np.zeros(slots.n, dtype=np.int64)
            order[:n_before] = np.arange(n_before)
            order[rows] = np.arange(n_before, n_before + len(rows))
            logits = logits.index_select(0, torch.from_numpy(order).to(self.device))
        if drafts:
            self._sample_verified(logits, verify, drafts)
        else:
            self._sample(logits)

    def _static_step(self, static: StaticStep) -> None:
        """One step through the static step: the same admissions, drafts and bookkeeping as the packed
        pass, the tokens drawn on the device."""
        slots = self._slots
        admitted = self._admissions()
        drafts = self._drafts()
        rows = slots.free_slots(len(admitted))
        n_before = slots.n
        try:
            dec, pre = static.step(slots.decode_rows(drafts, self.pad_id) if n_before else None,
                                   slots.prefill_rows(rows, admitted) if admitted else None,
                                   overlap=self.record_observed)
        except BaseException:
            self._waiting.extendleft(reversed(admitted))  # nothing advanced, as in the packed pass
            raise
        if admitted:
            slots.admit(rows, admitted)
        # Each slot's next token: its decode row's first, or an admitted sample's prefill token.
        tokens, logprobs = np.zeros(slots.n, dtype=np.int64), np.zeros(slots.n, dtype=np.float32)
        if dec is not None:
            tokens[:n_before], logprobs[:n_before] = dec[0][:, 0], dec[1][:, 0]
        if pre is not None:
            tokens[rows], logprobs[rows] = pre
        if not drafts:
            self._book(tokens, logprobs.tolist(), torch.from_numpy(tokens))
            return
        assert dec is not None
        # `_book_verified`'s layout: one row per slot, then each draft's rows in the order of `drafts`.
        toks = np.concatenate([tokens, *(dec[0][b, 1:1 + len(d)] for b, d in drafts)])
        lps = np.concatenate([logprobs, *(dec[1][b, 1:1 + len(d)] for b, d in drafts)])
        self._book_verified(toks.tolist(), lps.tolist(), drafts)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """Logits [len(keep), vocab] of the packed row's tokens `keep` (None: all of them)."""
        cache = self._slots.cache
        inner = self._decoder
        if inner is None:
            extra = {"logits_to_keep": keep} if self._keep_arg and keep is not None else {}
            out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache,
                             use_cache=True, **extra)
            return out.logits[0] if self._keep_arg or keep is None else out.logits[0, keep]
        # What `Qwen2Model.forward` and `Qwen2ForCausalLM.forward` compute, minus their per-call
        # wrappers (output capture, config defaults, mask building): ~0.1 ms of a ~0.8 ms step on
        # the tiny model. Only for architectures whose forward is exactly this (`_model.plain_decoder`).
        hidden = inner.embed_tokens(input_ids)
        rotary = self._rotary(inner.rotary_emb, hidden, position_ids)
        for layer in inner.layers:
            hidden = layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=position_ids,
                           past_key_values=cache, use_cache=True)
        hidden = hidden[0] if keep is None else hidden[0].index_select(0, keep)  # norm and head are per token
        return self.model.lm_head(inner.norm(hidden))

    def _rotary(self, rope: Any, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the positions: rows of a table, for plain RoPE (elementwise in the position,
        so bitwise what `rope` computes; ~10 ops a step fewer). Other RoPE types call `rope`."""
        if getattr(rope, "rope_type", None) != "default":
            return rope(hidden, position_ids)
        need = self._slots.cache.capacity
        if self._rope_table is None or self._rope_table[0].shape[1] < need or self._rope_table[0].dtype != hidden.dtype:
            self._rope_table = rope(hidden, torch.arange(need, device=hidden.device)[None])
        cos, sin = self._rope_table
        return cos[:, position_ids[0]], sin[:, position_ids[0]]

    def _admissions(self) -> list[SeqState]:
        """Waiting samples to admit now: once enough slots are free, or all that wait fit, or none runs."""
        wanted = min(self.max_batch - self._slots.running, len(self._waiting))
        if not wanted or not (wanted >= self.refill_min or wanted == len(self._waiting) or not self._slots.running):
            return []
        if not self.length_aware or wanted == len(self._waiting):
            return [self._waiting.popleft() for _ in range(wanted)]
        # Longest predicted remaining completion first (ties: arrival order), so that a step's long
        # samples do not start last and hold the step's tail alone.
        remaining = [self._predicted_remaining(s) for s in self._waiting]
        chosen = set(sorted(range(len(remaining)), key=lambda i: -remaining[i])[:wanted])
        picked = [s for i, s in enumerate(self._waiting) if i in chosen]
        self._waiting = deque(s for i, s in enumerate(self._waiting) if i not in chosen)
        return picked

    def _predicted_remaining(self, seq: SeqState) -> float:
        """Tokens the sample is predicted to still take (its prompt's history, else the default)."""
        budget = seq.sampling.max_new_tokens
        key = seq.history_key
        predicted = budget if key is None else self.history.predicted_length(key, default=budget)
        return min(predicted, budget) - len(seq.tokens)

    def _sample(self, logits: torch.Tensor) -> None:
        s = self._slots
        n = s.n
        dev = self.device
        u = torch.from_numpy(hashed_uniforms(s.keys[:n], s.count[:n])).to(dev)
        temp, top_p = torch.from_numpy(s.temp[:n]).to(dev), torch.from_numpy(s.top_p[:n]).to(dev)
        tokens, logprobs = sample_tokens(logits, temp, top_p, u)
        self._book(tokens.cpu().numpy(), logprobs.tolist(), tokens)

    def _book(self, tok_np: np.ndarray, lps: list[float], last: torch.Tensor) -> None:
        """Record one token per running slot (`tok_np`, `lps` indexed by slot; `last` the same tokens as
        the slot table keeps them) and finish the samples that are done (`SlotTable.book`)."""
        self._finished(*self._slots.book(tok_np, lps, last, self._version, self._is_eos()))

    def _sample_verified(self, logits: torch.Tensor, verify: torch.Tensor, drafts: list[tuple[int, list[int]]]) -> None:
        """`_sample` for a step that verified drafts (`fleetrl.rollout.speculative`): `logits` one row per
        slot (the position after its last token), `verify` one row per drafted token (the position after
        it), in the order of `drafts`. Each slot emits its accepted drafts and one token more."""
        s = self._slots
        n = s.n
        dev = self.device
        k = [len(d) for _, d in drafts]
        row_slot = np.concatenate([np.arange(n), np.repeat([b for b, _ in drafts], k)])
        row_offset = np.concatenate([np.zeros(n, dtype=np.int64), *(np.arange(1, m + 1) for m in k)])
        # Each row's token is drawn exactly as plain decoding draws the token at its position.
        u = torch.from_numpy(hashed_uniforms(s.keys[row_slot], s.count[row_slot] + row_offset)).to(dev)
        temp = torch.from_numpy(s.temp[row_slot]).to(dev)
        top_p = torch.from_numpy(s.top_p[row_slot]).to(dev)
        tokens, logprobs = sample_tokens(torch.cat([logits, verify]), temp, top_p, u)
        self._book_verified(tokens.cpu().numpy().tolist(), logprobs.tolist(), drafts)

    def _book_verified(self, toks: list[int], lps: list[float], drafts: list[tuple[int, list[int]]]) -> None:
        """`_book` for a step that verified drafts: `toks`/`lps` one row per slot, then one per drafted
        token in the order of `drafts`. Each slot emits its accepted drafts and one token more."""
        s, spec = self._slots, self.speculator
        assert spec is not None
        emitted = spec.accept(s.seqs, s.n, toks, lps, drafts, self._version)
        self._finished(*s.book_verified(toks, lps, emitted, self._version, self._is_eos()))

    def _finished(self, taken: int, finished: Finished) -> None:
        self.tokens_sampled += taken
        for seq, eos in finished:
            self._finish(seq, eos)

    def _finish(self, seq: SeqState, eos: bool) -> None:
        """`seq` is complete: set its reason, and keep its response in the history."""
        emulated_stop = seq.stop_at is not None and len(seq.tokens) >= seq.stop_at
        seq.finish_reason = "stop" if eos or emulated_stop else "length"
        self._touched.add(seq.group_id)
        self.history.record(seq.prompt_ids, seq.tokens)

    def _is_eos(self) -> np.ndarray:
        """A lookup table token id -> is EOS (np.isin costs ~10 us a step)."""
        vocab = self._vocab
        if self._eos_table.shape[0] != vocab:
            self._eos_table = np.zeros(vocab, dtype=bool)
            self._eos_table[[e for e in self.eos_ids if 0 <= e < vocab]] = True
        return self._eos_table

    # -- weights --------------------------------------------------------------------------------

    @torch.inference_mode()
    def _load_weights(self, tensors: Mapping[str, Any]) -> None:
        covered: set[int] = set()
        for name, tensor in tensors.items():
            param = self._params.get(name)
            if param is None:
                raise EngineError(f"tensor {name!r} is not a parameter or buffer of the engine's model")
            if tuple(param.shape) != tuple(tensor.shape):
                raise EngineError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"the model expects {tuple(param.shape)}")
            param.copy_(tensor)
            covered.add(id(param))
        missing = [n for n, p in self.model.named_parameters() if id(p) not in covered]
        if missing:
            raise EngineError(f"weights are missing {len(missing)} parameter(s), first {missing[0]!r}")
        log.debug("engine.weights_loaded", tensors=len(tensors))

    @torch.inference_mode()
    def _load_changes(self, changes: Mapping[str, TensorChanges]) -> None:
        """Scatter each tensor's changed elements into its parameter on the engine's device: only the
        positions and values cross to the device, not the tensors (tied names written once)."""
        written: dict[int, tuple[torch.Tensor, Any, torch.Tensor]] = {}
        for name, change in changes.items():
            param = self._params.get(name)
            if param is None:
                raise EngineError(f"tensor {name!r} is not a parameter or buffer of the engine's model")
            if id(param) in written:
                continue
            flat = param.view(-1)
            pos = change.positions
            if len(pos) != len(change.values) or (len(pos) and not 0 <= int(pos[0]) <= int(pos[-1]) < flat.numel()):
                raise EngineError(f"changes of tensor {name!r} do not fit its {flat.numel()} elements")
            written[id(param)] = (flat, pos, change.values)
        self._uploader.scatter(list(written.values()))  # one packed copy to the device (rollout/_upload.py)
        log.debug("engine.changes_loaded", tensors=len(written),
                  elements=sum(len(c.positions) for c in changes.values()))

    def _load_adapter(self, adapter: LoraWeights | None) -> None:
        if self._adapters is None:
            if adapter is None:
                return
            self._adapters = adapter_server(self.model, self.lora_mode)
        before = _hooked(self._adapters)
        self._adapters.apply(adapter)
        if self._static is not None and _hooked(self._adapters) != before:
            # Unmerged adapters added or removed forward hooks (or new buffers), which a graph captured before
            # did not record; a version on the same targets writes the buffers in place (merged ones write
            # the weights): the graphs stay valid then.
            self._static.graphs.clear()
        log.debug("engine.adapter_loaded", version=None if adapter is None else adapter.version, mode=self.lora_mode)


def _hooked(server: AdapterServer) -> list[tuple[str, int]]:
    """What a captured graph of the model depends on besides its weights: unmerged adapters' hooked
    modules and their buffers (merged adapters live in the weights' own storage)."""
    buffers = getattr(server, "_buffers", {})
    return sorted((name, id(a)) for name, (a, _b) in buffers.items())
