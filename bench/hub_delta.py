"""Bytes and time of the hub's delta versions on a realistic RL update, against baselines in the same run.

A Qwen2-architecture model built from a config (100.7 M parameters; `--quick`: 5 M) keeps fp32
master weights and takes real AdamW steps on a causal-LM loss over generated token data (a random
sparse Markov chain), first at lr 1e-6, then at lr 1e-5. After every step the bf16 cast is published
through `fleetrl.hub` into a directory store, and the same two states are measured with:

* dense bf16 safetensors, and safetensors + zstd (same level as the hub),
* XOR with the previous version + zstd of each whole tensor (the delta format slime and SkyRL ship),
* a naive sparse format: uint32 gaps + uint16 XOR values under zstd,
* the order-0 entropy bound: n·H(p) for the positions (p: changed fraction over the whole model)
  plus the empirical entropy of the stored values (the smallest of raw, XOR and difference),
  and the same bound per tensor (tighter: p per tensor).

Times: publish (snapshot, hash, encode, write) vs writing the dense safetensors file, and
materializing a delta in place into the engine's state dict vs loading the dense file of the same
version into that state dict, both measured in the same run, interleaved, best of REPEATS:

* ours: a reader that has followed the chain (as a rollout node's long-lived `Hub` has: the
  manifests of earlier versions are in its cache, its kernel is compiled) updates the engine's
  weights from version N-1 to N in place: it fetches and verifies N's signed manifest, fetches the
  delta object, checks every part's sha256, decodes, applies (hub/kernels.py) and checks every
  written word against the part's `changed_digest`;
* `materialize_ratio`: dense load time / ours, where the dense load is safetensors' `load_file`
  (a lazy mmap of the file, which is in the page cache) plus `copy_` into the same state dict:
  the cheapest way to load a dense file (a fresh dict from `load_file` alone would not even read
  the bytes until first use, so it is no materialization at all);
* `materialize_ratio_read`: against reading the file's bytes (as a GET from a store returns them),
  parsing and copying;
* `numpy_scatter_ratio`: dense load time / a numpy gather and scatter of the changed words alone
  (positions and new words known in advance: no fetch, decode or check), the way to apply a sparse
  update without a compiled kernel. At ~2.6% changed bf16 elements about 57% of the model's cache
  lines hold a change, so even that costs about as much as the dense load.

Neither baseline verifies anything. Threads are those of a real reader: torch intra-op threads 1
(what `rollout/__main__.py` and the torch engine set), `hub.threads` 2 (this machine's cores).
Our bytes include the signed manifest.

    .venv/bin/python bench/hub_delta.py [--quick]

Last line: `result: bytes_ratio_vs_zstd=… bytes_ratio_vs_dense=… bytes_ratio_vs_xor_zstd=… bound_ratio=…
changed_fraction=… materialize_ratio=… bytes_ratio_vs_zstd_lr1e5=…` (all but the last at lr 1e-6).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zstandard
from safetensors.torch import load, load_file, save_file

from fleetrl.hub.signing import generate_ed25519

os.environ.setdefault("FLEETRL_HUB_KEY", generate_ed25519()[0])  # this run's signing key (Ed25519, the default)

from fleetrl.config import FleetConfig, ModelConfig, TinyModelConfig
from fleetrl.hub import Hub
from fleetrl.hub.tensors import to_words

FULL = TinyModelConfig(vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=256)
QUICK = TinyModelConfig(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LEVEL = 3
REPEATS = 5
"""Timings are the best of this many runs: the machine is shared, and noise only ever adds time."""
READER_TORCH_THREADS = 1
"""torch intra-op threads of a rollout node (rollout/__main__.py), the process that materializes."""


@dataclass
class Phase:
    lr: float
    ours: list[int] = field(default_factory=list)
    dense: list[int] = field(default_factory=list)
    zstd: list[int] = field(default_factory=list)
    xor_zstd: list[int] = field(default_factory=list)
    naive: list[int] = field(default_factory=list)
    bound: list[float] = field(default_factory=list)
    bound_per_tensor: list[float] = field(default_factory=list)
    changed: list[float] = field(default_factory=list)
    publish_s: list[float] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)
    materialize_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    read_load_s: list[float] = field(default_factory=list)
    scatter_s: list[float] = field(default_factory=list)


def token_batches(vocab: int, batch: int, seq: int, seed: int = 0) -> Any:
    """Sequences from a sparse random Markov chain: each token has 4 likely successors."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 4))
    while True:
        out = np.empty((batch, seq), dtype=np.int64)
        out[:, 0] = rng.integers(0, vocab, size=batch)
        for t in range(1, seq):
            out[:, t] = successors[out[:, t - 1], rng.integers(0, 4, size=batch)]
        yield torch.from_numpy(out)


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k != "lm_head.weight"}


