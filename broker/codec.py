"""Wire codec of the data-plane records: msgpack maps with packed little-endian typed arrays.

Arrays are never Python lists on the wire: token ids are `<i4` bytes, logprobs `<f4` bytes, each
with an explicit element count `n` that the decoder checks against the byte length. Per-token
policy versions are run-length coded as `<i4` pairs (index of the first token, version), since a
version changes at most a few times within a sample. Decoding returns numpy views over the message
bytes (no copy). Any failure raises `RecordError` naming the field.
"""

from __future__ import annotations

import itertools
import struct
import sys
from typing import Any

import msgpack
import numpy as np

from fleetrl.broker.errors import RecordError
from fleetrl.broker.records import (
    SCHEMA_GROUP,
    SCHEMA_GROUP_V2,
    SCHEMA_PARTIAL,
    SCHEMA_PARTIAL_V2,
    SCHEMA_PROMPT,
    SCHEMA_PROMPT_V2,
    EvalTag,
    FloatArray,
    GroupRecord,
    HandedOverBy,
    IntArray,
    PartialRecord,
    PartialSample,
    PromptRecord,
    Record,
    RecordLimits,
    Sample,
    Sampling,
    Timings,
    check_record,
)

_I4 = np.dtype("<i4")
_F4 = np.dtype("<f4")
_LITTLE = sys.byteorder == "little"
_FEW_RUNS = 8
"""Run-length versions of up to this many runs are checked and expanded in Python (cheaper than numpy's
per-call cost); longer ones with numpy."""


# -- arrays -------------------------------------------------------------------------------------


def _pack_array(arr: Any, dtype: np.dtype[Any]) -> dict[str, Any]:
    a = np.ascontiguousarray(arr, dtype=dtype)
    return {"n": int(a.shape[0]), "d": a.tobytes()}


def _unpack_array(obj: Any, dtype: np.dtype[Any], field: str) -> Any:
    if not isinstance(obj, dict) or not isinstance(obj.get("d"), bytes) or not isinstance(obj.get("n"), int):
        raise RecordError("malformed", "expected a packed array {n, d}", field=field)
    n, data = obj["n"], obj["d"]
    if n < 0 or len(data) != n * dtype.itemsize:
        raise RecordError("malformed", f"array says {n} elements but holds {len(data)} bytes", field=field)
    arr = np.frombuffer(data, dtype=dtype)
    return arr if _LITTLE else arr.astype(dtype.newbyteorder("="))


def rle_versions(versions: IntArray) -> bytes:
    """Per-token versions as `<i4` pairs (first token index, version) for each run."""
    v = np.asarray(versions, dtype=np.int32)
    if len(v) == 0:
        return b""
    changes = np.flatnonzero(v[1:] != v[:-1])
    pairs = np.empty((len(changes) + 1, 2), dtype=_I4)
    pairs[0] = (0, v[0])
    pairs[1:, 0] = changes + 1
    pairs[1:, 1] = v[changes + 1]
    return pairs.tobytes()


def expand_versions(rle: bytes, n_tokens: int, field: str = "versions") -> IntArray:
    """Inverse of `rle_versions`; checks that the runs start at 0, increase and fit `n_tokens`."""
    if len(rle) % 8:
        raise RecordError("malformed", "run-length versions are not <i4 pairs", field=field)
    if n_tokens == 0:
        if rle:
            raise RecordError("malformed", "versions given for an empty sample", field=field)
        return np.zeros(0, dtype=np.int32)
    runs = len(rle) // 8
    if runs == 0:  # (numpy's path below raised IndexError on this: a crash, not a dead letter)
        raise RecordError("malformed", f"no versions for a sample of {n_tokens} tokens", field=field)
    out: IntArray
    if runs <= _FEW_RUNS:  # the common case (a version or two a sample): no numpy call per check
        flat = struct.unpack(f"<{2 * runs}i", rle)
        first, values = flat[0::2], flat[1::2]
        if first[0] != 0 or first[-1] >= n_tokens or any(b <= a for a, b in itertools.pairwise(first)):
            raise RecordError("malformed", "run starts must begin at 0, increase and stay below n", field=field)
        out = np.empty(n_tokens, dtype=np.int32)
        for start, stop, value in zip(first, (*first[1:], n_tokens), values, strict=True):
            out[start:stop] = value
        return out
    pairs = np.frombuffer(rle, dtype=_I4).reshape(-1, 2)
    starts = pairs[:, 0]
    ends = np.empty_like(starts)
    ends[:-1], ends[-1] = starts[1:], n_tokens
    lengths = ends - starts
    if starts[0] != 0 or (lengths <= 0).any():
        raise RecordError("malformed", "run starts must begin at 0, increase and stay below n", field=field)
    out = np.repeat(pairs[:, 1].astype(np.int32), lengths)
    return out


