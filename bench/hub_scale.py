"""The hub and the trainer's publisher at the size of real models, against baselines in the same run.

Synthetic but realistic updates: fp32 master weights shaped like Qwen2.5-0.5B, Llama-3.2-1B and
Qwen2.5-3B (Hugging Face names, tied embeddings; weights ~N(0, 0.02), norms 1, biases 0) take
AdamW-like steps: each element moves by lr·sign(g) for a random gradient g (Adam's normalized
update m̂/√v̂ has magnitude ≲ 1; its first step is exactly sign(g)) plus decoupled weight decay
0.01·lr·w, at lr 1e-6, then lr 1e-5. The bf16 cast of every step is published through
`fleetrl.hub` into a directory store with `hub.threads` 1 and torch at 1 thread, so times are
per thread. Per size and lr it prints:

* publish s per billion parameters (snapshot handed over, sha256, delta encode, upload, manifest);
* materialize-in-place s per billion: a second `Hub` holding version N-1 (as a rollout node's
  does) updates its state dict to N, every part and written word checked;
* bytes per version, as ratios: safetensors + zstd (level 3) of the version, and XOR with the
  previous version + zstd of each whole tensor (slime/SkyRL's delta format), over ours;
* the changed fraction of bf16 elements.

Trainer stall per step (largest size, lr 1e-6): a loop of steps as the trainer takes them, each an
emulated forward and backward that reads every weight matrix (`--step-tokens` tokens), then the
optimizer update, through the trainer's own `WeightPublisher` and snapshot buffers (`SnapshotRing`,
two sets, as `Learner.begin_published_state`): inline (`publish`: the cast, then the whole
publish) vs background (`submit`: wait for the previous publish, then begin the cast, which runs
while the next step's forward and backward read the weights; the next update waits for it, as
`Learner` does, before it changes them). The stall is the time the loop is not computing: the wait
for the cast plus the wait in `submit` (inline: the cast and the publish); `stall_ratio` = inline /
background (a background stall under 1 ms counts as 1 ms). Each phase's time is printed. On 2
shared cores the background cast and publish also compete with the step they overlap.

Peak resident memory of the process is printed after each part and as `peak_rss_gb`.

CLI chain (smallest size): five consecutive versions published by five `fleetrl hub publish`
processes from safetensors files, against the same five from one process into another store;
`cli_delta_ratio` = CLI bytes / one-process bytes over the four deltas; the CLI chain is then
pulled back and checked bit for bit.

    .venv/bin/python bench/hub_scale.py [--quick] [--sizes 0.5B,1B]

Defaults: 0.5B and 1B (3B needs more memory than a 24 GB machine has: fp32 masters, the hub's
parent, a reader's copy and the snapshot sets; add it with --sizes where memory allows).
`--quick`: a 28 M-parameter model of the same shape family (under 2 min).
Last line: `result: publish_s_per_b=… stall_ratio=… cli_delta_ratio=… materialize_s_per_b=…
bytes_ratio_vs_zstd=… bytes_ratio_vs_xor_zstd=… peak_rss_gb=…` (largest size, lr 1e-6).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import yaml
import zstandard
from safetensors.torch import load_file, save_file

from fleetrl.hub.signing import generate_ed25519

os.environ.setdefault("FLEETRL_HUB_KEY", generate_ed25519()[0])  # this run's signing key (Ed25519, the default)

from fleetrl import log
from fleetrl.config import FleetConfig
from fleetrl.hub import Hub
from fleetrl.hub.tensors import to_words
from fleetrl.trainer.metrics import TrainerMetrics
from fleetrl.trainer.publisher import WeightPublisher
from fleetrl.trainer.snapshots import SnapshotRing

LEVEL = 3
LRS = (1e-6, 1e-5)
TIED = "lm_head.weight"


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    kv_dim: int
    vocab: int


SHAPES = {
    "quick": Shape(512, 1408, 4, 128, 32000),  # 27.6 M
    "0.5B": Shape(896, 4864, 24, 128, 151936),  # Qwen2.5-0.5B: 494 M
    "1B": Shape(2048, 8192, 16, 512, 128256),  # Llama-3.2-1B: 1.24 B
    "3B": Shape(2048, 11008, 36, 256, 151936),  # Qwen2.5-3B: 3.09 B
}


@dataclass
class Row:
    size: str
    params: int
    lr: float
    publish_s: list[float] = field(default_factory=list)
    materialize_s: list[float] = field(default_factory=list)
    ours: list[int] = field(default_factory=list)
    changed: list[float] = field(default_factory=list)
    zstd: int = 0
    xor_zstd: int = 0

    def per_b(self, seconds: list[float]) -> float:
        return statistics.median(seconds) / (self.params / 1e9)


def make_masters(s: Shape, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 masters under Hugging Face names; lm_head is the embedding tensor itself (tied)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).mul_(0.02)

    h = s.hidden
    out = {"model.embed_tokens.weight": w(s.vocab, h)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.q_proj.bias": torch.zeros(h),
                p + "self_attn.k_proj.weight": w(s.kv_dim, h), p + "self_attn.k_proj.bias": torch.zeros(s.kv_dim),
                p + "self_attn.v_proj.weight": w(s.kv_dim, h), p + "self_attn.v_proj.bias": torch.zeros(s.kv_dim),
                p + "self_attn.o_proj.weight": w(h, h), p + "mlp.gate_proj.weight": w(s.intermediate, h),
                p + "mlp.up_proj.weight": w(s.intermediate, h), p + "mlp.down_proj.weight": w(h, s.intermediate),
                p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h)}
    out["model.norm.weight"] = torch.ones(h)
    out[TIED] = out["model.embed_tokens.weight"]
    return out


def adamw_like_step(masters: dict[str, torch.Tensor], lr: float, g: torch.Generator) -> None:
    """w -= lr·sign(g) + 0.01·lr·w, in place, each tensor once (lm_head is the embedding)."""
    for name, w in masters.items():
        if name == TIED:
            continue
        sign = torch.rand(w.shape, generator=g) < 0.5
        w.mul_(1 - 0.01 * lr).add_(torch.where(sign, lr, -lr))


def snapshot(masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the trainer publishes: a private bf16 copy (Learner.published_state)."""
    return {k: v.to(torch.bfloat16, copy=True) for k, v in masters.items()}


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k != TIED}


