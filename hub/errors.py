"""Errors of the tensor hub.

    HubError                      anything the hub refuses or cannot do; `retriable` says whether
    ├── StoreError                    trying again later may succeed (a network blip, a missing
    │   ├── ObjectNotFound            object a replicator has not copied yet)
    │   └── ObjectExists          a conditional create lost: someone else wrote that key first
    ├── VersionConflict           another publisher claimed version N first
    ├── IntegrityError            bytes whose sha256 does not match the manifest, a frame that
    │                             does not decode, a manifest that contradicts its key
    ├── SignatureError            an unsigned or mis-signed manifest, or a missing key
    ├── LeaseLost                 a replicator's lease was taken over
    ├── BaseMismatch              a LoRA adapter version whose base the reader does not hold
    ├── CodecError                a tensor the codec cannot encode (dtype, shape)
    └── UnknownVersion            a version a command names that the store holds no manifest of

Messages name the store and key, and the tensor where one is at fault, so that an operator knows
which object to look at.
"""

from __future__ import annotations


class HubError(Exception):
    """Base of every hub error."""

    retriable: bool = False

    def __init__(self, message: str, *, retriable: bool | None = None) -> None:
        super().__init__(message)
        if retriable is not None:
            self.retriable = retriable


class StoreError(HubError):
    """An object store operation failed (I/O, HTTP)."""

    retriable = True


class ObjectNotFound(StoreError):
    """The key does not exist in the store (yet)."""

    retriable = True


class ObjectExists(StoreError):
    """A conditional create found the key already there."""

    retriable = False


class VersionConflict(HubError):
    """Another publisher created this version's manifest first."""


class IntegrityError(HubError):
    """Bytes that do not match what the manifest promises."""


class SignatureError(IntegrityError):
    """A manifest that is unsigned, signed with another key or scheme, or unverifiable."""


class LeaseLost(HubError):
    """The replicator lease is held by someone else."""

    retriable = True


class BaseMismatch(HubError):
    """A LoRA adapter version applies to a base version other than the one the reader holds: it must
    load that base first (the adapter alone would run on the wrong weights)."""


class CodecError(HubError):
    """A tensor the codec cannot handle."""


class UnknownVersion(HubError):
    """A version named on the command line that the store does not hold. `argument` is the flag that
    named it: `fleetrl` refuses it as a bad argument (one line naming the flag, exit 2)."""

    def __init__(self, message: str, *, argument: str) -> None:
        super().__init__(message)
        self.argument = argument
