"""Prompt text <-> token ids for the worker: the char tokenizer, or a local Hugging Face tokenizer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from fleetrl.rollout.errors import EngineError
from fleetrl.rollout.tasks.tokenizer import CharTokenizer


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class _HfCodec:
    """A transformers tokenizer: special tokens added on encode, skipped on decode."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int]) -> None:
        self.tok, self.eos = tokenizer, frozenset(eos_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Iterable[int]) -> str:
        kept = []
        for i in ids:
            if int(i) in self.eos:
                break
            kept.append(int(i))
        return str(self.tok.decode(kept, skip_special_tokens=True))


def load_codec(model_config: Any, eos_ids: Sequence[int] = ()) -> TextCodec:
    """`model.tokenizer`: `char`, or a local tokenizer folder (also the checkpoint's own folder)."""
    name = model_config.tokenizer
    if name == "char":
        return _CharCodec()
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise EngineError(f"model.tokenizer {name!r}: cannot load a local tokenizer: {exc}") from exc
    return _HfCodec(tokenizer, eos_ids)


class _CharCodec:
    def __init__(self) -> None:
        self.tok = CharTokenizer()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(ids)
