"""The figures `fleetrl demo` ends with: learning, weight traffic, accounting, processes.

`summarize` turns the demo's `Progress` (from the children's log events) and the `fleetrl audit`
report into one JSON-able document; `write_artefacts` writes it to `<workdir>/summary.json` with the
run's metrics.jsonl and reward.png; `render` prints it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import sys
from typing import Any

from rich.table import Table

from fleetrl.demo.view import Progress

_WINDOW = 3  # reward "first" and "last" are means over this many steps (one batch is noisy)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def summarize(p: Progress, audit: dict[str, Any], wall_s: float, pids: dict[str, int],
              exit_codes: dict[str, int | None], workdir: pathlib.Path, *, faults: list[Any] | None = None,
              dead_letters: dict[str, Any] | None = None, fuzz: dict[str, Any] | None = None,
              out: pathlib.Path | None = None, plan: dict[str, Any] | None = None,
              stores: list[dict[str, Any]] | None = None, export: str | None = None) -> dict[str, Any]:
    anchors = [b for v, (b, anchor) in p.published.items() if v == anchor]
    deltas = [b for v, (b, anchor) in p.published.items() if v != anchor]
    dead = dead_letters or {}
    first = round(statistics.fmean(p.rewards[:_WINDOW]), 4) if p.rewards else None
    last = round(statistics.fmean(p.rewards[-_WINDOW:]), 4) if p.rewards else None
    return {
        "audit": {
            "ok": bool(audit.get("ok")), "dispatched": audit.get("dispatched"), "trained": audit.get("trained"),
            "lost": len(audit.get("lost") or []), "trained_twice": len(audit.get("trained_twice") or []),
            "stale_dropped": audit.get("stale"), "dead_lettered": dead.get("total", audit.get("dead_lettered")),
            "dead_lettered_dispatched": audit.get("dead_lettered"), "in_flight": audit.get("in_flight"),
            "pending": audit.get("pending"), "after_checkpoint": audit.get("after_checkpoint"),
            "foreign_prompts": audit.get("foreign_prompts"),
            "eval": audit.get("eval") or {},
            "problems": audit.get("problems", []),
        },
        "eval": p.eval_rows(),
        "reward": {"start": first, "end": last},
        "faults": [dataclasses.asdict(f) for f in faults or []],
        "fault_plan": plan or {},
        "dead_letters": dead,
        "fuzz": fuzz or {},
        "fleetrl_audit": audit,
        "stores": stores or [],
        "stores_ok": _stores_ok(stores or []),
        "wall_s": round(wall_s, 1),
        "steps": p.step,
        "rewards": [round(r, 4) for r in p.rewards],
        "reward_first": first,
        "reward_last": last,
        "final_version": p.version,
        "versions_published": len(p.published),
        "anchor_bytes_mean": round(statistics.fmean(anchors)) if anchors else None,
        "delta_bytes_mean": round(statistics.fmean(deltas)) if deltas else None,
        "regions": {
            name: {"replica_version": r.replica_version, "wan_copies": r.copies, "wan_bytes": r.copy_bytes,
                   "copied_from": dict(sorted(r.sources.items())), "groups_done": r.groups_done}
            for name, r in p.regions.items()
        },
        "cost": cost_summary(p.metric_rows(), audit.get("trained")),
        "pids": pids,
        "exit_codes": exit_codes,
        "still_running": sorted(name for name, pid in pids.items() if _alive(pid)),
        "workdir": str(workdir),
        "out": str(out or workdir),
        "export_command": export,
    }


def write_artefacts(summary: dict[str, Any], p: Progress, faults: list[Any], workdir: pathlib.Path,
                    out: pathlib.Path) -> None:
    """summary.json in the work directory and in `out` (the demo's --out), metrics.jsonl (a row per
    step) and reward.png in `out`."""
    from fleetrl.demo.plot import plot_run

    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    if out != workdir:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    with open(out / "metrics.jsonl", "w") as f:
        for row in p.metric_rows():
            f.write(json.dumps(row) + "\n")
    plot_run(p.metric_rows(), [dataclasses.asdict(x) for x in faults], out / "reward.png", p.eval_rows())


def export_command(config_path: pathlib.Path, stores: list[dict[str, Any]], home_in_s3: bool) -> str | None:
    """The `fleetrl hub export` command that writes this run's newest version as a Hugging Face folder:
    with the run's own config (its stores and public key), which a user's config does not name. None
    when the home store lived in the demo's S3 server (`--partition`, `--durable`), stopped at the end."""
    home = next((x for x in stores if x["store"] == "home"), None)
    if home is None or home["latest"] is None or home_in_s3:
        return None
    program = pathlib.Path(sys.argv[0])
    fleetrl = os.path.relpath(program) if program.name == "fleetrl" and program.is_absolute() \
        and not os.path.relpath(program).startswith("..") else "fleetrl"
    run_config = os.path.relpath(config_path) if not os.path.relpath(config_path).startswith("..") else str(config_path)
    version = home["latest"]
    return f"{fleetrl} hub export --config {run_config} --version {version} --out model-v{version}"


