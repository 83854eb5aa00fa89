"""Manifest signatures: HMAC-SHA256 with a shared key, or Ed25519 (DESIGN.md §5).

The signing key is a config secret (`hub.signing.key`, `key_file` or `key_env`, see
fleetrl/config/secrets.py). Ed25519 is the default: rollout regions verify with the public key alone
(`public_key` or `public_key_file`), so a compromised region cannot forge a version; HMAC is an
explicit choice for single-tenant setups, where every reader could also sign. Every key has a short
`key_id` (a hash prefix) that manifests carry, so a refusal can say which key signed and which one was
expected.
"""

from __future__ import annotations

import hashlib
import hmac
import pathlib
from dataclasses import dataclass
from typing import Any

from fleetrl.config import SecretError, SecretField, SigningConfig
from fleetrl.hub.errors import SignatureError


def _key_id(material: bytes) -> str:
    return hashlib.sha256(material).hexdigest()[:16]


def _read_secret(cfg: SigningConfig) -> tuple[bytes, str] | None:
    """The signing key material and where it came from; None when no source is set."""
    field = SecretField("hub.signing.key", cfg, "key")
    try:
        value = field.value()
    except SecretError as exc:
        raise SignatureError(str(exc)) from exc
    if value is None:
        return None
    _, env_name, file = field.sources()
    inline = "hub.signing.key" if cfg.key is not None else f"environment variable {env_name}"
    return value.encode(), f"file {file}" if file else inline


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
        raise SignatureError(f"Ed25519 private key from {source} is not PEM or 64 hex digits (hub.signing.scheme is "
                             f"ed25519, the default; a shared HMAC key needs scheme: hmac-sha256)") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"key from {source} is not an Ed25519 private key")
    return key


def _ed25519_public(cfg: SigningConfig) -> Any:
    """The configured public key (`public_key`, else `public_key_file`); None when neither is set."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    where = "hub.signing.public_key" if cfg.public_key else f"public key file {cfg.public_key_file}"
    try:
        if cfg.public_key:
            material = cfg.public_key.strip().encode()
        elif cfg.public_key_file:
            material = pathlib.Path(cfg.public_key_file).read_bytes().strip()
        else:
            return None
        if material.startswith(b"-----BEGIN"):
            key = serialization.load_pem_public_key(material)
        else:
            key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(material.decode()))
    except (OSError, ValueError, TypeError) as exc:
        raise SignatureError(f"cannot load the Ed25519 public key from {where}: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"{where} is not an Ed25519 public key")
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
    public = _ed25519_public(cfg)
    if public is None and private is None:
        raise SignatureError(
            f"no Ed25519 key: set hub.signing.public_key or public_key_file (readers), or key_file / "
            f"environment variable {cfg.key_env} (the publisher)"
        )
    if public is None:
        public = private.public_key()  # type: ignore[union-attr]  # not both None: checked above
    elif private is not None and _raw_public(private.public_key()) != _raw_public(public):
        # A publisher whose versions no reader would accept must not start publishing them.
        own = _key_id(_raw_public(private.public_key()))
        raise SignatureError(f"the Ed25519 private key (key {own}) does not match the configured public key "
                             f"{_key_id(_raw_public(public))}: readers would refuse every version it signs")
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
