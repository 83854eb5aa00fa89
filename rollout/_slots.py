"""The torch engine's slot table: per-slot decoding state as arrays, and the packed pass of a step.

Slot b below `n` either runs a sample (`seqs[b]`) or is free. The state a step needs lives in
arrays indexed by slot, updated with one vector operation per step, not per sample: the position
(= cache column) of each slot's last token, its sampling counter, key, temperature and top-p, the
last sampled token (the next input). `plan` turns the running slots plus the samples admitted this
step, and the drafted tokens of slots that speculate, into one packed forward pass
(`fleetrl.rollout._kv.Pass`).

After the step, `book` (or `book_verified`, for a step that verified drafts) records the sampled
tokens into the running samples, applies the finish rules to the whole batch at once (EOS -> stop;
max_new_tokens or the context, folded into each slot's `limit` -> length), advances the slots and
frees the finished ones, which it hands back to the engine (reasons, history). Only the per-sample
token, logprob and version lists are appended in Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fleetrl.rollout._kv import Pass, Prefill, SlotCache
from fleetrl.rollout._static import DecodeRows, PrefillRows
from fleetrl.rollout.engine import SeqState
from fleetrl.rollout.sampling import hash_keys

Finished = list[tuple[SeqState, bool]]
"""Samples a step completed, each with whether it met EOS (else it reached its length limit)."""


class SlotTable:
    """Decoding state of `max_batch` slots and their KV cache."""

    def __init__(self, max_batch: int, num_layers: int, max_context: int, device: torch.device) -> None:
        self.device = device
        self.max_context = max_context
        self.max_batch = max_batch
        self.cache = SlotCache(num_layers, max_batch)
        self.seqs: list[SeqState | None] = [None] * max_batch
        self.n = 0
        """Slots below n are in the forward pass (the highest running slot + 1)."""
        self.running = 0
        self.pos = np.zeros(max_batch, dtype=np.int64)
        """Position and cache column of each slot's last token (its next decode input); 0 when free."""
        self.write_slot = np.full(max_batch, max_batch, dtype=np.int64)
        """Where a slot's decode row writes: itself when running, the scratch slot when free."""
        self.count = np.zeros(max_batch, dtype=np.int64)
        """Completion tokens so far: the counter of the slot's next uniform."""
        self.limit = np.zeros(max_batch, dtype=np.int64)
        """Completion length at which a slot's sample stops (max_new_tokens, or the context)."""
        self.keys = np.zeros(max_batch, dtype=np.uint64)
        """Each slot's sample key, hashed (`sampling.hash_keys`)."""
        self.live = np.zeros(max_batch, dtype=np.int64)
        self.last = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.temp = np.ones(max_batch, dtype=np.float32)
        self.top_p = np.ones(max_batch, dtype=np.float32)
        self._columns = torch.arange(self.cache.capacity, device=device)

    def running_rows(self) -> list[int]:
        return [b for b, s in enumerate(self.seqs[: self.n]) if s is not None]

    def free_slots(self, k: int) -> list[int]:
        """The lowest `k` free slots (keeps `n`, the pass width, small)."""
        return [b for b, s in enumerate(self.seqs) if s is None][:k]

    def plan(
        self, admitted: Sequence[tuple[int, list[int]]], drafts: Sequence[tuple[int, list[int]]] = (),
    ) -> tuple[Pass, torch.Tensor, torch.Tensor | None]:
        """The pass decoding slots 0..n-1, prefilling `admitted` (slot, tokens) and verifying `drafts`
        (running slot, drafted tokens); returns (pass, input_ids, keep).

        `keep` indexes the packed tokens whose logits are sampled: the n decode rows, then the last
        token of each admitted sample, then every drafted token (None: every token, when nothing is
        admitted or drafted).
        """
        n, dev = self.n, self.device
        width = int(self.pos[:n].max()) + 1 if n else 0
        draft_cols = [int(self.pos[b]) + 1 for b, _ in drafts]
        self.reserve(max([width, *(len(t) for _, t in admitted), *(c + len(t) for c, (_, t) in zip(
            draft_cols, drafts, strict=True))]))
        pos = torch.from_numpy(self.pos[:n]).to(dev)
        mask = (self._columns[:width][None, :] <= pos[:, None])[:, None, None, :] if n else None
        if not admitted and not drafts:
            slots = torch.from_numpy(self.write_slot[:n]).to(dev)
            plan = Pass(n, width, mask, slots, pos)
            return plan, self.last[:n], None
        segments = [*admitted, *drafts]
        lengths = np.fromiter((len(t) for _, t in segments), dtype=np.int64, count=len(segments))
        offsets = np.cumsum(lengths) - lengths  # each segment's first token, from the first segment
        starts = (n + offsets).tolist()
        firsts = np.asarray([0] * len(admitted) + draft_cols, dtype=np.int64)
        total = int(lengths.sum())
        within = np.arange(total) - np.repeat(offsets, lengths)  # each token's index in its segment
        slots_np = np.concatenate([self.write_slot[:n], np.repeat([s for s, _ in segments], lengths)])
        cols_np = np.concatenate([self.pos[:n], np.repeat(firsts, lengths) + within])
        a = len(admitted)
        lens = lengths.tolist()
        prefill = Prefill.build([s for s, _ in admitted], starts[:a], lens[:a], dev) if admitted else None
        verify = Prefill.build([s for s, _ in drafts], starts[a:], lens[a:], dev, draft_cols) if drafts else None
        plan = Pass(n, width, mask, torch.from_numpy(slots_np).to(dev), torch.from_numpy(cols_np).to(dev), prefill,
                    verify)
        flat = np.fromiter((t for _, toks in segments for t in toks), dtype=np.int64, count=total)
        # Logits kept: the decode rows, each admitted sample's last token, every drafted token.
        draft_start = n + int(offsets[a]) if drafts else n + total
        keep = np.concatenate([np.arange(n), n + offsets[:a] + lengths[:a] - 1, np.arange(draft_start, n + total)])
        return plan, torch.cat([self.last[:n], torch.from_numpy(flat).to(dev)]), torch.from_numpy(keep).to(dev)

    def decode_rows(self, drafts: Sequence[tuple[int, list[int]]], pad_id: int) -> DecodeRows:
        """The static step's decode inputs for slots 0..n-1: each slot's last token, then its draft."""
        n = self.n
        length = 1 + max((len(d) for _, d in drafts), default=0)
        ids = np.full((n, length), pad_id, dtype=np.int64)
        ids[:, 0] = self.last[:n].numpy()
        for b, draft in drafts:
            ids[b, 1:1 + len(draft)] = draft
        return DecodeRows(ids, self.pos[:n], self.write_slot[:n], self.count[:n], self.keys[:n], self.temp[:n],
                          self.top_p[:n])

    @staticmethod
    def prefill_rows(rows: list[int], seqs: list[SeqState]) -> PrefillRows:
        """The static step's prefill inputs for `seqs` admitted into slots `rows` (as `admit` will set them)."""
        return PrefillRows(
            rows, [s.prompt_ids + s.tokens for s in seqs], np.array([len(s.tokens) for s in seqs], dtype=np.int64),
            hash_keys([s.key for s in seqs]), np.array([s.sampling.temperature for s in seqs], dtype=np.float32),
            np.array([s.sampling.top_p for s in seqs], dtype=np.float32))

    def reserve(self, width: int) -> None:
        self.cache.reserve(width)
        if self._columns.shape[0] < self.cache.capacity:
            self._columns = torch.arange(self.cache.capacity, device=self.device)

    def admit(self, rows: list[int], seqs: list[SeqState]) -> None:
        """Slots `rows` now hold `seqs`, whose prompt + completion this step's pass prefills."""
        # The counters as of the last prefilled token; `advance` moves them past the token sampled now.
        self.pos[rows] = [len(s.prompt_ids) + len(s.tokens) - 1 for s in seqs]
        self.write_slot[rows] = rows
        self.count[rows] = [len(s.tokens) for s in seqs]
        self.limit[rows] = [min(s.sampling.max_new_tokens, self.max_context - len(s.prompt_ids),
                                s.stop_at if s.stop_at is not None else 1 << 62) for s in seqs]
        self.keys[rows] = hash_keys([s.key for s in seqs])
        self.live[rows] = 1
        self.temp[rows] = [s.sampling.temperature for s in seqs]
        self.top_p[rows] = [s.sampling.top_p for s in seqs]
        for b, s in zip(rows, seqs, strict=True):
            self.seqs[b] = s
        self.running += len(rows)
        self.n = max(self.n, max(rows) + 1)

    def advance(self, tokens: torch.Tensor, extra: dict[int, int] | None = None) -> None:
        """Every running slot took one more token: it is the next input, one column on. `extra`: slots
        that took more (accepted drafts), and how many more; `tokens` holds each slot's last one."""
        n = self.n
        self.last[:n] = tokens
        self.pos[:n] += self.live[:n]
        self.count[:n] += self.live[:n]
        if extra:
            rows, more = list(extra), list(extra.values())
            self.pos[rows] += more
            self.count[rows] += more

    def free(self, rows: list[int]) -> None:
        if not rows:
            return
        self.temp[rows] = self.top_p[rows] = 1.0
        self.pos[rows] = self.count[rows] = self.live[rows] = 0
        self.write_slot[rows] = self.max_batch
        for b in rows:
            self.seqs[b] = None
        self.running -= len(rows)
        while self.n and self.seqs[self.n - 1] is None:
            self.n -= 1

    # -- bookkeeping after a step ---------------------------------------------------------------

    def book(self, tok_np: np.ndarray, lps: list[float], last: torch.Tensor, version: int,
             is_eos: np.ndarray) -> tuple[int, Finished]:
        """Record one token per running slot (`tok_np`, `lps` indexed by slot; `last` the same tokens as
        the table keeps them), apply the finish rules, advance the slots, free the finished ones.
        Returns (tokens recorded, the finished samples). `is_eos`: token id -> is EOS."""
        n = self.n
        toks = tok_np.tolist()
        rows = self.running_rows()
        for b in rows:
            seq = self.seqs[b]
            assert seq is not None
            seq.tokens.append(toks[b])
            seq.logprobs.append(lps[b])
            seq.versions.append(version)
        # Engine._append's finish rules over the whole batch at once: EOS -> stop; max_new_tokens or
        # the context (both folded into the slot's `limit`) -> length.
        live = self.live[:n] > 0
        stop = is_eos[tok_np] & live
        done = np.flatnonzero(stop | ((self.count[:n] + 1 >= self.limit[:n]) & live)).tolist()
        finished = [(self._seq(b), bool(stop[b])) for b in done]
        self.advance(last)
        self.free(done)
        return len(rows), finished

    def book_verified(self, toks: list[int], lps: list[float], emitted: dict[int, tuple[list[int], list[float]]],
                      version: int, is_eos: np.ndarray) -> tuple[int, Finished]:
        """`book` for a step that verified drafts: `toks`/`lps` hold one row per slot first; `emitted`
        the tokens and logprobs each drafting slot emits (its accepted drafts and one token more).
        Returns (tokens recorded, the finished samples)."""
        n = self.n
        plain_eos = is_eos[toks[:n]].tolist()  # plain rows: one lookup for the batch
        count, limit = self.count[:n].tolist(), self.limit[:n].tolist()
        last = list(toks[:n])
        extra: dict[int, int] = {}
        done: list[int] = []
        finished: Finished = []
        recorded = 0
        for b in self.running_rows():
            seq = self.seqs[b]
            assert seq is not None
            got = emitted.get(b)
            if got is None:
                seq.tokens.append(toks[b])
                seq.logprobs.append(lps[b])
                seq.versions.append(version)
                taken, stop = 1, plain_eos[b]
            else:
                new, new_lp = got
                at = next((i for i, t in enumerate(new) if is_eos[t]), None)
                if at is not None:  # an accepted draft may reach EOS before its last token
                    new, new_lp = new[: at + 1], new_lp[: at + 1]
                seq.tokens.extend(new)
                seq.logprobs.extend(new_lp)
                seq.versions.extend([version] * len(new))
                taken, stop = len(new), at is not None
                if taken > 1:
                    extra[b], last[b] = taken - 1, new[-1]
            recorded += taken
            if stop or count[b] + taken >= limit[b]:
                done.append(b)
                finished.append((seq, bool(stop)))
        self.advance(torch.tensor(last, dtype=torch.long, device=self.device), extra)
        self.free(done)
        return recorded, finished

    def _seq(self, b: int) -> SeqState:
        seq = self.seqs[b]
        assert seq is not None
        return seq
