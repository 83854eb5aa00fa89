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
  answers) cost a copy of their tokens and no index (~0.07 us a token here, against ~2.3 to index);
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
import math
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

_ALPHA = 0.2
"""Weight of the newest verification in a prompt's acceptance average."""


def prompt_key(prompt_ids: Sequence[int]) -> bytes:
    """The history key of a prompt: a digest of its token ids (same prompt, same key, any group id)."""
    return hashlib.blake2b(np.asarray(prompt_ids, dtype="<i4").tobytes(), digest_size=16).digest()


_POS_BITS = 32  # an index entry packs (response serial, position) into one int


@dataclass(slots=True)
class PromptHistory:
    """The recent responses to one prompt and the index over them."""

    tail: tuple[int, ...]
    """The prompt's last tokens: context for matching the first completion tokens."""
    responses: dict[int, array[int]] = field(default_factory=dict)
    """Serial number -> `tail` + the response's tokens (4 bytes a token); the last `max_responses`."""
    lengths: list[int] = field(default_factory=list)
    serial: int = 0
    """Responses recorded so far (the next one's serial number)."""
    indexed_from: int = 0
    """The index holds every response from this serial on (evicted ones are skipped at lookup)..."""
    indexed_to: int = 0
    """... up to this one: those recorded since are indexed at the prompt's next draft."""
    acceptance: float = 1.0
    """Moving average of the share of drafted tokens the target policy accepted."""
    by_pair: dict[int, list[int]] = field(default_factory=dict)
    """The two tokens before a position -> [serial << 32 | position]: where a context may continue."""
    by_token: dict[int, list[int]] = field(default_factory=dict)
    """The token before a position -> the same (for a match of one token)."""

    def mean_length(self) -> float:
        return sum(self.lengths) / len(self.lengths)

    def tokens(self) -> int:
        return sum(len(r) for r in self.responses.values())


def _pair(a: int, b: int) -> int:
    return (a << _POS_BITS) | b


