"""Issue 37's device check: the static decode step, the learner that fits and device weight updates, on
a 0.5 B Qwen2 of Qwen2.5-0.5B's shape (built from a config) on one CUDA GPU, in one call.

Parts, in this order (each prints `part NAME (Ns): ...`; a failure is printed and the next part runs;
a part that would start past `--budget-s` is skipped):

  checks   parity on the device, tiny fp32 model: `device_uniforms` equal the host's bit for bit; the
           static engine with CUDA graphs samples the packed CPU engine's tokens; a sparse weight update
           on the device equals a dense load; chunked logprobs equal the whole logits' (loss, grads)
  engine   the torch engine (static step, CUDA graphs, bf16) at batch 64 and 256 on long-tailed work, and
           `model.generate` at batch 64 on the same prompts: useful tokens per second. Lengths are
           long-tailed as bench/engine.py makes them: the EOS row of the output embedding is pushed along
           the mean final hidden direction so that a sample stops with ~1.5 % chance per token (256 new
           tokens at most). Each engine runs the work once to capture its graphs, then is timed.
  learner  one learner step of 16,384 tokens (8 groups x 8 samples x (64 + 192)), one micro-batch, per
           path (bench/gpu_learner.py): the whole logits (`logprob_chunk_tokens: 0`, today's step), chunked,
           selective checkpointing (`--activation-gib`), every layer checkpointed, compiled decoder
           layers; ms per 1k tokens, peak allocated memory and MFU of each.
  weights  a real learner step's version published as a delta; the engine (bf16, on the device) takes it
           as changed positions and values (`Hub.changes` on the host, then `stage_changes`), against a
           dense host-to-device copy of the same weights.
  packed   today's packed engine at batch 64 on the same work (for the record, if time is left).
  liger    Liger Kernel (last: it patches modules process-wide): its fused layers and head against the
           chunked path on a tiny fp32 model (log-probs, gradients, loss), then the 0.5 B step with it,
           alone and with selective checkpointing. Needs liger-kernel in .whl (see gpu_check.sh).

    bash bench/gpu_check.sh            # on the lent machine (see the script)
    bash bench/gpu_check.sh --tiny     # here: the same parts on the CPU with a tiny shape

Last line: `result: engine_tok_s_b64=... engine_tok_s_b256=... generate_tok_s_b64=... speedup_cuda=...
learner_ms_per_1k_tok=... learner_peak_gib=... learner_mfu=... update_s_gpu=... dense_h2d_s=...`, then
each learner path's `learner_<path>_{ms_per_1k_tok,peak_gib,mfu}` (full, chunked, mb16, mb8, sel, ckpt,
compile, compile_sel, liger, liger_sel), `learner_fits` (the fastest path within 16 GiB, whose figures the first
learner_* are), `liger_dlogp`, `liger_dgrad` and a few more.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import pathlib
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gpu_learner import learner_batch, part_learner, part_liger

from fleetrl.broker import Sampling
from fleetrl.config import AlgorithmConfig, FleetConfig, ModelConfig, SpeculativeConfig
from fleetrl.config.models import TinyModelConfig
from fleetrl.hub import Hub, kernels
from fleetrl.rollout.engine import GroupRequest, TensorChanges
from fleetrl.rollout.sampling import device_keys, device_uniforms, hash_keys, hashed_uniforms
from fleetrl.rollout.torch_engine import TorchEngine
from fleetrl.trainer.batch import build_step_batch
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner

HALF_B = TinyModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096)
TINY = TinyModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
M50 = TinyModelConfig(vocab_size=32768, hidden_size=512, intermediate_size=1408, num_hidden_layers=12,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
"""bench/learner.py's ~50 M shape (for CPU figures of the weights part: `--tiny --shape 50m`)."""
SHAPES = {"tiny": TINY, "50m": M50, "0.5b": HALF_B}
P_STOP = 0.015
NO_SPEC = SpeculativeConfig(enabled=False)
RESULT: dict[str, float] = {}


