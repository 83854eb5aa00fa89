"""History-drafted speculative decoding is exact: the distribution, the logprobs, the versions.

The statistical test compares the speculative path's samples with the target policy's exact
sequence probabilities (every 3-token continuation of one prompt, from full forward passes) by a
chi-square goodness-of-fit test at a fixed false-alarm rate ALPHA. Its false-alarm rate and its power
against a small, known deviation (the same model at a temperature 12% off) are measured in the test
itself by simulating the statistic under both (multinomial draws), so the test shows it can fail.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from test_rollout_torch_engine import _fresh_logprobs
from transformers import DynamicCache

from fleetrl.broker import PartialSample, Sampling
from fleetrl.config import ModelConfig, SpeculativeConfig
from fleetrl.rollout.engine import GroupRequest
from fleetrl.rollout.history import ResponseHistory, prompt_key
from fleetrl.rollout.sampling import behaviour_logprobs
from fleetrl.rollout.speculative import accepted_length
from fleetrl.rollout.torch_engine import TorchEngine

torch.set_num_threads(1)
ALPHA = 1e-3
"""False-alarm rate of the chi-square test (a correct engine fails it once in a thousand seeds)."""
DRAWS = 5000
LOGPROB_TOL = 1e-4
PROMPT = [1, 5, 9, 4]
ALWAYS = SpeculativeConfig(min_acceptance=0.0)  # draft whatever the acceptance: both verdicts get exercised


def _policy(vocab: int = 16, sharpen: float = 1.0, seed: int = 0) -> Any:
    """A tiny untied Qwen2; `sharpen` scales its output layer (a more peaked policy drafts better)."""
    model = ModelConfig(tiny={"vocab_size": vocab, "tie_word_embeddings": False, "seed": seed}).build().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


def _exact_probabilities(model: Any, prompt: list[int], steps: int, temperature: float, top_p: float,
                         eos: int, residual_bug: list[int] | None = None) -> dict[tuple[int, ...], float]:
    """P(completion) for every completion of at most `steps` tokens (ending at EOS or at `steps`), from full
    forward passes, each position's distribution processed as the engine samples it.

    `residual_bug`: instead, the distribution of a broken speculative sampler that drafts these tokens and,
    on rejecting one, draws from p again rather than from the residual (so it over-samples drafts:
    p(d) -> p(d) (2 - p(d))), the classic mistake; the power of the test is measured against it."""
    vocab = model.config.vocab_size
    out: dict[tuple[int, ...], float] = {}
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    for depth in range(steps):
        prefixes = list(frontier)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        every = torch.arange(vocab).repeat(len(prefixes))
        probs = behaviour_logprobs(logits.repeat_interleave(vocab, 0), every, temperature, top_p).exp()
        probs = probs.view(len(prefixes), vocab).double()
        nxt: dict[tuple[int, ...], float] = {}
        for row, prefix in enumerate(prefixes):
            p = probs[row]
            if residual_bug is not None and list(prefix) == residual_bug[:depth]:
                d = residual_bug[depth]
                p = p * (1 - p[d])
                p[d] = probs[row, d] * (2 - probs[row, d])
            for t, pt in enumerate(p.tolist()):
                if pt > 0:
                    seq = (*prefix, t)
                    target = out if t == eos or depth == steps - 1 else nxt
                    target[seq] = frontier[prefix] * pt
        frontier = nxt
    return out


def _chi_square(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the cells, those expecting fewer than 5 pooled into one; (stat, dof)."""
    small = expected < 5
    obs = np.append(counts[..., ~small], counts[..., small].sum(-1, keepdims=True), axis=-1)
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[..., :-1], exp[:-1]
    return ((obs - exp) ** 2 / exp).sum(-1), len(exp) - 1