def cost_summary(rows: list[dict[str, Any]], trained: Any = None) -> dict[str, Any]:
    """What the run cost, from the trainer's running totals in its last step (trainer/cost.py): dollars by
    capacity type, per 1,000 trained groups (the audit's count, else the steps'), and the waste: tokens
    sampled that no trained group holds, groups re-sent, tokens regenerated. Empty for an unpriced fleet."""
    priced = [r for r in rows if "cost_usd_total" in r]
    if not priced:
        return {}
    last = priced[-1]
    groups = int(trained) if isinstance(trained, int) and trained > 0 else sum(int(r.get("groups") or 0) for r in rows)
    tokens = sum(int(r.get("tokens") or 0) for r in rows)
    sampled = int(last.get("tokens_sampled_total") or 0)
    by_capacity = {c: float(last.get(f"cost_usd_{c}") or 0.0) for c in ("on_demand", "spot")}
    per = (lambda usd: round(1000 * usd / groups, 6)) if groups else (lambda usd: None)
    node_s, serving_s = float(last.get("node_s_total") or 0.0), float(last.get("serving_s_total") or 0.0)
    return {
        "usd": round(float(last["cost_usd_total"]), 6),
        "usd_by_capacity": {c: round(v, 6) for c, v in by_capacity.items()},
        "trained_groups": groups, "usd_per_1000_groups": per(float(last["cost_usd_total"])),
        "usd_per_1000_groups_by_capacity": {c: per(v) for c, v in by_capacity.items()},
        "tokens_sampled": sampled, "tokens_trained": tokens,
        "waste_share": round(max(0.0, 1 - tokens / sampled), 4) if sampled else None,
        "paid_idle_share": round(1 - serving_s / node_s, 4) if node_s else None,
        "groups_resent": int(last.get("groups_resent_total") or 0),
        "tokens_regenerated": int(last.get("tokens_regenerated_total") or 0),
    }


def _stores_ok(stores: list[dict[str, Any]]) -> bool:
    """Every store verified (gapless, `latest` the newest, each version's hashes) and every region's
    replica at the home store's newest version (the replicas caught up)."""
    return bool(stores) and all(s["ok"] and s["newest"] == s["latest"] for s in stores) \
        and len({s["latest"] for s in stores}) == 1