class Setup:
    def __init__(self, args: argparse.Namespace) -> None:
        self.tiny = args.tiny
        self.device = "cpu" if args.tiny else "cuda"
        self.shape = SHAPES[args.shape or ("tiny" if args.tiny else "0.5b")]
        self.max_new = 48 if args.tiny else 256
        self.batches = (8, 32) if args.tiny else (64, 256)
        self.samples = {8: 48, 32: 96} if args.tiny else {64: 192, 256: 1024}
        self.dtype = "float32" if args.tiny else "bfloat16"
        self.learner_groups = (8, 8, 16, 48) if args.tiny else (8, 8, 64, 192)  # groups, samples, prompt, completion
        self.started = time.perf_counter()
        self.budget_s = args.budget_s
        self.peak_tflops: float | None = args.peak_tflops
        self.activation_gib: float = args.activation_gib
        self.result = RESULT
        self.model: Any = None
        self.learner: Learner | None = None

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def engine(self, model: Any, batch: int, **kw: Any) -> TorchEngine:
        if self.tiny:  # the static step on the CPU runs eagerly (no CUDA graphs there)
            kw.setdefault("static", True)
            kw.setdefault("graphs", "eager")
        return TorchEngine(model, max_batch=batch, device=self.device, dtype=self.dtype, speculative=NO_SPEC,
                           **kw)


# -- workload --------------------------------------------------------------------------------------


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts of 8 to 16 tokens after BOS (as bench/engine.py makes them)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 17, (n,), generator=g).tolist()
    return [[1, *torch.randint(7, min(vocab, 1000), (k,), generator=g).tolist()] for k in lengths]


@torch.no_grad()
def push_eos(model: Any, device: str, p_stop: float = P_STOP) -> None:
    """Raise the EOS logit along the mean final hidden direction so that a sample stops with ~p_stop per
    step: long-tailed lengths from a random-init model (bench/engine.py's edit, calibrated to a rate)."""
    eos = int(model.config.eos_token_id)
    probe = torch.randint(3, model.config.vocab_size, (16, 32), generator=torch.Generator().manual_seed(1))
    h = model.model(input_ids=probe.to(device)).last_hidden_state.flatten(0, 1).float()
    emb = model.get_output_embeddings().weight
    logits = h @ emb.float().T
    e = logits[:, eos].clone()
    logits[:, eos] = -float("inf")
    need = torch.logsumexp(logits, dim=1) + math.log(p_stop) - e
    u = h.mean(0) / h.mean(0).norm()
    emb[eos] += ((need.mean() / (h @ u).mean()) * u).to(emb.dtype)


def useful(tokens: list[int], eos: int) -> int:
    return tokens.index(eos) + 1 if eos in tokens else len(tokens)


def run_engine(engine: TorchEngine, work: list[list[int]], max_new: int, seed: int = 0
               ) -> tuple[int, float, list[int], int]:
    """Useful tokens, seconds, sample lengths and engine steps of the work (one sample per prompt)."""
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=max_new)
    started = time.perf_counter()
    for i, p in enumerate(work):
        engine.submit(GroupRequest(f"g{seed}-{i}", p, sampling, n_samples=1, seed=seed))
    lengths: list[int] = []
    steps = 0
    while engine.has_work():
        steps += 1
        for group in engine.step():
            lengths += [len(s.completion_ids) for s in group.samples]
    return sum(lengths), time.perf_counter() - started, lengths, steps


def run_generate(model: Any, work: list[list[int]], batch: int, max_new: int, device: str) -> tuple[int, float]:
    eos = int(model.config.eos_token_id)
    tokens, started = 0, time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(len(p) for p in chunk)
        x = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=x, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
        tokens += sum(useful(row, eos) for row in out[:, width:].tolist())
    return tokens, time.perf_counter() - started


def lengths_text(lengths: list[int], cap: int) -> str:
    a = np.asarray(lengths)
    return (f"len mean {a.mean():.0f} p50 {np.median(a):.0f} p90 {np.percentile(a, 90):.0f} "
            f"capped {100 * (a >= cap).mean():.0f}%")


# -- parts ---------------------------------------------------------------------------------------------