def baselines(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], row: Row, root: pathlib.Path) -> None:
    zc = zstandard.ZstdCompressor(level=LEVEL)
    path = root / "baseline.safetensors"
    save_file(untied(cur), str(path))  # streamed through zstd from disk: not a second copy in memory
    with path.open("rb") as f:
        row.zstd = zc.copy_stream(f, _Counter())[1]
    path.unlink()
    row.xor_zstd = sum(len(zc.compress((to_words(prev[k]) ^ to_words(cur[k])).tobytes())) for k in untied(cur))


class _Counter:
    """A sink that only counts: the size of a compressed stream."""

    def write(self, data: bytes) -> int:
        return len(data)


def changed_fraction(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor]) -> float:
    n = m = 0
    for k in untied(cur):
        a, b = to_words(prev[k]), to_words(cur[k])
        n, m = n + a.size, m + int((a != b).sum())
    return m / n


def hub_config(root: pathlib.Path, name: str) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": "scale", "hub": {"home_store": (root / name).as_uri(), "anchor_interval": 1000, "zstd_level": LEVEL,
                                "threads": 1},
        "regions": [{"name": "r", "kafka": "127.0.0.1:9", "store": (root / f"{name}-r").as_uri()}],
    })


def run_size(size: str, steps: int, root: pathlib.Path) -> tuple[list[Row], dict[str, torch.Tensor], Hub]:
    """Publish and materialize `steps` versions per lr; returns the rows, the masters and the hub."""
    masters = make_masters(SHAPES[size])
    params = sum(v.numel() for k, v in masters.items() if k != TIED)
    print(f"{size}: {params / 1e9:.3f} B parameters", flush=True)
    g = torch.Generator().manual_seed(1)
    hub, reader = Hub.from_config(hub_config(root, size)), Hub.from_config(hub_config(root, size))
    cur = snapshot(masters)
    hub.publish(cur, owned=True)
    engine = reader.materialize(0)  # a rollout node's state dict, then followed in place
    adamw_like_step(masters, LRS[0], g)  # one untimed version: the kernels load, the caches fill
    cur = snapshot(masters)
    reader.materialize(hub.publish(cur, owned=True).version, into=engine, have_version=0)
    rows = []
    for lr in LRS:
        row = Row(size, params, lr)
        for i in range(steps):
            prev = cur
            adamw_like_step(masters, lr, g)
            cur = snapshot(masters)
            t0 = time.perf_counter()
            pv = hub.publish(cur, owned=True)
            row.publish_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            reader.materialize(pv.version, into=engine, have_version=pv.version - 1)
            row.materialize_s.append(time.perf_counter() - t0)
            row.ours.append(pv.bytes_written)
            row.changed.append(changed_fraction(prev, cur))
            if i == steps - 1:
                baselines(prev, cur, row, root)
        print(f"  lr {lr:g}: publish {row.per_b(row.publish_s):.2f} s/B  materialize {row.per_b(row.materialize_s):.2f}"
              f" s/B  ours {row.ours[-1]:,} B  zstd x{row.zstd / row.ours[-1]:.1f}  xor+zstd "
              f"x{row.xor_zstd / row.ours[-1]:.2f}  changed {statistics.median(row.changed):.4f}", flush=True)
        rows.append(row)
    reader.close()
    del engine
    return rows, masters, hub


