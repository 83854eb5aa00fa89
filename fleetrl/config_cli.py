"""`fleetrl config check` and `fleetrl config reference`.

The reference is rendered by `fleetrl.config.reference`, which also writes docs/config.md (the same rows,
section by section).
"""

from __future__ import annotations

import argparse
import json

from fleetrl.config import FleetConfig
from fleetrl.config.reference import render_page, render_reference

__all__ = ["check", "reference", "render_reference"]


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
    """Print the reference; with `--update FILE`, rewrite the table between the markers of FILE, or, in a
    file without them, write the whole page (docs/config.md: `render_page`)."""
    if args.update:
        import pathlib

        path = pathlib.Path(args.update)
        text = path.read_text() if path.exists() else ""
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            path.write_text(head + BEGIN + render_reference() + END + rest.split(END, 1)[1])
        else:
            path.write_text(render_page())
        print(f"updated the configuration reference in {path}")
        return 0
    print(render_reference(), end="")
    return 0