def part_checks(s: Setup) -> str:
    out = []
    keys = hash_keys(np.random.default_rng(0).integers(0, 2**63, 4096, dtype=np.int64).astype(np.uint64))
    pos = np.random.default_rng(1).integers(0, 2**40, 4096, dtype=np.int64)
    dev_u = device_uniforms(device_keys(keys).to(s.device), torch.from_numpy(pos).to(s.device)).cpu().numpy()
    same_u = bool((dev_u.view(np.uint64) == hashed_uniforms(keys, pos).view(np.uint64)).all())
    out.append(f"device uniforms == host bit for bit: {same_u}")
    model = ModelConfig().build().eval()
    work = prompts(12, 128, seed=3)
    cpu = TorchEngine(copy.deepcopy(model), max_batch=8, eos_ids=list(range(2, 20)), speculative=NO_SPEC)
    kw: dict[str, Any] = {"static": True, "graphs": "eager"} if s.tiny else {}
    dev = TorchEngine(copy.deepcopy(model), max_batch=8, device=s.device, eos_ids=list(range(2, 20)), **kw)
    results = []
    for engine in (cpu, dev):
        sampling = Sampling(temperature=0.9, top_p=0.95, max_new_tokens=40)
        done: dict[str, Any] = {}
        for i, p in enumerate(work):
            engine.submit(GroupRequest(f"g{i}", p, sampling, n_samples=3, seed=5))
        while engine.has_work():
            done.update({f.group_id: f.samples for f in engine.step()})
        results.append(done)
    pairs = [(a, b) for g in results[0] for a, b in zip(results[0][g], results[1][g], strict=True)]
    same = [a for a, b in pairs if np.array_equal(a.completion_ids, b.completion_ids)]
    diff = max((float(np.abs(a.logprobs - b.logprobs).max()) for a, b in pairs
                if np.array_equal(a.completion_ids, b.completion_ids) and len(a.logprobs)), default=0.0)
    static = dev._static
    out.append(f"static engine on {s.device} (graphs {static.graphs.mode if static else None}, "
               f"{static.graphs.captures if static else 0} captured) vs packed CPU fp32: identical "
               f"{len(same)}/{len(pairs)}, max|dlogprob| {diff:.1e}")
    new = ModelConfig(tiny={"seed": 9}).build().state_dict()
    changes = {}
    for name, t in new.items():
        flat = t.reshape(-1)
        pos_t = torch.arange(0, flat.numel(), 7)
        changes[name] = TensorChanges(pos_t.numpy(), flat[pos_t].clone())
    dev.stage_changes(changes, version=1)
    dev.step()
    dense = copy.deepcopy(dev.model.state_dict())
    for name, t in new.items():
        dense[name].view(-1)[::7] = t.reshape(-1)[::7].to(dense[name].device)
    ok = all(torch.equal(dev.model.state_dict()[n].cpu(), dense[n].cpu()) for n in new)
    out.append(f"sparse update on {s.device} == dense: {ok}")
    out.append(_check_logprobs(s))
    return "; ".join(out)


def _check_logprobs(s: Setup) -> str:
    from fleetrl.trainer.logprobs import causal_lm_logprobs

    model = ModelConfig(tiny={"vocab_size": 512}).build().to(s.device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, 512, (4, 40), generator=g).to(s.device)
    mask = torch.ones_like(x)
    scored = torch.zeros(4, 39, dtype=torch.bool, device=s.device)
    scored[:, 10:] = True
    grads, vals = [], []
    for chunk in (0, 16):
        model.zero_grad()
        ctx = torch.autocast(s.device, dtype=torch.bfloat16) if s.device == "cuda" else torch.autocast("cpu",
                                                                                                   enabled=False)
        with ctx:
            logp = causal_lm_logprobs(model, x, mask, x[:, 1:], scored, 1.0, chunk)
        (logp * scored).sum().backward()
        vals.append(logp.detach()[scored])
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    dv = (vals[0] - vals[1]).abs().max().item()
    dg = ((grads[0] - grads[1]).norm() / grads[0].norm()).item()
    return f"chunked logprobs vs whole logits on {s.device}: max|dlogp| {dv:.1e}, relative grad diff {dg:.1e}"


def _big_model(s: Setup) -> Any:
    if s.model is None:
        t = time.perf_counter()
        model = ModelConfig(tiny=s.shape).build().to(s.device, getattr(torch, s.dtype)).eval()
        model.generation_config.top_k = None
        push_eos(model, s.device)
        s.model = model
        print(f"  0.5B-class model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params, "
              f"built in {time.perf_counter() - t:.0f} s", flush=True)
    return s.model


def part_engine(s: Setup) -> str:
    model = _big_model(s)
    res = []
    rates: dict[int, float] = {}
    for batch in s.batches:
        work = prompts(s.samples[batch], model.config.vocab_size, seed=batch)
        engine = s.engine(model, batch)
        t = time.perf_counter()
        try:
            run_engine(engine, work, s.max_new, seed=1)  # warm-up: every bucket it meets is captured
        except Exception as exc:  # a capture that fails: measure the same step eagerly, and say so
            traceback.print_exc()
            res.append(f"b{batch} with CUDA graphs FAILED ({type(exc).__name__}: {str(exc)[:200]}); eager instead")
            engine = s.engine(model, batch, graphs="eager")
            run_engine(engine, work[:batch], 8, seed=1)
        s.sync()
        warm = time.perf_counter() - t
        captured = engine._static.graphs.captures if engine._static else 0
        toks, el, lengths, steps = run_engine(engine, work, s.max_new, seed=2)
        s.sync()
        rates[batch] = toks / el
        static = engine._static
        res.append(f"engine b{batch}: {rates[batch]:.0f} tok/s ({toks} tok in {el:.1f} s, {steps} steps = "
                   f"{el / steps * 1e3:.2f} ms/step; {lengths_text(lengths, s.max_new)}; warm-up {warm:.1f} s, "
                   f"{captured} graphs, {(static.graphs.captures if static else 0) - captured} more while timed)")
        del engine
    small = s.batches[0]
    work = prompts(s.samples[small], model.config.vocab_size, seed=small)
    run_generate(model, work[:small], small, 8, s.device)  # warm-up
    toks, el = run_generate(model, work, small, s.max_new, s.device)
    s.sync()
    gen = toks / el
    res.append(f"generate b{small}: {gen:.0f} useful tok/s ({toks} tok in {el:.1f} s)")
    RESULT.update({f"engine_tok_s_b{s.batches[0] if s.tiny else 64}": round(rates[s.batches[0]]),
                   f"engine_tok_s_b{s.batches[1] if s.tiny else 256}": round(rates[s.batches[1]]),
                   f"generate_tok_s_b{small}": round(gen), "speedup_cuda": round(rates[small] / gen, 2)})
    return "; ".join(res)


