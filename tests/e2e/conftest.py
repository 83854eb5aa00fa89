"""Fixtures of the e2e tests that run `fleetrl demo`."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import demo_testkit
import pytest


@pytest.fixture
def demo_config(tmp_path: pathlib.Path) -> pathlib.Path:
    """The shipped demo config on free ports (and unchanged otherwise)."""
    return demo_testkit.demo_config(tmp_path)[1]


@pytest.fixture
def workdir(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    """The demo's work directory; whatever it started and left alive is killed by PID afterwards."""
    work = tmp_path / "work"
    yield work
    demo_testkit.kill_leftovers(work)
