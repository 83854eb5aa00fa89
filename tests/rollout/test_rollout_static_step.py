"""The static decode step (rollout/_static.py) on CPU: the HF forward's logits, the packed engine's tokens,
and a capture that holds (rollout/_graphs.py's recorded stand-in of a CUDA graph)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from fleetrl.broker import Sampling
from fleetrl.config import ModelConfig
from fleetrl.rollout._graphs import CaptureError, RecordedGraph, StepGraphs
from fleetrl.rollout._kv import SlotCache
from fleetrl.rollout._static import DecodeRows, PrefillRows, StaticStep, bucket
from fleetrl.rollout.engine import GroupRequest
from fleetrl.rollout.sampling import hash_keys
from fleetrl.rollout.torch_engine import TorchEngine

torch.set_num_threads(1)
FREQUENT_EOS = list(range(2, 30))


def _step(model: Any, max_batch: int = 4, mode: str = "record") -> StaticStep:
    cache = SlotCache(model.config.num_hidden_layers, max_batch)
    return StaticStep(model, model.model, cache, max_batch=max_batch, max_tokens=4, mode=mode,  # type: ignore[arg-type]
                      prefill_tokens=64, keep_logits=True)


@torch.inference_mode()
def _hf_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([tokens])).logits[0].float()


@torch.inference_mode()
def test_prefill_decode_and_drafts_give_the_hf_forwards_logits() -> None:
    model = ModelConfig(tiny={"max_position_embeddings": 256}).build().eval()
    step = _step(model)
    seqs = [[1, 40, 41, 42], [1, *range(50, 70)], [1, 90]]
    slots = [0, 2, 1]
    keys = hash_keys([11, 12, 13])
    ones = np.ones(3, dtype=np.float32)
    # All three at once: two passes (length buckets 16 and 32), tokens handed back in admission order.
    _, together = step.step(None, PrefillRows(slots, seqs, np.zeros(3, np.int64), keys, ones, ones))
    for i, s in enumerate(seqs):  # one at a time: its first token comes from its last position's logits
        _, pre = step.step(None, PrefillRows(slots[i:i + 1], [s], np.zeros(1, np.int64), keys[i:i + 1], ones[:1],
                                             ones[:1]))
        assert pre is not None and together is not None and pre[0][0] == together[0][i]
        torch.testing.assert_close(step.prefill_logits[0], _hf_logits(model, s)[-1], rtol=0, atol=1e-4)
        s.append(int(pre[0][0]))
    by_slot = {b: seqs[i] for i, b in enumerate(slots)}
    for t in range(6):
        drafts = {0: [7, 8, 9], 2: [5]} if t % 2 else {}  # verify drafted tokens every other step
        length = 1 + max((len(d) for d in drafts.values()), default=0)
        ids = np.zeros((3, length), dtype=np.int64)
        for b in range(3):
            ids[b, 0] = by_slot[b][-1]
            ids[b, 1:1 + len(drafts.get(b, []))] = drafts.get(b, [])
        pos = np.array([len(by_slot[b]) - 1 for b in range(3)], dtype=np.int64)
        rows = DecodeRows(ids, pos, np.arange(3), np.full(3, t + 1), keys[[0, 2, 1]], ones, ones)
        dec, _ = step.step(rows, None)
        assert dec is not None
        per_row = bucket(length, 4)  # the pass's L
        for b in range(3):
            context = by_slot[b] + list(drafts.get(b, []))
            want = _hf_logits(model, context)[len(by_slot[b]) - 1:]  # the slot's token, then each draft's
            got = step.logits.view(-1, per_row, step.vocab)[b, : len(want)]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        for b in range(3):  # keep each slot's plain next token (drafts are discarded, as if rejected)
            by_slot[b].append(int(dec[0][b, 0]))


def _run(engine: TorchEngine, requests: list[GroupRequest], steps: int = 600) -> dict[str, Any]:
    for r in requests:
        engine.submit(r)
    done: dict[str, Any] = {}
    for _ in range(steps):
        done.update({f.group_id: f.samples for f in engine.step()})
        if not engine.has_work():
            break
    return done


def _requests(n: int, max_new: int = 24) -> list[GroupRequest]:
    out = []
    for g in range(n):
        sampling = Sampling(temperature=0.8 if g % 3 else 1.0, top_p=0.9 if g % 2 else 1.0, max_new_tokens=max_new)
        prompt = [1, *[(7 * g + k) % 90 + 30 for k in range(3 + (11 * g) % 40)]]
        out.append(GroupRequest(f"g{g}", prompt, sampling, n_samples=3, seed=5))
    return out


@pytest.mark.parametrize("mode", ["record", "eager"])
def test_the_static_engine_samples_the_packed_engines_tokens_for_a_seed(mode: str) -> None:
    model = ModelConfig(tiny={"max_position_embeddings": 512}).build()
    requests = _requests(7, max_new=100)  # some samples outgrow the cache's first 128 columns
    packed = _run(TorchEngine(copy.deepcopy(model), max_batch=6, eos_ids=[2]), requests)
    engine = TorchEngine(copy.deepcopy(model), max_batch=6, eos_ids=[2], static=True, graphs=mode)  # type: ignore[arg-type]
    static = _run(engine, requests)
    assert sorted(static) == sorted(packed) == [r.group_id for r in requests]
    for g, samples in packed.items():
        for a, b in zip(samples, static[g], strict=True):
            np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
            assert a.finish_reason == b.finish_reason
    assert engine._slots.cache.capacity > 128  # the buffers grew mid-run (and graphs were captured anew)


def test_speculative_verification_in_the_static_step_keeps_the_plain_tokens() -> None:
    model = ModelConfig().build()
    requests = [GroupRequest(f"e{e}", [1, 44, 45, 46], Sampling(max_new_tokens=30), n_samples=4, seed=e % 2)
                for e in range(4)]  # the same prompt and seed again: the history drafts its answers
    plain = TorchEngine(copy.deepcopy(model), max_batch=4, eos_ids=FREQUENT_EOS, static=True, graphs="record")
    got = {}
    for r in requests:
        got.update(_run(plain, [r]))
    assert plain.speculator is not None and plain.speculator.stats.drafted > 0
    decode_keys = [k for k in plain._static.graphs._graphs if k[0] == "decode"]
    assert any(k[2] > 1 for k in decode_keys)  # drafts were verified in multi-token decode passes
    reference = TorchEngine(copy.deepcopy(model), max_batch=4, eos_ids=FREQUENT_EOS)
    for r in requests:
        for a, b in zip(_run(reference, [r])[r.group_id], got[r.group_id], strict=True):
            np.testing.assert_array_equal(a.completion_ids, b.completion_ids)


def test_graphs_are_captured_once_per_bucket_and_a_weight_switch_needs_none() -> None:
    model = ModelConfig().build()
    engine = TorchEngine(copy.deepcopy(model), max_batch=8, eos_ids=FREQUENT_EOS, static=True, graphs="record")
    _run(engine, _requests(6, max_new=12))
    graphs = engine._static.graphs  # type: ignore[union-attr]
    captured = graphs.captures
    assert captured == len(graphs) > 0
    for key in graphs._graphs:  # batch buckets are powers of two (or max_batch); widths cover what lives
        if key[0] == "decode":
            assert key[1] in (1, 2, 4, 8) and key[3] <= 128
    new = ModelConfig(tiny={"seed": 3}).build()
    storage = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    before = dict(graphs.replays)
    engine.stage_weights(new.state_dict(), version=1)
    again = _run(engine, _requests(6, max_new=12))
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == storage
    # Keys captured under version 0 were replayed under version 1 (not captured again).
    assert any(graphs.replays[k] > before[k] for k in before)
    assert graphs.captures == len(graphs)
    fresh = _run(TorchEngine(new, max_batch=8, eos_ids=FREQUENT_EOS), _requests(6, max_new=12))
    for g, samples in fresh.items():
        for a, b in zip(samples, again[g], strict=True):
            np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
            assert (b.versions == 1).all()


def test_a_recorded_graph_reads_its_buffers_and_refuses_what_a_capture_cannot_hold() -> None:
    buf, out = torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3)

    def fn() -> None:
        out.copy_(torch.cumsum(buf * 2, 0))

    graph = RecordedGraph(fn)
    buf.copy_(torch.tensor([5.0, 0.0, 1.0]))
    graph.replay()
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0, 12.0]))
    with pytest.raises(CaptureError, match="host sync"):
        RecordedGraph(lambda: out.fill_(float(buf.sum())))
    with pytest.raises(CaptureError, match="boolean mask"):
        RecordedGraph(lambda: out[:1].copy_(buf[buf > 1].sum()))
    with pytest.raises(CaptureError, match="nonzero"):
        RecordedGraph(lambda: out.copy_(torch.nonzero(buf).float().sum()))
    with pytest.raises(Exception, match="CUDA"):
        StepGraphs("cuda", torch.device("cpu"))


def test_the_static_step_on_a_model_it_cannot_run_names_why() -> None:
    from fleetrl.rollout.errors import EngineError

    model = ModelConfig().build()
    model.model.rotary_emb.rope_type = "dynamic"
    with pytest.raises(EngineError, match="dynamic"):
        TorchEngine(model, max_batch=2, static=True)


def test_a_partial_handed_over_between_static_engines_continues_as_the_uninterrupted_run() -> None:
    model = ModelConfig().build()
    sampling = Sampling(temperature=0.9, top_p=0.95, max_new_tokens=20)
    request = GroupRequest("g", [1, 50, 51, 52, 53], sampling, n_samples=4, seed=11)

    def static(batch: int) -> TorchEngine:
        return TorchEngine(copy.deepcopy(model), max_batch=batch, eos_ids=FREQUENT_EOS, static=True, graphs="record")

    uninterrupted = static(4).generate(request)
    first = static(2)
    first.submit(GroupRequest("g", request.prompt_ids, sampling, n_samples=4, seed=11))
    for _ in range(5):
        first.step()
    handed = first.take("g")
    assert any(s.finish_reason is None and len(s.completion_ids) for s in handed)
    resumed = static(3).generate(GroupRequest("g", request.prompt_ids, sampling, 4, seed=11, resume=handed))
    for a, b in zip(uninterrupted, resumed, strict=True):
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@torch.inference_mode()
def test_admissions_split_into_prefill_passes_of_any_token_budget() -> None:
    model = ModelConfig().build().eval()
    cache = SlotCache(model.config.num_hidden_layers, 16)
    # 200 tokens is not a power of two: 12 samples of 16 padded tokens would be 16 rows in one bucket.
    step = StaticStep(model, model.model, cache, max_batch=16, max_tokens=1, mode="record", prefill_tokens=200)
    seqs = [[1, *range(30 + i, 30 + i + 5 + i)] for i in range(12)]
    ones = np.ones(12, dtype=np.float32)
    keys = hash_keys(list(range(12)))
    _, together = step.step(None, PrefillRows(list(range(12)), seqs, np.zeros(12, np.int64), keys, ones, ones))
    assert together is not None
    for i, s in enumerate(seqs):
        probs = torch.softmax(_hf_logits(model, s)[-1], -1)
        assert together[1][i] == pytest.approx(float(torch.log(probs[int(together[0][i])])), abs=1e-4)