def part_weights(s: Setup) -> str:
    # Without Liger: its patches are process-wide, and its part runs last.
    algo = AlgorithmConfig(lr=1e-6, fused_kernels=False, compile=False)
    learner = s.learner or Learner(ModelConfig(tiny=s.shape), algo, DistContext(device=torch.device(s.device)))
    res = []
    with tempfile.TemporaryDirectory() as tmp:
        w = pathlib.Path(tmp)
        conf = FleetConfig.model_validate({
            "run": "gpucheck", "hub": {"home_store": (w / "home").as_uri(), "anchor_interval": 1000,
                                       "threads": os.cpu_count() or 4, "signing": {"scheme": "hmac-sha256"}},
            "regions": [{"name": "r", "kafka": "127.0.0.1:9", "store": (w / "r").as_uri()}]})
        with Hub.from_config(conf) as hub, Hub.from_config(conf) as reader:
            groups, _ = learner_batch(s, s.shape.vocab_size)
            # A trained state, not the initial one: tensors of equal bytes (a fresh model's zero biases) are
            # stored once, and the version that separates them goes whole, not as changes.
            learner.train_step(build_step_batch(groups[:2], "grpo", 0))
            t = time.perf_counter()
            hub.publish(learner.published_state())
            res.append(f"publish v0 (anchor) {time.perf_counter() - t:.1f} s")
            learner.train_step(build_step_batch(groups[:2], "grpo", 0))
            published = learner.published_state()
            t = time.perf_counter()
            pv1 = hub.publish(published)
            res.append(f"publish v1 delta {time.perf_counter() - t:.1f} s, {pv1.bytes_written / 1e6:.2f} MB")
            state = reader.materialize(0)

            def v0() -> dict[str, torch.Tensor]:  # a fresh host copy of version 0, tied as the hub hands it out
                out = {k: v.clone() for k, v in state.items()}
                out["lm_head.weight"] = out["model.embed_tokens.weight"]
                return out

            engine = s.engine(ModelConfig(tiny=s.shape).build(), 8)
            engine.stage_weights(v0(), 0)
            engine.step()
            reader.manifest(1)  # the manifest is read (and its signature checked) before the clocks start
            # A node compiles the delta kernels while it loads its first version (WeightSync.load_first).
            t = time.perf_counter()
            kernels.warm_up()
            res.append(f"kernels warmed up in {time.perf_counter() - t:.1f} s (compile or disk cache)")
            new_s: list[float] = []
            host: list[float] = []
            old: list[float] = []
            ok, n_changed = True, 0
            for _ in range(2 if s.tiny else 3):  # each path from version 0 again; the best of the rounds
                mine, theirs = v0(), v0()
                s.sync()
                # The new path: the delta applied to the host state in place, its changes handed over.
                t = time.perf_counter()
                changed = reader.changes(1, mine, 0)
                assert changed is not None, "version 1 is not a delta in place (ties changed?)"
                host.append(time.perf_counter() - t)
                n_changed = sum(len(c.positions) for n, c in changed.items() if n != "lm_head.weight")
                engine.stage_changes({n: TensorChanges(c.positions, c.values) for n, c in changed.items()}, 1)
                engine.step()
                s.sync()
                new_s.append(time.perf_counter() - t)
                live = engine.model.state_dict()
                ok = ok and all(torch.equal(live[n].cpu(), published[n].cpu().to(live[n].dtype)) for n in published)
                # The old path (main at eefd600): materialize in place, clone the state, copy it all in.
                t = time.perf_counter()
                old_state = reader.materialize(1, into=theirs, have_version=0)
                engine.stage_weights({k: v.clone() for k, v in old_state.items()}, 1)
                engine.step()
                s.sync()
                old.append(time.perf_counter() - t)
            update_s, host_s, old_s = min(new_s), min(host), min(old)
            total = sum(v.numel() * v.element_size() for n, v in state.items() if n != "lm_head.weight")
            t = time.perf_counter()
            dense = {k: v.to(s.device) for k, v in state.items() if k != "lm_head.weight"}
            s.sync()
            h2d_s = time.perf_counter() - t
            del dense
            res.append(f"update on {s.device}: {update_s:.3f} s ({n_changed / 1e6:.2f} M changed elements; host "
                       f"apply, positions and values {host_s:.3f} s), engine equals published: {ok}; the old path "
                       f"(materialize, clone, dense load) {old_s:.3f} s; dense H2D of {total / 2**30:.2f} GiB "
                       f"{h2d_s:.3f} s (rounds: new {', '.join(f'{x:.3f}' for x in new_s)}; old "
                       f"{', '.join(f'{x:.3f}' for x in old)})")
            RESULT.update({"update_s_gpu" if not s.tiny else "update_s": round(update_s, 4),
                           "update_host_s": round(host_s, 4), "dense_h2d_s": round(h2d_s, 4),
                           "update_old_path_s": round(old_s, 4)})
    return "; ".join(res)


