"""Version manifests and the store layout (DESIGN.md §5).

    <run>/objects/<sha256>            immutable objects: parts back to back (content-addressed)
    <run>/versions/<N:012d>.json      signed manifest, created with a conditional write
    <run>/latest                      pointer to the newest version (the only mutable object)
    <run>/holders/<N:012d>/<store>    peer reference: that store holds every object of version N
    <run>/lease/<name>/<gen:012d>     replicator lease records (see lease.py)

A manifest lists each tensor under its Hugging Face name with dtype, shape, encoding, its parts
(object, byte range, sha256 of the part, element range) and the sha256 of its bytes after apply.
The manifest of a LoRA adapter version (`adapter`) lists the adapter's tensors under peft's names and
names the version of the base model they apply to; its chain (anchor, parent, deltas) runs over
adapter versions only, and the base is a version of its own, published once.
The file is `{"signature":{...},"manifest":{...}}` in one zstd frame; the signature covers the exact bytes of
the `manifest` value as stored (nothing is re-serialized to check it), so any edit, even of whitespace, is
refused, and the run and version inside it must match the key it is stored under (a manifest copied
under another key is refused).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Literal

import zstandard
from pydantic import BaseModel, ConfigDict, ValidationError

from fleetrl.hub.errors import IntegrityError, SignatureError
from fleetrl.hub.signing import Keys

FORMAT = "fleetrl.hub/1"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_MANIFEST_BYTES = 256 << 20


def object_key(run: str, sha: str) -> str:
    return f"{run}/objects/{sha}"


def version_key(run: str, version: int) -> str:
    return f"{run}/versions/{version:012d}.json"


def latest_key(run: str) -> str:
    return f"{run}/latest"


def holder_key(run: str, version: int, store: str) -> str:
    return f"{run}/holders/{version:012d}/{store}"


def holders_prefix(run: str, version: int) -> str:
    return f"{run}/holders/{version:012d}/"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PartRef(_Frozen):
    """One part: bytes [offset, offset+length) of object `object`, covering elements [start, stop)."""

    object: str
    offset: int
    length: int
    sha256: str
    """Of the part's bytes as stored: checked before decoding."""
    start: int
    stop: int
    changed_digest: str | None = None
    """Delta parts: 64-bit digest (`kernels.digest`, hex) of the new words at the changed positions,
    in order. An in-place update checks what it writes against it, without hashing the unchanged rest
    of the tensor."""


class TensorEntry(_Frozen):
    name: str
    dtype: str
    shape: list[int]
    sha256: str
    """Of the tensor's bytes (little-endian, row-major) after apply."""
    encoding: Literal["anchor", "delta", "same", "tied"]
    parts: list[PartRef] = []
    tied_to: str | None = None
    """For `tied`: the tensor whose bytes these are (tied embeddings are stored once)."""
    delta: list[PartRef] | None = None
    """Anchors only: the sparse change from the parent, so a reader one step behind skips the dense copy."""


class AdapterInfo(_Frozen):
    """What makes a version a LoRA adapter, and how to apply it (peft's names)."""

    base: int
    """The version of the full model this adapter applies to (a reader must hold exactly that one)."""
    r: int
    """Rank of every A (r x in) and B (out x r)."""
    lora_alpha: int
    """Each target weight becomes W + lora_alpha / r * B @ A."""
    lora_dropout: float = 0.0
    """Training-time dropout, kept for the exported adapter config (inference ignores it)."""
    peft_type: Literal["LORA"] = "LORA"

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r


class Manifest(_Frozen):
    format: Literal["fleetrl.hub/1"] = "fleetrl.hub/1"
    run: str
    version: int
    parent: int | None
    """Version the deltas apply to (None for the very first anchor)."""
    anchor: int
    """The anchor the chain of this version starts from (itself for an anchor)."""
    published_at: float
    objects: dict[str, int]
    """Every object this version's parts live in, with its size."""
    tensors: list[TensorEntry]
    adapter: AdapterInfo | None = None
    """Set for a LoRA adapter version: the tensors are the adapter's, applied to version `adapter.base`."""

    @property
    def base(self) -> int | None:
        """The version of the full model this adapter version applies to; None for full weights."""
        return None if self.adapter is None else self.adapter.base

    @property
    def is_anchor(self) -> bool:
        return self.anchor == self.version

    def delta_objects(self) -> set[str]:
        """Objects a reader at the parent version needs (for an anchor: its `delta` parts only)."""
        out: set[str] = set()
        for t in self.tensors:
            refs = t.delta if self.is_anchor else t.parts
            out.update(p.object for p in refs or [])
        return out