def _p_value(stat: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (regularized upper incomplete gamma)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _spec_samples(model: Any, temperature: float, top_p: float, steps: int) -> tuple[list[tuple[int, ...]], Any]:
    engine = TorchEngine(model, max_batch=250, eos_ids=[2], speculative=ALWAYS)
    # Seed the history with answers of a plain run (another seed), as an earlier epoch would.
    sampling = Sampling(temperature=temperature, top_p=top_p, max_new_tokens=steps)
    engine.generate(GroupRequest("earlier", PROMPT, sampling, n_samples=8, seed=99))
    before = engine.speculator.stats.drafted if engine.speculator else 0
    for g in range(DRAWS // 100):
        engine.submit(GroupRequest(f"g{g}", PROMPT, sampling, n_samples=100, seed=1))
    out: list[tuple[int, ...]] = []
    for _ in range(10_000):
        out += [tuple(s.completion_ids.tolist()) for f in engine.step() for s in f.samples]
        if not engine.has_work():
            break
    assert len(out) == DRAWS
    assert engine.speculator is not None and engine.speculator.stats.drafted > before
    return out, engine.speculator.stats


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.8, 0.9)])
def test_speculative_samples_are_distributed_as_the_target_policy(temperature: float, top_p: float) -> None:
    model, steps = _policy(sharpen=6.0), 3
    exact = _exact_probabilities(model, PROMPT, steps, temperature, top_p, eos=2)
    cells = list(exact)
    p = np.array([exact[c] for c in cells])
    assert abs(p.sum() - 1) < 1e-4
    samples, stats = _spec_samples(model, temperature, top_p, steps)
    # Both branches of the rule ran many times: drafts accepted, and drafts rejected.
    assert stats.accepted > 200 and stats.drafted - stats.accepted > 200
    where = {c: i for i, c in enumerate(cells)}
    counts = np.bincount([where[s] for s in samples], minlength=len(cells)).astype(float)
    stat, dof = _chi_square(counts, DRAWS * p)
    assert _p_value(stat, dof) > ALPHA, f"chi2={stat:.1f} on {dof} dof: not the target distribution"

    # The test's own error rates, by simulating the statistic (4,000 multinomial draws each): under
    # the target (false alarms, ~ALPHA), under the residual bug drafting the most likely answer, and
    # under the same policy at a temperature 12% off (a small deviation: its power is printed).
    crit = _critical_value(dof)
    rng = np.random.default_rng(0)

    def rejects(dist: dict[tuple[int, ...], float]) -> float:
        q = np.array([dist.get(c, 0.0) for c in cells])
        sims = _chi_square(rng.multinomial(DRAWS, q / q.sum(), 4_000).astype(float), DRAWS * p)[0]
        return float((sims > crit).mean())

    likely = list(max(exact, key=lambda c: exact[c]))
    false_alarm = rejects(exact)
    power_bug = rejects(_exact_probabilities(model, PROMPT, steps, temperature, top_p, 2, residual_bug=likely))
    power_t = rejects(_exact_probabilities(model, PROMPT, steps, temperature * 1.12, top_p, eos=2))
    print(f"chi-square test (T={temperature}, top_p={top_p}, {DRAWS} draws, {dof} dof): false-alarm rate "
          f"{false_alarm:.4f} (nominal {ALPHA}); power against the residual bug {power_bug:.3f}, "
          f"against T x 1.12 {power_t:.3f}")
    assert false_alarm < 5 * ALPHA
    assert power_bug > 0.95


def _critical_value(dof: int) -> float:
    """The chi-square quantile 1 - ALPHA, by bisection on the upper tail."""
    lo, hi = 0.0, 10.0 * dof + 100.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _p_value(mid, dof) > ALPHA else (lo, mid)
    return hi


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_every_recorded_logprob_is_the_target_models(temperature: float, top_p: float) -> None:
    engine = TorchEngine(_policy(vocab=64, sharpen=4.0), max_batch=6, eos_ids=list(range(2, 6)), speculative=ALWAYS)
    sampling = Sampling(temperature=temperature, top_p=top_p, max_new_tokens=24)
    prompts = {f"g{i}": [1, 7 + i, 20 + 3 * i, 11] for i in range(3)}
    done: list[tuple[str, PartialSample]] = []
    for seed in (0, 0, 1):  # the second epoch replays the first's samples: its drafts are accepted whole
        for g, p in prompts.items():
            engine.submit(GroupRequest(g, p, sampling, n_samples=4, seed=seed))
        for _ in range(500):
            done += [(f.group_id, s) for f in engine.step() for s in f.samples]
            if not engine.has_work():
                break
    assert len(done) == 36
    stats = engine.speculator.stats if engine.speculator else None
    assert stats is not None and stats.accepted > 50 and stats.drafted > stats.accepted
    for gid, s in done:
        fresh = _fresh_logprobs(engine.model, prompts[gid], s, temperature, top_p)
        np.testing.assert_allclose(s.logprobs, fresh.numpy(), atol=LOGPROB_TOL, rtol=0)


