"""Eval fields on the wire: prompts and groups carry `eval` as /2, partials keep it, and the bounds refuse
an eval group with a token of another version (the pinning contract) or a malformed tag."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from fleetrl.broker import (
    SCHEMA_GROUP,
    SCHEMA_GROUP_V2,
    SCHEMA_PROMPT,
    SCHEMA_PROMPT_V2,
    EvalTag,
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
)

LIMITS = RecordLimits(vocab_size=64, known_tasks=frozenset({"reverse"}), max_tokens_per_sample=8,
                      max_samples_per_group=4)


def _prompt(tag: EvalTag | None) -> PromptRecord:
    return PromptRecord("r-eval-h-000000003-000001", "r", "reverse", 2, Sampling(1.0, 1.0, 6), prompt="ab=",
                        reference="ba", min_version=3, eval=tag)


def _group(versions: list[list[int]], tag: EvalTag | None) -> GroupRecord:
    samples = [Sample(np.arange(len(v), dtype=np.int32), np.full(len(v), -0.5, np.float32),
                      np.asarray(v, np.int32), 0.5, "stop") for v in versions]
    return GroupRecord("r-eval-h-000000003-000001", "r", "reverse", 0, "a", "n", np.ones(3, np.int32), samples,
                       eval=tag)


def test_prompts_partials_and_groups_carry_their_eval_tag() -> None:
    tag = EvalTag("h", 3)
    assert _prompt(None).schema == SCHEMA_PROMPT and _prompt(tag).schema == SCHEMA_PROMPT_V2
    back = decode_record(encode_record(_prompt(tag), LIMITS), LIMITS)
    assert isinstance(back, PromptRecord) and back.eval == tag
    partial = PartialRecord(_prompt(tag), [PartialSample(np.zeros(0, np.int32), np.zeros(0, np.float32),
                                                         np.zeros(0, np.int32))] * 2,
                            HandedOverBy("a", "n", "sigterm"))
    resumed = decode_record(encode_record(partial, LIMITS), LIMITS)
    assert isinstance(resumed, PartialRecord) and resumed.prompt.eval == tag
    group = _group([[3, 3], [3]], tag)
    assert group.schema == SCHEMA_GROUP_V2 and _group([[3]], None).schema == SCHEMA_GROUP
    g = decode_record(encode_record(group, LIMITS), LIMITS)
    assert isinstance(g, GroupRecord) and g.eval == tag


def test_an_eval_group_with_a_token_of_another_version_is_refused() -> None:
    with pytest.raises(RecordError) as err:
        encode_record(_group([[3, 3], [3, 4]], EvalTag("h", 3)), LIMITS)
    assert err.value.reason == "version_bound" and err.value.field == "samples.versions"
    encode_record(_group([[3, 4]], None), LIMITS)  # a training group may span versions


@pytest.mark.parametrize("bad", [{"set": "h"}, {"set": 1, "version": 2}, {"set": "h", "version": "2"},
                                 {"set": "h", "version": True}, "h@2", {"set": "", "version": 1},
                                 {"set": "h", "version": -1}])
def test_a_malformed_eval_tag_is_refused_naming_the_field(bad: object) -> None:
    raw = msgpack.unpackb(encode_record(_prompt(EvalTag("h", 3))), raw=False)
    raw["eval"] = bad
    with pytest.raises(RecordError) as err:
        decode_record(msgpack.packb(raw, use_bin_type=True), LIMITS)
    assert err.value.field == "eval" and err.value.reason == "malformed"
