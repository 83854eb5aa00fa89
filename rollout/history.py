"""Response history: what the policy answered to a prompt before, for drafts and length predictions.

RL revisits its prompts every epoch, and a policy's answers to one prompt in consecutive epochs
are much alike (RhymeRL's observation): the tokens of earlier answers are good guesses of the next
ones. `ResponseHistory` keeps, per prompt (keyed by its token ids, so the same prompt under any
group id matches), the last few responses as token arrays, in a least-recently-used table of
bounded size. The engine records every sample it finishes (`record`) and asks it for

* a draft (`draft`): the tokens that followed the longest suffix of the sample's context (the tail
  of the prompt, then its completion so far) in an earlier response, found through an n-gram index
  (suffix match, no draft model), for the speculative path (`fleetrl.rollout.speculative`);
* a length prediction (`predicted_length`): the mean length of the prompt's earlier responses, or,
  for a prompt never seen, the mean of everything recorded (the engine admits long samples first).

The history is an optimization only: an empty one (a fresh worker) drafts nothing and predicts the
default, and nothing it holds can change the distribution of what is sampled (drafts are verified
by the target policy). Drafting for a prompt stops while the acceptance of its drafts is low (the
policy moved away from its old answers); a new response recorded for it lets it try again.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

_ALPHA = 0.2
"""Weight of the newest verification in a prompt's acceptance average."""


def prompt_key(prompt_ids: Sequence[int]) -> bytes:
    """The history key of a prompt: a digest of its token ids (same prompt, same key, any group id)."""
    return hashlib.blake2b(np.asarray(prompt_ids, dtype="<i4").tobytes(), digest_size=16).digest()


@dataclass(slots=True)
class PromptHistory:
    """The recent responses to one prompt and the n-gram index over them."""

    tail: tuple[int, ...]
    """The prompt's last tokens: context for matching the first completion tokens."""
    responses: dict[int, list[int]] = field(default_factory=dict)
    """Serial number -> `tail` + the response's tokens; the last `max_responses` recorded."""
    lengths: list[int] = field(default_factory=list)
    serial: int = 0
    """Responses recorded so far (the next one's serial number)."""
    indexed_from: int = 0
    """The index holds the n-grams of every response from this serial on (evicted ones are skipped)."""
    acceptance: float = 1.0
    """Moving average of the share of drafted tokens the target policy accepted."""
    index: dict[tuple[int, ...], list[tuple[int, int]]] = field(default_factory=dict)
    """n-gram -> [(response serial, position of the token after it)]."""

    def mean_length(self) -> float:
        return sum(self.lengths) / len(self.lengths)


class ResponseHistory:
    """A bounded least-recently-used table of earlier responses per prompt (see the module docstring)."""

    def __init__(self, *, max_prompts: int = 4096, max_responses: int = 8, max_ngram: int = 4,
                 min_ngram: int = 1, min_acceptance: float = 0.2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_prompts, self.max_responses = max_prompts, max_responses
        self.max_ngram, self.min_ngram, self.min_acceptance = max_ngram, min_ngram, min_acceptance
        self._prompts: OrderedDict[bytes, PromptHistory] = OrderedDict()
        self._length_sum = 0.0
        self._length_count = 0

    def __len__(self) -> int:
        return len(self._prompts)

    def get(self, key: bytes) -> PromptHistory | None:
        entry = self._prompts.get(key)
        if entry is not None:
            self._prompts.move_to_end(key)
        return entry

    def record(self, prompt_ids: Sequence[int], completion: Sequence[int]) -> None:
        """Keep a finished response (the oldest of the prompt's and the least recently used prompt go)."""
        key = prompt_key(prompt_ids)
        entry = self.get(key)
        if entry is None:
            entry = self._prompts[key] = PromptHistory(tuple(int(t) for t in prompt_ids[-self.max_ngram:]))
            while len(self._prompts) > self.max_prompts:
                self._prompts.popitem(last=False)
        seq = [*entry.tail, *(int(t) for t in completion)]
        entry.responses[entry.serial] = seq
        entry.lengths.append(len(completion))
        self._index(entry, entry.serial, seq)
        entry.serial += 1
        if len(entry.responses) > self.max_responses:
            del entry.responses[entry.serial - self.max_responses - 1], entry.lengths[0]
        if entry.serial - entry.indexed_from > 2 * self.max_responses:
            # Evicted responses' n-grams are skipped at lookup; drop them once they are as many as the live ones.
            entry.index, entry.indexed_from = {}, entry.serial - len(entry.responses)
            for serial, old in entry.responses.items():
                self._index(entry, serial, old)
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

    def draft(self, entry: PromptHistory, completion: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the longest matching suffix of (prompt tail + `completion`)
        in an earlier response: nearest to the same position, then newest. [] when none matches or
        drafting is off for the prompt.

        Fewer than `k` where the prompt's drafts are often rejected: verifying a token costs compute,
        and with acceptance a the run of accepted drafts is a / (1 - a) long on average."""
        a = entry.acceptance
        if a < self.min_acceptance:
            return []
        k = min(k, math.ceil(a / (1.0 - a)) + 1) if a < 1.0 else k
        if k <= 0:
            return []
        need = max(0, self.max_ngram - len(completion))
        context = (*entry.tail[max(0, len(entry.tail) - need):], *completion[len(completion) - self.max_ngram + need:])
        here = len(entry.tail) + len(completion)
        live = entry.responses
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            found = [sp for sp in entry.index.get(tuple(context[-n:]), ()) if sp[0] in live]
            if found:
                serial, pos = min(found, key=lambda sp: (abs(sp[1] - here), -sp[0]))
                return live[serial][pos:pos + k]
        return []

    def observe(self, entry: PromptHistory, drafted: int, accepted: int) -> None:
        """The target policy accepted `accepted` of `drafted` tokens drafted for the prompt."""
        if drafted:
            entry.acceptance += _ALPHA * (accepted / drafted - entry.acceptance)

    def _index(self, entry: PromptHistory, serial: int, seq: list[int]) -> None:
        index = entry.index
        for n in range(self.min_ngram, self.max_ngram + 1):
            for end in range(n, len(seq)):  # the n-gram ending before `end`, and a token after it
                index.setdefault(tuple(seq[end - n:end]), []).append((serial, end))