def test_speculative_tokens_equal_plain_decodings() -> None:
    """Same uniforms, same rule: drafting changes the speed only (a handover resumes identically)."""
    sampling = Sampling(temperature=0.9, max_new_tokens=20)
    outs = []
    for spec in (SpeculativeConfig(enabled=False), ALWAYS):
        engine = TorchEngine(_policy(vocab=64, sharpen=4.0), max_batch=4, eos_ids=[2], speculative=spec)
        engine.generate(GroupRequest("a", PROMPT, sampling, n_samples=4, seed=5))
        outs.append(engine.generate(GroupRequest("b", PROMPT, sampling, n_samples=6, seed=5)))
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_TOL, rtol=0)


def test_a_weight_switch_between_steps_discards_drafts_of_the_old_version() -> None:
    old, new = _policy(vocab=64, sharpen=4.0), _policy(vocab=64, sharpen=4.0, seed=3)
    sampling = Sampling(temperature=1.0, max_new_tokens=24)
    engine = TorchEngine(_policy(vocab=64, sharpen=4.0), max_batch=4, eos_ids=[2], speculative=ALWAYS)
    before = engine.generate(GroupRequest("g", PROMPT, sampling, n_samples=4, seed=8))
    # The same seed again: under the old weights every draft would be accepted, to the last token.
    engine.submit(GroupRequest("g", PROMPT, sampling, n_samples=4, seed=8))
    assert engine.step() == [] and engine.step() == []
    engine.stage_weights({k: v.clone() for k, v in new.state_dict().items()}, version=5)
    done = []
    for _ in range(100):
        done += engine.step()
        if done:
            break
    assert engine.speculator is not None and 5 in engine.speculator.stats.by_version  # it drafted after the switch
    changed = 0
    for s, was in zip(done[0].samples, before, strict=True):
        switch = int(np.argmax(s.versions == 5))
        assert switch > 0 and (s.versions[:switch] == 0).all() and (s.versions[switch:] == 5).all()
        np.testing.assert_array_equal(s.completion_ids[:switch], was.completion_ids[:switch])
        # From the switch on, each token's logprob is the new policy's, given the cache kept from before
        # it (as plain decoding keeps it): no token was taken on the old version's verdict.
        ids = s.completion_ids.tolist()
        with torch.no_grad():
            cache = DynamicCache(config=old.config)
            old(input_ids=torch.tensor([PROMPT + ids[: switch - 1]]), past_key_values=cache, use_cache=True)
            after = torch.tensor([ids[switch - 1 : -1]])
            logits = new(input_ids=after, past_key_values=cache, use_cache=True).logits[0]
        expect = behaviour_logprobs(logits, torch.tensor(ids[switch:]), 1.0)
        np.testing.assert_allclose(s.logprobs[switch:], expect.numpy(), atol=LOGPROB_TOL, rtol=0)
        changed += not np.array_equal(s.completion_ids, was.completion_ids)
    assert changed  # the new weights did not simply re-accept the old answers


# -- the history and the acceptance rule, in isolation -------------------------------------------

def test_accepted_length_is_the_first_disagreement() -> None:
    assert accepted_length([4, 5, 6, 7], [4, 5, 9]) == 2
    assert accepted_length([4, 5, 9, 7], [4, 5, 9]) == 3
    assert accepted_length([3, 5, 9, 7], [4, 5, 9]) == 0


