"""`fleetrl config check` and `fleetrl config reference`."""

from __future__ import annotations

import argparse
import itertools
import json
import types
import typing
from typing import Any, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from fleetrl.config import FleetConfig


def check(args: argparse.Namespace, config: FleetConfig) -> int:
    """Print the resolved config (after env overrides and path resolution)."""
    data = config.model_dump(mode="json")
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        import yaml

        print(yaml.safe_dump(data, sort_keys=False), end="")
        print(f"# ok: run {config.run!r}, {len(config.regions)} region(s)", flush=True)
    return 0


BEGIN, END = "<!-- BEGIN config-reference -->\n", "<!-- END config-reference -->\n"


def reference(args: argparse.Namespace, config: None) -> int:
    """Print the reference, or with `--update FILE` rewrite it between the markers in FILE."""
    if args.update:
        import pathlib

        path = pathlib.Path(args.update)
        text = path.read_text()
        if BEGIN not in text or END not in text:
            raise ValueError(f"{path}: no {BEGIN.strip()} ... {END.strip()} markers")
        head, rest = text.split(BEGIN, 1)
        path.write_text(head + BEGIN + render_reference() + END + rest.split(END, 1)[1])
        print(f"updated the configuration reference in {path}")
        return 0
    print(render_reference(), end="")
    return 0


def render_reference() -> str:
    """Markdown reference of every fleet.yaml field, from the models' docstrings and defaults."""
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    _walk(FleetConfig, "", lines, set())
    return "\n".join(lines) + "\n"


def _walk(model: type[BaseModel], prefix: str, lines: list[str], seen: set[str]) -> None:
    docs = _field_docs(model)
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        doc = docs.get(name) or _class_doc(field.annotation)
        lines.append(f"| `{path}` | {_type_name(field.annotation)} | {_default(field)} | {doc} |")
        for sub in _models_in(field.annotation):
            suffix = "[]." if _is_list(field.annotation) else "."
            tag = f" ({sub.model_fields['kind'].default})" if "kind" in sub.model_fields else ""
            key = path + suffix + tag
            if key not in seen:
                seen.add(key)
                _walk(sub, f"{path}{suffix}" if not tag else f"{path}{tag}.", lines, seen)


def _field_docs(model: type[BaseModel]) -> dict[str, str]:
    """Attribute docstrings (the string right under a field) of a model and its bases."""
    import ast
    import inspect

    out: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        try:
            tree = ast.parse(inspect.getsource(cls))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for a, b in itertools.pairwise(body):
            if (
                isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)
            ):
                out[a.target.id] = " ".join(b.value.value.split()).replace("|", "\\|")
    return out


def _class_doc(annotation: Any) -> str:
    models = _models_in(annotation)
    doc = (models[0].__doc__ or "") if len(models) == 1 else ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _is_list(annotation: Any) -> bool:
    return get_origin(annotation) is list


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a).replace("'", '"') for a in get_args(annotation))
    if origin in (types.UnionType, typing.Union):
        return " \\| ".join(_type_name(a) for a in get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(get_args(annotation)[0])
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(_type_name(a) for a in get_args(annotation))}]"
    if annotation is SecretStr:
        return "secret"
    return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        return "{…}" if isinstance(value, BaseModel) else f"`{json.dumps(value)}`"
    return f"`{json.dumps(field.default)}`"
