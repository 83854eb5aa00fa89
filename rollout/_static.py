"""The torch engine's static decode step: one function of fixed-size device buffers, captured per bucket.

On a GPU an eager decode step is ~94 % host time (issue 37: ~1,000 aten ops of 15-35 us each against
~5 ms of kernels at batch 64). Here the step is a function that reads everything from buffers made
once, at `max_batch` (token ids, positions, the slot each row writes to, sampling counters and keys,
temperatures, top-p) and writes the sampled tokens and their logprobs into an output buffer: the
model's layers, the sampling (`sampling.sample_tokens_fixed`, with the counter-based uniforms made on
the device, `sampling.device_uniforms`) and the KV writes all happen inside it. Its shapes are fixed
by a bucket key, and `_graphs.StepGraphs` captures it per key the first time the key is used and
replays it afterwards (on CPU it runs eagerly, or recorded in the suite):

* decode `(B, L, W, nucleus)`: slots 0..B-1 (B: the power of two at or above the highest running
  slot + 1), each with L tokens: its last sampled token, then up to L-1 drafted tokens to verify
  (`fleetrl.rollout.speculative`; L = 1 when nothing is drafted), at positions `pos[b] + i`.
  Attention reads the first W columns of each slot's buffer in place (W: a power of two at or above
  the furthest position + 1), so it costs what the longest live sequence holds, not the model's
  context. A free slot's row writes into the scratch slot.
* prefill `(A, L, nucleus)`: A admitted samples of up to L tokens each (their prompt and any completion
  handed over), written into columns 0..L-1 of their slots; attention is causal within each sample
  (nothing else is in its slot), and its last real token's logits give its first sampled token. The
  admissions of a step share as few passes as fit `prefill_tokens` tokens each.

The weights are never copied: a version switch writes into the same parameter storage, so the
captured graphs stay valid (`TorchEngine._load_weights`). When the cache must grow (a sample outgrows
the capacity) the buffers are replaced, and every graph is captured again as its key comes back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fleetrl.rollout._graphs import GraphMode, StepGraphs
from fleetrl.rollout._kv import SlotCache, SlotLayer, slot_pass
from fleetrl.rollout.errors import EngineError
from fleetrl.rollout.sampling import device_uniforms, sample_tokens_fixed

POSITION_ONLY_ROPE = {"default", "linear", "llama3", "yarn"}
"""RoPE types whose cos/sin are a function of the position alone (so a table of them is exact)."""
_MIN_WIDTH = 64


def bucket(n: int, cap: int, least: int = 1) -> int:
    """The power of two at or above `n` (at least `least`), at most `cap`."""
    b = max(least, 1 << max(0, int(n) - 1).bit_length())
    return min(b, cap)


@dataclass(slots=True)
class DecodePass:
    """B slots x L tokens, attending in place to the first W columns of slots 0..B-1."""

    width: int
    write_slot: torch.Tensor
    """[B] slot each row writes to (the scratch slot for a free one)."""
    positions: torch.Tensor
    """[B, L] column (and RoPE position) of each token."""
    mask: torch.Tensor
    """[B, 1, rep * L, W] bool: query (head group r, token i) of row b sees columns 0..positions[b, i]."""

    def write(self, layer: SlotLayer, key: torch.Tensor, value: torch.Tensor) -> None:
        assert layer.keys is not None and layer.values is not None
        slot = self.write_slot[:, None]
        layer.keys[slot, :, self.positions] = key.transpose(1, 2)  # [B, L, kv, dim]
        layer.values[slot, :, self.positions] = value.transpose(1, 2)

    def attend(self, layer: SlotLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        assert layer.keys is not None and layer.values is not None
        rows, heads, length, dim = query.shape
        kv = layer.keys.shape[1]
        # Group the query heads by their key/value head: no copy of the cache, one mask per row.
        q = query.reshape(rows, kv, (heads // kv) * length, dim)
        out = F.scaled_dot_product_attention(q, layer.keys[:rows, :, : self.width],
                                             layer.values[:rows, :, : self.width], attn_mask=self.mask, scale=scaling)
        # reshape, not view: CUDA's memory-efficient kernel (fp32 with a mask) returns its output laid out
        # [rows, tokens, heads, dim], which no view regroups (seen on an H200; bf16's kernel did not).
        return out.reshape(rows, heads, length, dim).transpose(1, 2)


@dataclass(slots=True)
class PrefillPass:
    """A samples of L tokens each, from column 0 of their slots: causal attention within each."""

    width: int
    slots: torch.Tensor
    """[A] slot of each sample (the scratch slot for padding)."""
    columns: torch.Tensor
    """[L] 0..L-1."""

    def write(self, layer: SlotLayer, key: torch.Tensor, value: torch.Tensor) -> None:
        assert layer.keys is not None and layer.values is not None
        slot, col = self.slots[:, None], self.columns[None, :]
        layer.keys[slot, :, col] = key.transpose(1, 2)
        layer.values[slot, :, col] = value.transpose(1, 2)

    def attend(self, layer: SlotLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        rows, heads, length, dim = query.shape
        kv = key.shape[1]
        k = key[:, :, None].expand(rows, kv, heads // kv, length, dim).reshape(rows, heads, length, dim)
        v = value[:, :, None].expand(rows, kv, heads // kv, length, dim).reshape(rows, heads, length, dim)
        out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
        return out.transpose(1, 2)


@dataclass(slots=True)
class DecodeRows:
    """Host inputs of one decode pass over slots 0..n-1 (numpy, n rows)."""

    ids: np.ndarray
    """[n, L] the slot's last token, then its drafted tokens (padding after a shorter draft)."""
    pos: np.ndarray
    write_slot: np.ndarray
    count: np.ndarray
    keys: np.ndarray
    """Hashed sample keys (uint64, `sampling.hash_keys`)."""
    temp: np.ndarray
    top_p: np.ndarray


