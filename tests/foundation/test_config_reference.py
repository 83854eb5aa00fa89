"""docs/config.md is generated from the config models, holds every field, and `--check` catches a stale copy."""

from __future__ import annotations

import pathlib

from fleetrl.config.reference import main, render_page, render_reference

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_docs_config_md_is_generated_from_the_models() -> None:
    current = (ROOT / "docs" / "config.md").read_text()
    assert current == render_page(), "run: python -m fleetrl.config.reference --update docs/config.md"


def test_the_page_holds_every_row_of_the_one_table_reference() -> None:
    page = set(render_page().splitlines())
    missing = [row for row in render_reference().splitlines()[2:] if row not in page]
    assert missing == []


def test_check_fails_on_a_stale_page(tmp_path: pathlib.Path) -> None:
    page = tmp_path / "config.md"
    assert main(["--update", str(page)]) == 0
    assert main(["--check", str(page)]) == 0
    page.write_text(page.read_text().replace("| `run` | str |", "| `run` | int |"))
    assert main(["--check", str(page)]) == 1