class ResponseHistory:
    """A bounded least-recently-used table of earlier responses per prompt (see the module docstring)."""

    SCAN = 64
    """Most index entries (the newest) a lookup scores: a frequent token must not make a step slow."""

    def __init__(self, *, max_prompts: int = 4096, max_responses: int = 8, max_tokens: int = 1 << 20,
                 max_ngram: int = 4, min_ngram: int = 1, min_acceptance: float = 0.2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_prompts, self.max_responses, self.max_tokens = max_prompts, max_responses, max_tokens
        self.max_ngram, self.min_ngram, self.min_acceptance = max_ngram, min_ngram, min_acceptance
        self._prompts: OrderedDict[bytes, PromptHistory] = OrderedDict()
        self._tokens = 0
        self._length_sum = 0.0
        self._length_count = 0

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
        entry.responses[entry.serial] = seq
        entry.lengths.append(len(completion))
        self._tokens += len(seq)
        entry.serial += 1
        if len(entry.responses) > self.max_responses:
            self._tokens -= len(entry.responses.pop(entry.serial - self.max_responses - 1))
            del entry.lengths[0]
        while len(self._prompts) > self.max_prompts or (self._tokens > self.max_tokens and len(self._prompts) > 1):
            self._tokens -= self._prompts.popitem(last=False)[1].tokens()
        # The policy answered again: let drafting for this prompt try once more if it had stopped.
        entry.acceptance = max(entry.acceptance, self.min_acceptance)
        self._length_sum += len(completion)
        self._length_count += 1

    def predicted_length(self, key: bytes, default: float) -> float:
        """Mean length of the prompt's earlier responses; else the mean of all; else `default`."""
        entry = self._prompts.get(key)
        if entry is not None:
            return entry.mean_length()
        return self._length_sum / self._length_count if self._length_count else default

    def draft(self, entry: PromptHistory, completion: Sequence[int], k: int, hint: int = -1) -> tuple[list[int], int]:
        """Up to `k` tokens that followed the longest matching suffix (up to `max_ngram` tokens) of
        (prompt tail + `completion`) in an earlier response: nearest to the same position, then newest;
        and where they start (packed serial and position: the `hint` of the next call, moved past the
        tokens taken). ([], -1) when none matches or drafting is off for the prompt.

        `hint`: where the previous draft continues; used as is while the last two tokens still match
        there (a sample following one earlier answer costs no search).

        Fewer than `k` where the prompt's drafts are often rejected: verifying a token costs compute,
        and with acceptance a the run of accepted drafts is a / (1 - a) long on average."""
        a = entry.acceptance
        if a < self.min_acceptance:
            return [], -1
        k = min(k, math.ceil(a / (1.0 - a)) + 1) if a < 1.0 else k
        if k <= 0:
            return [], -1
        need = max(0, self.max_ngram - len(completion))
        context = [*entry.tail[max(0, len(entry.tail) - need):], *completion[len(completion) - self.max_ngram + need:]]
        if not context:
            return [], -1
        live, mask = entry.responses, (1 << _POS_BITS) - 1
        if hint >= 0 and len(context) >= 2:
            seq = live.get(hint >> _POS_BITS)
            pos = hint & mask
            if seq is not None and 2 <= pos < len(seq) and seq[pos - 1] == context[-1] and seq[pos - 2] == context[-2]:
                return seq[pos:pos + k].tolist(), hint
        self._catch_up(entry)
        found: list[int] = []
        if len(context) >= 2:
            found = entry.by_pair.get(_pair(context[-2], context[-1]), [])
        if not found and self.min_ngram <= 1:
            found = entry.by_token.get(context[-1], [])
        here = len(entry.tail) + len(completion)
        best: tuple[int, int, int] | None = None  # (match length, -distance, serial) of the best candidate
        best_at = -1
        for packed in found[-self.SCAN:]:
            serial, pos = packed >> _POS_BITS, packed & mask
            seq = live.get(serial)
            if seq is None:
                continue
            m = 1
            while m < len(context) and m < pos and seq[pos - 1 - m] == context[-1 - m]:
                m += 1
            score = (m, -abs(pos - here), serial)
            if best is None or score > best:
                best, best_at = score, packed
        if best is None or best[0] < self.min_ngram:
            return [], -1
        return live[best_at >> _POS_BITS][(best_at & mask):(best_at & mask) + k].tolist(), best_at

    def observe(self, entry: PromptHistory, drafted: int, accepted: int) -> None:
        """The target policy accepted `accepted` of `drafted` tokens drafted for the prompt."""
        if drafted:
            entry.acceptance += _ALPHA * (accepted / drafted - entry.acceptance)

    def _catch_up(self, entry: PromptHistory) -> None:
        """Index the prompt's responses recorded since its last draft."""
        if entry.indexed_to == entry.serial:
            return
        if entry.serial - entry.indexed_from > 2 * self.max_responses:
            # Evicted responses' entries are skipped at lookup; drop them once they are as many as the live ones.
            entry.by_pair, entry.by_token, entry.indexed_from = {}, {}, entry.serial - len(entry.responses)
            todo = list(entry.responses.items())
        else:
            todo = [(serial, seq) for serial, seq in entry.responses.items() if serial >= entry.indexed_to]
        for serial, seq in todo:
            self._index(entry, serial, seq)
        entry.indexed_to = entry.serial

    def _index(self, entry: PromptHistory, serial: int, seq: array[int]) -> None:
        by_pair, by_token, base = entry.by_pair, entry.by_token, serial << _POS_BITS
        for end in range(1, len(seq)):  # the tokens before `end`, and a token after them
            by_token.setdefault(seq[end - 1], []).append(base | end)
            if end >= 2:
                by_pair.setdefault(_pair(seq[end - 2], seq[end - 1]), []).append(base | end)


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