def entropy_bits(values: np.ndarray) -> float:
    """Order-0 empirical entropy of a sequence of symbols, in bits (total)."""
    if values.size == 0:
        return 0.0
    _, counts = np.unique(values, return_counts=True)
    p = counts / values.size
    return float(-(counts * np.log2(p)).sum())


def h2(p: float) -> float:
    return 0.0 if p <= 0 or p >= 1 else -(p * np.log2(p) + (1 - p) * np.log2(1 - p))


def compare(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], phase: Phase, zc: Any) -> None:
    """Baseline sizes and entropy bounds of the change prev -> cur."""
    n_total = m_total = 0
    per_tensor = 0.0
    xor_bytes = naive_bytes = 0
    reps: dict[str, list[np.ndarray]] = {"raw": [], "xor": [], "sub": []}
    for name in untied(cur):
        old, new = to_words(prev[name]), to_words(cur[name])
        xor = old ^ new
        xor_bytes += len(zc.compress(xor.tobytes()))
        pos = np.flatnonzero(xor)
        gaps = np.diff(pos, prepend=-1).astype(np.uint32)
        naive_bytes += len(zc.compress(gaps.tobytes() + xor[pos].tobytes()))
        n_total, m_total = n_total + old.size, m_total + pos.size
        for rep, vals in (("raw", new[pos]), ("xor", xor[pos]), ("sub", (new[pos] - old[pos]))):
            reps[rep].append(vals)
        if pos.size:
            best = min(entropy_bits(v) for v in (new[pos], xor[pos], new[pos] - old[pos]))
            per_tensor += old.size * h2(pos.size / old.size) + best
    values_bits = min(entropy_bits(np.concatenate(v)) for v in reps.values())
    phase.bound.append((n_total * h2(m_total / n_total) + values_bits) / 8)
    phase.bound_per_tensor.append(per_tensor / 8)
    phase.changed.append(m_total / n_total)
    phase.xor_zstd.append(xor_bytes)
    phase.naive.append(naive_bytes)


def dense_baselines(state: dict[str, torch.Tensor], path: pathlib.Path, phase: Phase, zc: Any) -> None:
    t0 = time.perf_counter()
    save_file(untied(state), str(path))
    phase.save_s.append(time.perf_counter() - t0)
    data = path.read_bytes()
    phase.dense.append(len(data))
    phase.zstd.append(len(zc.compress(data)))


def engine_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rollout engine's copy of the weights at the previous version (tied like the model)."""
    into = {k: v.clone() for k, v in state.items() if k != "lm_head.weight"}
    into["lm_head.weight"] = into["model.embed_tokens.weight"]
    return into


def timed_materialize(reader: Hub, prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor],
                      version: int) -> float:
    """A reader that followed the chain up to `version - 1` (a rollout node's long-lived `Hub`: its
    threads are up, earlier manifests are cached) updates an engine's weights in place to `version`.
    Version N's manifest is dropped from its cache first, so every timing fetches and verifies it."""
    into = engine_state(prev)
    reader.reader._manifests.pop(version, None)
    t0 = time.perf_counter()
    reader.materialize(version, into=into, have_version=version - 1)
    elapsed = time.perf_counter() - t0
    assert all(torch.equal(into[k].view(torch.int16), cur[k].view(torch.int16)) for k in cur), "not exact"
    return elapsed