_SIGNATURE_HEAD = re.compile(r'\s*\{\s*"signature"\s*:\s*')
_MANIFEST_HEAD = re.compile(r'\s*,\s*"manifest"\s*:\s*')


def dump_signed(manifest: Manifest, keys: Keys) -> bytes:
    """The manifest file: signed JSON in one zstd frame (hex digests and names shrink ~4x, which
    matters next to deltas of a few hundred KB). Level 9: level 19 saved 5 % more of a 2.7 KB
    manifest for 30x the time (10 ms against 0.3 ms, on the path from a step to its version)."""
    # A version of full weights is written as before adapters existed (readers of then still read it).
    body = manifest.model_dump_json(exclude={"adapter"} if manifest.adapter is None else None).encode()
    signature = {"scheme": keys.scheme, "key_id": keys.key_id, "value": keys.sign(body)}
    text = b'{"signature":' + json.dumps(signature, separators=(",", ":")).encode() + b',"manifest":' + body + b"}"
    return zstandard.ZstdCompressor(level=9).compress(text)


def manifest_text(data: bytes, where: str) -> bytes:
    """The JSON of a manifest file (zstd-compressed as written, or plain JSON)."""
    if data[:4] != ZSTD_MAGIC:
        return data
    try:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_MANIFEST_BYTES)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{where}: manifest frame does not decode: {exc}") from exc


def _signed_parts(text: str, where: str) -> tuple[Any, str]:
    """The signature and the exact text of the manifest value of a manifest document."""
    head = _SIGNATURE_HEAD.match(text)
    if head is not None:
        try:
            signature, end = json.JSONDecoder().raw_decode(text, head.end())
        except ValueError as exc:
            raise IntegrityError(f"{where}: not a manifest document ({exc})") from exc
        body_head = _MANIFEST_HEAD.match(text, end)
        body = text[body_head.end() :].rstrip() if body_head is not None else ""
        if body.endswith("}") and body[:-1].rstrip().endswith("}"):
            return signature, body[:-1].rstrip()
    try:  # not laid out as written: unsigned, or edited
        doc = json.loads(text)
        return doc.get("signature"), json.dumps(doc["manifest"])
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise IntegrityError(f"{where}: not a manifest document ({exc})") from exc


def load_signed(data: bytes, keys: Keys, where: str, *, run: str, version: int) -> Manifest:
    """Parse, verify the signature, and check the manifest is the one its key promises."""
    try:
        text = manifest_text(data, where).decode()
    except UnicodeDecodeError as exc:
        raise IntegrityError(f"{where}: not a manifest document ({exc})") from exc
    signature, body = _signed_parts(text, where)
    if not isinstance(signature, dict) or not isinstance(signature.get("value"), str):
        raise SignatureError(f"{where}: manifest is unsigned")
    if signature.get("scheme") != keys.scheme:
        raise SignatureError(f"{where}: signed with {signature.get('scheme')!r}, this reader expects {keys.scheme!r}")
    if signature.get("key_id") != keys.key_id:
        raise SignatureError(f"{where}: signed with key {signature.get('key_id')}, expected key {keys.key_id}")
    keys.verify(body.encode(), signature["value"], where)
    try:
        manifest = Manifest.model_validate_json(body)
    except ValidationError as exc:
        raise IntegrityError(f"{where}: signed but malformed manifest: {exc}") from exc
    if manifest.run != run or manifest.version != version:
        raise IntegrityError(
            f"{where}: manifest of run {manifest.run!r} version {manifest.version} stored as "
            f"run {run!r} version {version} (swapped manifest)"
        )
    return manifest


def check_disjoint(refs: list[tuple[str, PartRef]], where: str) -> None:
    """Parts of one tensor in one version cover disjoint element ranges (as the publisher cuts them)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for name, r in refs:
        spans.setdefault(name, []).append((r.start, r.stop))
    for name, ranges in spans.items():
        ranges.sort()
        if any(prev[1] > cur[0] for prev, cur in itertools.pairwise(ranges)):
            raise IntegrityError(f"{where}: parts of tensor {name} overlap")
