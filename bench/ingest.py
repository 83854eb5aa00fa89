"""The trainer's ingest ceiling: finished groups per second one trainer process takes in from its regions.

Starts one real tansu per region (4 by default), fills each region's `trajectories` with groups of a
production shape (16 samples x 1,024 tokens, per-token versions with one in-flight update), then
measures the trainer's own path over them: `RegionClients.poll` (every region's consumer at once:
fetch, decode, bounds checks), `Collector.offer` (run, dedup, staleness), and each step's
`Collector.take` + `build_step_batch` (advantages, the flattened batch) and `mark_trained` (the
ledger). The learner's step is left out: this is what one process can feed it.

The baseline, measured in the same run over the same records, is the raw fetch: one aiokafka consumer
per region reading the bytes without decoding them. `ingest_vs_fetch` is the trainer's rate over the
raw rate (1.0: decoding and bookkeeping cost nothing beside the fetch).

`fleet_gpus_supported` turns the rate into the rollout fleet it can keep up with:
`ingest_groups_per_s / (gpu_tokens_per_s / tokens_per_group)`, where `--gpu-tokens-per-s` (default
2,500) is an assumed output-token rate of one GPU generating RL rollouts of a 7B policy (vLLM on an
H100 at the batch sizes RL uses runs at a few thousand output tokens/s; set yours). A group is
`samples x tokens` generated tokens.

    .venv/bin/python bench/ingest.py [--quick] [--regions 4] [--groups G] [--gpu-tokens-per-s T]

Last line: `result: ingest_groups_per_s=... ingest_mb_per_s=... fetch_groups_per_s=...
ingest_vs_fetch=... fleet_gpus_supported=...`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid

import numpy as np
from aiokafka import AIOKafkaConsumer

from fleetrl import devstack
from fleetrl.broker import GroupRecord, Producer, RecordLimits, Sample, ensure_topics, floats, ids, trainer_group
from fleetrl.config import FleetConfig
from fleetrl.trainer.batch import build_step_batch
from fleetrl.trainer.collector import Collector
from fleetrl.trainer.regions import RegionClients

VOCAB = 151_936
VERSION = 42
GROUPS_PER_STEP = 64


def _config(ports: list[int], samples: int, tokens: int) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": f"ingest-{uuid.uuid4().hex[:8]}",
        "model": {"tiny": {"vocab_size": VOCAB}},
        "algorithm": {"n_samples": samples, "max_new_tokens": tokens, "groups_per_step": GROUPS_PER_STEP,
                      "max_staleness": 4},
        "kafka": {"partitions": {"prompts": 1, "partials": 1, "trajectories": 8, "dead_letter": 1}},
        "regions": [{"name": f"r{i}", "kafka": f"127.0.0.1:{p}", "store": "/tmp/fleetrl-bench-store"}
                    for i, p in enumerate(ports)],
    })


def _group(rng: np.random.Generator, run: str, region: str, i: int, samples: int, tokens: int) -> GroupRecord:
    out = []
    for _ in range(samples):
        versions = np.full(tokens, VERSION - 1, dtype=np.int32)
        versions[int(rng.integers(1, tokens)):] = VERSION  # one in-flight weight update
        out.append(Sample(ids(rng.integers(0, VOCAB, tokens)), floats(-rng.exponential(0.7, tokens)), versions,
                          float(rng.random()), "stop"))
    return GroupRecord(f"{run}-{region}-{i:09d}", run, "reverse", 0, region, "node-1",
                       ids(rng.integers(0, VOCAB, 256)), out)


async def _fill(config: FleetConfig, groups: int, samples: int, tokens: int) -> int:
    """Produce `groups` groups into every region's trajectories; returns the bytes of one group's value."""
    rng = np.random.default_rng(0)
    template = [_group(rng, config.run, "r0", i, samples, tokens) for i in range(8)]
    size = 0
    for r in config.regions:
        await ensure_topics(config, r.name)
        async with Producer(config, r.name, f"fill-{r.name}") as producer:
            sends = []
            for i in range(groups):
                g = template[i % len(template)]
                record = GroupRecord(f"{config.run}-{r.name}-{i:09d}", g.run, g.task, 0, r.name, g.node,
                                     g.prompt_ids, g.samples)
                sends.append(producer.send("trajectories", record.group_id, record))
                if len(sends) == 64:
                    await asyncio.gather(*sends)
                    sends = []
            await asyncio.gather(*sends)
    from fleetrl.broker import encode_record

    size = len(encode_record(template[0]))
    return size


async def _raw_fetch(config: FleetConfig, total: int) -> float:
    """Seconds for plain aiokafka consumers (one per region) to fetch every record's bytes."""
    consumers = [AIOKafkaConsumer(f"fleetrl.{config.run}.trajectories", bootstrap_servers=r.kafka.bootstrap,
                                  group_id=f"raw-{uuid.uuid4().hex[:6]}", auto_offset_reset="earliest",
                                  enable_auto_commit=False, max_partition_fetch_bytes=32 << 20,
                                  fetch_max_bytes=64 << 20, fetch_max_wait_ms=100)
                 for r in config.regions]
    for c in consumers:
        await c.start()
    try:
        seen, t0 = 0, time.perf_counter()
        while seen < total and time.perf_counter() - t0 < 600:
            batches = await asyncio.gather(*(c.getmany(timeout_ms=200, max_records=256) for c in consumers))
            seen += sum(len(recs) for b in batches for recs in b.values())
        return time.perf_counter() - t0
    finally:
        for c in consumers:
            with contextlib.suppress(Exception):
                await c.stop()


