"""Checkpoints: everything exact resume needs, written atomically (DESIGN.md §3, issue 6).

A checkpoint is a folder `step-<N:09d>/` holding

    weights.pt       fp32 model and AdamW state (unsharded), torch.save
    state.msgpack    run, step, version, the collector's ledger and buffer, the dispatcher's
                     cursor and groups in flight, and the next offset of every (region, topic,
                     partition) the trainer consumed

It is written as `step-<N>.tmp/`, each file fsynced, then renamed in one step and the parent folder
fsynced: a folder with the final name is always complete, whatever moment a SIGKILL hits. Kafka
offsets are committed only after `save` returns, so the committed offsets never run ahead of the
newest durable checkpoint. `fleetrl audit` reads `state.msgpack` alone, without torch.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from dataclasses import dataclass
from typing import Any

import msgpack

from fleetrl.log import get_logger
from fleetrl.trainer.errors import CheckpointError

log = get_logger(__name__)

FORMAT = "fleetrl.trainer.checkpoint/1"
STATE_FILE, WEIGHTS_FILE = "state.msgpack", "weights.pt"


@dataclass(slots=True)
class Checkpoint:
    path: pathlib.Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def weights(self) -> tuple[dict[str, Any], dict[str, Any]]:
        import torch

        try:
            blob = torch.load(self.path / WEIGHTS_FILE, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a truncated or foreign file
            raise CheckpointError(f"checkpoint {self.path / WEIGHTS_FILE}: cannot load weights: {exc}") from exc
        return blob["model"], blob["optimizer"]


def save(directory: str | os.PathLike[str], state: dict[str, Any], model: dict[str, Any],
         optimizer: dict[str, Any], keep: int) -> pathlib.Path:
    """Write a checkpoint atomically and prune all but the newest `keep`; returns its folder."""
    import torch

    root = pathlib.Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{int(state['step']):09d}"
    final, tmp = root / name, root / f"{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with open(tmp / WEIGHTS_FILE, "wb") as f:
            torch.save({"model": model, "optimizer": optimizer}, f)
            _sync(f)
        with open(tmp / STATE_FILE, "wb") as f:
            f.write(msgpack.packb({"format": FORMAT, **state}, use_bin_type=True))
            _sync(f)
        if final.exists():  # never replace a durable checkpoint: a crash mid-way would lose it
            raise CheckpointError(f"checkpoint {final} exists already; steps only move forward")
        os.replace(tmp, final)
        _sync_dir(root)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {final}: {exc}", retriable=True) from exc
    _prune(root, keep)
    return final


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
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {folder / STATE_FILE}: not a {FORMAT} state")
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
