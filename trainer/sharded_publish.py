"""Sharded publish under FSDP: each rank publishes the tensors it owns; rank 0 writes the manifest.

Rank 0 no longer gathers the model. Every tensor gets one owner rank (largest first, to the least
loaded rank; tied parameters share theirs); its FSDP shards (dim 0, as `fully_shard` cuts them) are
cast to the publish dtype where they live and gathered, as bytes, on the owner alone. Each rank then
hashes, encodes and uploads the parts of its tensors through its `ShardPublisher` (hub/sharded.py),
and rank 0 writes the manifest from every rank's entries. The collectives:

    broadcast (newest version) -> per tensor: gather to its owner -> all_gather (reports)
    -> gather (entries, to rank 0) -> broadcast (committed or not)

With one process every step is local and the result is a plain publish. It is a collective: every
rank calls `publish_sharded` with the same arguments, in the same order as its other collectives
(the learner names it with `ctx.command`, like a training step), so it runs between steps rather
than beside them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from fleetrl.hub import HubError, PublishedVersion, ShardPublisher, VersionConflict
from fleetrl.trainer.dist import DistContext


def assign_owners(state: dict[str, Any], world: int) -> dict[str, int]:
    """name -> owner rank: largest tensors first, each to the least loaded rank; names of one
    parameter (tied weights) share an owner. Deterministic, so every rank computes the same map."""
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    load = [0] * world
    owner: dict[str, int] = {}
    for names in sorted(groups.values(), key=lambda ns: (-state[ns[0]].numel(), ns[0])):
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += state[names[0]].numel()
        owner.update(dict.fromkeys(names, rank))
    return owner


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _gather_to(t: Any, owner: int, ctx: DistContext, dtype: torch.dtype) -> torch.Tensor | None:
    """The full tensor in `dtype` on `owner` (None on the other ranks), from its shards on every rank."""
    from torch.distributed.tensor import DTensor, Shard

    if not ctx.distributed or not isinstance(t, DTensor):
        full = t.detach().to(dtype, copy=True)
        return full if ctx.rank == owner else None
    if tuple(t.placements) != (Shard(0),):
        full = t.full_tensor().to(dtype)  # not FSDP's dim-0 shards: every rank gathers it
        return full if ctx.rank == owner else None
    rows, rest = t.shape[0], tuple(t.shape[1:])
    per = math.ceil(rows / ctx.world_size)
    local = t.to_local().detach().to(dtype)
    buf = torch.zeros((per, *rest), dtype=dtype)
    buf[: local.shape[0]] = local
    chunks = [torch.empty_like(_as_bytes(buf)) for _ in range(ctx.world_size)] if ctx.rank == owner else None
    dist.gather(_as_bytes(buf), chunks, dst=owner)  # bytes: exact, and any dtype gloo lacks
    if chunks is None:
        return None
    return torch.cat(chunks).view(dtype).reshape(ctx.world_size * per, *rest)[:rows].clone()


def gather_owned(model: torch.nn.Module, ctx: DistContext, dtype: torch.dtype) -> tuple[list[str], dict[str, Any]]:
    """The model's state-dict names in order, and the full tensors this rank owns (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    owners = assign_owners(state, ctx.world_size)
    owned: dict[str, Any] = {}
    first: dict[int, str] = {}
    for name, t in state.items():
        if id(t) in first:  # a tied name: the same tensor as its first name, same owner
            if first[id(t)] in owned:
                owned[name] = owned[first[id(t)]]
            continue
        first[id(t)] = name
        full = _gather_to(t, owners[name], ctx, dtype)
        if full is not None:
            owned[name] = full
    return list(state), owned


def publish_sharded(publisher: ShardPublisher, model: torch.nn.Module, ctx: DistContext, dtype: torch.dtype,
                    version: int | None = None) -> PublishedVersion | None:
    """Publish the model's weights in `dtype` as the next version (rank 0 returns it). With
    `version`, every rank raises VersionConflict unless that is the next version."""
    from fleetrl.hub.parent import newest
    from fleetrl.hub.publisher import read_latest

    order, owned = gather_owned(model, ctx, dtype)
    latest = ctx.command(newest(publisher.reader, read_latest(publisher.store, publisher.run))
                         if ctx.is_leader else None)
    nxt = 0 if latest is None else latest + 1
    if version is not None and version != nxt:
        raise VersionConflict(f"{publisher.store.where(publisher.run + '/latest')}: asked to publish version "
                              f"{version} but the next version is {nxt}")
    plan = publisher.plan(ctx.all_gather_objects(publisher.prepare(owned, latest)), order, latest)
    parts = ctx.gather_objects(publisher.encode(plan))
    pv: PublishedVersion | None = None
    error: HubError | None = None
    if parts is not None:
        try:
            pv = publisher.commit(plan, parts, order)
        except HubError as exc:
            error = exc
    committed = ctx.command(error is None)
    publisher.finish(plan, committed)
    if error is not None:
        raise error
    return pv
