"""Shared pieces of the config models: the base model, name patterns, units."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

NAME_RE = r"^[a-z0-9][a-z0-9-]{0,62}$"
MIB = 1024 * 1024


class ReferenceProblem(ValueError):
    """A cross-field check that failed; `loc` points at the field at fault for error messages."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc, self.message = loc, message


class Model(BaseModel):
    """Base of every config model: unknown keys are errors, values are re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