def render(s: dict[str, Any]) -> Table:
    a = s["fleetrl_audit"]
    table = Table(title="fleetrl demo: summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    first, last = s["reward_first"], s["reward_last"]
    table.add_row("wall time", f"{s['wall_s']:.1f} s")
    table.add_row("learning", f"{s['steps']} steps; mean reward of the first {_WINDOW} steps "
                              f"{_fmt(first)} -> last {_WINDOW} steps {_fmt(last)}")
    table.add_row("weights", f"{s['versions_published']} versions published (0..{s['final_version']}); "
                             f"anchor {_kb(s['anchor_bytes_mean'])}, delta {_kb(s['delta_bytes_mean'])} per version")
    for name, r in s["regions"].items():
        sources = ", ".join(f"{n} {k}" for n, k in r["copied_from"].items()) or "-"
        table.add_row(f"region {name}", f"{r['groups_done']} groups generated; replica at version "
                                        f"{r['replica_version']}; {r['wan_copies']} WAN copies "
                                        f"({r['wan_bytes'] / 1e6:.2f} MB, from {sources})")
    table.add_row("groups", f"{a.get('dispatched')} dispatched, {a.get('trained')} trained once, "
                            f"{a.get('stale')} stale, {a.get('dead_lettered')} dead-lettered, "
                            f"{a.get('in_flight')} in flight, {a.get('pending')} buffered, "
                            f"{a.get('after_checkpoint')} after the checkpoint")
    if s.get("eval"):
        table.add_row("eval", _eval_line(s["eval"], a.get("eval") or {}))
    table.add_row("audit", "ok" if a.get("ok") else "FAILED: " + "; ".join(a.get("problems", [])))
    if s.get("cost"):
        table.add_row("cost", _cost_line(s["cost"]))
    table.add_row("stores", ("every version verified; " if s["stores_ok"] else "FAILED: ") + "; ".join(
        f"{x['store']} {x['first']}..{x['newest']} latest {x['latest']}"
        + ("" if x["ok"] else f" (gaps {x['gaps'][:5]}, bad {list(x['bad'])[:5]})")
        + ("" if x["newest"] == x["latest"] else f" (latest not at the newest: {x.get('ahead', [])[:5]} ahead)")
        for x in s["stores"]))
    if s["faults"]:
        kinds: dict[str, int] = {}
        for f in s["faults"]:
            kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
        table.add_row("faults", ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
                      + f"; lost {s['audit']['lost']}, trained twice {s['audit']['trained_twice']}")
    if s["fuzz"]:
        table.add_row("fuzz", f"{s['fuzz']['sent']} hostile records sent; {s['dead_letters'].get('fuzz')} of them "
                              f"dead-lettered; {s['dead_letters'].get('total')} dead letters in all "
                              f"({', '.join(f'{k} {v}' for k, v in s['dead_letters'].get('reasons', {}).items())})")
    running = s["still_running"]
    failed = {n: c for n, c in s["exit_codes"].items() if c != 0}
    codes = "daemons exited 0" if not failed else "non-zero exits: " + ", ".join(f"{n} {c}" for n, c in failed.items())
    table.add_row("processes", f"{len(s['pids'])} started, "
                               + ("all stopped" if not running else f"STILL RUNNING: {', '.join(running)}")
                               + f"; {codes}")
    table.add_row("files", f"{s['workdir']} (logs/); {s['out']} (summary.json, metrics.jsonl, reward.png)")
    if s.get("export_command"):
        table.add_row("export", f"the trained model as a Hugging Face folder: {s['export_command']}")
    return table


def _eval_line(rows: list[dict[str, Any]], books: dict[str, Any]) -> str:
    """Each eval set's pass@1 from its first evaluated version to its last, and the eval books."""
    parts = []
    for name in sorted({r["set"] for r in rows}):
        mine = [r for r in rows if r["set"] == name]
        parts.append(f"{name}: pass@1 {mine[0]['pass@1']:.3f} (v{mine[0]['version']}) -> {mine[-1]['pass@1']:.3f} "
                     f"(v{mine[-1]['version']}) over {len(mine)} evaluations")
    lost = len(books.get("lost") or [])
    return "; ".join(parts) + (f"; eval books: {books.get('returned')} of {books.get('dispatched')} prompts "
                               f"returned, lost {lost}" if books else "")


def _cost_line(c: dict[str, Any]) -> str:
    split = ", ".join(f"{k.replace('_', '-')} ${v:.4f}" for k, v in c["usd_by_capacity"].items() if v)
    per = c["usd_per_1000_groups_by_capacity"]
    per_split = ", ".join(f"{k.replace('_', '-')} ${v:.4f}" for k, v in per.items() if v)
    waste = ("no sampled tokens reported yet" if c["waste_share"] is None else
             f"{c['waste_share']:.1%} of the {c['tokens_sampled']} tokens sampled never trained")
    return (f"${c['usd']:.4f} ({split or 'nothing priced ran'}); per 1,000 trained groups "
            f"${_fmt(c['usd_per_1000_groups'])} ({per_split or '-'}); waste: {waste}, {c['groups_resent']} groups "
            f"re-sent, {c['tokens_regenerated']} tokens regenerated (known)")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _kb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024:.1f} KiB"
