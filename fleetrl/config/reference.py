"""docs/config.md from the config models: every section and field of `fleet.yaml`, with its type,
default and the docstring written right under it.

    python -m fleetrl.config.reference                        # print the page
    python -m fleetrl.config.reference --update docs/config.md
    python -m fleetrl.config.reference --check docs/config.md # exit 1 when the page is stale

The whole page is generated (its preamble is `PREAMBLE` here), so it cannot drift from the models; a
test checks that it is current. `render_reference()` is the same rows as one table, which
`fleetrl config reference` prints.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import json
import pathlib
import sys
import types
import typing
from typing import Any, NamedTuple, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from fleetrl.config.fleet import FleetConfig

PREAMBLE = """\
# Configuration reference

Every field of `fleet.yaml`, section by section, generated from the config models (`fleetrl/config/`)
by `python -m fleetrl.config.reference --update docs/config.md` (a test fails when it is stale). Any
field can be overridden from the environment: `FLEETRL_ALGORITHM__LR=1e-6`, list items by index or
name (`FLEETRL_REGIONS__EU_WEST_1__KAFKA__BOOTSTRAP=host:9092`). `fleetrl config check` prints the
resolved config; models refuse unknown keys, so a typo names itself.
"""
HEADER = "| field | type | default | description |\n|---|---|---|---|\n"


class Row(NamedTuple):
    path: str
    """Dotted path in fleet.yaml (`regions[].engine (torch).device`)."""
    type: str
    default: str
    doc: str

    def markdown(self) -> str:
        return f"| `{self.path}` | {self.type} | {self.default} | {self.doc} |"


def render_page() -> str:
    """docs/config.md: the preamble, a list of the sections, then one heading and table per section."""
    sections = list(FleetConfig.model_fields)
    out = [PREAMBLE, "Sections: " + " · ".join(f"[{s}](#{s})" for s in sections) + "\n"]
    for name, field in FleetConfig.model_fields.items():
        rows: list[Row] = []
        _walk(FleetConfig, "", rows, set(), only=name)
        intro = _section_doc(field.annotation) or _field_docs(FleetConfig)[name]
        out.append(f"## `{name}`\n\n{intro}\n\n{HEADER}" + "".join(r.markdown() + "\n" for r in rows))
    return "\n".join(out)


def render_reference() -> str:
    """Markdown reference of every fleet.yaml field as one table, from the models' docstrings and defaults."""
    rows: list[Row] = []
    _walk(FleetConfig, "", rows, set())
    return HEADER + "".join(r.markdown() + "\n" for r in rows)


def _walk(model: type[BaseModel], prefix: str, rows: list[Row], seen: set[str], only: str | None = None) -> None:
    docs = _field_docs(model)
    for name, field in model.model_fields.items():
        if only is not None and name != only:
            continue
        path = f"{prefix}{name}"
        doc = docs.get(name) or _class_doc(field.annotation)
        rows.append(Row(path, _type_name(field.annotation), _default(field), doc))
        for sub in _models_in(field.annotation):
            suffix = "[]." if _is_list(field.annotation) else "."
            tag = f" ({sub.model_fields['kind'].default})" if "kind" in sub.model_fields else ""
            key = path + suffix + tag
            if key not in seen:
                seen.add(key)
                _walk(sub, f"{path}{suffix}" if not tag else f"{path}{tag}.", rows, seen)


def _field_docs(model: type[BaseModel]) -> dict[str, str]:
    """Attribute docstrings (the string right under a field) of a model and its bases."""
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
    """The first paragraph of the docstring of the one model in `annotation` ("" if not exactly one)."""
    models = _models_in(annotation)
    doc = (models[0].__doc__ or "") if len(models) == 1 else ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def _section_doc(annotation: Any) -> str:
    """The whole docstring of a section's model, its paragraphs kept apart ("" for a plain field)."""
    models = _models_in(annotation)
    doc = (inspect.getdoc(models[0]) or "") if len(models) == 1 else ""
    return "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n") if p.strip())


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--update", metavar="FILE", help="rewrite FILE with the page")
    mode.add_argument("--check", metavar="FILE", help="exit 1 when FILE is not the current page")
    args = parser.parse_args(argv)
    page = render_page()
    if args.update:
        pathlib.Path(args.update).write_text(page)
    elif args.check:
        if pathlib.Path(args.check).read_text() != page:
            print(f"{args.check} is stale: run python -m fleetrl.config.reference --update {args.check}",
                  file=sys.stderr)
            return 1
    else:
        print(page, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
