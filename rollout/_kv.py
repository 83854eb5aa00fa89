"""Slot-addressed KV cache and attention for continuous batching over a transformers model.

The torch engine owns `max_batch` slots. Each layer's keys and values live in one preallocated
buffer `[max_batch + 1, kv_heads, capacity, head_dim]`: slot b holds one sample, its token at
position j in column j (no padding), and the extra last slot is scratch. Nothing is concatenated,
padded or compacted when samples come and go: a finished slot is simply reused, and the buffers
grow (doubling) only when a sample outgrows the capacity.

Each engine step is ONE forward pass over a packed row of tokens (`Pass`): first one token for
every slot below `n` (the decode rows: a running slot's last sampled token; a free slot decodes
into the void, writing to the scratch slot), then the prompt (+ completion so far) of every sample
admitted into a free slot this step (the prefill segments), then the drafted tokens of running
samples (`fleetrl.rollout.speculative`: segments that start one column after the slot's last
token). Every layer writes each token's key and value at its (slot, column) in place
(`SlotLayer.update`), then `slot_attention` attends:

* decode rows: one batched SDPA over the buffer views `[:n, :, :width]` (no copy), row b masked
  to its columns `0..pos[b]`;
* each prefill or draft segment: a causal SDPA over its own slot's first columns (a draft segment
  sees the slot's whole cache, its decode row's token written in this very pass included).

Columns past a slot's last accepted token may hold keys of rejected drafts: no mask ever reaches
them (a decode row attends up to its position), and the next tokens overwrite them.

So admitting samples costs no extra forward pass (the previous design ran a separate prefill
pass, then concatenated caches), and a decode step copies no cache. The engine switches the
model's attention implementation to `slot_attention` only for its own forward passes
(`slot_pass`), so the same model object keeps working elsewhere (e.g. `generate`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

ATTENTION = "fleetrl_slots"


@dataclass(slots=True)
class Prefill:
    """Segments of a pass, batched: A segments padded to the longest, L tokens. Segment a fills
    columns `first[a] ..` of its slot and attends causally to every column before (an admitted
    sample's prompt starts at column 0; a running sample's drafted tokens follow its last token)."""

    slots: torch.Tensor
    """[A] the slot of each segment."""
    length: int
    """L: the longest segment."""
    width: int
    """Key columns the segments attend to: the furthest segment's last column + 1."""
    query: torch.Tensor
    """[A * L] packed-row index of segment a's token i (padding repeats its last token)."""
    mask: torch.Tensor
    """[A, 1, L, width] bool: token i of segment a attends to columns 0 .. first[a] + i."""
    out: torch.Tensor
    """[sum of lengths] index into the flattened [A * L] outputs of each real token, in packed order."""

    @classmethod
    def build(cls, slots: list[int], starts: list[int], lengths: list[int], device: torch.device,
              first: list[int] | None = None) -> Prefill:
        # numpy, then one transfer each: a dozen tiny torch ops would cost ~40 us per admission.
        longest = max(lengths)
        i = np.arange(longest)
        start, length = np.asarray(starts)[:, None], np.asarray(lengths)[:, None]
        col0 = np.zeros_like(length) if first is None else np.asarray(first)[:, None]
        width = int((col0 + length).max())
        query = (start + np.minimum(i[None], length - 1)).ravel()
        real = i[None, :] < length  # [A, L]
        last_col = col0 + np.minimum(i[None], length - 1)  # [A, L]: padding attends as its last real token
        mask = np.arange(width)[None, None, :] <= last_col[:, :, None]  # [A, L, width]
        out = np.flatnonzero(real.ravel())

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        return cls(put(np.asarray(slots)), longest, width, put(query), put(mask[:, None]), put(out))


@dataclass(slots=True)
class Pass:
    """Addressing of one packed forward pass (see the module docstring)."""

    n: int
    """Decode rows: slots 0..n-1, the first n tokens of the packed row."""
    width: int
    """Columns the decode rows attend to (the longest running slot, its new token included)."""
    decode_mask: torch.Tensor | None
    """[n, 1, 1, width] bool: row b attends to columns 0..pos[b]."""
    write_slot: torch.Tensor
    """[R] slot each packed token writes its key/value to."""
    write_col: torch.Tensor
    """[R] column each packed token writes to."""
    prefill: Prefill | None = None
    """The samples admitted in this pass (their tokens follow the n decode rows)."""
    drafts: Prefill | None = None
    """Drafted tokens of running samples, verified in this pass (they follow the prefill tokens)."""