@dataclass(slots=True)
class PrefillRows:
    """Host inputs of the samples admitted in a step."""

    slots: list[int]
    tokens: list[list[int]]
    """Prompt + completion so far of each."""
    count: np.ndarray
    keys: np.ndarray
    temp: np.ndarray
    top_p: np.ndarray


class StaticStep:
    """The buffers, step functions and graphs of one engine (see the module docstring)."""

    def __init__(self, model: Any, decoder: Any, cache: SlotCache, *, max_batch: int, max_tokens: int,
                 mode: GraphMode, prefill_tokens: int, pad_id: int = 0, keep_logits: bool = False) -> None:
        cfg = model.config
        rope = decoder.rotary_emb
        if getattr(rope, "rope_type", "default") not in POSITION_ONLY_ROPE:
            raise EngineError(f"the static step needs a RoPE that depends on the position alone "
                              f"({sorted(POSITION_ONLY_ROPE)}); the model's is {rope.rope_type!r}")
        self.model, self.decoder, self.cache = model, decoder, cache
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_batch, self.max_tokens, self.pad_id = max_batch, max_tokens, pad_id
        self.prefill_tokens = prefill_tokens
        self.kv_heads = int(cfg.num_key_value_heads)
        self.heads = int(cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.vocab = int(cfg.vocab_size)
        self.graphs = StepGraphs(mode, self.device)
        self.keep_logits = keep_logits
        """Tests: copy each pass's logits into `logits` (decode) / `prefill_logits`."""
        dev = self.device
        pin = dev.type == "cuda"
        # Rows: pos, write_slot, count, key, then max_tokens rows of token ids (one per column of L).
        self._ints = torch.zeros(4 + max_tokens, max_batch, dtype=torch.long, device=dev)
        self._floats = torch.ones(2, max_batch, dtype=torch.float32, device=dev)
        self._out = torch.zeros(2, max_batch, max_tokens, dtype=torch.int32, device=dev)
        self._pf_ints = torch.zeros(4, max_batch, dtype=torch.long, device=dev)  # slot, last index, count, key
        self._pf_floats = torch.ones(2, max_batch, dtype=torch.float32, device=dev)
        self._pf_out = torch.zeros(2, max_batch, dtype=torch.int32, device=dev)
        self._host = {name: torch.zeros(t.shape, dtype=t.dtype, pin_memory=pin) if dev.type != "cpu" else t
                      for name, t in (("ints", self._ints), ("floats", self._floats), ("pf_ints", self._pf_ints),
                                      ("pf_floats", self._pf_floats))}
        self.logits = torch.zeros(max_batch * max_tokens if keep_logits else 0, self.vocab, device=dev)
        self.prefill_logits = torch.zeros(max_batch if keep_logits else 0, self.vocab, device=dev)
        self._pf_ids = torch.zeros(0, dtype=torch.long, device=dev)
        self._pf_host = self._pf_ids
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        # Every buffer exists before the first capture (one made inside a capture would live in its pool).
        cache.allocate(self.kv_heads, self.head_dim, self.dtype, dev)
        self._reset()

    # -- buffers that follow the cache's capacity -----------------------------------------------

    def _reset(self) -> None:
        """(Re)make what depends on the cache's capacity and forget the graphs captured over it."""
        cap = self.cache.capacity
        self.graphs.clear()
        probe = torch.zeros(1, 1, dtype=self.dtype, device=self.device)
        self._rope = self.decoder.rotary_emb(probe, torch.arange(cap, device=self.device)[None])
        size = max(self.prefill_tokens, cap)
        self._pf_ids = torch.zeros(size, dtype=torch.long, device=self.device)
        self._pf_host = self._pf_ids if self.device.type == "cpu" else torch.zeros(size, dtype=torch.long,
                                                                                  pin_memory=True)

    def _reserve(self, width: int) -> None:
        """Room for `width` columns: the cache grows (its contents copied, `SlotCache.reserve`) and the
        graphs captured over the old buffers are dropped."""
        if width > self.cache.capacity:
            self.cache.reserve(width)
            self._reset()

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    # -- one engine step ------------------------------------------------------------------------

    def step(self, decode: DecodeRows | None, prefill: PrefillRows | None,
             overlap: Callable[[], object] | None = None) -> tuple[tuple[np.ndarray, np.ndarray] | None,
                                                                   tuple[np.ndarray, np.ndarray] | None]:
        """Launch the prefill and decode passes, run `overlap` while the device works, then read back
        (tokens, logprobs): decode `[n, L]` each, prefill `[A]` each in admission order."""
        # Padding tokens of a shorter L take columns too (they are overwritten before anything reads them).
        widths = [int(decode.pos.max()) + bucket(decode.ids.shape[1], self.max_tokens)] if decode is not None else []
        widths += [max(len(t) for t in prefill.tokens)] if prefill is not None else []
        self._reserve(max(widths, default=0))
        pending, order = self._launch_prefill(prefill) if prefill is not None else ([], [])
        dec = self._launch_decode(decode) if decode is not None else None
        if overlap is not None:
            overlap()
        pre = None
        if prefill is not None:
            got = torch.cat(pending, dim=1).cpu().numpy() if pending else np.zeros((2, 0), np.int32)
            got = got[:, np.argsort(np.concatenate(order), kind="stable")]
            pre = (got[0].astype(np.int64), got[1].view(np.float32))
        out = None
        if dec is not None:
            n, length = dec
            got = self._out[:, :n, :length].to("cpu", copy=True).numpy()
            out = (got[0].astype(np.int64), got[1].view(np.float32))
        return out, pre

    def _launch_decode(self, rows: DecodeRows) -> tuple[int, int]:
        n, length = rows.ids.shape
        b = bucket(n, self.max_batch)
        el = bucket(length, self.max_tokens)
        width = bucket(int(rows.pos.max()) + el, self.cache.capacity, _MIN_WIDTH)
        nucleus = bool((rows.top_p < 1.0).any())
        ints, floats = self._host["ints"].numpy(), self._host["floats"].numpy()
        ints[0, :n], ints[1, :n], ints[2, :n] = rows.pos, rows.write_slot, rows.count
        ints[3, :n] = rows.keys.view(np.int64)
        ints[4:4 + length, :n] = rows.ids.T
        ints[4 + length:4 + el, :n] = self.pad_id
        ints[0:3, n:b] = 0
        ints[1, n:b] = self.max_batch  # padding rows write into the scratch slot
        ints[3, n:b] = 0
        ints[4:4 + el, n:b] = self.pad_id
        floats[0, :n], floats[1, :n] = rows.temp, rows.top_p
        floats[:, n:b] = 1.0
        self._upload("ints", "floats")
        self.graphs.run(("decode", b, el, width, nucleus), lambda: self._decode_fn(b, el, width, nucleus))
        return n, length

    def _launch_prefill(self, rows: PrefillRows) -> tuple[list[torch.Tensor], list[np.ndarray]]:
        """One pass per group of admitted samples of one length bucket, `prefill_tokens` a pass; each
        pass's outputs are copied aside on the device (the next pass reuses the buffer). Returns them
        with the admitted indices of each pass's columns."""
        lengths = np.fromiter((len(t) for t in rows.tokens), dtype=np.int64, count=len(rows.tokens))
        by_length = np.argsort(lengths, kind="stable")
        outs: list[torch.Tensor] = []
        order: list[np.ndarray] = []
        at = 0
        while at < len(by_length):
            el = bucket(int(lengths[by_length[at]]), self.cache.capacity, 16)
            fit = self.prefill_tokens // el  # samples a pass holds, as a power of two: a bucket never outgrows it
            per = 1 << (fit.bit_length() - 1) if fit else 1
            group = [i for i in by_length[at:at + per] if lengths[i] <= el]
            at += len(group)
            if outs and self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the host buffers are reused
            outs.append(self._prefill_pass(rows, group, el))
            order.append(np.asarray(group, dtype=np.int64))
        return outs, order

    def _prefill_pass(self, rows: PrefillRows, group: Sequence[int], el: int) -> torch.Tensor:
        a = len(group)
        ab = bucket(a, self.max_batch)
        ids = self._pf_host.numpy()[: ab * el].reshape(ab, el)
        ids[:] = self.pad_id
        for r, i in enumerate(group):
            ids[r, : len(rows.tokens[i])] = rows.tokens[i]
        ints, floats = self._host["pf_ints"].numpy(), self._host["pf_floats"].numpy()
        pick = np.asarray(group, dtype=np.int64)
        ints[0, :a] = np.asarray(rows.slots, dtype=np.int64)[pick]
        ints[1, :a] = [len(rows.tokens[i]) - 1 for i in group]
        ints[2, :a], ints[3, :a] = rows.count[pick], rows.keys[pick].view(np.int64)
        ints[:, a:ab] = 0
        ints[0, a:ab] = self.max_batch
        floats[0, :a], floats[1, :a] = rows.temp[pick], rows.top_p[pick]
        floats[:, a:ab] = 1.0
        if self.device.type != "cpu":
            self._pf_ids[: ab * el].copy_(self._pf_host[: ab * el], non_blocking=True)
        self._upload("pf_ints", "pf_floats")
        nucleus = bool((rows.top_p[pick] < 1.0).any())
        self.graphs.run(("prefill", ab, el, nucleus), lambda: self._prefill_fn(ab, el, nucleus))
        return self._pf_out[:, :a].clone()

    def _upload(self, *names: str) -> None:
        if self.device.type == "cpu":
            return  # the host arrays are the buffers
        for name in names:
            getattr(self, "_" + name).copy_(self._host[name], non_blocking=True)

    # -- the step functions (captured: tensor ops on the buffers only) --------------------------

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Embeddings through every decoder layer, [rows, L] -> [rows, L, hidden] (the final norm not
        applied): what `Qwen2Model.forward` computes, minus its mask building and per-call wrappers."""
        assert self._rope is not None
        cos, sin = self._rope
        rotary = (cos[0][positions], sin[0][positions])
        hidden = self.decoder.embed_tokens(ids)
        for layer in self.decoder.layers:
            hidden = layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=positions,
                           past_key_values=self.cache, use_cache=True)
        return hidden

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.decoder.norm(hidden))

    def _decode_fn(self, b: int, el: int, width: int, nucleus: bool) -> None:
        ints, floats = self._ints, self._floats
        offsets = torch.arange(el, device=self.device)
        positions = ints[0, :b, None] + offsets  # [B, L]
        seen = torch.arange(width, device=self.device)[None, None, :] <= positions[:, :, None]  # [B, L, W]
        rep = self.heads // self.kv_heads
        mask = seen[:, None, None].expand(b, 1, rep, el, width).reshape(b, 1, rep * el, width)
        plan = DecodePass(width, ints[1, :b], positions, mask)
        with slot_pass(self.model, self.cache, plan):
            hidden = self._layers(ints[4:4 + el, :b].T, positions)
        logits = self._head(hidden).reshape(b * el, -1)
        if self.keep_logits:
            self.logits[: b * el].copy_(logits)
        counters = (ints[2, :b, None] + offsets).reshape(-1)
        keys = ints[3, :b, None].expand(b, el).reshape(-1)
        temp = floats[0, :b, None].expand(b, el).reshape(-1)
        top_p = floats[1, :b, None].expand(b, el).reshape(-1)
        tokens, logprobs = sample_tokens_fixed(logits, temp, top_p, device_uniforms(keys, counters), nucleus)
        self._out[0, :b, :el].copy_(tokens.view(b, el))
        self._out[1, :b, :el].copy_(logprobs.view(b, el).view(torch.int32))

    def _prefill_fn(self, a: int, el: int, nucleus: bool) -> None:
        ints, floats = self._pf_ints, self._pf_floats
        columns = torch.arange(el, device=self.device)
        positions = columns[None, :].expand(a, el)
        plan = PrefillPass(el, ints[0, :a], columns)
        with slot_pass(self.model, self.cache, plan):
            hidden = self._layers(self._pf_ids[: a * el].view(a, el), positions)
        last = hidden.gather(1, ints[1, :a, None, None].expand(a, 1, hidden.shape[-1])).squeeze(1)
        logits = self._head(last)
        if self.keep_logits:
            self.prefill_logits[:a].copy_(logits)
        u = device_uniforms(ints[3, :a], ints[2, :a])
        tokens, logprobs = sample_tokens_fixed(logits, floats[0, :a], floats[1, :a], u, nucleus)
        self._pf_out[0, :a].copy_(tokens)
        self._pf_out[1, :a].copy_(logprobs.view(torch.int32))
