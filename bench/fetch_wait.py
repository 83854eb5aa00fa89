"""Produce-to-consume latency on real tansu against the consumer's `kafka.fetch_max_wait_ms`.

A record that lands while a consumer's fetch waits on the broker may be handed over only when the
wait ends. This sends one record at a time (a trickle, as prompts arrive at a worker) through
FleetRL's own Producer and Consumer, laid out as a rollout worker reads (`partials` before `prompts`,
4 partitions each, the priority consumer), and measures, per record, the time from the produce call
to the consumer's poll returning it, for the client default (500 ms, the baseline, measured in the
same run) and for smaller waits. (With one topic of one partition, tansu answers a waiting fetch as
soon as a record lands, and the wait costs nothing.)

    .venv/bin/python bench/fetch_wait.py [--quick] [--waits 500,100,50,20]

Last line: `result: p50_ms_wait500=... p50_ms_wait100=... ... latency_ratio=...` (baseline p50 over
the configured default's p50).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from fleetrl import devstack
from fleetrl.broker import Consumer, Producer, PromptRecord, RecordLimits, Sampling, ensure_topics, rollout_group
from fleetrl.config import FleetConfig, KafkaConfig

BASELINE_MS = 500


def _config(port: int, wait_ms: int) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": f"fw-{uuid.uuid4().hex[:8]}", "model": {"tiny": {}},
        "kafka": {"partitions": {"prompts": 4, "partials": 4, "trajectories": 4, "dead_letter": 1},
                  "fetch_max_wait_ms": wait_ms},
        "regions": [{"name": "r1", "kafka": f"127.0.0.1:{port}", "store": "/tmp/fleetrl-bench-store"}],
    })


async def _latencies(port: int, wait_ms: int, records: int, gap_s: float) -> list[float]:
    config = _config(port, wait_ms)
    await ensure_topics(config, "r1")
    limits = RecordLimits.from_config(config)
    out: list[float] = []
    async with Producer(config, "r1", "fw-producer") as producer, \
            Consumer(config, "r1", ["partials", "prompts"], rollout_group(config.run), limits, None, "fw-consumer",
                     priority=True) as consumer:
        for _ in range(100):  # joined and assigned before the clock starts
            await consumer.poll(1, 0.1)
            if consumer.assignment():
                break
        for i in range(records):
            await asyncio.sleep(gap_s)  # a trickle: the consumer's fetch is waiting when the record lands
            record = PromptRecord(group_id=f"g-{i}", run=config.run, task="reverse", n_samples=1,
                                  sampling=Sampling(max_new_tokens=8), prompt="ab=")
            t0 = time.monotonic()
            await producer.send("prompts", record.group_id, record)
            got: list[object] = []
            while not got and time.monotonic() - t0 < 10:
                got = await consumer.poll(1, 1.0)
            out.append((time.monotonic() - t0) * 1000)
    return out


async def _main(waits: list[int], records: int) -> dict[int, float]:
    server = devstack.tansu()
    with server:
        p50 = {}
        for wait in waits:
            lat = await _latencies(server.port, wait, records, gap_s=0.13)
            p50[wait] = statistics.median(lat)
            q = statistics.quantiles(lat, n=10)
            print(f"fetch_max_wait_ms={wait:>4}: p50 {p50[wait]:7.1f} ms  p90 {q[-1]:7.1f} ms  ({len(lat)} records)")
    return p50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 records per setting")
    parser.add_argument("--waits", default="500,100,50,20")
    args = parser.parse_args()
    default = KafkaConfig().fetch_max_wait_ms
    waits = sorted({BASELINE_MS, default, *(int(w) for w in args.waits.split(","))}, reverse=True)
    p50 = asyncio.run(_main(waits, 20 if args.quick else 100))
    ratio = p50[BASELINE_MS] / p50[default]
    print("result: " + " ".join(f"p50_ms_wait{w}={p50[w]:.1f}" for w in waits)
          + f" default_ms={default} latency_ratio={ratio:.2f}")


if __name__ == "__main__":
    main()