def timed_load(path: pathlib.Path, prev: dict[str, torch.Tensor], read: bool = False) -> float:
    """Dense file into the engine's weights: mapped (`load_file`), or read as a store GET returns it."""
    into = engine_state(prev)
    t0 = time.perf_counter()
    loaded = load(path.read_bytes()) if read else load_file(str(path))
    for k, v in loaded.items():
        into[k].copy_(v)
    return time.perf_counter() - t0


def timed_scatter(prev: dict[str, torch.Tensor], changes: dict[str, tuple[np.ndarray, np.ndarray]]) -> float:
    """A numpy gather and scatter of the changed words alone (positions and words known in advance:
    no fetch, decode or check)."""
    into = engine_state(prev)
    targets = {name: to_words(into[name]) for name in changes}
    t0 = time.perf_counter()
    for name, (pos, new) in changes.items():
        np.take(targets[name], pos)
        targets[name][pos] = new
    return time.perf_counter() - t0


def timed_reads(reader: Hub, prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], version: int,
                dense_path: pathlib.Path) -> tuple[float, float, float, float]:
    """Best of REPEATS of ours, the mapped dense load, the read dense load and the numpy gather/scatter,
    interleaved (so that noise from other processes on the machine falls on all alike), with a
    reader's threads."""
    changes = {}
    for name in untied(cur):
        old, new = to_words(prev[name]), to_words(cur[name])
        pos = np.flatnonzero(old != new)
        if pos.size:
            changes[name] = (pos, new[pos])
    threads = torch.get_num_threads()
    torch.set_num_threads(READER_TORCH_THREADS)
    try:
        runs = [(timed_materialize(reader, prev, cur, version), timed_load(dense_path, prev),
                 timed_load(dense_path, prev, read=True), timed_scatter(prev, changes)) for _ in range(REPEATS)]
    finally:
        torch.set_num_threads(threads)
    return tuple(min(r[i] for r in runs) for i in range(4))  # type: ignore[return-value]


