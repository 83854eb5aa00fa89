"""The torch engine: recorded logprobs, batching independence, in-flight updates, token-level resume."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from fleetrl.broker import PartialSample, Sampling
from fleetrl.config import EngineEmulation, ModelConfig
from fleetrl.rollout import EngineError
from fleetrl.rollout.engine import GroupRequest
from fleetrl.rollout.sampling import behaviour_logprobs
from fleetrl.rollout.torch_engine import TorchEngine

torch.set_num_threads(1)
LOGPROB_TOL = 1e-4  # fp32, batched left-padded decode vs one fresh unpadded forward pass
FREQUENT_EOS = list(range(2, 40))  # treat ~30% of the vocab as EOS so lengths vary (random-init model)


def _engine(max_batch: int = 8, eos: list[int] | None = None, seed: int = 0) -> TorchEngine:
    cfg = ModelConfig()
    cfg.tiny.seed = seed
    return TorchEngine(cfg.build(), max_batch=max_batch, eos_ids=eos)


def _prompt(i: int) -> list[int]:
    return [1, *[(7 * i + k) % 90 + 40 for k in range(3 + i % 4)]]


def _fresh_logprobs(model: Any, prompt: list[int], s: PartialSample, t: float, p: float) -> torch.Tensor:
    x = torch.tensor([prompt + s.completion_ids.tolist()])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, len(prompt) - 1 : -1]
    return behaviour_logprobs(logits, torch.from_numpy(s.completion_ids.astype(np.int64)), t, p)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_recorded_logprobs_equal_a_fresh_forward_pass(temperature: float, top_p: float) -> None:
    engine = _engine(max_batch=5, eos=FREQUENT_EOS)
    sampling = Sampling(temperature=temperature, top_p=top_p, max_new_tokens=16)
    for g in range(3):
        engine.submit(GroupRequest(f"g{g}", _prompt(g), sampling, n_samples=4, seed=3))
    done = {}
    for _ in range(200):
        done.update({f.group_id: f.samples for f in engine.step()})
    assert sorted(done) == ["g0", "g1", "g2"]
    for g, samples in done.items():
        for s in samples:
            fresh = _fresh_logprobs(engine.model, _prompt(int(g[1:])), s, temperature, top_p)
            np.testing.assert_allclose(s.logprobs, fresh.numpy(), atol=LOGPROB_TOL, rtol=0)
            assert (s.versions == 0).all() and s.finish_reason in ("stop", "length")


def test_tokens_do_not_depend_on_batch_composition() -> None:
    sampling = Sampling(max_new_tokens=12)
    alone = _engine(max_batch=1, eos=FREQUENT_EOS).generate(GroupRequest("g1", _prompt(1), sampling, 3, seed=9))
    crowded = _engine(max_batch=3, eos=FREQUENT_EOS)
    crowded.submit(GroupRequest("g0", _prompt(0), sampling, 5, seed=9))
    together = crowded.generate(GroupRequest("g1", _prompt(1), sampling, 3, seed=9))
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)


def test_finished_slots_are_refilled_and_every_sample_finishes() -> None:
    engine = _engine(max_batch=4, eos=FREQUENT_EOS)
    for g in range(5):
        engine.submit(GroupRequest(f"g{g}", _prompt(g), Sampling(max_new_tokens=10), 3, seed=1))
    finished, peak, steps = {}, 0, 0
    while engine.has_work() and steps < 500:
        finished.update({f.group_id: f.samples for f in engine.step()})
        peak, steps = max(peak, engine.running()), steps + 1
    assert len(finished) == 5 and all(len(v) == 3 for v in finished.values())
    assert peak == 4
    total = sum(len(s.completion_ids) for v in finished.values() for s in v)
    assert steps < total / 2  # a static batch of one group at a time would need >= total / 3 steps


def test_in_flight_update_switches_versions_exactly_at_the_step() -> None:
    engine, new_model = _engine(max_batch=8), ModelConfig(tiny={"seed": 1}).build()
    sampling = Sampling(max_new_tokens=12)
    engine.submit(GroupRequest("g", _prompt(2), sampling, n_samples=3, seed=4))
    for _ in range(5):
        assert engine.step() == []
    engine.stage_weights({k: v.to(torch.bfloat16) for k, v in new_model.state_dict().items()}, version=7)
    done = []
    while not done:
        done = engine.step()
    for s in done[0].samples:
        np.testing.assert_array_equal(s.versions, [0] * 5 + [7] * 7)
    # The engine now holds the new version's weights, bf16 as published, cast into its fp32.
    for name, tensor in new_model.state_dict().items():
        torch.testing.assert_close(engine.model.state_dict()[name], tensor.to(torch.bfloat16).float(), atol=0, rtol=0)


def test_resumed_partial_reproduces_the_uninterrupted_run() -> None:
    sampling = Sampling(temperature=0.9, top_p=0.95, max_new_tokens=14)
    request = GroupRequest("g-resume", _prompt(3), sampling, n_samples=4, seed=11)
    uninterrupted = _engine(eos=FREQUENT_EOS).generate(request)
    first = _engine(max_batch=2, eos=FREQUENT_EOS)
    first.submit(GroupRequest("g-resume", _prompt(3), sampling, n_samples=4, seed=11))
    for _ in range(6):
        first.step()
    handed = first.take("g-resume")
    assert any(s.finish_reason is None for s in handed) and any(len(s.completion_ids) for s in handed)
    second = _engine(max_batch=3, eos=FREQUENT_EOS)
    resumed = second.generate(GroupRequest("g-resume", _prompt(3), sampling, 4, seed=11, resume=handed))
    for a, b, h in zip(uninterrupted, resumed, handed, strict=True):
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_TOL)
        n = len(h.completion_ids)  # the handed-over prefix is kept token for token
        np.testing.assert_array_equal(b.completion_ids[:n], h.completion_ids)
        np.testing.assert_array_equal(b.logprobs[:n], h.logprobs)
        assert a.finish_reason == b.finish_reason


def test_bad_weights_and_requests_name_the_fault() -> None:
    engine = _engine()
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.stage_weights({**state, "model.nope.weight": torch.zeros(1)}, 1)
    with pytest.raises(EngineError, match=r"model\.nope\.weight"):
        engine.step()
    bad = dict(state)
    bad["model.norm.weight"] = torch.zeros(3)
    engine.stage_weights(bad, 1)
    with pytest.raises(EngineError, match=r"model.norm.weight.*shape"):
        engine.step()
    partial = {k: v for k, v in state.items() if "layers.1." not in k}
    engine.stage_weights(partial, 1)
    with pytest.raises(EngineError, match="missing"):
        engine.step()
    with pytest.raises(EngineError, match="g-x"):
        engine.submit(GroupRequest("g-x", [], Sampling(), 1))


def test_cache_growth_and_the_generic_forward_path_agree_with_a_fresh_pass() -> None:
    # Samples outgrow the slot cache's first capacity (128 columns): the buffers double mid-run.
    sampling = Sampling(max_new_tokens=60)
    prompts = [[1, *[(5 * i + k) % 80 + 40 for k in range(90 + 7 * i)]] for i in range(3)]
    results = []
    for generic in (False, True):
        engine = _engine(max_batch=2)  # rarely stops early: EOS is one id of 128
        if generic:
            engine._decoder = None  # the model's own forward instead of the decoder-layer fast path
        for i, p in enumerate(prompts):
            engine.submit(GroupRequest(f"g{i}", p, sampling, n_samples=1, seed=5))
        done = {}
        for _ in range(400):
            done.update({f.group_id: f.samples[0] for f in engine.step()})
        assert sorted(done) == ["g0", "g1", "g2"]
        assert max(len(p) + len(s.completion_ids) for p, s in zip(prompts, done.values(), strict=True)) > 128
        for i, p in enumerate(prompts):
            fresh = _fresh_logprobs(engine.model, p, done[f"g{i}"], 1.0, 1.0)
            np.testing.assert_allclose(done[f"g{i}"].logprobs, fresh.numpy(), atol=LOGPROB_TOL, rtol=0)
        results.append(done)
    for g in results[0]:
        np.testing.assert_array_equal(results[0][g].completion_ids, results[1][g].completion_ids)


def test_a_failed_step_loses_nothing_and_changes_no_token() -> None:
    sampling = Sampling(max_new_tokens=10)
    requests = [GroupRequest(f"g{g}", _prompt(g), sampling, n_samples=3, seed=2) for g in range(3)]
    reference = _engine(max_batch=4, eos=FREQUENT_EOS)
    for r in requests:
        reference.submit(r)
    expected = {}
    for _ in range(100):
        expected.update({f.group_id: f.samples for f in reference.step()})
    engine = _engine(max_batch=4, eos=FREQUENT_EOS)
    for r in requests:
        engine.submit(r)
    layer = engine.model.model.layers[1]
    original = layer.forward
    done = {}
    for fail_at in (0, 3):  # a step that admits everything, then one mid-run
        for _ in range(fail_at):
            done.update({f.group_id: f.samples for f in engine.step()})
        layer.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
        with pytest.raises(RuntimeError, match="device lost"):
            engine.step()
        layer.forward = original
    for _ in range(100):
        done.update({f.group_id: f.samples for f in engine.step()})
    assert sorted(done) == sorted(expected)
    for g, samples in expected.items():
        for a, b in zip(samples, done[g], strict=True):
            np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_TOL)


def test_emulated_lengths_are_long_tailed_and_kept_across_a_handover() -> None:
    emulate = EngineEmulation(tail_p=0.2, short_tokens=3)
    sampling = Sampling(max_new_tokens=20)
    cfg = ModelConfig()
    engine = TorchEngine(cfg.build(), max_batch=16, eos_ids=[10_000], emulate=emulate)  # no EOS in the vocab
    lengths = [len(s.completion_ids) for g in range(10)
               for s in engine.generate(GroupRequest(f"g{g}", _prompt(g), sampling, 8, seed=1))]
    short, long = [n for n in lengths if n <= 3], [n for n in lengths if n == 20]
    assert len(short) + len(long) == len(lengths) == 80  # nothing in between: short, or the tail
    assert 5 <= len(long) <= 30  # ~20 % of 80 run to max_new_tokens
    # A sample handed over after 2 tokens stops where the uninterrupted one stopped.
    whole = TorchEngine(cfg.build(), max_batch=16, eos_ids=[10_000], emulate=emulate).generate(
        GroupRequest("h", _prompt(3), sampling, 8, seed=1))
    first = TorchEngine(cfg.build(), max_batch=16, eos_ids=[10_000], emulate=emulate)
    first.submit(GroupRequest("h", _prompt(3), sampling, 8, seed=1))
    first.step()
    first.step()
    partial = first.take("h")
    resumed = TorchEngine(cfg.build(), max_batch=16, eos_ids=[10_000], emulate=emulate).generate(
        GroupRequest("h", _prompt(3), sampling, 8, seed=1, resume=partial))
    assert [len(s.completion_ids) for s in resumed] == [len(s.completion_ids) for s in whole]
    assert all(s.finish_reason == ("length" if len(s.completion_ids) == 20 else "stop") for s in resumed)
