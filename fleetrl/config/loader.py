"""Load `fleet.yaml` into a `FleetConfig`, with `FLEETRL_...` environment overrides.

Errors are `ConfigError`s whose one-line message names the file, the line and the field, so that a
daemon that refuses to start says exactly what to fix.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from fleetrl.config.base import ReferenceProblem
from fleetrl.config.errors import ConfigError
from fleetrl.config.fleet import FleetConfig
from fleetrl.config.pricing import FilePriceConfig

ENV_PREFIX = "FLEETRL_"
# Fields that accept a bare string for their main key (`kafka: host:9092`).
_SHORTHANDS = {"kafka": "bootstrap", "store": "url", "home_store": "url"}


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> FleetConfig:
    """Read, override from the environment, validate, and resolve relative paths of a fleet.yaml."""
    file = pathlib.Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(str(file), None, None, f"cannot read: {exc.strerror}") from exc
    return parse_config(text, source=str(file), base_dir=file.resolve().parent, env=env)


def parse_config(
    text: str,
    *,
    source: str = "<string>",
    base_dir: pathlib.Path | None = None,
    env: Mapping[str, str] | None = None,
) -> FleetConfig:
    """Validate YAML text; `env` defaults to `os.environ` (pass `{}` to ignore the environment)."""
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise ConfigError(source, None, line, f"not valid YAML: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(source, None, 1, "the top level must be a mapping")
    apply_env_overrides(data, os.environ if env is None else env, source)
    try:
        config = FleetConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ReferenceProblem):  # cross-field check: it knows where it points
            loc, msg = loc + cause.loc, cause.message
        field = _dotted(loc, data)
        raise ConfigError(source, field or None, _line_of(root, loc), msg) from exc
    if base_dir is not None:
        _resolve_paths(config, base_dir)
    return config


def apply_env_overrides(data: dict[str, Any], env: Mapping[str, str], source: str) -> None:
    """`FLEETRL_A__B__C=v` sets data[a][b][c] = yaml(v). List items by index or by `name`.

    Only variables whose first segment is a top-level field are overrides; others such as
    `FLEETRL_HUB_KEY` (a signing key) are left alone.
    """
    top = set(FleetConfig.model_fields)
    for key in sorted(env):
        if not key.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in key[len(ENV_PREFIX) :].split("__")]
        if parts[0] not in top:
            continue
        try:
            value = yaml.safe_load(env[key])
        except yaml.YAMLError as exc:
            raise ConfigError(source, ".".join(parts), None, f"{key} is not a YAML value") from exc
        _set_path(data, parts, value, key, source)


def _set_path(data: Any, parts: list[str], value: Any, key: str, source: str) -> None:
    node = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            idx = _list_index(node, part)
            if idx is None:
                raise ConfigError(source, ".".join(parts), None, f"{key}: no list item {part!r}")
            if last:
                node[idx] = value
            else:
                node = node[idx]
            continue
        if not isinstance(node, dict):
            raise ConfigError(source, ".".join(parts), None, f"{key}: {part!r} is not a mapping")
        if last:
            node[part] = value
            continue
        if isinstance(node.get(part), str) and part in _SHORTHANDS:
            node[part] = {_SHORTHANDS[part]: node[part]}
        node = node.setdefault(part, {})


def _list_index(items: list[Any], part: str) -> int | None:
    if part.isdigit():
        return int(part) if int(part) < len(items) else None
    for i, item in enumerate(items):
        if isinstance(item, dict) and str(item.get("name", "")).replace("-", "_") == part:
            return i
    return None


def _dotted(loc: tuple[Any, ...], data: Any) -> str:
    """Field path for messages; list items that have a `name` show it (`regions[eu-west]`)."""
    out: list[str] = []
    node = data
    for part in loc:
        if isinstance(part, int) and isinstance(node, list):
            item = node[part] if part < len(node) else None
            name = item.get("name") if isinstance(item, dict) else None
            out[-1:] = [f"{out[-1] if out else ''}[{name if name else part}]"]
            node = item
            continue
        if isinstance(node, dict) and part not in node and node.get("kind") == part:
            continue  # discriminated-union tag, not a key
        out.append(str(part))
        node = node.get(part) if isinstance(node, dict) else None
    return ".".join(out)


def _line_of(root: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the deepest YAML node that the error location reaches."""
    node, line = root, (root.start_mark.line + 1 if root is not None else None)
    for part in loc:
        child = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == part:
                    child, line = v, k.start_mark.line + 1
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
            line = child.start_mark.line + 1
        if child is None:
            break
        node = child
    return line


def _resolve_paths(config: FleetConfig, base: pathlib.Path) -> None:
    """Relative store paths, checkpoint, model, tokenizer, dataset and eval set folders, and price files are relative to
    the config file."""
    for store in config.stores().values():
        if store.scheme == "file" and not store.url.startswith("file://"):
            store.url = (base / store.url).resolve().as_uri()
    m, d, r = config.model, config.dataset, config.reward
    if m.path is not None:
        m.path = _resolve(base, m.path)
    if m.tokenizer is not None and m.tokenizer != "char":
        m.tokenizer = _resolve(base, m.tokenizer)
    if d.path is not None:
        d.path = _resolve(base, d.path)
    r.python_path = [_resolve(base, folder) for folder in r.python_path]
    if d.env is not None:
        d.env.python_path = [_resolve(base, folder) for folder in d.env.python_path]
    for eval_set in config.eval.sets:
        if eval_set.path is not None:
            eval_set.path = _resolve(base, eval_set.path)
        if eval_set.reward is not None:
            eval_set.reward.python_path = [_resolve(base, folder) for folder in eval_set.reward.python_path]
    for region in config.regions:
        for price in [region.price, *(p.price for p in region.pools)]:
            if isinstance(price, FilePriceConfig):
                price.path = _resolve(base, price.path)
    ckpt = pathlib.Path(config.trainer.checkpoint_dir)
    if not ckpt.is_absolute():
        config.trainer.checkpoint_dir = str((base / ckpt).resolve())
    if config.tracking.output_dir is not None:
        config.tracking.output_dir = _resolve(base, config.tracking.output_dir)


def _resolve(base: pathlib.Path, path: str) -> str:
    return str((base / pathlib.Path(path).expanduser()).resolve())