def run_phase(phase: Phase, model: torch.nn.Module, batches: Any, steps: int, hub: Hub, reader: Hub,
              workdir: pathlib.Path, state: dict[str, torch.Tensor], version: int) -> tuple[dict[str, Any], int]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=phase.lr, weight_decay=0.0)
    zc = zstandard.ZstdCompressor(level=LEVEL)
    for _ in range(steps):
        loss = model(input_ids=(ids := next(batches)), labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cur = bf16_state(model)
        t0 = time.perf_counter()
        pv = hub.publish(cur)
        phase.publish_s.append(time.perf_counter() - t0)
        assert pv.version == version + 1 and pv.anchor != pv.version, "benchmark expects delta versions"
        version = pv.version
        phase.ours.append(pv.bytes_written)
        compare(state, cur, phase, zc)
        dense_path = workdir / f"v{version}.safetensors"
        dense_baselines(cur, dense_path, phase, zc)
        timings = timed_reads(reader, state, cur, version, dense_path)
        phase.materialize_s.append(timings[0])
        phase.load_s.append(timings[1])
        phase.read_load_s.append(timings[2])
        phase.scatter_s.append(timings[3])
        dense_path.unlink()
        print(f"  lr={phase.lr:g} v{version}: loss {loss.item():.3f} changed {phase.changed[-1]:.4f} "
              f"ours {pv.bytes_written:,} B  zstd {phase.zstd[-1]:,} B  xor+zstd {phase.xor_zstd[-1]:,} B  "
              f"naive {phase.naive[-1]:,} B  bound {phase.bound[-1]:,.0f} B  "
              f"materialize {phase.materialize_s[-1] * 1e3:.0f} ms vs load {phase.load_s[-1] * 1e3:.0f} ms",
              flush=True)
        state = cur
    return state, version


def ratio(num: list[float] | list[int], den: list[float] | list[int]) -> float:
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def report(p: Phase) -> None:
    print(f"lr {p.lr:g}: median over {len(p.ours)} steps")
    print(f"  changed fraction of bf16 elements   {statistics.median(p.changed):.4f}")
    print(f"  bytes per version (ours)            {statistics.median(p.ours):,.0f}")
    for label, base in (("dense safetensors", p.dense), ("safetensors + zstd", p.zstd),
                        ("XOR + zstd (whole tensors)", p.xor_zstd), ("naive sparse (u32 gaps, u16 XOR)", p.naive)):
        print(f"  vs {label:<32} {statistics.median(base):>14,.0f} B  ratio {ratio(base, p.ours):7.2f}x")
    print(f"  entropy bound (global p)            {statistics.median(p.bound):>14,.0f} B  "
          f"ours/bound {ratio(p.ours, p.bound):.3f}")
    print(f"  entropy bound (p per tensor)        {statistics.median(p.bound_per_tensor):>14,.0f} B  "
          f"ours/bound {ratio(p.ours, p.bound_per_tensor):.3f}")
    print(f"  publish {statistics.median(p.publish_s) * 1e3:.0f} ms vs save dense "
          f"{statistics.median(p.save_s) * 1e3:.0f} ms; materialize in place "
          f"{statistics.median(p.materialize_s) * 1e3:.0f} ms vs load dense "
          f"{statistics.median(p.load_s) * 1e3:.0f} ms mapped (ratio {ratio(p.load_s, p.materialize_s):.2f}), "
          f"{statistics.median(p.read_load_s) * 1e3:.0f} ms read (ratio {ratio(p.read_load_s, p.materialize_s):.2f}); "
          f"numpy gather/scatter of the changes alone {statistics.median(p.scatter_s) * 1e3:.0f} ms "
          f"(dense load / that: {ratio(p.load_s, p.scatter_s):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 M-parameter model, fewer steps (< 2 min)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tiny = QUICK if args.quick else FULL
    steps = 3 if args.quick else 4
    batch, seq = (4, 64) if args.quick else (2, 128)
    torch.manual_seed(0)
    model = ModelConfig(tiny=tiny).build()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2 {n_params / 1e6:.1f} M parameters (fp32 masters, bf16 published)", flush=True)
    with tempfile.TemporaryDirectory(prefix="fleetrl-bench-") as tmp:
        workdir = pathlib.Path(tmp)
        config = FleetConfig.model_validate({
            "run": "bench", "hub": {"home_store": (workdir / "home").as_uri(), "anchor_interval": 1000,
                                    "zstd_level": LEVEL, "threads": 2},
            "regions": [{"name": "r", "kafka": "127.0.0.1:9", "store": (workdir / "r").as_uri()}],
        })
        with Hub.from_config(config) as hub, Hub.from_config(config) as reader:
            state = bf16_state(model)
            hub.publish(state)  # version 0: the anchor
            reader.materialize(0)  # the reader starts from the anchor, then follows the chain
            batches = token_batches(tiny.vocab_size, batch, seq)
            slow, fast = Phase(1e-6), Phase(1e-5)
            state, version = run_phase(slow, model, batches, steps, hub, reader, workdir, state, 0)
            run_phase(fast, model, batches, steps, hub, reader, workdir, state, version)
    report(slow)
    report(fast)
    print(f"result: bytes_ratio_vs_zstd={ratio(slow.zstd, slow.ours):.2f} "
          f"bytes_ratio_vs_dense={ratio(slow.dense, slow.ours):.2f} "
          f"bytes_ratio_vs_xor_zstd={ratio(slow.xor_zstd, slow.ours):.3f} "
          f"bound_ratio={ratio(slow.ours, slow.bound):.3f} "
          f"bound_ratio_per_tensor={ratio(slow.ours, slow.bound_per_tensor):.3f} "
          f"changed_fraction={statistics.median(slow.changed):.4f} "
          f"materialize_ratio={ratio(slow.load_s, slow.materialize_s):.2f} "
          f"materialize_ratio_read={ratio(slow.read_load_s, slow.materialize_s):.2f} "
          f"numpy_scatter_ratio={ratio(slow.load_s, slow.scatter_s):.2f} "
          f"bytes_ratio_vs_zstd_lr1e5={ratio(fast.zstd, fast.ours):.2f} "
          f"changed_fraction_lr1e5={statistics.median(fast.changed):.4f} "
          f"params_m={n_params / 1e6:.1f}")


if __name__ == "__main__":
    main()
