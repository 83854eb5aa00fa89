"""History-drafted speculative decoding: draft from earlier responses, verify in one pass, accept exactly.

Where the response history (`fleetrl.rollout.history`) holds earlier answers to a running sample's
prompt, the torch engine appends up to `k` drafted tokens d_1..d_k to the sample's row of a step's
forward pass (`_kv.py`: a segment after its last token). That one pass gives the target policy's
distributions p_0..p_k at the k + 1 positions (p_i conditioned on the drafts before it), each
processed exactly as plain decoding processes it (temperature, then top-p: `sampling.py`).

Acceptance is the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023) for a draft
that proposes one token with certainty (q = one-hot at d_i): accept d_i with probability
min(1, p_i(d_i) / q(d_i)) = p_i(d_i); on the first rejection emit a token drawn from the residual
norm(max(0, p_i - q)) = p_i without d_i, renormalized, and stop; when all k are accepted, emit a
bonus token drawn from p_k. Every emitted token is therefore distributed exactly as plain decoding
would draw it at that position, at any temperature and top-p.

The engine realizes the rule with the uniforms plain decoding uses (maximal coupling): at position
i it draws t_i = inverse-CDF(p_i, u_i) with the sample's counter-based uniform u_i of that position,
accepts d_i iff t_i == d_i, and on the first mismatch emits t_i. P(t_i == d_i) = p_i(d_i) (accept),
and t_i given t_i != d_i is distributed as the residual: the rule above, with the tokens plain
decoding would have drawn. So a sample's tokens do not depend on whether, or what, it drafted (up to
floating-point differences between a verification pass and a one-token pass): a handed-over sample
still continues exactly as it would have, and the history can only change speed. The recorded
logprob of every emitted token is the target's, from p_i, and its version the step's weights.

Drafts live for one step only: they are drafted, verified and accepted or thrown away inside one
forward pass with the weights of that step, so a weight switch (between steps) never meets a draft
verified under the old version; the next step drafts again and verifies under the new weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fleetrl.rollout.engine import SeqState
from fleetrl.rollout.history import ResponseHistory


def accepted_length(sampled: Sequence[int] | np.ndarray, draft: Sequence[int]) -> int:
    """How many drafted tokens the target accepts: the first position where its draw differs."""
    for i, d in enumerate(draft):
        if int(sampled[i]) != d:
            return i
    return len(draft)


@dataclass(slots=True)
class SpecStats:
    """Counters of the speculative path (cumulative; the benchmark reads them between epochs)."""

    verifies: int = 0
    """Sample-steps that verified a draft."""
    drafted: int = 0
    accepted: int = 0
    by_version: dict[int, list[int]] = field(default_factory=dict)
    """Policy version -> [drafted, accepted] under its weights."""

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def add(self, version: int, drafted: int, accepted: int) -> None:
        self.verifies += 1
        self.drafted += drafted
        self.accepted += accepted
        per = self.by_version.setdefault(version, [0, 0])
        per[0] += drafted
        per[1] += accepted


class Speculator:
    """Picks each running sample's draft from the history and books the verdicts."""

    def __init__(self, history: ResponseHistory, max_draft_tokens: int) -> None:
        self.history, self.max_draft_tokens = history, max_draft_tokens
        self.stats = SpecStats()

    def drafts(self, seqs: Sequence[SeqState | None], room: np.ndarray) -> list[tuple[int, list[int]]]:
        """(slot, drafted tokens) for the running slots whose prompt has a usable history; `room[b]`:
        tokens slot b may still take after this step's own one (its draft fits its length limit)."""
        out = []
        for b, seq in enumerate(seqs):
            if seq is None or seq.history_key is None:
                continue
            k = min(self.max_draft_tokens, int(room[b]))
            if k > 0:
                entry = self.history.get(seq.history_key)
                draft, seq.draft_at = self.history.draft(entry, seq.tokens, k, seq.draft_at)
                if draft:
                    out.append((b, draft))
        return out

    def verdict(self, seq: SeqState, draft: Sequence[int], accepted: int, version: int) -> None:
        """The target accepted `accepted` drafted tokens and emitted one more of its own."""
        self.stats.add(version, len(draft), accepted)
        seq.draft_at += accepted + 1  # the earlier answer's next position, if the sample still follows it
        entry = self.history.get(seq.history_key) if seq.history_key is not None else None
        self.history.observe(entry, len(draft), accepted)

    def accept(self, seqs: Sequence[SeqState | None], n: int, toks: list[int], lps: list[float],
               drafts: list[tuple[int, list[int]]], version: int) -> dict[int, tuple[list[int], list[float]]]:
        """What each drafting slot emits after a verifying step, its verdict booked: its accepted drafts
        and one token more, with their logprobs. `toks`/`lps`: one row per slot (`n` of them), then one
        per drafted token in the order of `drafts`."""
        emitted: dict[int, tuple[list[int], list[float]]] = {}
        first = n
        for b, draft in drafts:
            m = len(draft)
            sampled = [toks[b], *toks[first:first + m]]
            taken = accepted_length(sampled, draft) + 1
            emitted[b] = (sampled[:taken], [lps[b], *lps[first:first + m]][:taken])
            seq = seqs[b]
            assert seq is not None
            self.verdict(seq, draft, taken - 1, version)
            first += m
        return emitted