def forward_backward(masters: dict[str, torch.Tensor], tokens: int, g: torch.Generator) -> None:
    """Reads every weight matrix as a step's forward and backward pass over `tokens` tokens would:
    x·Wᵀ, then the input gradient through W (4 FLOPs per parameter per token; the weight gradients
    are left out, the bench's optimizer does not use them). The embedding is a lookup; its tied
    copy is the LM head's matrix."""
    for name, w in masters.items():
        if w.dim() != 2 or name == "model.embed_tokens.weight":
            continue
        x = torch.randn(tokens, w.shape[1], generator=g)
        y = x @ w.T
        y @ w  # the backward's input-gradient matmul; its value is not needed


async def trainer_loop(masters: dict[str, torch.Tensor], hub: Hub, steps: int, tokens: int, background: bool
                       ) -> tuple[list[float], dict[str, float]]:
    """Steps as the trainer takes them (`Learner` and `TrainerService._publish_step`): forward and
    backward, the optimizer update (after `SnapshotRing.fence`), then the publish through the
    trainer's `WeightPublisher` and `SnapshotRing` (two buffer sets): inline (`publish`: the cast,
    then the whole publish) or background (`submit`: wait for the previous publish, begin the cast,
    which runs during the next step's forward and backward). Returns the stall per step (time the
    loop is not computing) and mean seconds per phase."""
    publisher = WeightPublisher(hub, None, TrainerMetrics())
    version = hub.latest()
    assert version is not None
    g = torch.Generator().manual_seed(2)
    ring = SnapshotRing()
    stalls, phases = [], {"forward_backward": 0.0, "update": 0.0, "cast_wait": 0.0, "publish_wait": 0.0}
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        await asyncio.to_thread(forward_backward, masters, tokens, g)
        t1 = time.perf_counter()
        cast_wait = await asyncio.to_thread(ring.fence)
        t2 = time.perf_counter()
        await asyncio.to_thread(adamw_like_step, masters, LRS[0], g)
        t3 = time.perf_counter()
        version += 1
        if background:
            await publisher.submit(lambda: asyncio.to_thread(ring.begin, masters, torch.bfloat16), version)
        else:
            await publisher.publish(await asyncio.to_thread(ring.take, masters, torch.bfloat16), version)
        t4 = time.perf_counter()
        stalls.append(cast_wait + (t4 - t3))
        for key, seconds in (("forward_backward", t1 - t0), ("update", t3 - t2), ("cast_wait", cast_wait),
                             ("publish_wait", t4 - t3)):
            phases[key] += seconds / steps
    await publisher.flush()
    ring.close()
    phases["wall"] = (time.perf_counter() - start) / steps
    phases["snapshot_gb"], phases["resident_gb"] = ring.nbytes / 2**30, resident_gb()
    return stalls, phases


def stall(masters: dict[str, torch.Tensor], hub: Hub, steps: int, tokens: int) -> float:
    inline, p_in = asyncio.run(trainer_loop(masters, hub, steps, tokens, background=False))
    back, p_bg = asyncio.run(trainer_loop(masters, hub, steps, tokens, background=True))
    mean = statistics.mean
    ratio = mean(inline) / max(mean(back), 1e-3)  # a stall under a millisecond counts as one
    print(f"trainer stall per step: inline {mean(inline):.3f} s, background {mean(back):.3f} s: x{ratio:.1f}",
          flush=True)
    for mode, p in (("inline", p_in), ("background", p_bg)):
        print(f"  {mode}: forward+backward {p['forward_backward']:.2f} s ({tokens} tokens), update "
              f"{p['update']:.2f} s, waiting for the cast {p['cast_wait']:.3f} s, for publishing "
              f"{p['publish_wait']:.3f} s; wall per step {p['wall']:.2f} s; resident at its end "
              f"{p['resident_gb']:.1f} GB, of which snapshot buffers {p['snapshot_gb']:.1f} GB", flush=True)
    return ratio


