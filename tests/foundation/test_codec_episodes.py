"""`fleetrl.group/2` segments and `fleetrl.prompt/2` env: round trips, bounds, /1 still read."""

from __future__ import annotations

import itertools

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.broker import (
    SCHEMA_GROUP,
    SCHEMA_GROUP_V2,
    GroupRecord,
    PromptRecord,
    RecordError,
    RecordLimits,
    Sample,
    Sampling,
    decode_record,
    encode_record,
    expand_segments,
    floats,
    ids,
    segments_of,
)

LIMITS = RecordLimits(vocab_size=1000, known_tasks=frozenset({"tools"}), max_tokens_per_sample=64,
                      max_prompt_tokens=64, max_samples_per_group=8)


def _episode(sources: list[int], reward: float = 1.0) -> Sample:
    """Policy tokens with logprob -0.5 at version 3, environment tokens with logprob 0 at version -1."""
    src = np.asarray(sources, dtype=np.int32)
    return Sample(ids(np.arange(len(src)) + 5), floats(np.where(src == 1, 0.0, -0.5)), ids(np.where(src == 1, -1, 3)),
                  reward, "stop", segments=segments_of(src))


def _group(samples: list[Sample]) -> GroupRecord:
    return GroupRecord(group_id="g1", run="r", task="tools", attempt=0, region="eu", node="n1",
                       prompt_ids=ids([1, 2, 3]), samples=samples)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0, 1]), min_size=1, max_size=64))
def test_segments_round_trip_and_expand_to_the_sources(sources: list[int]) -> None:
    sources[0] = 0  # an episode starts with the policy's turn
    record = decode_record(encode_record(_group([_episode(sources)]), LIMITS), LIMITS, expect=SCHEMA_GROUP)
    assert isinstance(record, GroupRecord)
    s = record.samples[0]
    assert record.schema == SCHEMA_GROUP_V2
    assert s.sources().tolist() == sources
    assert s.policy_mask().tolist() == [x == 0 for x in sources]
    runs = 1 + sum(a != b for a, b in itertools.pairwise(sources))
    assert s.segments is not None and s.segments.shape == (runs, 2)  # run-length: one pair per run


def test_group_without_segments_stays_v1_and_reads_as_all_policy() -> None:
    plain = Sample(ids([5, 6]), floats([-0.1, -0.2]), ids([2, 2]), 0.5, "stop")
    value = encode_record(_group([plain]), LIMITS)
    assert msgpack.unpackb(value)["schema"] == SCHEMA_GROUP
    record = decode_record(value, LIMITS, expect=SCHEMA_GROUP)
    assert isinstance(record, GroupRecord) and record.samples[0].segments is None
    assert record.samples[0].policy_mask().tolist() == [True, True]


def test_min_version_ignores_environment_tokens() -> None:
    assert _group([_episode([0, 0, 1, 1, 0])]).min_version == 3


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda s: setattr(s, "segments", ids([[0, 0], [9, 1]])), "samples[0].segments"),  # run past the end
    (lambda s: setattr(s, "segments", ids([[1, 0]])), "samples[0].segments"),  # first run not at 0
    (lambda s: setattr(s, "segments", ids([[0, 0], [2, 2]])), "samples[0].segments"),  # unknown source
    (lambda s: setattr(s, "segments", ids([[0, 0], [3, 1], [2, 0]])), "samples[0].segments"),  # not increasing
    (lambda s: s.logprobs.__setitem__(2, -0.3), "samples[0].segments"),  # env token with a logprob
    (lambda s: s.versions.__setitem__(2, 3), "samples[0].segments"),  # env token with a version
    (lambda s: s.versions.__setitem__(0, -1), "samples[0].versions"),  # policy token without one
])
def test_segment_bounds_are_refused(mutate: object, field: str) -> None:
    sample = _episode([0, 0, 1, 1, 0])
    sample.logprobs, sample.versions = sample.logprobs.copy(), sample.versions.copy()
    mutate(sample)  # type: ignore[operator]
    with pytest.raises(RecordError) as err:
        encode_record(_group([sample]), LIMITS)
    assert err.value.field == field


def test_decoder_refuses_segments_that_are_not_pairs() -> None:
    obj = msgpack.unpackb(encode_record(_group([_episode([0, 1])])))
    obj["samples"][0]["seg"] = b"\x00" * 12
    with pytest.raises(RecordError) as err:
        decode_record(msgpack.packb(obj), LIMITS)
    assert err.value.field == "samples[0].segments"


def test_prompt_env_round_trips_as_v2_and_is_checked() -> None:
    p = PromptRecord("g1", "r", "tools", 2, Sampling(), prompt="hi", env={"name": "calc", "args": {"n": 3}})
    value = encode_record(p, LIMITS)
    assert msgpack.unpackb(value)["schema"] == "fleetrl.prompt/2"
    back = decode_record(value, LIMITS, expect="fleetrl.prompt/1")
    assert isinstance(back, PromptRecord) and back.env == {"name": "calc", "args": {"n": 3}}
    p.env = {"name": 3}
    with pytest.raises(RecordError) as err:
        encode_record(p, LIMITS)
    assert err.value.field == "env"


def test_expand_segments_of_none_is_all_policy() -> None:
    assert expand_segments(None, 3).tolist() == [0, 0, 0]
