"""Static checks of infra/terraform with python-hcl2: every variable typed, described and (where a
wrong value is likely) validated; no account ids, no secret literals; provider constraints that
admit the mirrored AWS provider."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import hcl2
import pytest
from tf_support import TF_ROOT

HCL_OPTS = hcl2.SerializationOptions(strip_string_quotes=True, explicit_blocks=False)
TF_FILES = sorted(p for p in TF_ROOT.rglob("*.tf") if ".terraform" not in p.parts)
# Names where a wrong value is likely: these must carry a validation block.
MUST_VALIDATE = re.compile(r"(^name$|^run$|cidrs?$|^vpc_id$|subnet|ami|^node$|^trainer$|^kafka$|^mqtt$|"
                           r"^regions$|^home$|port$|_version$|scheme$|expiry|bucket_prefix)")


def _parse(path: pathlib.Path) -> dict[str, Any]:
    with open(path) as f:
        data: dict[str, Any] = hcl2.load(f, serialization_options=HCL_OPTS)
    return data


def _blocks(kind: str) -> list[tuple[str, str, dict[str, Any]]]:
    found = []
    for path in TF_FILES:
        for block in _parse(path).get(kind, []):
            for name, body in block.items():
                found.append((str(path.relative_to(TF_ROOT)), name, body))
    return found


def test_files_parse() -> None:
    assert len(TF_FILES) >= 30
    for path in TF_FILES:
        _parse(path)


VARIABLES = _blocks("variable")
OUTPUTS = _blocks("output")


@pytest.mark.parametrize(("file", "name", "body"), VARIABLES, ids=[f"{f}:{n}" for f, n, _ in VARIABLES])
def test_variable_typed_described_validated(file: str, name: str, body: dict[str, Any]) -> None:
    assert body.get("type"), f"{file}: variable {name} has no type"
    assert len(str(body.get("description", ""))) >= 15, f"{file}: variable {name} needs a description"
    # `any` sections pass through to fleet.yaml, where the config models check them.
    if MUST_VALIDATE.search(name) and str(body["type"]).strip("${}") != "any":
        assert body.get("validation"), f"{file}: variable {name} needs a validation block"


@pytest.mark.parametrize(("file", "name", "body"), OUTPUTS, ids=[f"{f}:{n}" for f, n, _ in OUTPUTS])
def test_output_described(file: str, name: str, body: dict[str, Any]) -> None:
    assert len(str(body.get("description", ""))) >= 10, f"{file}: output {name} needs a description"


def test_no_account_ids_or_secret_literals() -> None:
    for path in TF_FILES:
        if "tests" in path.relative_to(TF_ROOT).parts:
            continue  # mocks use the documentation account id 000000000000
        text = path.read_text()
        assert not re.search(r"(?<![\d.])\d{12}(?![\d.])", text), f"{path}: looks like a hard-coded account id"
        assert not re.search(r"\bsecret_string\s*=", text), f"{path}: secret_string is kept in state"
        literal = re.search(r"\b(password|secret|secret_string_wo)\s*=\s*\"[^\"$]{4,}\"", text, re.I)
        assert not literal, f"{path}: secret literal {literal.group(0)!r}"


def _admits(constraint: str, version: tuple[int, ...]) -> bool:
    for part in constraint.split(","):
        op, _, ver = part.strip().partition(" ")
        want = tuple(int(x) for x in ver.split("."))
        ok = {">=": version >= want, "<": version < want, "<=": version <= want, ">": version > want,
              "=": version == want, "~>": version >= want and version[: len(want) - 1] == want[:-1]}[op]
        if not ok:
            return False
    return True


def test_provider_constraints_admit_the_mirror() -> None:
    constraints = []
    for path in TF_ROOT.rglob("versions.tf"):
        for tf in _parse(path).get("terraform", []):
            for req in tf.get("required_providers", []):
                if "aws" in req:
                    constraints.append(req["aws"]["version"])
    assert constraints and all(_admits(c, (5, 100, 0)) for c in constraints), constraints
    assert not _admits(constraints[0], (5, 80, 0)), "write-only secrets need AWS provider >= 5.90"
