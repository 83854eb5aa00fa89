"""`reward.png`: a demo run at a glance (matplotlib, drawn off-screen).

Top: the mean reward of each step (the spread of its samples shaded), and each held-out evaluation's
pass@1 and mean reward at the step that published its version (the eval curve, `eval.sets`). Bottom:
the staleness of the groups each step trained (mean and max, in policy versions). Every injected fault
is a vertical line at the step the trainer was on when it happened, coloured by kind; a partition is a
shaded span.
"""

from __future__ import annotations

import pathlib
from typing import Any

_COLOURS = {"kill": "tab:red", "preempt": "tab:orange", "partition": "tab:purple"}


def _step_at(rows: list[dict[str, Any]], t: float) -> float:
    """The (fractional) step the run was at `t` seconds after the demo started."""
    before = [r for r in rows if r["t"] <= t]
    if not before:
        return 0.0
    last = before[-1]
    after = [r for r in rows if r["t"] > t]
    if not after:
        return float(last["step"])
    nxt = after[0]
    return last["step"] + (t - last["t"]) / max(1e-9, nxt["t"] - last["t"])


def plot_run(rows: list[dict[str, Any]], faults: list[dict[str, Any]], path: pathlib.Path,
             evals: list[dict[str, Any]] | None = None) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, height_ratios=(3, 2))
    steps = [r["step"] for r in rows]
    mean = [r["reward_mean"] or 0.0 for r in rows]
    std = [r.get("reward_std") or 0.0 for r in rows]
    top.plot(steps, mean, color="tab:blue", label="reward (mean of the step)")
    top.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                     [m + s for m, s in zip(mean, std, strict=True)], color="tab:blue", alpha=0.15,
                     label="± std of its samples")
    for name in sorted({e["set"] for e in evals or []}):
        points = sorted((e["step"], e["pass@1"], e["reward_mean"]) for e in evals or [] if e["set"] == name)
        top.plot([x for x, _, _ in points], [y for _, y, _ in points], color="tab:red", marker="o",
                 label=f"eval {name}: pass@1")
        top.plot([x for x, _, _ in points], [r for _, _, r in points], color="tab:red", marker="x", linestyle=":",
                 label=f"eval {name}: reward")
    top.set_ylabel("reward")
    bottom.plot(steps, [r.get("staleness_mean") or 0.0 for r in rows], color="tab:green", label="staleness mean")
    bottom.plot(steps, [r.get("staleness_max") or 0.0 for r in rows], color="tab:green", linestyle="--",
                label="staleness max")
    bottom.set_ylabel("versions behind")
    bottom.set_xlabel("optimizer step")
    seen: set[str] = set()
    heals = {f["target"]: f["t"] for f in faults if f["kind"] == "heal"}
    for f in faults:
        kind = f["kind"]
        if kind not in _COLOURS:
            continue
        x = _step_at(rows, f["t"])
        label = None if kind in seen else kind
        seen.add(kind)
        for ax in (top, bottom):
            if kind == "partition":
                end = _step_at(rows, heals.get(f["target"], rows[-1]["t"] if rows else f["t"]))
                ax.axvspan(x, max(end, x + 0.1), color=_COLOURS[kind], alpha=0.12,
                           label=f"partition {f['target']}" if ax is top and label else None)
            else:
                ax.axvline(x, color=_COLOURS[kind], alpha=0.6, linewidth=1, label=label if ax is top else None)
    top.legend(loc="upper left", fontsize=8)
    bottom.legend(loc="upper left", fontsize=8)
    n = sum(1 for f in faults if f["kind"] in _COLOURS)
    title = "reward, held-out eval" if evals else "reward"
    top.set_title(f"fleetrl demo: {title} and staleness per step, {n} injected faults")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
