"""Record codec throughput and size against a JSON-of-lists baseline, measured in the same run.

A group is 64 samples x 1,024 tokens (token ids, behaviour logprobs, per-token versions with one
in-flight update per sample), as a trainer consumes them. Both codecs encode and decode the same
groups; ours also bounds-checks on decode, as the trainer's consumer does.

    .venv/bin/python bench/codec.py [--quick]

Last line: `result: ours_groups_per_s=... json_groups_per_s=... speed_ratio=... bytes_ratio=...`
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np

from fleetrl.broker import GroupRecord, RecordLimits, Sample, decode_record, encode_record, floats, ids

VOCAB = 151_936  # Qwen2's vocabulary: ids take 6 digits in JSON, as in production


def make_group(rng: np.random.Generator, i: int, samples: int, tokens: int) -> GroupRecord:
    out = []
    for _ in range(samples):
        versions = np.full(tokens, 41, dtype=np.int32)
        versions[int(rng.integers(1, tokens)):] = 42  # one in-flight weight update
        out.append(Sample(ids(rng.integers(0, VOCAB, tokens)), floats(-rng.exponential(0.7, tokens)),
                          versions, float(rng.random()), "stop"))
    return GroupRecord(f"group-{i:08d}", "bench", "math", 0, "us-west-2", "node-7",
                       ids(rng.integers(0, VOCAB, 256)), out)


def json_encode(g: GroupRecord) -> bytes:
    """The naive format: every array a JSON list, per-token versions included."""
    return json.dumps({
        "schema": "fleetrl.group/1", "group_id": g.group_id, "run": g.run, "task": g.task, "attempt": g.attempt,
        "region": g.region, "node": g.node, "prompt_ids": g.prompt_ids.tolist(),
        "samples": [{"completion_ids": s.completion_ids.tolist(), "logprobs": s.logprobs.tolist(),
                     "versions": s.versions.tolist(), "reward": s.reward, "finish_reason": s.finish_reason}
                    for s in g.samples],
    }).encode()


def json_decode(b: bytes) -> GroupRecord:
    o = json.loads(b)
    return GroupRecord(o["group_id"], o["run"], o["task"], o["attempt"], o["region"], o["node"],
                       ids(o["prompt_ids"]),
                       [Sample(ids(s["completion_ids"]), floats(s["logprobs"]), ids(s["versions"]), s["reward"],
                               s["finish_reason"]) for s in o["samples"]])


def timed(fn: Callable[[], None], repeats: int) -> float:
    """Best of `repeats`: the least disturbed run on a noisy machine."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer groups and repeats")
    args = parser.parse_args()
    n_groups, repeats = (8, 3) if args.quick else (32, 5)
    rng = np.random.default_rng(0)
    groups = [make_group(rng, i, 64, 1024) for i in range(n_groups)]
    limits = RecordLimits(vocab_size=VOCAB, known_tasks=frozenset({"math"}), max_tokens_per_sample=4096,
                          max_prompt_tokens=4096, max_samples_per_group=64)

    ours = [encode_record(g) for g in groups]
    theirs = [json_encode(g) for g in groups]
    for g, b in zip(groups, ours, strict=True):  # same content both ways, or the race is meaningless
        back = decode_record(b, limits)
        assert isinstance(back, GroupRecord)
        assert all(np.array_equal(a.versions, c.versions) for a, c in zip(g.samples, back.samples, strict=True))

    t_ours = timed(lambda: [decode_record(encode_record(g), limits) for g in groups], repeats)
    t_json = timed(lambda: [json_decode(json_encode(g)) for g in groups], repeats)
    b_ours = sum(map(len, ours)) / n_groups
    b_json = sum(map(len, theirs)) / n_groups
    print(f"group: 64 samples x 1024 tokens; {n_groups} groups, best of {repeats}")
    print(f"{'codec':<18}{'groups/s':>12}{'bytes/group':>14}")
    print(f"{'msgpack+typed':<18}{n_groups / t_ours:>12.1f}{b_ours:>14,.0f}")
    print(f"{'json lists':<18}{n_groups / t_json:>12.1f}{b_json:>14,.0f}")
    print(f"result: ours_groups_per_s={n_groups / t_ours:.1f} json_groups_per_s={n_groups / t_json:.1f} "
          f"speed_ratio={t_json / t_ours:.1f} ours_bytes_per_group={b_ours:.0f} "
          f"json_bytes_per_group={b_json:.0f} bytes_ratio={b_json / b_ours:.2f}")


if __name__ == "__main__":
    main()
