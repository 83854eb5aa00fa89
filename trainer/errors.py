"""Errors of the trainer.

    TrainerError                 base; `retriable` says whether the same call may succeed later
    ├── DatasetError             a prompt file that cannot be read, or a line of it that is wrong
    ├── CheckpointError          a checkpoint that cannot be written, read, or does not fit the run
    ├── AuditError               the topics and the checkpoint disagree (a group lost or trained twice)
    └── PriceError               a price source that cannot be read or holds no matching price

Messages name the file, line, checkpoint path or group at fault. Broker and hub errors pass
through unchanged: they already name their topic, offset, store and key.
"""

from __future__ import annotations


class TrainerError(Exception):
    """Base of every trainer error."""

    retriable: bool = False


class DatasetError(TrainerError):
    """A prompt source that cannot be read; the message names the file and line."""


class CheckpointError(TrainerError):
    """A checkpoint that cannot be written or read, or that belongs to another run."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


class AuditError(TrainerError):
    """The audit found a group lost or trained more than once."""


class PriceError(TrainerError):
    """A price source (a spot price file, EC2's spot price history) that cannot be read, or holds no price
    for the pool; the message names the region, the pool and the source."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable
