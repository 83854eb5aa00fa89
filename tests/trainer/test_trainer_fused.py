"""Liger Kernel and torch.compile in the learner (trainer/fused.py): on the CPU Liger is never applied, the
learner's numbers stay bit for bit, and the fused head's seam gives the chunked path's numbers."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import shutil
import types
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from structlog.testing import capture_logs

from fleetrl.broker import GroupRecord, Sample, floats, ids
from fleetrl.config import AlgorithmConfig, ModelConfig
from fleetrl.trainer import fused
from fleetrl.trainer.batch import build_step_batch
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner
from fleetrl.trainer.logprobs import causal_lm_logprobs, head_logprobs
from fleetrl.trainer.losses import token_logprobs

torch.set_num_threads(1)
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _groups() -> list[GroupRecord]:
    gen = np.random.default_rng(1)
    out = []
    for g in range(2):
        samples = [Sample(ids(gen.integers(3, 128, 6 + i).tolist()), floats(np.full(6 + i, -3.0, np.float32)),
                          np.zeros(6 + i, np.int32), float(i % 2), "stop") for i in range(4)]
        out.append(GroupRecord(f"g{g}", "r", "t", 0, "a", "n", ids([1, 9, 8]), samples))
    return out


def _run(**algo: Any) -> tuple[list[float], torch.Tensor, Learner]:
    torch.manual_seed(0)
    cfg = AlgorithmConfig(lr=1e-2, micro_batch_samples=3, logprob_chunk_tokens=5, kl_coef=0.1, ppo_epochs=2, **algo)
    learner = Learner(ModelConfig(), cfg, DistContext())
    losses = [learner.train_step(build_step_batch(_groups(), "grpo", v)).loss for v in range(2)]
    return losses, torch.cat([p.detach().flatten() for p in learner.model.parameters()]), learner


def test_the_new_fields_default_to_todays_learner() -> None:
    algo = AlgorithmConfig()
    assert algo.fused_kernels is None and algo.compile is None and algo.activation_memory_gib is None
    assert not fused.compiles(algo, CPU) and fused.compiles(algo, CUDA)  # auto: on CUDA only
    assert fused.compiles(AlgorithmConfig(compile=True), CPU)
    assert not fused.compiles(AlgorithmConfig(compile=False), CUDA)
    with pytest.raises(ValidationError, match="activation_memory_gib"):
        AlgorithmConfig(activation_memory_gib=0)
    with pytest.raises(ValidationError, match=r"activation_memory_gib is 4\.0 and activation_checkpointing is true"):
        AlgorithmConfig(activation_memory_gib=4, activation_checkpointing=True)


@pytest.mark.parametrize(("setting", "device", "reason"), [
    (None, CPU, "algorithm.fused_kernels is auto, but the learner runs on cpu: Liger's Triton kernels need CUDA"),
    (True, CPU, "algorithm.fused_kernels is true, but the learner runs on cpu: Liger's Triton kernels need CUDA"),
    (False, CUDA, "algorithm.fused_kernels is false"),
])
def test_liger_is_not_chosen_off_cuda_or_when_off(setting: bool | None, device: torch.device, reason: str) -> None:
    choice = fused.choose_liger(AlgorithmConfig(fused_kernels=setting), device, "qwen2")
    assert not choice.applied and choice.reason == reason


def test_auto_liger_gives_way_to_the_compiled_layers_on_cuda() -> None:
    """Compiled layers were measured faster than Liger's (docs/trainer.md): auto takes them, not both."""
    choice = fused.choose_liger(AlgorithmConfig(), CUDA, "qwen2")
    assert not choice.applied and "compiled (algorithm.compile)" in choice.reason
    assert "compiled" not in fused.choose_liger(AlgorithmConfig(fused_kernels=True), CUDA, "qwen2").reason


def test_liger_on_cuda_needs_a_wired_model_type_and_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    algo = AlgorithmConfig(compile=False)
    assert "not wired for model type 'gpt2'" in fused.choose_liger(algo, CUDA, "gpt2").reason

    def missing(name: str) -> Any:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", missing)
    choice = fused.choose_liger(algo, CUDA, "qwen2")
    assert not choice.applied and "liger-kernel does not import" in choice.reason and "fleetrl[gpu]" in choice.reason
    monkeypatch.setattr(importlib, "import_module", lambda name: types.SimpleNamespace())
    assert fused.choose_liger(algo, CUDA, "qwen2").applied


def test_liger_is_applied_through_its_own_function_and_its_module_swaps_reach_no_other_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.qwen2 import modeling_qwen2 as mq

    for name in ("Qwen2RMSNorm", "Qwen2MLP", "apply_rotary_pos_emb"):  # put back after the test, whatever it does
        monkeypatch.setattr(mq, name, getattr(mq, name))
    plain_rope, plain_norm = mq.apply_rotary_pos_emb, mq.Qwen2RMSNorm
    calls: list[dict[str, Any]] = []
    fused_rope_calls: list[bool] = []

    def fused_rope(q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        fused_rope_calls.append(q.is_cuda)

    def apply_liger_kernel_to_qwen2(**kw: Any) -> None:  # what Liger's does: module swaps, then the instance
        calls.append(kw)
        mq.apply_rotary_pos_emb, mq.Qwen2RMSNorm = fused_rope, type("LigerRMSNorm", (torch.nn.Module,), {})

    model = ModelConfig().build()  # before the stand-in import: transformers imports lazily
    fake = types.SimpleNamespace(apply_liger_kernel_to_qwen2=apply_liger_kernel_to_qwen2)
    real_import = importlib.import_module
    monkeypatch.setattr(importlib, "import_module",
                        lambda name: fake if name == "liger_kernel.transformers" else real_import(name))
    fused.apply_liger(model)
    assert calls == [{"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                      "fused_linear_cross_entropy": False, "model": model}]
    assert mq.Qwen2RMSNorm is plain_norm  # a model built later gets the plain classes
    fused.apply_liger(ModelConfig().build())  # a second learner in the process wraps the original once
    assert mq.apply_rotary_pos_emb.plain is plain_rope  # type: ignore[attr-defined]
    other = ModelConfig().build()
    x = torch.randint(3, 128, (1, 6))
    with torch.no_grad():
        assert torch.equal(other(input_ids=x).logits, model(input_ids=x).logits)  # CPU: the plain RoPE ran
    assert fused_rope_calls == []
    cuda_q = types.SimpleNamespace(is_cuda=True)
    mq.apply_rotary_pos_emb(cuda_q, "k", "cos", "sin")
    assert fused_rope_calls == [True]


def test_on_cpu_liger_is_not_applied_said_once_and_the_numbers_are_bit_identical() -> None:
    with capture_logs() as logs:
        forced_losses, forced, learner = _run(fused_kernels=True)
    said = [e for e in logs if e["event"] == "learner.fused_kernels"]
    assert len(said) == 1 and said[0]["applied"] is False
    assert said[0]["reason"] == ("algorithm.fused_kernels is true, but the learner runs on cpu: Liger's Triton "
                                 "kernels need CUDA")
    assert not learner.liger.applied
    assert not any("Liger" in type(m).__name__ for m in learner.model.modules())
    auto_losses, auto, _ = _run()
    off_losses, off, _ = _run(fused_kernels=False)
    assert forced_losses == auto_losses == off_losses
    assert torch.equal(forced, off) and torch.equal(auto, off)


def test_a_fused_head_replaces_the_chunked_head_behind_the_same_seam() -> None:
    """The seam Liger's kernel plugs into, with a stand-in kernel (Liger has no CPU path): the same
    log-probabilities and gradients as the chunked head."""
    seen: list[tuple[int, ...]] = []

    def stand_in(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, t: float) -> torch.Tensor:
        seen.append(tuple(hidden.shape))
        return token_logprobs((hidden @ weight.T)[None], targets[None], t)[0]

    torch.manual_seed(0)
    model = ModelConfig().build().double()
    x = torch.randint(3, 128, (2, 9))
    mask = torch.ones_like(x)
    scored = torch.zeros(2, 8, dtype=torch.bool)
    scored[:, 3:] = True
    results = []
    for head in (None, stand_in):
        model.zero_grad()
        logp = causal_lm_logprobs(model, x, mask, x[:, 1:], scored, 0.7, 4, head)
        (logp * torch.linspace(-1, 2, 8, dtype=logp.dtype)).sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert seen == [(10, model.config.hidden_size)]  # the scored tokens only
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-6)
    for got, want in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)  # both round the logits to fp32
    # A head the kernel cannot take (a bias) stays on the chunked module path.
    biased = torch.nn.Linear(4, 7, bias=True)
    out = head_logprobs(torch.randn(3, 4), biased, torch.tensor([0, 1, 2]), 1.0, 2, stand_in)
    assert out.shape == (3,) and len(seen) == 1


def _compiler_missing() -> str | None:
    cc = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    return None if cc else ("torch.compile's CPU backend (inductor) needs a C++ compiler; none on PATH "
                            "(g++, c++, clang++)")


@pytest.mark.slow
@pytest.mark.timeout(600)
# torch's own inductor imports torch.utils.mkldnn, which uses a deprecated torch.jit decorator
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
# dynamo reads every attribute of the tensors it traces, `.grad` of non-leaf ones included
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
def test_compiled_decoder_layers_train_as_eager() -> None:
    if (why := _compiler_missing()) is not None:
        pytest.skip(why)
    eager_losses, eager, _ = _run()
    compiled_losses, compiled, learner = _run(compile=True)
    layers = [m for m in learner.model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert len(layers) == ModelConfig().build().config.num_hidden_layers
    assert {n for n, _ in learner.model.named_parameters()} == {n for n, _ in ModelConfig().build().named_parameters()}
    assert compiled_losses == pytest.approx(eager_losses, abs=1e-5)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
                    reason="needs a CUDA GPU and liger-kernel (the gpu extra)")
def test_liger_on_cuda_gives_the_chunked_paths_logprobs_gradients_and_loss() -> None:
    plain = ModelConfig(tiny={"vocab_size": 512}).build().cuda()
    liger = copy.deepcopy(plain)
    fused.apply_liger(liger)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, 512, (4, 48), generator=g).cuda()
    scored = torch.zeros(4, 47, dtype=torch.bool, device="cuda")
    scored[:, 10:] = True
    out = []
    for model, head in ((plain, None), (liger, fused.liger_head_logprobs)):
        logp = causal_lm_logprobs(model, x, torch.ones_like(x), x[:, 1:], scored, 0.8, 16, head)
        loss = -(logp * scored).sum() / scored.sum()
        loss.backward()
        out.append((logp.detach(), {n: p.grad for n, p in model.named_parameters()}, loss.item()))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=1e-4)
    for name, grad in out[0][1].items():
        torch.testing.assert_close(out[1][1][name], grad, rtol=1e-3, atol=1e-5, msg=name)
    assert out[1][2] == pytest.approx(out[0][2], abs=1e-5)
    # The learner on CUDA (bf16 autocast) with and without Liger: the same step's loss.
    losses = [Learner(ModelConfig(), AlgorithmConfig(lr=1e-3, fused_kernels=on), DistContext(device=torch.device(
        "cuda"))).train_step(build_step_batch(_groups(), "grpo", 0)).loss for on in (False, True)]
    assert losses[1] == pytest.approx(losses[0], rel=0.05, abs=1e-3)
