"""Prompt text <-> token ids for the worker: the char tokenizer, or a local Hugging Face tokenizer.

Chat prompts (`messages`, `fleetrl.prompt/2`) are rendered with the tokenizer's chat template and
`add_generation_prompt=True`, exactly as `tokenizer.apply_chat_template` does: the ids the engine
decodes from, the record carries, and the trainer learns from are the same ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from fleetrl.rollout.errors import EngineError, TaskError
from fleetrl.rollout.tasks.tokenizer import CharTokenizer


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """Chat messages -> prompt ids through the chat template (TaskError when there is none)."""
        ...

    def decode_all(self, ids: Iterable[int]) -> str:
        """Every token as text, special ones included (a prompt as the model saw it)."""
        ...

    def decode(self, ids: Iterable[int]) -> str: ...


class _HfCodec:
    """A transformers tokenizer: special tokens added on encode, skipped on decode."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int]) -> None:
        self.tok, self.eos = tokenizer, frozenset(eos_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=True)["input_ids"])

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise TaskError(f"tokenizer {self.tok.name_or_path!r} has no chat template: cannot render chat messages")
        try:
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as exc:  # a Jinja template can raise anything (it may even raise on purpose)
            raise TaskError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return [int(i) for i in ids]

    def decode_all(self, ids: Iterable[int]) -> str:
        return str(self.tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        kept = []
        for i in ids:
            if int(i) in self.eos:
                break
            kept.append(int(i))
        return str(self.tok.decode(kept, skip_special_tokens=True))


def load_codec(model_config: Any, eos_ids: Sequence[int] = ()) -> TextCodec:
    """`model.tokenizer`: `char`, or a local tokenizer folder (also the checkpoint's own folder)."""
    name = model_config.tokenizer_source
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

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        raise TaskError("model.tokenizer 'char' has no chat template: cannot render chat messages")

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(ids)

    def decode_all(self, ids: Iterable[int]) -> str:
        return self.tok.decode(ids)