def resident_gb() -> float:
    """Resident memory of this process now."""
    pages = int(pathlib.Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def peak_rss_gb() -> float:
    """Peak resident memory of this process (the CLI chain's processes are counted apart)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def cli_chain(size: str, root: pathlib.Path) -> float:
    """Five versions by five `fleetrl hub publish` processes vs one process; bytes of the deltas."""
    masters, g = make_masters(SHAPES[size], seed=3), torch.Generator().manual_seed(3)
    files = [root / f"cli-v{i}.safetensors" for i in range(5)]
    for i, path in enumerate(files):  # one version in memory at a time: 1B's five would be 12 GB
        if i:
            adamw_like_step(masters, LRS[0], g)
        save_file(untied(snapshot(masters)), str(path))
    del masters
    cfg = root / "cli.yaml"
    cfg.write_text(yaml.safe_dump(hub_config(root, "cli").model_dump(mode="json")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cli = []
    for path in files:
        argv = [sys.executable, "-m", "fleetrl.cli", "hub", "publish", str(path),
                "--config", str(cfg)]
        done = subprocess.run(argv, env=env, capture_output=True, timeout=1800, check=True)
        cli.append(json.loads(done.stdout)["bytes_written"])
    with Hub.from_config(hub_config(root, "one")) as one:
        single = [one.publish(load_file(str(path)), owned=True).bytes_written for path in files]
    with Hub.from_config(hub_config(root, "cli")) as hub:
        pulled, last = hub.materialize(4), load_file(str(files[-1]))
        exact = all(torch.equal(pulled[k].view(torch.int16), v.view(torch.int16)) for k, v in last.items())
    ratio = sum(cli[1:]) / sum(single[1:])
    print(f"CLI chain ({size}): {cli} B vs one process {single} B: x{ratio:.4f}; pull bit-exact: {exact}", flush=True)
    if not exact:
        raise SystemExit("the CLI chain did not pull back bit for bit")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 28 M-parameter model (under 2 min on 2 cores)")
    parser.add_argument("--sizes", default="0.5B,1B", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--step-tokens", type=int, default=8,
                        help="tokens of the stall loop's emulated forward and backward per step (default 8: a real "
                             "step's batch holds thousands of sequences, so this understates the overlap)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    log.configure(level="WARNING")
    sizes = ["quick"] if args.quick else args.sizes.split(",")
    steps, stall_steps = (3, 6) if args.quick else (3, 4)  # medians of 3: one slow step (a kernel compiling)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="fleetrl-scale-") as tmp:
        root = pathlib.Path(tmp)
        cli_ratio = cli_chain(sizes[0], root)
        print(f"peak resident memory after the CLI chain: {peak_rss_gb():.1f} GB", flush=True)
        for i, size in enumerate(sizes):
            size_rows, masters, hub = run_size(size, steps, root)
            rows += size_rows
            if i == len(sizes) - 1:
                stall_ratio = stall(masters, hub, stall_steps, args.step_tokens)
            hub.close()
            del masters
            print(f"peak resident memory after {size}: {peak_rss_gb():.1f} GB", flush=True)
    print("\n| size | params | lr | publish s/B | materialize s/B | changed | bytes/version | vs st+zstd "
          "| vs XOR+zstd |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.size} | {r.params / 1e9:.3f} B | {r.lr:g} | {r.per_b(r.publish_s):.2f} | "
              f"{r.per_b(r.materialize_s):.2f} | {statistics.median(r.changed):.4f} | "
              f"{statistics.median(r.ours):,.0f} | "
              f"{r.zstd / r.ours[-1]:.1f} | {r.xor_zstd / r.ours[-1]:.2f} |")
    top = next(r for r in rows if r.size == sizes[-1] and r.lr == LRS[0])
    print(f"result: publish_s_per_b={top.per_b(top.publish_s):.2f} stall_ratio={stall_ratio:.1f} "
          f"cli_delta_ratio={cli_ratio:.4f} materialize_s_per_b={top.per_b(top.materialize_s):.2f} "
          f"bytes_ratio_vs_zstd={top.zstd / top.ours[-1]:.1f} "
          f"bytes_ratio_vs_xor_zstd={top.xor_zstd / top.ours[-1]:.2f} peak_rss_gb={peak_rss_gb():.1f}")


if __name__ == "__main__":
    main()