class OtherPass(Protocol):
    """A pass of another layout (`fleetrl.rollout._static`): it writes and attends itself."""

    width: int

    def write(self, layer: SlotLayer, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write this pass's keys and values into the layer's buffers."""

    def attend(self, layer: SlotLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """The attention output [*query's leading dims but heads, tokens, heads, dim]."""


AnyPass = Pass | OtherPass
_PASS: contextvars.ContextVar[tuple[SlotCache, AnyPass] | None] = contextvars.ContextVar("fleetrl_pass", default=None)


class SlotLayer(CacheLayerMixin):
    """One layer's buffers; the current `Pass` says where each new token goes."""

    is_sliding = False

    def __init__(self, owner: SlotCache) -> None:
        super().__init__()
        self._owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.allocate(key_states.shape[1], key_states.shape[3], key_states.dtype, key_states.device)

    def allocate(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """The buffers, zeroed (the static step allocates them before any capture)."""
        o = self._owner
        self.keys = torch.zeros(o.max_batch + 1, kv_heads, o.capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        p = self._owner.current
        if not isinstance(p, Pass):
            p.write(self, key_states, value_states)
            return key_states, value_states
        # [1, heads, R, dim] -> one (slot, column) per packed token, written in place.
        self.keys[p.write_slot, :, p.write_col] = key_states[0].transpose(0, 1)
        self.values[p.write_slot, :, p.write_col] = value_states[0].transpose(0, 1)
        return key_states, value_states  # slot_attention reads the buffers, not these

    def grow(self, capacity: int) -> None:
        if self.keys is None or self.values is None or self.keys.shape[2] >= capacity:
            return
        self.keys, self.values = _widened(self.keys, capacity), _widened(self.values, capacity)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.current.width, 0

    def get_seq_length(self) -> int:
        return self._owner.current.width

    def get_max_length(self) -> int:
        return -1


def _widened(t: torch.Tensor, capacity: int) -> torch.Tensor:
    out = t.new_zeros(t.shape[0], t.shape[1], capacity, t.shape[3])
    out[:, :, : t.shape[2]] = t
    return out


class SlotCache(Cache):
    """Per-slot KV buffers of every layer."""

    def __init__(self, num_layers: int, max_batch: int, capacity: int = 128) -> None:
        self.max_batch = max_batch
        self.capacity = capacity
        self._current: AnyPass | None = None
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])

    @property
    def current(self) -> AnyPass:
        if self._current is None:
            raise RuntimeError("the slot cache is used outside of a slot pass")
        return self._current

    def reserve(self, width: int) -> None:
        """Make room for `width` columns in every slot (doubling; rare)."""
        if width <= self.capacity:
            return
        while self.capacity < width:
            self.capacity *= 2
        for layer in self.layers:
            assert isinstance(layer, SlotLayer)
            layer.grow(self.capacity)


    def allocate(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate every layer's buffers now (zeroed), at the current capacity."""
        for layer in self.layers:
            assert isinstance(layer, SlotLayer)
            layer.allocate(kv_heads, head_dim, dtype, device)


@contextlib.contextmanager
def slot_pass(model: Any, cache: SlotCache, plan: AnyPass) -> Iterator[None]:
    """Run the model's attention through `slot_attention` for this pass only."""
    config = model.config
    previous = config._attn_implementation_internal
    cache._current = plan
    token = _PASS.set((cache, plan))
    # The internal attribute, as `set_attn_implementation` does: the property setter costs ~8 us.
    config._attn_implementation_internal = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation_internal = previous
        _PASS.reset(token)
        cache._current = None


def slot_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a packed slot pass: query [1, heads, R, dim] -> output [1, R, heads, dim]."""
    current = _PASS.get()
    if current is None:  # the model called outside an engine pass: plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    cache, p = current
    layer = cache.layers[module.layer_idx]  # type: ignore[index]
    assert isinstance(layer, SlotLayer)
    if not isinstance(p, Pass):
        return p.attend(layer, query, key, value, scaling), None
    keys, values = layer.keys, layer.values
    assert keys is not None and values is not None
    heads, dim, kv_heads = query.shape[1], query.shape[3], keys.shape[1]
    rep = heads // kv_heads
    outs = []
    if p.n:
        # One query per row: group the query heads by their key/value head (no repeat of the cache).
        q = query[0, :, : p.n].transpose(0, 1).reshape(p.n, kv_heads, rep, dim)
        o = F.scaled_dot_product_attention(q, keys[: p.n, :, : p.width], values[: p.n, :, : p.width],
                                           attn_mask=p.decode_mask, scale=scaling)
        outs.append(o.reshape(p.n, heads, -1))
    for f in (p.prefill, p.drafts):
        if f is None:
            continue
        # All segments in one SDPA: [A, heads, L, dim] against their slots' first `width` columns.
        q = query[0].index_select(1, f.query).view(heads, -1, f.length, dim).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, keys[f.slots, :, : f.width], values[f.slots, :, : f.width],
                                           attn_mask=f.mask, scale=scaling, enable_gqa=rep > 1)
        outs.append(o.transpose(1, 2).flatten(0, 1).index_select(0, f.out))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION, slot_attention)
