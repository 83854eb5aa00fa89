"""Manifest signatures: HMAC-SHA256 with a shared key, or Ed25519 (DESIGN.md §5).

Keys come from a file or an environment variable named in `hub.signing`, never from the config
itself. Ed25519 lets rollout regions verify with the public key alone (`public_key_file`), so a
compromised region cannot forge a version. Every key has a short `key_id` (a hash prefix) that
manifests carry, so a refusal can say which key signed and which one was expected.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pathlib
from dataclasses import dataclass
from typing import Any

from fleetrl.config import SigningConfig
from fleetrl.hub.errors import SignatureError


def _key_id(material: bytes) -> str:
    return hashlib.sha256(material).hexdigest()[:16]


def _read_secret(cfg: SigningConfig) -> tuple[bytes, str] | None:
    """The key material and where it came from; None when neither file nor variable is set."""
    if cfg.key_file:
        try:
            return pathlib.Path(cfg.key_file).read_bytes().strip(), f"file {cfg.key_file}"
        except OSError as exc:
            raise SignatureError(f"cannot read signing key file {cfg.key_file}: {exc.strerror}") from exc
    if cfg.key_env and os.environ.get(cfg.key_env):
        return os.environ[cfg.key_env].strip().encode(), f"environment variable {cfg.key_env}"
    return None


@dataclass(frozen=True)
class Keys:
    """What one process can do: sign (publisher) and/or verify (everyone)."""

    scheme: str
    key_id: str
    signing_key: Any = None
    verify_key: Any = None

    def sign(self, data: bytes) -> str:
        if self.signing_key is None:
            raise SignatureError(f"no {self.scheme} signing key: set hub.signing.key_file or key_env")
        if self.scheme == "hmac-sha256":
            return hmac.new(self.signing_key, data, hashlib.sha256).hexdigest()
        return str(self.signing_key.sign(data).hex())

    def verify(self, data: bytes, signature: str, where: str) -> None:
        """Raise SignatureError (naming `where`) unless `signature` signs `data` with our key."""
        if self.scheme == "hmac-sha256":
            good = hmac.compare_digest(hmac.new(self.verify_key, data, hashlib.sha256).hexdigest(), signature)
        else:
            from cryptography.exceptions import InvalidSignature

            try:
                self.verify_key.verify(bytes.fromhex(signature), data)
                good = True
            except (InvalidSignature, ValueError):
                good = False
        if not good:
            raise SignatureError(f"{where}: signature does not verify with {self.scheme} key {self.key_id}")


def _ed25519_private(material: bytes, source: str) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        if material.startswith(b"-----BEGIN"):
            key = serialization.load_pem_private_key(material, password=None)
        else:
            key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(material.decode()))
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"Ed25519 private key from {source} is not PEM or 64 hex digits: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"key from {source} is not an Ed25519 private key")
    return key


def _ed25519_public(path: str) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        material = pathlib.Path(path).read_bytes().strip()
        if material.startswith(b"-----BEGIN"):
            key = serialization.load_pem_public_key(material)
        else:
            key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(material.decode()))
    except (OSError, ValueError, TypeError) as exc:
        raise SignatureError(f"cannot load Ed25519 public key file {path}: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"{path} is not an Ed25519 public key")
    return key


def _raw_public(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    raw: bytes = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw


def load_keys(cfg: SigningConfig) -> Keys:
    """Keys from the config's sources; raises SignatureError naming the source that is missing."""
    secret = _read_secret(cfg)
    if cfg.scheme == "hmac-sha256":
        if secret is None:
            raise SignatureError(
                f"no HMAC key: set environment variable {cfg.key_env} or hub.signing.key_file"
            )
        return Keys("hmac-sha256", _key_id(secret[0]), secret[0], secret[0])
    private = _ed25519_private(*secret) if secret is not None else None
    if cfg.public_key_file:
        public = _ed25519_public(cfg.public_key_file)
    elif private is not None:
        public = private.public_key()
    else:
        raise SignatureError(
            f"no Ed25519 key: set hub.signing.public_key_file, key_file or environment variable {cfg.key_env}"
        )
    return Keys("ed25519", _key_id(_raw_public(public)), private, public)


def generate_ed25519() -> tuple[str, str]:
    """A new Ed25519 key pair as (private hex, public hex): for set-up scripts and tests."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return private.hex(), _raw_public(key.public_key()).hex()
