"""The learner parts of bench/gpu_check.py (issues 37 and 50): each learner path's step time, peak memory
and MFU, and Liger Kernel against the chunked path.

`part_learner`: one step of 16,384 tokens (8 groups x 8 samples x (64 + 192)) in one micro-batch, per path:
whole logits (`logprob_chunk_tokens: 0`, the baseline), chunked, chunked at micro-batches of 16 and 8 (for
the record), selective checkpointing at `--activation-gib` (`activation_memory_gib`), every layer
checkpointed, and chunked with each decoder layer compiled (`algorithm.compile`), alone and with selective
checkpointing. `fused_kernels` is
false in all of them: Liger patches modules process-wide, so it runs in its own part, last.

`part_liger`: on a tiny fp32 model, the Liger-patched policy with Liger's fused head against the plain
chunked one (log-probabilities, gradients, loss); then the 0.5 B step with Liger, alone and with
selective checkpointing.

MFU counts model FLOPs only (PaLM's appendix B): 6 x N + 12 x layers x hidden x T per token, N the
parameters of every matmul (the tied output head counted once, the embedding lookup not), T the sequence
length; recomputation is not counted. The peak is the card's dense bf16 rate (`--peak-tflops`, else
from its name).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fleetrl.broker import GroupRecord, Sample, floats, ids
from fleetrl.config import AlgorithmConfig, ModelConfig
from fleetrl.trainer.activations import SelectiveCheckpointing, enable_checkpointing
from fleetrl.trainer.batch import build_step_batch
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner

BF16_PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.1,
                    "B200": 2250.0, "GH200": 989.4}
"""Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by a substring of the card's name (SXM parts)."""


def peak_flops(device_name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    for key in sorted(BF16_PEAK_TFLOPS, key=len, reverse=True):
        if key in device_name:
            return BF16_PEAK_TFLOPS[key] * 1e12
    return None


def step_flops(config: Any, seqs: int, seq_len: int) -> float:
    """Model FLOPs of one training step (forward and backward) over `seqs` sequences of `seq_len` tokens."""
    h, layers = config.hidden_size, config.num_hidden_layers
    kv = h // config.num_attention_heads * config.num_key_value_heads
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * config.intermediate_size  # q, o; k, v; gate, up, down
    n = layers * per_layer + config.vocab_size * h  # + the output head
    return float(seqs * seq_len * (6 * n + 12 * layers * h * seq_len))


def learner_batch(s: Any, vocab: int) -> tuple[list[GroupRecord], int]:
    n_groups, n_samples, prompt, completion = s.learner_groups
    rng = np.random.default_rng(0)
    groups = []
    for g in range(n_groups):
        samples = [Sample(ids(rng.integers(3, vocab, completion).tolist()),
                          floats(np.full(completion, -10.0, np.float32)), np.zeros(completion, np.int32),
                          float(i % 2), "length") for i in range(n_samples)]
        prompt_ids = ids(rng.integers(3, vocab, prompt).tolist())
        groups.append(GroupRecord(f"g{g}", "r", "t", 0, "a", "n", prompt_ids, samples))
    return groups, n_groups * n_samples * (prompt + completion)


def _measure(s: Any, learner: Learner, groups: list[GroupRecord], tokens: int, key: str, name: str) -> str:
    """Time a path (the best of 3 steps after a warm-up) and record its figures as `<key>_...`."""
    if s.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        learner.train_step(build_step_batch(groups, "grpo", 0))  # warm-up (and compilation)
        s.sync()
        times = []
        for _ in range(2 if s.tiny else 3):
            t = time.perf_counter()
            stats = learner.train_step(build_step_batch(groups, "grpo", 0))
            s.sync()
            times.append(time.perf_counter() - t)
    except torch.OutOfMemoryError as exc:
        return f"{name}: out of memory ({str(exc)[:80]})"
    peak = torch.cuda.max_memory_allocated() / 2**30 if s.device == "cuda" else float("nan")
    best = min(times)
    ms_1k = best * 1e3 / tokens * 1000
    _, n_samples, prompt, completion = s.learner_groups
    flops = step_flops(learner.model.config, len(groups) * n_samples, prompt + completion)
    peak_rate = peak_flops(torch.cuda.get_device_name(0) if s.device == "cuda" else "", s.peak_tflops)
    mfu = flops / best / peak_rate if peak_rate else float("nan")
    s.result[f"{key}_ms_per_1k_tok"], s.result[f"{key}_peak_gib"] = round(ms_1k, 2), round(peak, 2)
    s.result[f"{key}_mfu"] = round(mfu, 3)
    return f"{name}: {best * 1e3:.0f} ms/step = {ms_1k:.1f} ms per 1k tok, peak {peak:.1f} GiB, MFU {mfu:.1%}, " \
           f"loss {stats.loss:.5f}"


def _learner(s: Any, **algo: Any) -> Learner:
    cfg = AlgorithmConfig(**{"lr": 1e-6, "micro_batch_samples": 64, "logprob_chunk_tokens": 1024,
                             "fused_kernels": False, "compile": False, **algo})
    return Learner(ModelConfig(tiny=s.shape), cfg, DistContext(device=torch.device(s.device)))


def _drop(s: Any) -> None:
    s.learner = None
    if s.device == "cuda":
        torch.cuda.empty_cache()


def part_learner(s: Any) -> str:
    if s.model is not None:  # the engine's copy is not needed any more: room for the learner
        s.model = None
        _drop(s)
    groups, tokens = learner_batch(s, s.shape.vocab_size)
    res = [f"{tokens} tokens/step", *_one_learner_paths(s, groups, tokens)]
    _drop(s)  # part_weights builds its own learner
    compiled = _learner(s, compile=True)
    res.append(_measure(s, compiled, groups, tokens, "learner_compile", "chunked+compile"))
    compiled._selective = SelectiveCheckpointing(compiled.model, s.activation_gib, 2 if s.device == "cuda" else 4)
    res.append(_measure(s, compiled, groups, tokens, "learner_compile_sel",
                        f"chunked+compile+selective {s.activation_gib:g} GiB"))
    del compiled
    _drop(s)
    pick_fastest_that_fits(s)
    return "; ".join(res)


def _one_learner_paths(s: Any, groups: list[GroupRecord], tokens: int) -> list[str]:
    """The paths that differ only in the learner's settings, on one learner (built once)."""
    t = time.perf_counter()
    learner = _learner(s)
    res = [f"learner built in {time.perf_counter() - t:.0f} s"]

    def with_(update: dict[str, Any], setup: Callable[[], None] | None = None) -> Learner:
        learner.algo = learner.algo.model_copy(update={"micro_batch_samples": 64, **update})
        if setup is not None:
            setup()
        return learner

    def selective() -> None:
        learner._selective = SelectiveCheckpointing(learner.model, s.activation_gib, 2 if s.device == "cuda" else 4)

    def every_layer() -> None:
        learner._selective = None
        enable_checkpointing(learner.model)

    paths: list[tuple[str, str, Callable[[], Learner]]] = [
        ("whole logits", "learner_full", lambda: with_({"logprob_chunk_tokens": 0})),
        ("chunked", "learner_chunked", lambda: with_({"logprob_chunk_tokens": 1024})),
        ("chunked mb16", "learner_mb16", lambda: with_({"micro_batch_samples": 16})),
        ("chunked mb8", "learner_mb8", lambda: with_({"micro_batch_samples": 8})),
        (f"selective ckpt {s.activation_gib:g} GiB", "learner_sel", lambda: with_({}, selective)),
        ("chunked+ckpt", "learner_ckpt", lambda: with_({}, every_layer)),
    ]
    for name, key, make in paths:
        res.append(_measure(s, make(), groups, tokens, key, name))
        if key == "learner_sel" and learner._selective is not None:
            res[-1] += f" ({learner._selective.checkpointed}/{len(learner._selective.layers)} layers checkpointed)"
    return res


def pick_fastest_that_fits(s: Any) -> None:
    """The learner that fits: the fastest one-micro-batch path within 16 GiB. Smaller micro-batches are
    measured for the record only (they hide the logits; the issue's step is one micro-batch of 64)."""
    keys = ("learner_full", "learner_chunked", "learner_sel", "learner_ckpt", "learner_compile", "learner_compile_sel",
            "learner_liger", "learner_liger_sel")
    fits = [k for k in keys if s.result.get(f"{k}_peak_gib", 99) <= 16]
    if fits:
        best = min(fits, key=lambda k: s.result[f"{k}_ms_per_1k_tok"])
        for figure in ("ms_per_1k_tok", "peak_gib", "mfu"):
            s.result[f"learner_{figure}"] = s.result[f"{best}_{figure}"]
        s.result["learner_fits"] = best[len("learner_"):]


def part_liger(s: Any) -> str:
    """Liger (process-wide patches: run last). Parity on a tiny model, then the 0.5 B step."""
    from fleetrl.trainer.fused import apply_liger, choose_liger, liger_head_logprobs
    from fleetrl.trainer.logprobs import causal_lm_logprobs

    choice = choose_liger(AlgorithmConfig(fused_kernels=True), torch.device(s.device), "qwen2")
    if not choice.applied:
        return f"not applied: {choice.reason}"
    plain = ModelConfig(tiny={"vocab_size": 512}).build().to(s.device)
    fused = copy.deepcopy(plain)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, 512, (4, 48), generator=g).to(s.device)
    mask, scored = torch.ones_like(x), torch.zeros(4, 47, dtype=torch.bool, device=s.device)
    scored[:, 10:] = True
    out = []
    for model, head in ((plain, None), (fused, liger_head_logprobs)):
        if head is not None:  # after the plain pass: the RoPE patch is process-wide
            apply_liger(model)
        model.zero_grad()
        logp = causal_lm_logprobs(model, x, mask, x[:, 1:], scored, 0.8, 16, head)
        loss = -(logp * scored).sum() / scored.sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        out.append((logp.detach()[scored], grads, loss.item()))
    dv = (out[0][0] - out[1][0]).abs().max().item()
    dg = ((out[0][1] - out[1][1]).norm() / out[0][1].norm()).item()
    res = [f"Liger vs chunked on a tiny fp32 model on {s.device}: max|dlogp| {dv:.1e}, relative grad diff "
           f"{dg:.1e}, loss {out[1][2]:.6f} vs {out[0][2]:.6f}"]
    s.result.update({"liger_dlogp": float(f"{dv:.2e}"), "liger_dgrad": float(f"{dg:.2e}")})
    groups, tokens = learner_batch(s, s.shape.vocab_size)
    for name, key, algo in (("liger", "learner_liger", {}),
                            (f"liger+selective {s.activation_gib:g} GiB", "learner_liger_sel",
                             {"activation_memory_gib": s.activation_gib})):
        learner = _learner(s, **algo, fused_kernels=True)
        res.append(_measure(s, learner, groups, tokens, key, name))
        del learner
        _drop(s)
    pick_fastest_that_fits(s)
    return "; ".join(res)
