"""Response history: what the policy answered to a prompt before, for drafts and length predictions.

RL revisits its prompts every epoch, and a policy's answers to one prompt in consecutive epochs
are much alike (RhymeRL's observation): the tokens of earlier answers are good guesses of the next
ones. `ResponseHistory` keeps, per prompt (keyed by its token ids, so the same prompt under any
group id matches), the last few responses as token arrays, in a least-recently-used table bounded
in prompts and in tokens (about 60 bytes a token with the index). The engine records every sample
it finishes (`record`) and asks it for

* a draft (`draft`): the tokens that followed the longest suffix of the sample's context (the tail
  of the prompt, then its completion so far) in an earlier response, found through an index of the
  positions after each token and each pair of tokens, the match then extended backwards to
  `max_ngram` (suffix match, no draft model), for the speculative path (`fleetrl.rollout.speculative`).
  A response is indexed at its prompt's first draft after it was recorded, not when recorded, so
  recording is cheap: answers to prompts the engine never drafts for (most of what its region
  answers) cost a copy of their tokens and no index (~0.07 us a token here, against ~2.3 to index).
  Where the prompt's own answers hold no match of two tokens, the draft comes from the newest answer
  of any prompt that continued the context's last two tokens (`across_prompts`: a table of pairs
  written when an answer is recorded, ~0.9 us and up to ~100 bytes a token);
* a length prediction (`predicted_length`): the mean length of the prompt's earlier responses, or,
  for a prompt never seen, the mean of everything recorded (the engine admits long samples first).

Besides its own answers, the engine records those of the other workers of its region (read from the
region's `trajectories`, `fleetrl.rollout.region_history`): they wait in a `ResponseInbox` filled from
any thread and are recorded by the engine's thread, a bounded number of tokens per step.

The history is an optimization only: an empty one (a fresh worker) drafts nothing and predicts the
default, and nothing it holds can change the distribution of what is sampled (drafts are verified
by the target policy). Drafting for a prompt stops while the acceptance of its drafts is low (the
policy moved away from its old answers); a new response recorded for it lets it try again.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

_ALPHA = 0.2
"""Weight of the newest verification in a prompt's acceptance averages."""


def prompt_key(prompt_ids: Sequence[int]) -> bytes:
    """The history key of a prompt: a digest of its token ids (same prompt, same key, any group id)."""
    return hashlib.blake2b(np.asarray(prompt_ids, dtype="<i4").tobytes(), digest_size=16).digest()


_POS_BITS = 32  # a position in the history packs (response id, position) into one int
_MASK = (1 << _POS_BITS) - 1


@dataclass(slots=True)
class Acceptance:
    """Moving averages of how the policy judged drafts: accepted tokens and examined tokens per
    verification (the accepted ones and the one it rejected, if any: the tokens after a rejection are
    never judged)."""

    accepted: float = 1.0
    examined: float = 1.0

    @property
    def rate(self) -> float:
        """The estimated chance that the policy accepts a drafted token, given it accepted the ones
        before: accepted / examined. Not the share of drafted tokens accepted, which a long draft's
        unjudged tail drags down: at a per-token chance of 0.95, eight drafted tokens are 80 % accepted."""
        return self.accepted / self.examined

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.accepted += _ALPHA * (accepted - self.accepted)
            self.examined += _ALPHA * (accepted + (accepted < drafted) - self.examined)

    def reopen(self, floor: float) -> None:
        """Raise the rate to at least `floor` (a new answer: let drafting try again)."""
        self.accepted = max(self.accepted, floor * self.examined)


