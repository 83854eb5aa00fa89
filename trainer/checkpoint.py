"""Checkpoints: everything exact resume needs, written atomically (DESIGN.md §3, issue 6).

A checkpoint is a folder `step-<N:09d>/` holding

    weights/         fp32 model and AdamW state as torch.distributed.checkpoint shards: every rank
                     writes (and fsyncs) its own file, rank 0 the metadata (trainer checkpoints)
    weights.pt       or: the same state unsharded, one torch.save file (`save`, older checkpoints)
    state.msgpack    run, step, version, the collector's ledger (bounded: `ledger.py`) and buffer, the dispatcher's
                     cursor and groups in flight, and the next offset of every (region, topic,
                     partition) the trainer consumed

It is written as `step-<N>.tmp/` (`begin`; the ranks write their shards into it), then rank 0
writes the state, fsyncs everything and renames the folder in one step and fsyncs the parent
(`commit`): a folder with the final name is always complete, whatever moment a SIGKILL hits any
rank. Kafka offsets are committed only after `commit` returns, so the committed offsets never run
ahead of the newest durable checkpoint. Under torchrun on several nodes, `checkpoint_dir` must be
a shared filesystem. `fleetrl audit` reads `state.msgpack` alone, without torch.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from dataclasses import dataclass
from typing import Any

import msgpack

from fleetrl.crashpoints import crash_point
from fleetrl.log import get_logger
from fleetrl.trainer.errors import CheckpointError

log = get_logger(__name__)

FORMAT = "fleetrl.trainer.checkpoint/2"
"""Format 2 adds the collector's folded ledger and settled watermarks (`ledger.py`); format 1
states (every ledger row detailed) are still read."""
READABLE_FORMATS = ("fleetrl.trainer.checkpoint/1", FORMAT)
STATE_FILE, WEIGHTS_FILE, WEIGHTS_DIR = "state.msgpack", "weights.pt", "weights"


@dataclass(slots=True)
class Checkpoint:
    path: pathlib.Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def shards(self) -> pathlib.Path | None:
        """The torch.distributed.checkpoint folder, when the weights are sharded."""
        folder = self.path / WEIGHTS_DIR
        return folder if folder.is_dir() else None

    def weights(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The full (unsharded) model and optimizer state, read in this process alone."""
        import torch

        try:
            if self.shards is not None:
                return _read_shards(self.shards)
            blob = torch.load(self.path / WEIGHTS_FILE, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a truncated or foreign file
            raise CheckpointError(f"checkpoint {self.path}: cannot load weights: {exc}") from exc
        return blob["model"], blob["optimizer"]


def _read_shards(folder: pathlib.Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full state of a sharded checkpoint in one process (tools and tests; the trainer itself
    loads each rank's shards with `Learner.load_shards`). Through a temporary torch.save file: DCP's
    public way to read a checkpoint without a model to load it into."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from fleetrl.trainer.dist import single_process_dcp

    with tempfile.TemporaryDirectory(prefix="fleetrl-ckpt-") as tmp, single_process_dcp():
        dcp_to_torch_save(folder, pathlib.Path(tmp) / "weights.pt")
        blob = torch.load(pathlib.Path(tmp) / "weights.pt", map_location="cpu", weights_only=True)
    return blob["model"], blob["optimizer"]


def begin(directory: str | os.PathLike[str], step: int) -> pathlib.Path:
    """A fresh temporary folder for the checkpoint of `step` (a leftover from a crash is replaced)."""
    root = pathlib.Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"step-{int(step):09d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:
        raise CheckpointError(f"cannot start checkpoint in {root}: {exc}", retriable=True) from exc
    return tmp


def commit(directory: str | os.PathLike[str], tmp: pathlib.Path, state: dict[str, Any], keep: int) -> pathlib.Path:
    """Write the state next to the weights in `tmp`, fsync, rename to the final name, prune all
    but the newest `keep`; returns the durable folder."""
    root = pathlib.Path(directory)
    final = root / tmp.name.removesuffix(".tmp")
    try:
        with open(tmp / STATE_FILE, "wb") as f:
            f.write(msgpack.packb({"format": FORMAT, **state}, use_bin_type=True))
            _sync(f)
        for folder in (tmp / WEIGHTS_DIR, tmp):
            if folder.is_dir():
                _sync_dir(folder)
        if final.exists():  # never replace a durable checkpoint: a crash mid-way would lose it
            raise CheckpointError(f"checkpoint {final} exists already; steps only move forward")
        crash_point("trainer.checkpoint.state_written")
        os.replace(tmp, final)
        _sync_dir(root)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {final}: {exc}", retriable=True) from exc
    _prune(root, keep)
    return final


def save(directory: str | os.PathLike[str], state: dict[str, Any], model: dict[str, Any],
         optimizer: dict[str, Any], keep: int) -> pathlib.Path:
    """Write a checkpoint of full (unsharded) state dicts atomically; returns its folder."""
    import torch

    tmp = begin(directory, int(state["step"]))
    try:
        with open(tmp / WEIGHTS_FILE, "wb") as f:
            torch.save({"model": model, "optimizer": optimizer}, f)
            _sync(f)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint weights {tmp / WEIGHTS_FILE}: {exc}", retriable=True) from exc
    return commit(directory, tmp, state, keep)


def amend_state(directory: str | os.PathLike[str], step: int, state: dict[str, Any]) -> pathlib.Path:
    """Replace the loop state of the durable checkpoint of `step` (its weights stay: same step), atomically:
    the state file is written beside the old one and renamed over it, so a crash leaves one or the other,
    each consistent with the weights. Used to record what settled after the step's checkpoint without a
    new step (the evaluations a draining trainer took in)."""
    folder = pathlib.Path(directory) / f"step-{int(step):09d}"
    tmp = folder / f"{STATE_FILE}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(msgpack.packb({"format": FORMAT, **state}, use_bin_type=True))
            _sync(f)
        os.replace(tmp, folder / STATE_FILE)
        _sync_dir(folder)
    except OSError as exc:
        raise CheckpointError(f"cannot amend checkpoint {folder}: {exc}", retriable=True) from exc
    return folder


def latest(directory: str | os.PathLike[str], run: str | None = None) -> Checkpoint | None:
    """The newest complete checkpoint, or None. Leftover `.tmp` folders are ignored."""
    root = pathlib.Path(directory)
    if not root.is_dir():
        return None
    folders = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    if not folders:
        return None
    ckpt = Checkpoint(folders[-1], read_state(folders[-1]))
    if run is not None and ckpt.state.get("run") != run:
        raise CheckpointError(f"checkpoint {ckpt.path} belongs to run {ckpt.state.get('run')!r}, not {run!r}")
    return ckpt


def read_state(folder: pathlib.Path) -> dict[str, Any]:
    try:
        state = msgpack.unpackb((folder / STATE_FILE).read_bytes(), raw=False, strict_map_key=False)
    except (OSError, ValueError, msgpack.ExtraData) as exc:
        raise CheckpointError(f"checkpoint {folder / STATE_FILE}: unreadable: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") not in READABLE_FORMATS:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"checkpoint {folder / STATE_FILE}: format {found!r} is not one this version "
                              f"reads ({', '.join(READABLE_FORMATS)})")
    return state


def _prune(root: pathlib.Path, keep: int) -> None:
    folders = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in folders[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
        log.debug("checkpoint.pruned", path=str(old))


def _sync(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())


def _sync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
