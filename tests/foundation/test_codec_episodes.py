"""`fleetrl.group/2` and `fleetrl.partial/2` segments, `fleetrl.prompt/2` env: round trips, bounds, /1 still read."""

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
    SCHEMA_PARTIAL,
    SCHEMA_PARTIAL_V2,
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


# -- fleetrl.partial/2: an agent run's capture handed over (segments and contexts per sample) ----------

def _partial(samples: list[PartialSample]) -> PartialRecord:
    prompt = PromptRecord(group_id="g1", run="r", task="tools", n_samples=len(samples), sampling=Sampling(),
                          prompt_ids=ids([1, 2, 3]))
    return PartialRecord(prompt, samples, HandedOverBy("eu", "n1", "preempted"))


def _captured(sources: list[int], contexts: list[tuple[int, list[int]]] | None = None) -> PartialSample:
    e = _episode(sources)
    return PartialSample(e.completion_ids, e.logprobs, e.versions, None, segments=e.segments,
                         contexts=None if contexts is None else [(at, ids(p)) for at, p in contexts])


def test_partial_v2_round_trips_segments_and_contexts() -> None:
    sample = _captured([0, 0, 1, 1, 0, 0, 0], [(0, [1, 2, 3]), (4, [9, 8])])
    plain = PartialSample(ids([]), floats([]), ids([]))  # a run that captured nothing yet
    record = _partial([sample, plain])
    assert record.schema == SCHEMA_PARTIAL_V2
    back = decode_record(encode_record(record, LIMITS), LIMITS, expect=SCHEMA_PARTIAL)
    assert isinstance(back, PartialRecord) and back.schema == SCHEMA_PARTIAL_V2
    s = back.samples[0]
    assert s.completion_ids.tolist() == sample.completion_ids.tolist()
    assert s.versions.tolist() == [3, 3, -1, -1, 3, 3, 3] and s.logprobs.tolist()[2:4] == [0.0, 0.0]
    assert s.segments is not None and s.segments.tolist() == [[0, 0], [2, 1], [4, 0]]
    assert s.contexts is not None and [(at, p.tolist()) for at, p in s.contexts] == [(0, [1, 2, 3]), (4, [9, 8])]
    assert back.samples[1].segments is None and back.samples[1].contexts is None


def test_partial_without_structure_stays_v1_and_v1_is_still_read() -> None:
    record = _partial([PartialSample(ids([5, 6]), floats([-0.1, -0.2]), ids([2, 2]))])
    assert record.schema == SCHEMA_PARTIAL
    raw = msgpack.unpackb(encode_record(record, LIMITS), raw=False)
    assert raw["schema"] == SCHEMA_PARTIAL and "seg" not in raw["samples"][0]
    back = decode_record(msgpack.packb(raw, use_bin_type=True), LIMITS, expect=SCHEMA_PARTIAL)
    assert isinstance(back, PartialRecord) and back.samples[0].segments is None
    assert back.samples[0].completion_ids.tolist() == [5, 6]


def test_partial_v2_bounds_name_the_field() -> None:
    bad_env = _captured([0, 1, 0])
    bad_env.versions = ids([3, 3, 3])  # an environment token with a policy version
    with pytest.raises(RecordError) as err:
        encode_record(_partial([bad_env]), LIMITS)
    assert err.value.reason == "segment_bound" and err.value.field == "samples[0].segments"
    with pytest.raises(RecordError) as err:
        encode_record(_partial([_captured([0, 0], [(1, [1])])]), LIMITS)  # contexts must start at token 0
    assert err.value.reason == "segment_bound" and err.value.field == "samples[0].contexts"
    long_ctx = _captured([0, 0], [(0, list(range(LIMITS.max_prompt_tokens + LIMITS.max_tokens_per_sample + 1)))])
    with pytest.raises(RecordError) as err:
        encode_record(_partial([long_ctx]), LIMITS)
    assert err.value.reason == "tokens_bound" and err.value.field == "samples[0].contexts[0]"


def test_a_group_names_the_tokens_it_could_not_replay_by_region() -> None:
    record = _group([_episode([0, 1, 0])])
    record.regenerated = {"eu": 12}
    back = decode_record(encode_record(record, LIMITS), LIMITS, expect=SCHEMA_GROUP)
    assert isinstance(back, GroupRecord) and back.schema == SCHEMA_GROUP_V2 and back.regenerated == {"eu": 12}
    assert decode_record(encode_record(_group([_episode([0])]), LIMITS), LIMITS).regenerated is None  # type: ignore[union-attr]
    record.regenerated = {"eu": -1}
    with pytest.raises(RecordError) as err:
        encode_record(record, LIMITS)
    assert err.value.reason == "malformed" and err.value.field == "regenerated"
