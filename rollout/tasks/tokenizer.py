"""The character tokenizer shipped in code (`model.tokenizer: char`): vocab 128, no download.

Ids 0, 1 and 2 are pad, bos and eos; printable ASCII (space to `~`, 95 characters) takes ids
3..97 and newline 98; 99..127 are unused (the tiny model's vocab is 128 so that any of them is
still a valid id). Characters outside this set encode as `?`.
"""

from __future__ import annotations

from collections.abc import Iterable

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = 128
_FIRST = 3
_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
_TO_ID = {ch: _FIRST + i for i, ch in enumerate(_CHARS)}


class CharTokenizer:
    """Text <-> ids, one id per character."""

    pad_id, bos_id, eos_id, vocab_size = PAD_ID, BOS_ID, EOS_ID, VOCAB_SIZE

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        unknown = _TO_ID["?"]
        ids = [_TO_ID.get(ch, unknown) for ch in text]
        return [BOS_ID, *ids] if bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Characters of the ids up to the first eos; pad, bos and unused ids are skipped."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if _FIRST <= i < _FIRST + len(_CHARS):
                out.append(_CHARS[i - _FIRST])
        return "".join(out)