def test_history_drafts_from_the_longest_suffix_match_and_stays_bounded() -> None:
    h = ResponseHistory(max_prompts=2, max_responses=2, max_ngram=3)
    h.record([1, 2, 3], [10, 11, 12, 13, 14])
    entry = h.get(prompt_key([1, 2, 3]))
    assert entry is not None
    assert h.draft(entry, [], 3)[0] == [10, 11, 12]  # the prompt's tail matches the response's start
    tokens, at = h.draft(entry, [10, 11], 2)
    assert tokens == [12, 13]
    assert h.draft(entry, [10, 11, 12, 13], 2, hint=at + 2) == ([14], at + 2)  # the hint: no search
    assert h.draft(entry, [99, 13], 5)[0] == [14]  # only the 1-gram `13` matches
    assert h.draft(entry, [99, 98], 3) == ([], -1)
    assert h.draft(entry, [99, 98], 3, hint=at)[0] == []  # a hint that no longer matches is not used
    h.record([1, 2, 3], [10, 20, 21])
    assert h.draft(entry, [10], 2)[0] == [20, 21]  # the newest response wins at the same position
    h.record([1, 2, 3], [30])  # the oldest response goes
    assert h.draft(entry, [10, 11], 2)[0] == [] and h.draft(entry, [], 1)[0] == [30]
    h.record([4], [5])
    h.record([6], [7])  # the least recently used prompt goes
    assert len(h) == 2 and h.get(prompt_key([1, 2, 3])) is None
    small = ResponseHistory(max_tokens=100)
    for p in range(10):
        small.record([p], [5] * 30)
    assert small.tokens <= 100 and len(small) == 3  # the token budget: the newest prompts stay
    assert small.get(prompt_key([9])) is not None and small.get(prompt_key([6])) is None


def test_history_indexes_a_prompts_answers_at_its_next_draft_only() -> None:
    """Recording copies tokens (the region's answers to prompts never drafted for cost no index); the
    index catches up at the prompt's next draft, and drops evicted answers once they outnumber the live."""
    h = ResponseHistory(max_responses=2, max_ngram=2)
    h.record([1], [10, 11, 12])
    entry = h.get(prompt_key([1]))
    assert entry is not None and entry.by_pair == {} and entry.by_token == {}
    assert h.draft(entry, [10], 2)[0] == [11, 12]
    indexed = sum(len(v) for v in entry.by_token.values())
    assert indexed == 3  # the positions after 1, 10 and 11 (the prompt's tail + the answer)
    for first in range(20, 26):  # six more answers: four evicted, more than the two live ones
        h.record([1], [first, first + 1])
    assert sum(len(v) for v in entry.by_token.values()) == indexed
    assert h.draft(entry, [24], 1)[0] == [25] and h.draft(entry, [10], 2)[0] == []
    assert sum(len(v) for v in entry.by_token.values()) == 4  # rebuilt over the two live answers only


def test_drafting_stops_when_acceptance_falls_and_retries_on_a_new_answer() -> None:
    h = ResponseHistory(min_acceptance=0.3)
    h.record([1], [5, 6, 7, 8, 9, 10])
    entry = h.get(prompt_key([1]))
    assert entry is not None and len(h.draft(entry, [], 8)[0]) == 6
    for _ in range(10):
        h.observe(entry, drafted=4, accepted=0)
    assert h.draft(entry, [], 8)[0] == []
    h.record([1], [5, 6, 7])
    assert h.draft(entry, [], 8)[0] != []


def test_the_draft_length_follows_the_per_token_acceptance_not_the_share_accepted() -> None:
    """Six of eight drafted tokens accepted, again and again: the policy accepts a token with chance 6/7
    given the ones before (the two unjudged tokens after a rejection say nothing), so the mean run is 6
    and drafts run 7 long; the share accepted (0.75) would have cut them to 4."""
    h = ResponseHistory()
    h.record([1], list(range(10, 30)))
    entry = h.get(prompt_key([1]))
    assert entry is not None
    for _ in range(50):
        h.observe(entry, drafted=8, accepted=6)
    assert entry.acceptance.rate == pytest.approx(6 / 7, abs=1e-3)
    assert len(h.draft(entry, [], 16)[0]) == 7
    for _ in range(50):
        h.observe(entry, drafted=8, accepted=8)  # nothing rejected: the rate tends to 1, drafts to the cap
    assert len(h.draft(entry, [], 16)[0]) == 16


