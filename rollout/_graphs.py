"""Run a static-shape step function once per call, captured where the device allows it.

`StepGraphs.run(key, fn)` runs `fn` (a closure over fixed-size buffers: it reads its inputs from them
and writes its outputs into them, and returns nothing). What happens the first time a key is seen:

* `cuda`: `fn` runs once eagerly on a side stream (lazy initialisation of cuBLAS and friends, as
  `torch.cuda.graphs` asks), then is captured into a `torch.cuda.CUDAGraph` in a memory pool shared by
  every graph of the engine, and replayed. Every later call of the key only replays: one launch
  instead of ~1,000 host-side op dispatches (issue 37: 5.2 ms against 66-84 ms at batch 64).
* `record`: the CPU stand-in of capture. `fn` runs once under a dispatch mode that records every aten
  op it issues, with its arguments; a replay runs the recorded ops again with no Python of `fn` (the
  tensors that were made inside it replaced by the replay's own). Like a CUDA graph, everything `fn`
  decided in Python is frozen at capture: a replay sees the buffers' new contents only through tensor
  ops. An op that would break a real capture raises `CaptureError`: a host sync (`.item()`, `bool()`
  of a tensor), or an op whose output shape depends on tensor values (`nonzero`, boolean masks).
  The suite runs the engine's static step this way on CPU.
* `eager`: `fn` runs every time (CPU in production: there is no graph to save on the host).

Sharing one pool between graphs is safe because graphs replay one at a time on one stream and `fn`
keeps nothing that was allocated inside it: its results are copied into buffers made beforehand.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from fleetrl.rollout.errors import EngineError

GraphMode = Literal["cuda", "record", "eager"]


class CaptureError(EngineError):
    """A step function did something a CUDA graph cannot hold (a host sync, a data-dependent shape)."""


_UNCAPTURABLE = {
    "aten::_local_scalar_dense": "a host sync (.item(), bool() or int() of a tensor)",
    "aten::nonzero": "a data-dependent output shape (nonzero)",
    "aten::masked_select": "a data-dependent output shape (masked_select)",
    "aten::_unique2": "a data-dependent output shape (unique)",
    "aten::unique_consecutive": "a data-dependent output shape (unique_consecutive)",
    "aten::unique_dim": "a data-dependent output shape (unique)",
    "aten::repeat_interleave.Tensor": "a data-dependent output shape (repeat_interleave by a tensor)",
}


class _Recorder(TorchDispatchMode):
    """Runs and records the aten ops of one call (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, Any, Any, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name + ("." + func._overloadname if func._overloadname != "default" else "")
        why = _UNCAPTURABLE.get(name) or _UNCAPTURABLE.get(func._schema.name)
        if why is None and func._schema.name == "aten::index" and _bool_index(args):
            why = "a data-dependent output shape (indexing with a boolean mask)"
        if why is not None:
            raise CaptureError(f"the captured step function calls {name}: {why}")
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _bool_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class RecordedGraph:
    """The ops of one recorded call, replayed in order (the CPU stand-in of a CUDA graph)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        recorder = _Recorder()
        with recorder:
            fn()
        self._ops = recorder.ops  # holding the recorded outputs keeps their ids unique

    def replay(self) -> None:
        made: dict[int, Any] = {}

        def swap(x: Any) -> Any:
            return made.get(id(x), x) if isinstance(x, torch.Tensor) else x

        for func, args, kwargs, out in self._ops:
            new = func(*tree_map(swap, args), **tree_map(swap, kwargs))
            if isinstance(out, torch.Tensor):
                made[id(out)] = new
            elif isinstance(out, tuple | list):
                for old, fresh in zip(out, new, strict=True):
                    if isinstance(old, torch.Tensor):
                        made[id(old)] = fresh


class StepGraphs:
    """The engine's captured step functions, one per bucket key (see the module docstring)."""

    def __init__(self, mode: GraphMode, device: torch.device) -> None:
        if mode == "cuda" and device.type != "cuda":
            raise EngineError(f"CUDA graphs need a CUDA device, the engine runs on {device}")
        self.mode, self.device = mode, device
        self._graphs: dict[Hashable, Any] = {}
        self._pool: Any = None
        self.captures = 0
        """Graphs captured so far (the first call of each key; again after `clear`)."""
        self.replays: dict[Hashable, int] = {}
        """Calls of each key (captured or not)."""

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, fn: Callable[[], None]) -> None:
        self.replays[key] = self.replays.get(key, 0) + 1
        if self.mode == "eager":
            fn()
            return
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(fn)
            self.captures += 1
        graph.replay()

    def clear(self) -> None:
        """Forget every graph (the buffers they were captured over were replaced)."""
        self._graphs.clear()

    def _capture(self, fn: Callable[[], None]) -> Any:
        if self.mode == "record":
            return RecordedGraph(fn)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()  # warm-up: lazy inits happen outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a weight pull's copies) neither join nor break the capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            fn()
        return graph
