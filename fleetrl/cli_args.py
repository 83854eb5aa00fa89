"""Argument types of the `fleetrl` command line: a bad argument is refused before any work starts.

Each type below is an argparse `type=` callable: it returns the parsed value or raises
`argparse.ArgumentTypeError`, which argparse turns into one line on stderr and exit 2,

    fleetrl demo: error: argument --steps: must be >= 1, got -1

(`OneLineParser` keeps argparse's usage block off, as `config check` prints one line for a bad
config). What only the config or a store can tell (a `--region` fleet.yaml lacks, a version a store
does not hold) is refused once they are read, by raising an exception that carries the flag in its
`argument` attribute: `ArgumentRefused` here, `fleetrl.hub.errors.UnknownVersion` in the hub (which
may not import this module, DESIGN.md §2). `fleetrl.cli.main` prints any such exception in the same
form, `<prog>: error: argument <flag>: <message>`, and exits 2.

Torch-free and import-light: `fleetrl --help` imports this module (DESIGN.md §9).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, NoReturn

if TYPE_CHECKING:
    from fleetrl.config import FleetConfig

Version = int | Literal["latest"]
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_SIZE = re.compile(r"(\d+)(GIB|MIB|KIB|GB|MB|KB)")  # what transformers' save_pretrained takes


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, `<prog>: error: <message>`, and exit 2
    (sub-command parsers inherit the class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class ArgumentRefused(ValueError):
    """An argument the config (or what it names) refuses: `argument` is the flag, the message says
    what is wrong and what exists."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def refusal_line(prog: str, exc: BaseException) -> str | None:
    """The usage line for an exception that refuses an argument (one with an `argument`), else None."""
    argument = getattr(exc, "argument", None)
    return f"{prog}: error: argument {argument}: {exc}" if isinstance(argument, str) and argument else None


# -- numbers ----------------------------------------------------------------------------------------


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def trackers(text: str) -> tuple[str, ...]:
    """`tensorboard,mlflow`: experiment trackers by TRL's `report_to` names (`none`: no tracker)."""
    from fleetrl.config.tracking import TRACKERS

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names == ("none",):
        return ()
    unknown = [n for n in names if n not in TRACKERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown tracker(s) {', '.join(unknown) or repr(text)}; "
                                         f"known: {', '.join(TRACKERS)} (or none)")
    return names


def positive_int(text: str) -> int:
    """A count: a whole number >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """A duration or period in seconds, > 0."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def eval_where(text: str) -> str:
    """Where `fleetrl eval` runs: auto, fleet or local."""
    if text not in ("auto", "fleet", "local"):
        raise argparse.ArgumentTypeError(f"must be auto, fleet or local, got {text!r}")
    return text


def non_negative_seconds(text: str) -> float:
    """A bound in seconds, >= 0 (0: do not wait)."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def fraction(text: str) -> float:
    """A share in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def byte_size(text: str) -> int | str:
    """A size as transformers' `max_shard_size` takes it: bytes (`1000000`) or `5GB`, `500MiB`, `100KB`."""
    if text.isdigit() and int(text) > 0:
        return int(text)
    match = _SIZE.fullmatch(text.upper())
    if match is None or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"must be a size such as 5GB, 500MiB, 100KB or a number of bytes, "
                                         f"got {text!r}")
    return text.upper()


# -- names and positions ----------------------------------------------------------------------------


def version(text: str) -> Version:
    """A hub version: `latest` or a whole number >= 0 (whether the store holds it is the handler's check)."""
    if text == "latest":
        return "latest"
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a version number (>= 0) or 'latest', got {text!r}")
    return int(text)


def log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def partition_offset(text: str) -> tuple[int, int]:
    """`PARTITION:OFFSET` of a record, e.g. `0:12`."""
    partition, sep, offset = text.partition(":")
    if not sep or not partition.isdigit() or not offset.isdigit():
        raise argparse.ArgumentTypeError(f"must be PARTITION:OFFSET, e.g. 0:12, got {text!r}")
    return int(partition), int(offset)


def kinds(known: Iterable[str], text: str) -> tuple[str, ...]:
    """A comma list of names, each one of `known`."""
    names = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in names if k not in known]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown kind(s) {unknown or [text]}; kinds: {', '.join(known)}")
    return names


# -- paths ------------------------------------------------------------------------------------------


def existing_file(text: str) -> pathlib.Path:
    path = pathlib.Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: {'is a folder' if path.is_dir() else 'no such file'}")
    return path


def existing_path(text: str) -> pathlib.Path:
    """A file or a folder that exists."""
    path = pathlib.Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder")
    return path


def new_path(text: str) -> pathlib.Path:
    """A path where something new is written: nothing is there yet."""
    path = pathlib.Path(text)
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text} already exists (it must not: a new folder is written there)")
    return path


def output_file(text: str) -> pathlib.Path:
    """A file to write (replaced if there): its folder exists and the path is no folder."""
    path = pathlib.Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: folder {path.parent} does not exist")
    return path


def folder_to_make(text: str) -> pathlib.Path:
    """A folder that may not exist yet (it is created), but is not a file."""
    path = pathlib.Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    return path


# -- against the config -----------------------------------------------------------------------------


def check_names(args: argparse.Namespace, config: FleetConfig, source: str) -> None:
    """`--region` and `--store` name what `config` (read from `source`) has, else ArgumentRefused."""
    region = getattr(args, "region", None)
    regions = [r.name for r in config.regions]
    if region is not None and region not in regions:
        raise ArgumentRefused("--region", f"{region!r} not in {source} (regions: {', '.join(regions)})")
    store = getattr(args, "store", None)
    if store is None:
        return
    stores = list(config.stores())
    named = ([] if store == "all" else store.split(",")) if getattr(args, "all", False) else [store]
    for name in named:
        if name not in stores:
            raise ArgumentRefused("--store", f"{name!r} not in {source} (stores: {', '.join(stores)})")

