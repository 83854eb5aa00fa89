"""How much slower this machine is than the one the suite's bounds were written on, and the bounds scaled by it.

Every deadline in the suite is a hang detector: it must never be what decides a verdict. A machine half
as fast, or one whose cores the suite's own workers share, takes longer for the same work; so each bound
is written for the reference machine and multiplied here by `factor()`:

    from slowdown import scaled
    deadline = loop.time() + scaled(60)
    proc.wait(timeout=scaled(10))

The factor is measured once, at the start of `make test`, by the pytest process that starts the others
(tests/conftest.py): every core runs the same short fixed workload at once (a pure-Python loop and a small
torch op, under 1 s), and the slowest core's time is divided by the time the reference machine took.
Running on every core at once is what sees a CPU quota (a cgroup giving 0.8 of a core to a 2-core
machine makes one process 1.25x slower but two processes 2.5x slower; `make test-slow`) and a machine
whose cores are already busy. The factor is never below 1: a faster machine keeps the bounds as written.

`FLEETRL_TEST_SLOWDOWN=2.5` sets the factor by hand (and skips the measurement); the measuring process
exports the factor it found under the same name, so that xdist's workers and every subprocess a test
starts use the same one.
"""

from __future__ import annotations

import multiprocessing
import os
import time

ENV = "FLEETRL_TEST_SLOWDOWN"
MEASURED_ENV = "FLEETRL_TEST_SLOWDOWN_MEASURED"  # "1" when the factor came from the measurement below

PY_LOOP_N = 3_000_000
TORCH_STEPS = 3_000
REFERENCE_S = 0.26
"""The workload's time on the reference machine (2 cores, 2026-11-28, both cores busy with it, best of
three rounds): 3 M additions of a pure-Python loop, then 3,000 steps of a 128x128 matmul and tanh on one
torch thread. Measured there inside `tests/cpu_quota.sh 2.5` (0.8 CPU): 0.56-0.70 s, i.e. 0.22-0.28 s
unconstrained; the machine the issue reported as slower ran the pure-Python loop 1.5x slower."""

ROUNDS = 3
"""Each core's figure is its best round: a round another process interrupted reads slow, not the machine."""

FLEETS_PER_REFERENCE_CORE = 2
"""A fleet of the suite (two brokers, MQTT, trainer, replicators, agents, workers, mostly waiting) needs
about half a reference core: four ran side by side on the reference machine's two cores within bounds."""


def _workload() -> float:
    import torch

    torch.set_num_threads(1)
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        s = 0
        for i in range(PY_LOOP_N):
            s += i
        a = torch.full((128, 128), 0.5)
        for _ in range(TORCH_STEPS):
            a = torch.tanh(a @ a * 0.01)
        best = min(best, time.perf_counter() - start)
    return best


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def measure() -> float:
    """The slowest core's time for the workload divided by the reference time, with every usable core
    running it at once (forked processes, so nothing is imported twice)."""
    import torch  # noqa: F401  imported before the fork: the children only run the workload

    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(_cores()) as pool:
        times = pool.starmap(_workload, [()] * _cores())
    return max(times) / REFERENCE_S


def factor() -> float:
    """The suite's slowdown factor: `FLEETRL_TEST_SLOWDOWN` when set, else 1 (the measurement runs once,
    in `ensure_factor()`, before any worker starts)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: not a number (e.g. {ENV}=2.5)") from None
    if not value > 0:
        raise ValueError(f"{ENV}={raw!r}: must be > 0")
    return value


def ensure_factor() -> tuple[float, bool]:
    """The factor, measured now unless `FLEETRL_TEST_SLOWDOWN` already holds one, exported to the
    environment for the workers and subprocesses; returns (factor, whether it was measured)."""
    if os.environ.get(ENV, "").strip():
        return factor(), os.environ.get(MEASURED_ENV) == "1"
    value = round(max(1.0, measure()), 2)
    os.environ[ENV] = str(value)
    os.environ[MEASURED_ENV] = "1"
    return value, True


def scaled(seconds: float) -> float:
    """A bound written for the reference machine, on this one."""
    return seconds * factor()


MEASURE_SPREAD = 1.12
"""How far above the machine's nominal slowdown one measurement may read: inside `tests/cpu_quota.sh 2.5`
the workload took 0.56-0.70 s, i.e. 2.15-2.72x (the quota's throttling periods land unevenly on a sub-second
workload). The fleet slots are counted from the factor divided by this, so that one machine does not get 2
slots in one run and 1 in the next (a suite twice as long: `make test-slow` measured 2.72x and got 1)."""


def fleet_slots() -> int:
    """How many tests that start a whole fleet (brokers, trainer, agents, workers) may run at once: two per
    reference core, rounded, the factor taken at the low end of its measurement's spread (on 2 cores: 4 as
    on the reference machine, where the suite's four workers each ran one and passed; 3 at 1.5x; 2 from
    2x to just under 3x; 1 from 3x)."""
    return max(1, int(FLEETS_PER_REFERENCE_CORE * _cores() * MEASURE_SPREAD / factor() + 0.5))
