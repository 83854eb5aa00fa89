"""Region credits vs an even split, on a simulated fleet with one slow and one partitioned region.

The trainer's real `Dispatcher`, `RegionCredits` and `Collector` run against a discrete-event
simulation of three rollout regions (simulated seconds, nothing sleeps):

* `fast`  : 8 slots, 2 s per group
* `slow`  : 8 slots, 12 s per group (old GPUs)
* `flaky` : 8 slots, 2 s per group, partitioned from t=60 s to t=180 s (finishes nothing,
            heartbeats stop); its groups come back after `silent_region_timeout_s` by redispatch

The learner takes a step (0.5 s) whenever `groups_per_step` fresh groups are buffered, under the
staleness admission bound. Baseline: the same code with every region's rate and latency pinned equal
(an even split by in-flight count, what a dispatcher without measurement does). Reported: the
simulated time to train N steps and the groups dropped as stale, for both.

    .venv/bin/python bench/trainer_credits.py [--quick]

Last line: `result: speedup=<even time / credit time> credit_s=… even_s=… stale_credit=… stale_even=…`
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

from fleetrl.broker import GroupRecord, PromptRecord, Sample, floats, ids
from fleetrl.config import FleetConfig
from fleetrl.log import configure
from fleetrl.trainer.collector import Collector
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.dispatcher import Dispatcher

REGIONS = {"fast": (8, 2.0), "slow": (8, 12.0), "flaky": (8, 2.0)}
PARTITION = ("flaky", 60.0, 180.0)
STEP_S, G, S, TIMEOUT_S, WINDOW_S = 0.5, 8, 1, 30.0, 20.0


class EvenCredits(RegionCredits):
    """Baseline: no measurement; every region gets the same share."""

    def rates(self, now: float) -> dict[str, float]:
        return {name: 1.0 for name in self.regions}

    def latency(self, region: str, now: float) -> float:
        return 0.0


@dataclass
class Region:
    slots: int
    service_s: float
    queue: list[PromptRecord] = field(default_factory=list)
    busy: int = 0


def _group(p: PromptRecord, region: str, version: int) -> GroupRecord:
    sample = Sample(ids([5, 6]), floats([-1.0, -1.0]), ids([version, version]), 1.0, "stop")
    return GroupRecord(p.group_id, p.run, p.task, p.attempt, region, "n", ids([1]), [sample])


async def simulate(credits_cls: type[RegionCredits], steps: int) -> tuple[float, int, int]:
    cfg = FleetConfig.model_validate({
        "run": "bench", "algorithm": {"groups_per_step": G, "max_staleness": S, "n_samples": 1},
        "regions": [{"name": n, "kafka": "127.0.0.1:1", "store": f"/tmp/{n}"} for n in REGIONS],
    })
    regions = {n: Region(*spec) for n, spec in REGIONS.items()}
    # (time, seq, region, prompt, version); region "" is the trainer loop's own tick (it polls every second)
    events: list[tuple[float, int, str, PromptRecord | None, int]] = [(1.0, -1, "", None, 0)]
    seq = itertools.count()
    now, version = 0.0, 0
    credits = credits_cls({n: 1.0 for n in REGIONS}, window_s=WINDOW_S, tokens_per_group=1)

    async def send(region: str, p: PromptRecord) -> None:
        regions[region].queue.append(p)

    dispatcher = Dispatcher(cfg, itertools.repeat(("reverse", "ab=", "ba")), send, credits)
    collector = Collector("bench", S)

    def start_work() -> None:
        for name, r in regions.items():
            while r.busy < r.slots and r.queue:
                p = r.queue.pop(0)
                r.busy += 1
                heapq.heappush(events, (now + r.service_s, next(seq), name, p, version))

    def partitioned(name: str, t: float) -> bool:
        return name == PARTITION[0] and PARTITION[1] <= t < PARTITION[2]

    while version < steps:
        await dispatcher.redispatch_silent(now, TIMEOUT_S)
        await dispatcher.dispatch(version, version, now, collector.is_resolved)
        for name in REGIONS:
            if not partitioned(name, now):
                credits.on_heartbeat(name, "n", "up", 0.0, now)
        start_work()
        t, _, name, p, used = heapq.heappop(events)
        now = max(now, t)
        if p is None:
            heapq.heappush(events, (now + 1.0, next(seq), "", None, 0))
            continue
        regions[name].busy -= 1
        if partitioned(name, now):  # finished, but the result waits in the region's Kafka
            heapq.heappush(events, (PARTITION[2], next(seq), name, p, used))
            regions[name].busy += 1
            continue
        flight = dispatcher.in_flight.get(p.group_id)
        credits.on_arrival(name, now, None if flight is None else now - flight.dispatched_at)
        verdict = collector.offer(_group(p, name, used), version)
        if verdict != "duplicate":
            dispatcher.resolve(p.group_id)
        while collector.ready(G):
            batch, _ = collector.take(G, version)
            if len(batch) < G:
                collector.give_back(batch)
                break
            collector.mark_trained(batch, version + 1, version)
            version += 1
            now += STEP_S
    return now, len(collector.stale), collector.duplicates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    steps = 60 if ap.parse_args().quick else 200
    configure(level="ERROR")  # redispatch warnings are expected here
    credit_s, stale_credit, dup_credit = asyncio.run(simulate(RegionCredits, steps))
    even_s, stale_even, dup_even = asyncio.run(simulate(EvenCredits, steps))
    print(f"{steps} steps of {G} groups, s={S}: credits {credit_s:.1f} s ({stale_credit} stale, {dup_credit} "
          f"duplicates), even split {even_s:.1f} s ({stale_even} stale, {dup_even} duplicates)")
    print(f"result: speedup={even_s / credit_s:.2f} credit_s={credit_s:.1f} even_s={even_s:.1f} "
          f"stale_credit={stale_credit} stale_even={stale_even} steps={steps}")


if __name__ == "__main__":
    main()