# -- records -> maps ----------------------------------------------------------------------------


def _prompt_map(p: PromptRecord) -> dict[str, Any]:
    return {
        "group_id": p.group_id, "run": p.run, "task": p.task, "attempt": p.attempt,
        "prompt": p.prompt,
        "prompt_ids": None if p.prompt_ids is None else _pack_array(p.prompt_ids, _I4),
        "n_samples": p.n_samples,
        "sampling": {"temperature": p.sampling.temperature, "top_p": p.sampling.top_p,
                     "max_new_tokens": p.sampling.max_new_tokens},
        "reference": p.reference, "min_version": p.min_version, "dispatched_at": p.dispatched_at,
        **({"messages": p.messages} if p.messages is not None else {}),
        **({"columns": p.columns} if p.columns is not None else {}),
        **({"env": p.env} if p.env is not None else {}),
        **({"eval": _eval_map(p.eval)} if p.eval is not None else {}),
    }


def _eval_map(tag: EvalTag) -> dict[str, Any]:
    return {"set": tag.set_name, "version": tag.version}


def _eval_tag(value: Any) -> EvalTag | None:
    if value is None:
        return None
    ok = isinstance(value, dict) and set(value) == {"set", "version"} and isinstance(value["set"], str) \
        and isinstance(value["version"], int) and not isinstance(value["version"], bool)
    if not ok:
        raise RecordError("malformed", "eval must be {set: str, version: int}", field="eval")
    return EvalTag(value["set"], value["version"])


def _tokens_map(tokens: IntArray, logprobs: FloatArray, versions: IntArray) -> dict[str, Any]:
    return {"ids": _pack_array(tokens, _I4), "lp": _pack_array(logprobs, _F4), "ver": rle_versions(versions)}


def _structure_map(segments: IntArray | None, contexts: list[tuple[int, IntArray]] | None) -> dict[str, Any]:
    """A sample's optional `seg` and `ctx` (`fleetrl.group/2`, `fleetrl.partial/2`)."""
    return {**({"seg": _pack_segments(segments)} if segments is not None else {}),
            **({"ctx": [{"at": int(at), "p": _pack_array(p, _I4)} for at, p in contexts]}
               if contexts is not None else {})}


def to_map(record: Record) -> dict[str, Any]:
    if isinstance(record, GroupRecord):
        return {
            "schema": record.schema, "group_id": record.group_id, "run": record.run, "task": record.task,
            "attempt": record.attempt, "region": record.region, "node": record.node,
            "prompt_ids": _pack_array(record.prompt_ids, _I4),
            "samples": [
                {**_tokens_map(s.completion_ids, s.logprobs, s.versions), "reward": float(s.reward),
                 "finish": s.finish_reason, **_structure_map(s.segments, s.contexts)}
                for s in record.samples
            ],
            "timings": {"queued": record.timings.queued, "started": record.timings.started,
                        "finished": record.timings.finished},
            **({"reward_parts": record.reward_parts} if record.reward_parts is not None else {}),
            **({"eval": _eval_map(record.eval)} if record.eval is not None else {}),
            **({"regen": record.regenerated} if record.regenerated is not None else {}),
        }
    if isinstance(record, PartialRecord):
        h = record.handed_over_by
        return {
            "schema": record.schema, **_prompt_map(record.prompt),
            "samples": [{**_tokens_map(s.completion_ids, s.logprobs, s.versions), "finish": s.finish_reason,
                         **_structure_map(s.segments, s.contexts)}
                        for s in record.samples],
            "handed_over_by": {"region": h.region, "node": h.node, "reason": h.reason},
        }
    return {"schema": record.schema, **_prompt_map(record)}