@dataclass(slots=True)
class PromptHistory:
    """The recent responses to one prompt and the index over them."""

    tail: tuple[int, ...]
    """The prompt's last tokens: context for matching the first completion tokens."""
    responses: dict[int, array[int]] = field(default_factory=dict)
    """Response id (history-wide, increasing) -> `tail` + the response's tokens (4 bytes a token); the
    last `max_responses`, oldest first."""
    lengths: list[int] = field(default_factory=list)
    recorded: int = 0
    """Responses recorded so far."""
    rebuilt_at: int = 0
    """`recorded` when the index was last rebuilt (entries of responses evicted since are skipped at lookup)."""
    indexed_below: int = 0
    """The index holds the responses with ids below this: those recorded since are indexed at the
    prompt's next draft."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    by_pair: dict[int, list[int]] = field(default_factory=dict)
    """The two tokens before a position -> [response id << 32 | position]: where a context may continue."""
    by_token: dict[int, list[int]] = field(default_factory=dict)
    """The token before a position -> the same (for a match of one token)."""

    def mean_length(self) -> float:
        return sum(self.lengths) / len(self.lengths)


def _pair(a: int, b: int) -> int:
    return (a << _POS_BITS) | b


class ResponseHistory:
    """A bounded least-recently-used table of earlier responses per prompt (see the module docstring)."""

    SCAN = 64
    """Most index entries (the newest) a lookup scores: a frequent token must not make a step slow."""

    def __init__(self, *, max_prompts: int = 4096, max_responses: int = 8, max_tokens: int = 1 << 20,
                 max_ngram: int = 4, min_ngram: int = 1, min_acceptance: float = 0.2,
                 across_prompts: bool = True) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_prompts, self.max_responses, self.max_tokens = max_prompts, max_responses, max_tokens
        self.max_ngram, self.min_ngram, self.min_acceptance = max_ngram, min_ngram, min_acceptance
        self.across_prompts = across_prompts
        self._prompts: OrderedDict[bytes, PromptHistory] = OrderedDict()
        self._responses: dict[int, array[int]] = {}
        """Every live response by id (the prompts' `responses` together)."""
        self._next_id = 0
        self._tokens = 0
        self._length_sum = 0.0
        self._length_count = 0
        self._newest: dict[int, int] = {}
        """Two tokens -> the position after them in the newest response of any prompt that holds them
        (`across_prompts`; indexed when recorded, a few dict writes per token)."""
        self._newest_dead = 0
        """Tokens evicted since `_newest` was rebuilt (its entries into them are skipped at lookup)."""
        self.unseen = Acceptance()
        """How drafts for prompts without a history of their own fared (they draft across prompts)."""

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def tokens(self) -> int:
        """Tokens held (prompt tails and responses): the budget `max_tokens` bounds it."""
        return self._tokens

    def get(self, key: bytes) -> PromptHistory | None:
        entry = self._prompts.get(key)
        if entry is not None:
            self._prompts.move_to_end(key)
        return entry

    def record(self, prompt_ids: Sequence[int], completion: Sequence[int]) -> None:
        """Keep a finished response (the oldest of the prompt's, and the least recently used prompts
        beyond `max_prompts` or the token budget, go)."""
        key = prompt_key(prompt_ids)
        entry = self.get(key)
        if entry is None:
            entry = self._prompts[key] = PromptHistory(tuple(int(t) for t in prompt_ids[-self.max_ngram:]))
        seq = array("i", entry.tail)
        seq.extend(array("i", completion))
        rid, self._next_id = self._next_id, self._next_id + 1
        entry.responses[rid] = self._responses[rid] = seq
        entry.lengths.append(len(completion))
        self._tokens += len(seq)
        entry.recorded += 1
        if len(entry.responses) > self.max_responses:
            oldest = next(iter(entry.responses))
            del entry.responses[oldest]
            self._forget(oldest)
            del entry.lengths[0]
        while len(self._prompts) > self.max_prompts or (self._tokens > self.max_tokens and len(self._prompts) > 1):
            for old_rid in self._prompts.popitem(last=False)[1].responses:
                self._forget(old_rid)
        if self.across_prompts:
            self._remember(rid, seq)
        # The policy answered again: let drafting for this prompt try once more if it had stopped.
        entry.acceptance.reopen(self.min_acceptance)
        self._length_sum += len(completion)
        self._length_count += 1

    def predicted_length(self, key: bytes, default: float) -> float:
        """Mean length of the prompt's earlier responses; else the mean of all; else `default`."""
        entry = self._prompts.get(key)
        if entry is not None:
            return entry.mean_length()
        return self._length_sum / self._length_count if self._length_count else default

    def draft(self, entry: PromptHistory | None, completion: Sequence[int], k: int,
              hint: int = -1) -> tuple[list[int], int]:
        """Up to `k` tokens that followed the context (prompt tail + `completion`) in an earlier response,
        and where they start (packed response id and position: the `hint` of the next call, moved past
        the tokens taken). ([], -1) when none matches or drafting is off for the prompt.

        Where it looks, best first: the prompt's own responses, for the longest suffix of the context
        (up to `max_ngram` tokens) that matches two tokens or more, nearest to the same position, then
        newest; then (`across_prompts`) the newest response of any prompt that holds the context's last
        two tokens; then the prompt's own responses for its last token (`min_ngram` 1). `entry` None:
        a prompt with no history of its own drafts across prompts only.

        `hint`: where the previous draft continues; used as is while the last two tokens still match
        there (a sample following one earlier answer costs no search).

        Fewer than `k` where the prompt's drafts are often rejected: verifying a token costs compute,
        and with a per-token acceptance a the run of accepted drafts is a / (1 - a) long on average."""
        a = (entry.acceptance if entry is not None else self.unseen).rate
        if a < self.min_acceptance:
            return [], -1
        k = min(k, round(a / (1.0 - a)) + 1) if a < 1.0 else k
        if k <= 0:
            return [], -1
        tail = entry.tail if entry is not None else ()
        need = max(0, self.max_ngram - len(completion))
        context = [*tail[max(0, len(tail) - need):], *completion[len(completion) - self.max_ngram + need:]]
        if len(context) >= 2 and hint >= 0:
            seq = self._responses.get(hint >> _POS_BITS)
            pos = hint & _MASK
            if seq is not None and 2 <= pos < len(seq) and seq[pos - 1] == context[-1] and seq[pos - 2] == context[-2]:
                return seq[pos:pos + k].tolist(), hint
        here = len(tail) + len(completion)
        own, matched = self._match(entry, context, here) if entry is not None and context else (-1, 0)
        at = own if matched >= 2 else -1
        if at < 0 and len(context) >= 2 and self.across_prompts:
            at = self._newest.get(_pair(context[-2], context[-1]), -1)
            if at >= 0 and (at >> _POS_BITS) not in self._responses:
                at = -1  # evicted since
        if at < 0 and matched >= self.min_ngram:
            at = own
        if at < 0:
            return [], -1
        pos = at & _MASK
        return self._responses[at >> _POS_BITS][pos:pos + k].tolist(), at

    def observe(self, entry: PromptHistory | None, drafted: int, accepted: int) -> None:
        """The target policy accepted `accepted` of `drafted` tokens drafted for the prompt."""
        (entry.acceptance if entry is not None else self.unseen).observe(drafted, accepted)

    def _match(self, entry: PromptHistory, context: list[int], here: int) -> tuple[int, int]:
        """The prompt's own best continuation of `context` (packed id and position, -1 if none; `here`:
        the position the context ends at) and how many of the context's last tokens match there."""
        self._catch_up(entry)
        found: list[int] = []
        if len(context) >= 2:
            found = entry.by_pair.get(_pair(context[-2], context[-1]), [])
        if not found:
            found = entry.by_token.get(context[-1], [])
        best: tuple[int, int, int] | None = None  # (match length, -distance, response id) of the best candidate
        best_at = -1
        live = entry.responses
        for packed in found[-self.SCAN:]:
            rid, pos = packed >> _POS_BITS, packed & _MASK
            seq = live.get(rid)
            if seq is None:
                continue
            m = 1
            while m < len(context) and m < pos and seq[pos - 1 - m] == context[-1 - m]:
                m += 1
            score = (m, -abs(pos - here), rid)
            if best is None or score > best:
                best, best_at = score, packed
        return (best_at, best[0]) if best is not None else (-1, 0)

    def _catch_up(self, entry: PromptHistory) -> None:
        """Index the prompt's responses recorded since its last draft."""
        if not entry.responses or next(reversed(entry.responses)) < entry.indexed_below:
            return
        if entry.recorded - entry.rebuilt_at > 2 * self.max_responses:
            # Evicted responses' entries are skipped at lookup; drop them once they are as many as the live ones.
            entry.by_pair, entry.by_token, entry.rebuilt_at = {}, {}, entry.recorded - len(entry.responses)
            todo = list(entry.responses.items())
        else:
            todo = [(rid, seq) for rid, seq in entry.responses.items() if rid >= entry.indexed_below]
        for rid, seq in todo:
            self._index(entry, rid, seq)
        entry.indexed_below = self._next_id

    def _index(self, entry: PromptHistory, rid: int, seq: array[int]) -> None:
        by_pair, by_token, base = entry.by_pair, entry.by_token, rid << _POS_BITS
        for end in range(1, len(seq)):  # the tokens before `end`, and a token after them
            by_token.setdefault(seq[end - 1], []).append(base | end)
            if end >= 2:
                by_pair.setdefault(_pair(seq[end - 2], seq[end - 1]), []).append(base | end)

    def _remember(self, rid: int, seq: array[int]) -> None:
        """Point every pair of `seq` that a token follows at the position after it (the newest wins)."""
        if len(seq) < 3:
            return
        t = np.frombuffer(seq, dtype=np.intc).astype(np.int64)
        pairs = (t[:-2] << _POS_BITS) | t[1:-1]
        base = rid << _POS_BITS
        self._newest.update(zip(pairs.tolist(), range(base | 2, base | len(seq)), strict=True))

    def _forget(self, rid: int) -> None:
        seq = self._responses.pop(rid)
        self._tokens -= len(seq)
        if not self.across_prompts:
            return
        self._newest_dead += len(seq)
        if self._newest_dead > max(self._tokens, 1024):
            # The table's entries into evicted responses are skipped at lookup; rebuild it once they
            # may be as many as the live ones (oldest first, so that the newest wins).
            self._newest, self._newest_dead = {}, 0
            for live_rid, live in self._responses.items():
                self._remember(live_rid, live)


class ResponseInbox:
    """Answers read from the region, waiting for the engine's thread to record them (`ResponseHistory.record`).

    `put` may be called from any thread; `take` from the engine's. A FIFO bounded in tokens: beyond
    `max_tokens` (the history's own budget: it would evict them anyway) the oldest answers go.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._queue: deque[tuple[Sequence[int], Sequence[int]]] = deque()
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, prompt_ids: Sequence[int], completion: Sequence[int]) -> int:
        """Queue one answer; returns how many older ones were dropped to make room."""
        dropped = 0
        with self._lock:
            self._queue.append((prompt_ids, completion))
            self._tokens += len(completion)
            while self._tokens > self.max_tokens and len(self._queue) > 1:
                self._tokens -= len(self._queue.popleft()[1])
                dropped += 1
        return dropped

    def take(self, max_tokens: int) -> list[tuple[Sequence[int], Sequence[int]]]:
        """The oldest answers, whole, up to `max_tokens` tokens (at least one while any waits)."""
        out: list[tuple[Sequence[int], Sequence[int]]] = []
        taken = 0
        with self._lock:
            while self._queue and (not out or taken + len(self._queue[0][1]) <= max_tokens):
                answer = self._queue.popleft()
                taken += len(answer[1])
                self._tokens -= len(answer[1])
                out.append(answer)
        return out
