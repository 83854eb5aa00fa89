"""docs/metrics.md from the code: every metric each daemon registers, with its type, labels and help.

    python -m fleetrl.metrics_doc                      # print the table
    python -m fleetrl.metrics_doc --update docs/metrics.md

A test checks that the page is current, that every name follows `fleetrl_<part>_<name>_<unit>`
(counters end `_total`, nothing else does) and that the Grafana board queries only these names.
"""

from __future__ import annotations

import argparse
import pathlib
import re
from dataclasses import dataclass

from fleetrl.metrics import MetricsRegistry

BEGIN, END = "<!-- BEGIN metrics -->\n", "<!-- END metrics -->\n"
NAME_RE = re.compile(r"^fleetrl_(trainer|rollout|agent|replicator|cost)_[a-z0-9_]+$")


@dataclass(frozen=True)
class MetricDoc:
    daemon: str
    name: str
    """The exposed name (a counter's with `_total`)."""
    type: str
    labels: tuple[str, ...]
    help: str


def registries() -> dict[str, MetricsRegistry]:
    """A fresh registry of each daemon that serves metrics."""
    from fleetrl.hub.metrics import ReplicatorMetrics
    from fleetrl.regions.metrics import AgentMetrics
    from fleetrl.trainer.metrics import TrainerMetrics

    return {"trainer": TrainerMetrics(), "agent": AgentMetrics(), "replicator": ReplicatorMetrics()}


def metric_docs() -> list[MetricDoc]:
    docs: list[MetricDoc] = []
    for daemon, reg in registries().items():
        for wrapper in vars(reg).values():
            describe = getattr(wrapper, "describe", None)
            if describe is None or not hasattr(wrapper, "_labelnames"):
                continue
            for family in describe():
                name = family.name + ("_total" if family.type == "counter" else "")
                docs.append(MetricDoc(daemon, name, family.type, tuple(wrapper._labelnames), family.documentation))
    return sorted(docs, key=lambda d: (d.daemon, d.name))


def render() -> str:
    lines = ["| daemon | metric | type | labels | meaning |", "|---|---|---|---|---|"]
    for d in metric_docs():
        lines.append(f"| {d.daemon} | `{d.name}` | {d.type} | {', '.join(d.labels) or '—'} | {d.help} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--update", metavar="FILE", help="rewrite the table between the markers in FILE")
    args = parser.parse_args()
    if not args.update:
        print(render(), end="")
        return 0
    path = pathlib.Path(args.update)
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    path.write_text(head + BEGIN + render() + END + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