def test_drafts_come_from_other_prompts_answers_where_the_prompts_own_do_not_continue() -> None:
    h = ResponseHistory(max_ngram=3)
    h.record([2], [3, 6, 9])  # prompt B: its own answer continues `6` with 9, and never `5 6`
    h.record([1], [5, 6, 7, 8])  # prompt A, newer: `5 6` continues with 7 8
    b = h.get(prompt_key([2]))
    assert b is not None
    assert h.draft(b, [5, 6], 3)[0] == [7, 8]  # A's answer continues both tokens: better than B's own `6 -> 9`
    assert h.draft(b, [3, 6], 3)[0] == [9]  # B's own answer continues `3 6`: it wins
    h.record([2], [5, 6, 4, 4])  # now B's own answer holds `5 6` too: it wins over A's newer one
    assert h.draft(b, [5, 6], 3)[0] == [4, 4]
    assert h.draft(None, [5, 6], 3)[0] == [4, 4]  # a prompt never seen drafts from the newest answer of any
    assert h.draft(None, [6], 3)[0] == []  # ... only on two tokens of its own
    alone = ResponseHistory(max_ngram=3, across_prompts=False)
    alone.record([1], [5, 6, 7, 8])
    alone.record([2], [3, 6, 9])
    b = alone.get(prompt_key([2]))
    assert b is not None and alone.draft(b, [5, 6], 3)[0] == [9] and alone.draft(None, [5, 6], 3)[0] == []


def test_drafts_across_prompts_stop_when_rejected_and_never_come_from_evicted_answers() -> None:
    h = ResponseHistory(max_responses=1, min_acceptance=0.3)
    h.record([1], [5, 6, 7])
    assert h.draft(None, [5, 6], 3)[0] == [7]
    for _ in range(10):
        h.observe(None, drafted=3, accepted=0)  # unseen prompts' drafts were all rejected
    assert h.draft(None, [5, 6], 3)[0] == []
    assert h.draft(h.get(prompt_key([1])), [5, 6], 3)[0] == [7]  # the prompt's own gate is its own
    h.record([1], [8, 9, 10])  # the only answer holding `5 6` is evicted
    assert h.draft(h.get(prompt_key([9])), [5, 6], 3)[0] == []


def test_the_table_across_prompts_is_rebuilt_once_evicted_answers_could_outnumber_the_live() -> None:
    h = ResponseHistory(max_prompts=4, max_responses=1, max_tokens=1 << 12)
    for p in range(3000):  # distinct pairs every answer: 60,000 recorded, about 100 live
        h.record([p], [p * 20 + i for i in range(1, 22)])
    assert h.tokens <= 4 * 22
    assert len(h._newest) <= 1024 + 22 + 4 * 22  # the dead allowance and an answer over it, and the live pairs
    assert h.draft(None, [2999 * 20 + 1, 2999 * 20 + 2], 2)[0] == [2999 * 20 + 3, 2999 * 20 + 4]


def test_length_predictions_come_from_history_else_the_default() -> None:
    h = ResponseHistory()
    assert h.predicted_length(prompt_key([1]), default=64) == 64
    h.record([1], [5] * 10)
    h.record([1], [5] * 20)
    h.record([2], [5] * 60)
    assert h.predicted_length(prompt_key([1]), default=64) == 15
    assert h.predicted_length(prompt_key([3]), default=64) == pytest.approx(30)  # the mean of all


@pytest.mark.parametrize("length_aware", [True, False])
def test_the_engine_admits_long_predicted_samples_first(length_aware: bool) -> None:
    engine = TorchEngine(_policy(vocab=64), max_batch=2, eos_ids=[2], length_aware=length_aware)
    short, long_ = [1, 7, 8], [1, 9, 10]
    engine.history.record(short, [5] * 3)
    engine.history.record(long_, [5] * 30)
    sampling = Sampling(max_new_tokens=40)
    engine.submit(GroupRequest("short", short, sampling, n_samples=2))
    engine.submit(GroupRequest("long", long_, sampling, n_samples=2))
    engine.step()
    first = "long" if length_aware else "short"
    assert engine.tokens_so_far(first) == 2
    assert engine.tokens_so_far("short" if length_aware else "long") == 0


def test_bad_speculative_config_names_the_field() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="min_ngram"):
        SpeculativeConfig(min_ngram=5, max_ngram=2)
    with pytest.raises(ValidationError, match="max_draft_tokens"):
        SpeculativeConfig(max_draft_tokens=0)
