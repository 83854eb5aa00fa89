"""Secrets in the config: a field type that never shows its value, and where the values come from.

A secret field `X` (type `Secret`) has two siblings, `X_file` and `X_env`. Its value is read from, in
this order: the file `X_file` (a systemd credential — `$CREDENTIALS_DIRECTORY/name` is expanded — or
a mounted Kubernetes secret), `X` itself in fleet.yaml (discouraged: the file becomes a secret too),
then the environment variable `X_env`. Whatever the source, the value is registered with
`fleetrl.log.register_secret`, so a log event, an error line or a status line that would carry it
shows `[REDACTED]` instead; the field itself prints as `**********` (`config check`, reprs).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from pydantic import BaseModel, SecretStr

from fleetrl.config.errors import SecretError
from fleetrl.log import register_secret

Secret = SecretStr
"""A config value that never shows itself: `str()`, `repr()` and JSON dumps give `**********`."""


@dataclass(frozen=True)
class SecretField:
    """One secret field of a loaded config: where it sits and the model that holds it."""

    path: str
    owner: BaseModel
    name: str

    def sources(self) -> tuple[SecretStr | None, str | None, str | None]:
        """(inline value, environment variable name, file path) as configured."""
        get = getattr
        return get(self.owner, self.name), get(self.owner, f"{self.name}_env", None), \
            get(self.owner, f"{self.name}_file", None)

    def value(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The secret from its first configured source (None when none is set); registered for redaction."""
        inline, env_name, file = self.sources()
        found: str | None = None
        if file:
            found = _read_file(self.path, file)
        elif inline is not None:
            found = inline.get_secret_value()
        elif env_name:
            found = (os.environ if environ is None else environ).get(env_name) or None
        if found is not None:
            found = found.strip()
            register_secret(found)
        return found or None


def _read_file(field: str, file: str) -> str:
    path = pathlib.Path(os.path.expandvars(file))
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise SecretError(f"{field}_file: cannot read secret file {path}: {reason}") from exc


def secret_fields(model: BaseModel, prefix: str = "") -> Iterator[SecretField]:
    """Every `Secret` field inside `model` (nested models and lists of them), with its dotted path."""
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        path = f"{prefix}{name}"
        if info.annotation is not None and _is_secret(info.annotation):
            yield SecretField(path, model, name)
        elif isinstance(value, BaseModel):
            yield from secret_fields(value, f"{path}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    label = getattr(item, "name", i)
                    yield from secret_fields(item, f"{path}[{label}].")


def _is_secret(annotation: object) -> bool:
    if annotation is SecretStr:
        return True
    return any(_is_secret(a) for a in getattr(annotation, "__args__", ()))


def register_all(model: BaseModel, environ: Mapping[str, str] | None = None) -> int:
    """Read every configured secret once so that each is redacted from logs from the start.

    A secret file that cannot be read is left for the component that needs it to report; returns
    how many secrets were found.
    """
    found = 0
    for field in secret_fields(model):
        try:
            found += field.value(environ) is not None
        except SecretError:
            continue
    return found
