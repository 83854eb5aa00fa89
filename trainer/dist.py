"""The seam between one process and `torchrun`: rank, collectives, FSDP2 sharding, state dicts.

Everything distributed goes through torch.distributed's own collectives (broadcast_object_list,
scatter_object_list, all_reduce) and FSDP2 (`fully_shard`); with a world of one, each call is the
identity, so the learner and the trainer loop are one code path for a laptop and for a node of
GPUs. Rank 0 leads: it alone talks to Kafka, MQTT and the hub, and tells the other ranks what to
do next with `command`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fleetrl.log import get_logger

log = get_logger(__name__)


@dataclass(slots=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")  # noqa: RUF009 - an immutable default

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, device: str = "cpu") -> DistContext:
        """Join the process group when launched by torchrun (WORLD_SIZE > 1); gloo on CPU, nccl on CUDA."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(device=torch.device(device))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        rank = dist.get_rank()
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
        log.info("dist.joined", rank=rank, world_size=world, device=str(dev))
        return cls(rank=rank, world_size=world, device=dev)

    def command(self, cmd: Any = None) -> Any:
        """Rank 0 names the next collective operation; every rank returns it."""
        if not self.distributed:
            return cmd
        box = [cmd]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def scatter(self, parts: list[Any] | None) -> Any:
        """Rank 0's `parts[r]` lands on rank r."""
        if not self.distributed:
            assert parts is not None and len(parts) == 1
            return parts[0]
        out: list[Any] = [None]
        dist.scatter_object_list(out, parts if self.is_leader else None, src=0)
        return out[0]

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_leader else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2: each decoder layer its own unit, then the root (embeddings, head, norm)."""
        if not self.distributed:
            return model.to(self.device)
        from torch.distributed.fsdp import fully_shard

        model.to(self.device)
        for layer in _decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return model

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            # Sharded modules that outlive the process group, or a rank tearing gloo down while
            # its peer still talks to it, abort at exit ("terminate called without an active
            # exception"): callers drop their learner first; collect it, then meet, then leave.
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def get_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, ctx: DistContext,
              to_cpu: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Full (unsharded) state dicts, on the CPU unless `to_cpu` is False (one process only: then the
    model's own tensors); on ranks > 0 they are empty. Collective under FSDP."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=ctx.distributed, cpu_offload=to_cpu or ctx.distributed)
    msd = _trainable(model, get_model_state_dict(model, options=opts))
    osd = None if optimizer is None else get_optimizer_state_dict(model, optimizer, options=opts)
    return msd, osd


def _trainable(model: torch.nn.Module, msd: dict[str, Any]) -> dict[str, Any]:
    """The state dict without frozen parameters, where the model has some (a LoRA policy's base): they
    are no training state, and every start rebuilds them from the model's config."""
    if _all_trainable(model):
        return msd
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in msd.items() if k in trainable}


def _options(model: torch.nn.Module, **kwargs: Any) -> Any:
    """StateDictOptions that load a state dict without the frozen parameters `_trainable` left out."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=_all_trainable(model), **kwargs)


def _all_trainable(model: torch.nn.Module) -> bool:
    return all(p.requires_grad for p in model.parameters())


def set_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
    msd: dict[str, Any], osd: dict[str, Any] | None, ctx: DistContext,
) -> None:
    """Load full state dicts read by rank 0 into every rank (broadcast under FSDP).

    Ranks > 0 pass empty dicts (and `osd={}` when the leader loads an optimizer state, None when not).
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    opts = _options(model, full_state_dict=ctx.distributed, broadcast_from_rank0=ctx.distributed)
    set_model_state_dict(model, msd, options=opts)
    if optimizer is not None and osd is not None:
        set_optimizer_state_dict(model, optimizer, osd, options=opts)


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Each rank's own shards (DTensors under FSDP; whole tensors in one process), by FQN; the
    optimizer's lazily created state is initialized so that a load has every key to fill."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=False)
    return {"model": _trainable(model, get_model_state_dict(model, options=opts)),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=opts)}


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """torch.distributed.checkpoint: every rank writes (and fsyncs) its own shards under `path`,
    rank 0 the metadata; collective under FSDP, returns once all ranks' files are written."""
    import torch.distributed.checkpoint as dcp

    with single_process_dcp():
        dcp.save(_sharded_state(model, optimizer), checkpoint_id=path)


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Read back what `save_shards` wrote: each rank loads its own shards (resharded by DCP if the
    world size changed). Collective under FSDP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _sharded_state(model, optimizer)
    with single_process_dcp():
        dcp.load(state, checkpoint_id=path)
    opts = _options(model, full_state_dict=False)
    set_model_state_dict(model, state["model"], options=opts)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=opts)


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """torch.distributed.checkpoint warns on every save and load without a process group that it
    assumes one process: in one process that is exactly what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
        yield