async def _trainer_ingest(config: FleetConfig, total: int) -> tuple[float, int]:
    """Seconds for the trainer's clients, collector and batcher to take in every group; steps built."""
    limits = RecordLimits.from_config(config)
    collector = Collector(config.run, config.algorithm.max_staleness)
    steps = taken = 0
    async with RegionClients(config, limits, trainer_group(config.run), {}) as clients:
        t0 = time.perf_counter()
        while taken < total and time.perf_counter() - t0 < 600:
            for region, deliveries in (await clients.poll(256, 0.2)).items():
                for d in deliveries:
                    assert isinstance(d.record, GroupRecord)
                    collector.offer(d.record, VERSION)
                    clients.handled(region, d)
            while collector.ready(GROUPS_PER_STEP) or (collector.pending and taken + len(collector.pending) >= total):
                n = min(GROUPS_PER_STEP, len(collector.pending))
                groups, _ = collector.take(n, VERSION)
                build_step_batch(groups, config.algorithm.advantage, VERSION)
                collector.mark_trained(groups, steps + 1, VERSION)
                taken += len(groups)
                steps += 1
        return time.perf_counter() - t0, steps


async def _main(args: argparse.Namespace) -> None:
    servers = [devstack.tansu() for _ in range(args.regions)]
    with contextlib.ExitStack() as stack:
        for s in servers:
            stack.enter_context(s)
        config = _config([s.port for s in servers], args.samples, args.tokens)
        t0 = time.perf_counter()
        size = await _fill(config, args.groups, args.samples, args.tokens)
        total = args.groups * args.regions
        print(f"filled {args.regions} regions with {args.groups} groups each ({args.samples} x {args.tokens} "
              f"tokens, {size / 1e6:.2f} MB per group) in {time.perf_counter() - t0:.1f} s")
        fetch_s = await _raw_fetch(config, total)
        ingest_s, steps = await _trainer_ingest(config, total)
    fetch_rate, ingest_rate = total / fetch_s, total / ingest_s
    tokens_per_group = args.samples * args.tokens
    gpus = ingest_rate / (args.gpu_tokens_per_s / tokens_per_group)
    print(f"raw fetch:      {fetch_rate:8.1f} groups/s  {fetch_rate * size / 1e6:8.1f} MB/s")
    print(f"trainer ingest: {ingest_rate:8.1f} groups/s  {ingest_rate * size / 1e6:8.1f} MB/s  ({steps} steps built)")
    print(f"a GPU at {args.gpu_tokens_per_s:,.0f} tokens/s makes {args.gpu_tokens_per_s / tokens_per_group:.3f} "
          f"groups/s: one trainer process keeps up with {gpus:,.0f} GPUs")
    print(f"result: ingest_groups_per_s={ingest_rate:.1f} ingest_mb_per_s={ingest_rate * size / 1e6:.1f} "
          f"fetch_groups_per_s={fetch_rate:.1f} ingest_vs_fetch={ingest_rate / fetch_rate:.2f} "
          f"fleet_gpus_supported={gpus:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="48 groups per region")
    parser.add_argument("--regions", type=int, default=4)
    parser.add_argument("--groups", type=int, default=None, help="groups per region (default 192; quick 48)")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--gpu-tokens-per-s", type=float, default=2500.0)
    args = parser.parse_args()
    args.groups = args.groups or (48 if args.quick else 192)
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