def encode_record(record: Record, limits: RecordLimits | None = None) -> bytes:
    """msgpack bytes of a record; with `limits`, refuse (RecordError) what a consumer would refuse."""
    if limits is not None:
        check_record(record, limits)
    try:
        out: bytes = msgpack.packb(to_map(record), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. a reference msgpack cannot hold
        raise RecordError("unencodable", f"cannot encode: {exc}", group_id=record.group_id) from exc
    return out


# -- maps -> records ----------------------------------------------------------------------------


def decode_record(value: bytes, limits: RecordLimits | None = None, expect: str | None = None) -> Record:
    """Parse and (with `limits`) bounds-check one record. Raises `RecordError` naming the field."""
    try:
        obj = msgpack.unpackb(value, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise RecordError("malformed", f"not a msgpack record: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict):
        raise RecordError("malformed", "record is not a msgpack map")
    schema = obj.get("schema")
    if expect is not None and schema not in _accepted(expect):
        raise RecordError("wrong_schema", f"expected schema {expect!r}, got {schema!r}", field="schema")
    try:
        record = _from_map(schema, obj)
    except RecordError as exc:
        exc.group_id = exc.group_id or _str_or_none(obj.get("group_id"))
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError("malformed", f"{type(exc).__name__}: {exc}", field=_missing(exc),
                          group_id=_str_or_none(obj.get("group_id"))) from exc
    if limits is not None:
        check_record(record, limits)
    return record


def _accepted(expect: str) -> tuple[str, ...]:
    """Readers of prompts, partials and groups accept /1 and /2 (DESIGN.md §3)."""
    if expect == SCHEMA_PROMPT:
        return (SCHEMA_PROMPT, SCHEMA_PROMPT_V2)
    if expect == SCHEMA_PARTIAL:
        return (SCHEMA_PARTIAL, SCHEMA_PARTIAL_V2)
    return (SCHEMA_GROUP, SCHEMA_GROUP_V2) if expect == SCHEMA_GROUP else (expect,)


def _pack_segments(segments: IntArray) -> bytes:
    """`segments` as `<i4` pairs (first token index, source)."""
    return np.ascontiguousarray(segments, dtype=_I4).reshape(-1, 2).tobytes()


def _unpack_segments(value: Any, field: str) -> IntArray | None:
    if value is None:
        return None
    if not isinstance(value, bytes) or len(value) % 8:
        raise RecordError("malformed", "segments must be <i4 pairs", field=field)
    seg = np.frombuffer(value, dtype=_I4).reshape(-1, 2)
    return seg if _LITTLE else seg.astype(np.int32)


def _from_map(schema: Any, obj: dict[str, Any]) -> Record:
    if schema in (SCHEMA_GROUP, SCHEMA_GROUP_V2):
        return _group(obj)
    if schema in (SCHEMA_PROMPT, SCHEMA_PROMPT_V2):
        return _prompt(obj)
    if schema in (SCHEMA_PARTIAL, SCHEMA_PARTIAL_V2):
        h = obj["handed_over_by"]
        return PartialRecord(
            prompt=_prompt(obj),
            samples=[_partial_sample(s, f"samples[{i}]") for i, s in enumerate(_list(obj, "samples"))],
            handed_over_by=HandedOverBy(region=_s(h, "region"), node=_s(h, "node"), reason=_s(h, "reason")),
        )
    raise RecordError("wrong_schema", f"unknown schema {schema!r}", field="schema")


def _prompt(o: dict[str, Any]) -> PromptRecord:
    s = o["sampling"]
    pids = o.get("prompt_ids")
    return PromptRecord(
        group_id=_s(o, "group_id"), run=_s(o, "run"), task=_s(o, "task"), attempt=_i(o, "attempt"),
        prompt=o.get("prompt"),
        prompt_ids=None if pids is None else _unpack_array(pids, _I4, "prompt_ids"),
        n_samples=_i(o, "n_samples"),
        sampling=Sampling(temperature=float(s["temperature"]), top_p=float(s["top_p"]),
                          max_new_tokens=int(s["max_new_tokens"])),
        reference=o.get("reference"), min_version=_i(o, "min_version"),
        dispatched_at=float(o.get("dispatched_at", 0.0)),
        messages=o.get("messages"), columns=_columns(o.get("columns")), env=o.get("env"),
        eval=_eval_tag(o.get("eval")),
    )


def _columns(value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise RecordError("malformed", "columns must be a map", field="columns")
    return value


def _tokens(s: dict[str, Any], name: str) -> tuple[IntArray, FloatArray, IntArray]:
    tokens = _unpack_array(s["ids"], _I4, f"{name}.completion_ids")
    logprobs = _unpack_array(s["lp"], _F4, f"{name}.logprobs")
    ver = s["ver"]
    if not isinstance(ver, bytes):
        raise RecordError("malformed", "versions must be packed bytes", field=f"{name}.versions")
    return tokens, logprobs, expand_versions(ver, len(tokens), f"{name}.versions")


def _partial_sample(s: dict[str, Any], name: str) -> PartialSample:
    tokens, logprobs, versions = _tokens(s, name)
    return PartialSample(tokens, logprobs, versions, finish_reason=s.get("finish"),
                         segments=_unpack_segments(s.get("seg"), f"{name}.segments"),
                         contexts=_contexts(s.get("ctx"), f"{name}.contexts"))


def _group(o: dict[str, Any]) -> GroupRecord:
    samples = []
    for i, s in enumerate(_list(o, "samples")):
        tokens, logprobs, versions = _tokens(s, f"samples[{i}]")
        segments = _unpack_segments(s.get("seg"), f"samples[{i}].segments")
        samples.append(Sample(tokens, logprobs, versions, reward=float(s["reward"]), finish_reason=_s(s, "finish"),
                              segments=segments, contexts=_contexts(s.get("ctx"), f"samples[{i}].contexts")))
    t = o.get("timings") or {}
    return GroupRecord(
        group_id=_s(o, "group_id"), run=_s(o, "run"), task=_s(o, "task"), attempt=_i(o, "attempt"),
        region=_s(o, "region"), node=_s(o, "node"),
        prompt_ids=_unpack_array(o["prompt_ids"], _I4, "prompt_ids"), samples=samples,
        timings=Timings(queued=float(t.get("queued", 0.0)), started=float(t.get("started", 0.0)),
                        finished=float(t.get("finished", 0.0))),
        reward_parts=_reward_parts(o.get("reward_parts")),
        eval=_eval_tag(o.get("eval")),
        regenerated=_regenerated(o.get("regen")),
    )


def _contexts(value: Any, field: str) -> list[tuple[int, IntArray]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("at"), int) for c in value):
        raise RecordError("malformed", "contexts must be a list of {at: int, p: <i4 array>}", field=field)
    return [(int(c["at"]), _unpack_array(c.get("p"), _I4, f"{field}[{j}]")) for j, c in enumerate(value)]


def _regenerated(value: Any) -> dict[str, int] | None:
    if value is not None and not isinstance(value, dict):
        raise RecordError("malformed", "regenerated must map regions to token counts", field="regenerated")
    return value


def _reward_parts(value: Any) -> dict[str, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise RecordError("malformed", "reward_parts must be a map of names to numbers", field="reward_parts")
    try:
        return {k: float(v) for k, v in value.items()}
    except (TypeError, ValueError):
        raise RecordError("malformed", "reward_parts must be a map of names to numbers", field="reward_parts") from None


def _s(o: dict[str, Any], key: str) -> str:
    v = o[key]
    if not isinstance(v, str):
        raise RecordError("malformed", f"expected a string, got {type(v).__name__}", field=key)
    return v


def _i(o: dict[str, Any], key: str) -> int:
    v = o.get(key, 0)
    if not isinstance(v, int) or isinstance(v, bool):
        raise RecordError("malformed", f"expected an integer, got {type(v).__name__}", field=key)
    return v


def _list(o: dict[str, Any], key: str) -> list[Any]:
    v = o[key]
    if not isinstance(v, list):
        raise RecordError("malformed", f"expected a list, got {type(v).__name__}", field=key)
    return v


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _missing(exc: Exception) -> str | None:
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else None