def part_packed(s: Setup) -> str:
    model = _big_model(s)
    batch = s.batches[0]
    work = prompts(s.samples[batch], model.config.vocab_size, seed=batch)
    engine = TorchEngine(model, max_batch=batch, device=s.device, dtype=s.dtype, speculative=NO_SPEC, static=False)
    run_engine(engine, work[:batch], 8, seed=1)
    toks, el, _, steps = run_engine(engine, work, s.max_new, seed=2)
    s.sync()
    RESULT[f"packed_tok_s_b{batch}"] = round(toks / el)
    return f"packed engine b{batch}: {toks / el:.0f} tok/s ({toks} tok in {el:.1f} s, {el / steps * 1e3:.2f} ms/step)"


PARTS: dict[str, tuple[Callable[[Setup], str], float]] = {
    "checks": (part_checks, 30.0), "engine": (part_engine, 120.0), "learner": (part_learner, 120.0),
    "weights": (part_weights, 45.0), "packed": (part_packed, 40.0), "liger": (part_liger, 60.0),
}
"""Each part and the seconds it is expected to need at most (a part starts only if that much is left)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny shapes: the same parts end to end")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="model shape (default: tiny with --tiny, else 0.5b)")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--budget-s", dest="budget_s", type=float, default=420.0,
                        help="start no part that could run past this many seconds")
    parser.add_argument("--peak-tflops", dest="peak_tflops", type=float, default=None,
                        help="the card's dense bf16 peak for MFU (default: from its name, bench/gpu_learner.py)")
    parser.add_argument("--activation-gib", dest="activation_gib", type=float, default=6.0,
                        help="algorithm.activation_memory_gib of the selective checkpointing paths")
    args = parser.parse_args()
    os.environ.setdefault("FLEETRL_HUB_KEY", "gpu-check-key")
    torch.manual_seed(0)
    if args.tiny:
        torch.set_num_threads(1)
    s = Setup(args)
    env = f"torch {torch.__version__}"
    if torch.cuda.is_available():
        env += f", {torch.cuda.get_device_name(0)}"
    print(f"env: {env}; device {s.device}", flush=True)
    for name in args.parts.split(","):
        fn, need_s = PARTS[name]
        if not args.tiny and s.left_s() < need_s:
            print(f"part {name}: skipped ({s.left_s():.0f} s left of the budget, needs up to {need_s:.0f})")
            continue
        t = time.perf_counter()
        try:
            msg = fn(s)
        except Exception as exc:  # report it and go on to the next part
            traceback.print_exc()
            msg = f"FAILED {type(exc).__name__}: {exc}"
        print(f"part {name} ({time.perf_counter() - t:.0f} s): {msg}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    keys = ["engine_tok_s_b64", "engine_tok_s_b256", "generate_tok_s_b64", "speedup_cuda", "learner_ms_per_1k_tok",
            "learner_peak_gib", "learner_mfu", "update_s_gpu", "dense_h2d_s"]
    first = [f"{k}={RESULT.get(k, 'nan')}" for k in keys if not args.tiny or k in RESULT]
    rest = [f"{k}={v}" for k, v in RESULT.items() if k not in keys]
    print("result: " + " ".join(first + rest), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
