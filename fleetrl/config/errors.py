"""Errors of the config layer: one class, one line that names file, line and field."""

from __future__ import annotations


class ConfigError(ValueError):
    """A fleet.yaml that cannot be used. `str()` is one line: `file:line: field: message`."""

    def __init__(self, file: str, field: str | None, line: int | None, message: str) -> None:
        self.file, self.field, self.line, self.message = file, field, line, message
        where = f"{file}:{line}" if line else file
        super().__init__(f"{where}: {field}: {message}" if field else f"{where}: {message}")


class SecretError(ValueError):
    """A secret that cannot be read. The one-line message names the field and the source, never the value."""
