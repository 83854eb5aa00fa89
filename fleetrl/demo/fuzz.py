"""The demo's fuzzing producer (`--fuzz-rate R`): hostile records into `prompts` and `trajectories`.

    python -m fleetrl.demo.fuzz --config fleet.yaml [--seed N]

A separate process, a Kafka producer like any other: it reads a count per line on stdin (the demo
tells it how many hostile records keep it at the rate asked), sends that many to random regions,
and logs `fuzz.sent` (JSON, with the counts per kind) after each batch; stdin closing ends it with
`fuzz.done`. Every record it sends is keyed `fuzz-<kind>-<n>`, so the demo can find each one in the
dead-letter topics afterwards. Every kind is refused by the consumers (a worker for `prompts`, the
trainer for `trajectories`), none may crash them:

    bytes       random bytes                    truncated   a valid record cut short
    wrong_type  msgpack of the wrong shape      nan         NaN behaviour logprobs
    vocab       token ids outside the vocab     oversized   more tokens or samples than the bounds
    no_header   a valid record without the `fleetrl-schema` header
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from typing import Any

import msgpack
import numpy as np

from fleetrl.broker import (
    SCHEMA_HEADER,
    GroupRecord,
    Producer,
    PromptRecord,
    Sample,
    Sampling,
    encode_record,
    topic_name,
)
from fleetrl.config import FleetConfig, load_config

KINDS = ("bytes", "truncated", "wrong_type", "nan", "vocab", "oversized", "no_header")
KEY_PREFIX = "fuzz-"
_CHUNK = 500  # records in flight at once


def _prompt(config: FleetConfig, gid: str, rng: random.Random, n_ids: int = 4) -> PromptRecord:
    vocab = config.model.tiny.vocab_size
    ids = _ids(rng, n_ids, vocab)
    return PromptRecord(group_id=gid, run=config.run, task=config.dataset.task, n_samples=config.algorithm.n_samples,
                        sampling=Sampling(max_new_tokens=config.algorithm.max_new_tokens), prompt_ids=ids)


def _ids(rng: random.Random, n: int, vocab: int) -> np.ndarray:
    """`n` token ids below `vocab`, from `rng` (one call, not one per token: the fuzzer floods)."""
    return (np.frombuffer(rng.randbytes(4 * n), dtype=np.uint32) % vocab).astype(np.int32)


def _group(config: FleetConfig, gid: str, rng: random.Random, *, lp: float = -1.0, token: int | None = None,
           n_tokens: int | None = None, n_samples: int | None = None) -> GroupRecord:
    vocab, a = config.model.tiny.vocab_size, config.algorithm
    n = n_tokens or a.max_new_tokens
    samples = []
    for _ in range(n_samples or a.n_samples):
        ids = np.full(n, token, dtype=np.int32) if token is not None else _ids(rng, n, vocab)
        samples.append(Sample(completion_ids=ids, logprobs=np.full(n, lp, dtype=np.float32),
                              versions=np.zeros(n, dtype=np.int32), reward=rng.random(), finish_reason="length"))
    return GroupRecord(group_id=gid, run=config.run, task=config.dataset.task, attempt=0, region="fuzz",
                       node="fuzz", prompt_ids=np.array([1, 2, 3], dtype=np.int32), samples=samples)


def hostile(config: FleetConfig, stream: str, kind: str, gid: str,
            rng: random.Random) -> tuple[bytes, list[tuple[str, bytes]]]:
    """One hostile record for `stream` (`prompts` or `trajectories`): its value and headers."""
    schema = "fleetrl.prompt/1" if stream == "prompts" else "fleetrl.group/1"
    headers = [(SCHEMA_HEADER, schema.encode())]
    valid = (_prompt(config, gid, rng) if stream == "prompts" else _group(config, gid, rng))
    if kind == "bytes":
        return rng.randbytes(rng.randrange(1, 512)), headers
    if kind == "truncated":
        raw = encode_record(valid)
        return raw[: rng.randrange(1, len(raw))], headers
    if kind == "wrong_type":
        shapes: list[Any] = [[1, 2, 3], "fleetrl", {"schema": schema, "group_id": 7, "run": [config.run]},
                             {"schema": schema, "group_id": gid, "samples": "many", "prompt_ids": 3}]
        return msgpack.packb(rng.choice(shapes), use_bin_type=True), headers
    if kind == "no_header":
        return encode_record(valid), []
    vocab = config.model.tiny.vocab_size
    if stream == "prompts":
        bad = {"nan": lambda: _nan_prompt(config, gid, rng),
               "vocab": lambda: _with_ids(_prompt(config, gid, rng), vocab + rng.randrange(1, 1 << 20)),
               "oversized": lambda: _with_ids(_prompt(config, gid, rng, n_ids=config.dataset.max_prompt_tokens + 1),
                                              1)}
        return encode_record(bad[kind]()), headers
    if kind == "nan":
        return encode_record(_group(config, gid, rng, lp=float("nan"))), headers
    if kind == "vocab":
        return encode_record(_group(config, gid, rng, token=vocab + rng.randrange(1, 1 << 20))), headers
    too_long = config.algorithm.max_new_tokens + 1 + rng.randrange(64)
    return encode_record(_group(config, gid, rng, n_tokens=too_long)), headers


def _with_ids(p: PromptRecord, token: int) -> PromptRecord:
    assert p.prompt_ids is not None
    p.prompt_ids = np.full(len(p.prompt_ids), token, dtype=np.int32)
    return p


def _nan_prompt(config: FleetConfig, gid: str, rng: random.Random) -> PromptRecord:
    p = _prompt(config, gid, rng)
    p.sampling = Sampling(temperature=float("nan"), max_new_tokens=config.algorithm.max_new_tokens)
    return p


class Fuzzer:
    def __init__(self, config: FleetConfig, seed: int) -> None:
        self.config, self.rng = config, random.Random(seed)
        self.sent: Counter[str] = Counter()
        self.n = 0
        self.producers: dict[str, Producer] = {}

    async def start(self) -> None:
        for r in self.config.regions:
            self.producers[r.name] = await Producer(self.config, r.name, f"{self.config.run}-fuzz").start()

    async def close(self) -> None:
        for p in self.producers.values():
            await p.close()

    async def send(self, count: int) -> None:
        """`count` hostile records, produced `_CHUNK` at a time without waiting for each ack (the
        producer batches them): a flood as a misbehaving client would send it."""
        topics = {stream: topic_name(self.config.run, stream) for stream in ("prompts", "trajectories")}
        for start in range(0, count, _CHUNK):
            sends = []
            for _ in range(min(_CHUNK, count - start)):
                stream = self.rng.choice(("prompts", "trajectories"))
                kind = self.rng.choice(KINDS)
                region = self.rng.choice(list(self.producers))
                key = f"{KEY_PREFIX}{kind}-{self.n}"
                value, headers = hostile(self.config, stream, kind, key, self.rng)
                sends.append(self.producers[region].send_raw(topics[stream], key.encode(), value, headers))
                self.n += 1
                self.sent[f"{stream}/{kind}"] += 1
            await asyncio.gather(*sends)


def _event(name: str, **fields: Any) -> None:
    print(json.dumps({"event": name, "ts": time.time(), **fields}), flush=True)


async def _serve(config: FleetConfig, seed: int) -> None:
    fuzzer = Fuzzer(config, seed)
    await fuzzer.start()
    _event("fuzz.started", regions=list(fuzzer.producers))
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            count = int(line.strip() or 0)
            if count > 0:
                await fuzzer.send(count)
                _event("fuzz.sent", count=count, total=fuzzer.n)
    finally:
        _event("fuzz.done", total=fuzzer.n, kinds=dict(sorted(fuzzer.sent.items())))
        await fuzzer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetrl.demo.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(_serve(load_config(args.config), args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
