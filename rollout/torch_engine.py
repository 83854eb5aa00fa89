"""The PyTorch/transformers engine: continuous batching with a shared KV cache, CPU or CUDA.

Each `step()` runs at most two forward passes: one decode pass over every running sample (one new
token each, against the shared left-padded `DynamicCache`), and one prefill pass over the samples
admitted into free slots (prompt plus any completion a previous worker handed over). The two
batches are merged, one token is sampled per row (`fleetrl.rollout.sampling`), and finished rows
leave the cache at once, so the next step refills their slots.

Weights come from the hub's materialized tensors (Hugging Face names, tied weights once) via
`stage_weights`, cast into the engine's dtype; the model itself is built from `ModelConfig`
(a tiny Qwen2 from config, or any local Hugging Face checkpoint).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fleetrl.log import get_logger
from fleetrl.rollout import _kv
from fleetrl.rollout.engine import Engine, SeqState
from fleetrl.rollout.errors import EngineError
from fleetrl.rollout.sampling import sample_tokens, uniforms

log = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchEngine(Engine):
    """Continuous-batching engine over a transformers causal LM."""

    def __init__(
        self, model: Any, *, max_batch: int = 32, device: str = "cpu", dtype: str = "float32",
        eos_ids: list[int] | None = None, pad_id: int | None = None, version: int = 0,
        refill_fraction: float = 0.125,
    ) -> None:
        cfg = model.config
        eos = eos_ids if eos_ids is not None else _as_list(cfg.eos_token_id)
        if not eos:
            raise EngineError("model config names no eos_token_id and none was given")
        super().__init__(eos_ids=eos, max_context=int(getattr(cfg, "max_position_embeddings", 1 << 30)),
                         version=version)
        if dtype not in _DTYPES:
            raise EngineError(f"unknown engine dtype {dtype!r}; known: {sorted(_DTYPES)}")
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=_DTYPES[dtype]).eval()
        self.max_batch = max_batch
        # Admitting costs one prefill pass whatever its size: wait until a few slots are free.
        self.refill_min = max(1, int(max_batch * refill_fraction))
        self.pad_id = int(pad_id if pad_id is not None else (cfg.pad_token_id or 0))
        self._params = _param_index(self.model)
        self._waiting: deque[SeqState] = deque()
        self._rows: list[SeqState] = []
        self._cache: Any = None
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self._last = torch.zeros(0, dtype=torch.long, device=self.device)
        self._temp = torch.zeros(0, device=self.device)
        self._top_p = torch.zeros(0, device=self.device)
        self._keys = np.zeros(0, dtype=np.uint64)

    @classmethod
    def from_config(cls, model_config: Any, engine_config: Any, version: int = 0) -> TorchEngine:
        """Build the model of `ModelConfig` and wrap it per `TorchEngineConfig`."""
        torch.set_num_threads(engine_config.threads)
        return cls(model_config.build(), max_batch=engine_config.max_batch, device=engine_config.device,
                   dtype=engine_config.dtype, version=version, refill_fraction=engine_config.refill_fraction)

    # -- scheduler ------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._rows or self._waiting)

    def running(self) -> int:
        """Samples decoding now (finished rows awaiting removal excluded)."""
        return sum(s.finish_reason is None for s in self._rows)

    def _enqueue(self, seqs: list[SeqState]) -> None:
        self._waiting.extend(seqs)

    def _withdraw(self, seqs: list[SeqState]) -> None:
        gone = {id(s) for s in seqs}
        self._waiting = deque(s for s in self._waiting if id(s) not in gone)
        keep = [i for i, s in enumerate(self._rows) if id(s) not in gone]
        if len(keep) != len(self._rows):
            self._keep_rows(keep)

    @torch.inference_mode()
    def _decode_step(self) -> None:
        logits = []
        if self._rows:
            logits.append(self._decode())
        free = self.max_batch - len(self._rows)
        if self._waiting and (free >= self.refill_min or (free > 0 and not self._rows)):
            admitted = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            logits.append(self._prefill(admitted))
        self._sample(torch.cat(logits))

    def _decode(self) -> torch.Tensor:
        ones = torch.ones(len(self._rows), 1, dtype=torch.long, device=self.device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        out = self.model(input_ids=self._last[:, None], attention_mask=self._mask, position_ids=self._pos[:, None],
                         past_key_values=self._cache, use_cache=True)
        self._pos = self._pos + 1
        return out.logits[:, -1]

    def _prefill(self, seqs: list[SeqState]) -> torch.Tensor:
        """Forward the admitted samples' prompt + completion so far; merge them into the batch."""
        inputs = [s.prompt_ids + s.tokens for s in seqs]
        length = max(len(x) for x in inputs)
        ids = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), length, dtype=torch.long)
        for i, x in enumerate(inputs):
            ids[i, length - len(x):] = torch.tensor(x, dtype=torch.long)
            mask[i, length - len(x):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = _kv.new_cache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        last_pos = mask.sum(dim=1)  # position of each admitted sample's next token
        temp = torch.tensor([s.sampling.temperature for s in seqs], device=self.device)
        top_p = torch.tensor([s.sampling.top_p for s in seqs], device=self.device)
        keys = np.array([s.key for s in seqs], dtype=np.uint64)
        if self._rows:
            self._cache, self._mask = _kv.concat(self._cache, self._mask, cache, mask)
            self._pos = torch.cat([self._pos, last_pos])
            self._temp, self._top_p = torch.cat([self._temp, temp]), torch.cat([self._top_p, top_p])
            self._keys = np.concatenate([self._keys, keys])
        else:
            self._cache, self._mask, self._pos = cache, mask, last_pos
            self._temp, self._top_p, self._keys = temp, top_p, keys
        self._rows.extend(seqs)
        return out.logits[:, -1]

    def _sample(self, logits: torch.Tensor) -> None:
        rows = self._rows
        u = torch.from_numpy(uniforms(self._keys, [s.position for s in rows])).to(self.device)
        tokens, logprobs = sample_tokens(logits, self._temp, self._top_p, u)
        self._last = tokens
        for seq, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            if seq.finish_reason is None:
                self._append(seq, tok, lp)
        # Finished rows stay (decoding into the void) until enough of them make a refill worth it:
        # dropping rows copies the whole cache, so it is done once per refill, not once per finish.
        dead = sum(s.finish_reason is not None for s in rows)
        if dead and (dead >= self.refill_min or not self._waiting or dead == len(rows)):
            self._keep_rows([i for i, s in enumerate(rows) if s.finish_reason is None])

    def _keep_rows(self, keep: list[int]) -> None:
        if not keep:
            self._rows, self._cache = [], None
            self._mask = self._mask[:0, :0]
            self._pos, self._last = self._pos[:0], self._last[:0]
            self._temp, self._top_p, self._keys = self._temp[:0], self._top_p[:0], self._keys[:0]
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._cache, self._mask = _kv.select(self._cache, self._mask, idx)
        self._pos, self._last = self._pos[idx], self._last[idx]
        self._temp, self._top_p, self._keys = self._temp[idx], self._top_p[idx], self._keys[keep]
        self._rows = [self._rows[i] for i in keep]

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


def _param_index(model: Any) -> dict[str, torch.Tensor]:
    """Every state-dict name (tied aliases included) mapped to the live tensor it loads into."""
    live = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    return {name: live[name] for name in model.state_dict() if name in live}


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]
