"""Wire codec: hypothesis round trips, run-length versions, and one refusal per bound."""

from __future__ import annotations

import itertools
import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.broker import (
    GroupRecord,
    HandedOverBy,
    PartialRecord,
    PartialSample,
    PromptRecord,
    RecordError,
    RecordLimits,
    Sample,
    Sampling,
    decode_record,
    encode_record,
    expand_versions,
    floats,
    ids,
    rle_versions,
)

LIMITS = RecordLimits(vocab_size=1000, known_tasks=frozenset({"reverse", "math"}),
                      max_tokens_per_sample=64, max_prompt_tokens=64, max_samples_per_group=8)

token_lists = st.lists(st.integers(0, LIMITS.vocab_size - 1), max_size=LIMITS.max_tokens_per_sample)
logprob = st.floats(min_value=-80.0, max_value=0.0, allow_nan=False, width=32)


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    tokens = draw(token_lists)
    n = len(tokens)
    lps = draw(st.lists(logprob, min_size=n, max_size=n))
    # versions never decrease within a sample: an engine only moves forward
    steps = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    base = draw(st.integers(0, 10_000))
    versions = base + np.cumsum(np.array(steps, dtype=np.int64) * (np.arange(n) % 7 == 0), dtype=np.int64)
    return Sample(ids(tokens), floats(lps), ids(versions), draw(st.floats(-10, 10)),
                  draw(st.sampled_from(["stop", "length", "abort"])))


@st.composite
def groups(draw: st.DrawFn) -> GroupRecord:
    return GroupRecord(
        group_id=draw(st.text(min_size=1, max_size=20)), run="r", task=draw(st.sampled_from(["reverse", "math"])),
        attempt=draw(st.integers(0, 5)), region="eu", node="n1",
        prompt_ids=ids(draw(st.lists(st.integers(0, 999), max_size=64))),
        samples=draw(st.lists(samples(), min_size=1, max_size=8)),
    )


def assert_samples_equal(a: Sample | PartialSample, b: Sample | PartialSample) -> None:
    assert np.array_equal(a.completion_ids, b.completion_ids)
    assert a.logprobs.tobytes() == b.logprobs.tobytes()  # bit for bit
    assert np.array_equal(a.versions, b.versions)
    assert a.finish_reason == b.finish_reason


@settings(max_examples=150, deadline=None)
@given(groups())
def test_group_round_trips_exactly(group: GroupRecord) -> None:
    back = decode_record(encode_record(group, LIMITS), LIMITS)
    assert isinstance(back, GroupRecord)
    assert (back.group_id, back.task, back.attempt) == (group.group_id, group.task, group.attempt)
    assert np.array_equal(back.prompt_ids, group.prompt_ids)
    for a, b in zip(group.samples, back.samples, strict=True):
        assert_samples_equal(a, b)
        assert a.reward == b.reward


def make_prompt(**over: object) -> PromptRecord:
    fields: dict[str, object] = dict(group_id="g-1", run="r", task="reverse", n_samples=4,
                                     sampling=Sampling(0.7, 0.95, 16), prompt="abc", reference={"answer": "cba"},
                                     min_version=3, dispatched_at=12.5, attempt=1)
    fields.update(over)
    return PromptRecord(**fields)  # type: ignore[arg-type]


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200), st.lists(st.integers(0, 999), max_size=64) | st.none(),
       st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5), max_size=4))
def test_prompt_round_trips(text: str, prompt_ids: list[int] | None, reference: dict[str, object]) -> None:
    p = make_prompt(prompt=text, prompt_ids=None if prompt_ids is None else ids(prompt_ids), reference=reference)
    back = decode_record(encode_record(p, LIMITS), LIMITS)
    assert isinstance(back, PromptRecord)
    assert (back.prompt, back.reference, back.sampling, back.min_version, back.attempt) == (
        p.prompt, p.reference, p.sampling, p.min_version, p.attempt)
    assert (back.prompt_ids is None) == (p.prompt_ids is None)
    if p.prompt_ids is not None and back.prompt_ids is not None:
        assert np.array_equal(back.prompt_ids, p.prompt_ids)


@settings(max_examples=50, deadline=None)
@given(st.lists(samples(), min_size=1, max_size=8), st.lists(st.booleans(), min_size=8, max_size=8))
def test_partial_round_trips(parts: list[Sample], finished: list[bool]) -> None:
    ps = [PartialSample(s.completion_ids, s.logprobs, s.versions, s.finish_reason if f else None)
          for s, f in zip(parts, finished, strict=False)]
    record = PartialRecord(make_prompt(), ps, HandedOverBy("eu", "n2", "sigterm"))
    back = decode_record(encode_record(record, LIMITS), LIMITS)
    assert isinstance(back, PartialRecord)
    assert back.handed_over_by == record.handed_over_by and back.group_id == "g-1"
    for a, b in zip(ps, back.samples, strict=True):
        assert_samples_equal(a, b)


@given(st.lists(st.integers(0, 3), max_size=300))
def test_version_runs_expand_to_the_original(deltas: list[int]) -> None:
    versions = ids(np.cumsum(deltas)) if deltas else ids([])
    rle = rle_versions(versions)
    assert np.array_equal(expand_versions(rle, len(versions)), versions)
    # one (start, version) pair per run
    assert len(rle) == 8 * (1 + int(np.count_nonzero(np.diff(versions)))) if len(versions) else rle == b""


@given(st.lists(st.tuples(st.integers(-2, 40), st.integers(-1, 5)), max_size=12), st.integers(0, 40))
def test_run_length_versions_are_checked_alike_with_few_runs_and_many(runs: list[tuple[int, int]], n: int) -> None:
    """Up to 8 runs are checked and expanded in Python, more with numpy: either way the runs must start
    at token 0, increase and stay below the sample's length, and expand to the same versions."""
    rle = np.asarray(runs, dtype="<i4").reshape(-1, 2).tobytes()
    starts = [a for a, _ in runs]
    valid = (n == 0 and not runs) or (n > 0 and bool(runs) and starts[0] == 0 and starts[-1] < n
                                      and all(b > a for a, b in itertools.pairwise(starts)))
    if not valid:
        with pytest.raises(RecordError):
            expand_versions(rle, n)
        return
    lengths = np.diff([*starts, n])
    expected = np.repeat(np.asarray([v for _, v in runs], dtype=np.int32), lengths) if runs else np.zeros(0)
    assert np.array_equal(expand_versions(rle, n), expected)


def group_with(**sample_over: object) -> GroupRecord:
    s: dict[str, object] = dict(completion_ids=ids([5, 6, 7]), logprobs=floats([-0.1, -2.0, -0.5]),
                                versions=ids([1, 1, 2]), reward=1.0, finish_reason="stop")
    s.update(sample_over)
    return GroupRecord("g-9", "r", "reverse", 0, "eu", "n1", ids([1, 2]), [Sample(**s)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("record", "reason", "field"),
    [
        (group_with(completion_ids=ids([5, 6, 1000])), "token_range", "samples[0].completion_ids"),
        (group_with(completion_ids=ids([5, -1, 7])), "token_range", "samples[0].completion_ids"),
        (group_with(logprobs=floats([-0.1, math.nan, -0.5])), "logprob_bound", "samples[0].logprobs"),
        (group_with(logprobs=floats([-0.1, -math.inf, -0.5])), "logprob_bound", "samples[0].logprobs"),
        (group_with(logprobs=floats([-0.1, 0.25, -0.5])), "logprob_bound", "samples[0].logprobs"),
        (group_with(completion_ids=ids(range(65)), logprobs=floats([-1.0] * 65), versions=ids([0] * 65)),
         "tokens_bound", "samples[0].completion_ids"),
        (group_with(reward=math.nan), "reward", "samples[0].reward"),
        (group_with(finish_reason="bored"), "finish_reason", "samples[0].finish_reason"),
        (group_with(logprobs=floats([-0.1, -0.2])), "length_mismatch", "samples[0]"),
        (make_prompt(task="poetry"), "unknown_task", "task"),
        (make_prompt(n_samples=9), "samples_bound", "n_samples"),
        (make_prompt(prompt=None), "missing_prompt", "prompt"),
    ],
)
def test_each_bound_is_refused_with_its_reason(record: object, reason: str, field: str) -> None:
    # what the producer would refuse to send ...
    with pytest.raises(RecordError) as on_encode:
        encode_record(record, LIMITS)  # type: ignore[arg-type]
    # ... a consumer refuses too, when another producer sent it anyway
    with pytest.raises(RecordError) as on_decode:
        decode_record(encode_record(record), LIMITS)  # type: ignore[arg-type]
    for err in (on_encode.value, on_decode.value):
        assert (err.reason, err.field) == (reason, field)


def test_versions_must_cover_every_token_on_encode() -> None:
    with pytest.raises(RecordError) as info:
        encode_record(group_with(versions=ids([1, 1])), LIMITS)
    assert (info.value.reason, info.value.field) == ("length_mismatch", "samples[0]")


def test_unencodable_reference_is_a_record_error() -> None:
    with pytest.raises(RecordError, match="cannot encode") as info:
        encode_record(make_prompt(reference={"big": 2**70}))
    assert info.value.group_id == "g-1"


def test_too_many_samples_is_refused() -> None:
    g = group_with()
    g.samples = g.samples * 9
    with pytest.raises(RecordError, match=r"9 samples outside 1\.\.8") as info:
        decode_record(encode_record(g), LIMITS)
    assert info.value.reason == "samples_bound"


@pytest.mark.parametrize(
    ("value", "field"),
    [
        (b"\xc1garbage", None),
        (msgpack.packb([1, 2, 3]), None),
        (msgpack.packb({"schema": "fleetrl.nope/9"}), "schema"),
        (msgpack.packb({"schema": "fleetrl.group/1", "group_id": "g", "samples": []}), "run"),
    ],
)
def test_malformed_bytes_raise_record_error(value: bytes, field: str | None) -> None:
    with pytest.raises(RecordError) as info:
        decode_record(value, LIMITS)
    assert info.value.field == field


def test_array_length_must_match_its_count() -> None:
    obj = msgpack.unpackb(encode_record(group_with()))
    obj["samples"][0]["ids"]["n"] = 4  # says 4 tokens, holds 3
    with pytest.raises(RecordError, match="says 4 elements but holds 12 bytes") as info:
        decode_record(msgpack.packb(obj), LIMITS)
    assert info.value.field == "samples[0].completion_ids" and info.value.group_id == "g-9"


def test_error_names_topic_partition_offset() -> None:
    err = RecordError("token_range", "token id outside [0, 10)", field="prompt_ids", group_id="g-1")
    assert str(err.at("fleetrl.r.trajectories", 3, 42)) == (
        "fleetrl.r.trajectories[3]@42: field 'prompt_ids': token id outside [0, 10) (group g-1)")


def test_arrays_are_packed_typed_bytes_not_lists() -> None:
    obj = msgpack.unpackb(encode_record(group_with()))
    sample = obj["samples"][0]
    assert sample["ids"] == {"n": 3, "d": np.array([5, 6, 7], "<i4").tobytes()}
    assert sample["lp"]["d"] == np.array([-0.1, -2.0, -0.5], "<f4").tobytes()
    assert sample["ver"] == np.array([[0, 1], [2, 2]], "<i4").tobytes()
