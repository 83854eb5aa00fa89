"""Model turns through the worker's engine: one-request-at-a-time callers beside the continuous batch.

Episodes (rollout/episodes.py) and the agent endpoint (rollout/openai_server.py) do not own groups
of the engine: they ask for one model turn at a time (a prompt, n samples) and wait for it. `EngineTurns`
queues such requests and hands each its finished samples: the worker's loop calls `sync` between two
engine steps (submitting queued turns, withdrawing cancelled ones; the engine is not stepping then)
and `deliver` with every group a step finished. `drive` is that loop alone, for a process that has
an engine and no Kafka (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fleetrl.broker import PartialSample, Sampling, floats, ids
from fleetrl.rollout.engine import Engine, FinishedGroup, GroupRequest
from fleetrl.rollout.errors import EngineError


class EngineTurns:
    """Turns waiting for or inside `engine`; `wake` tells the worker's loop that one arrived."""

    def __init__(self, engine: Engine, seed: int, wake: Callable[[], None] = lambda: None) -> None:
        self.engine, self.seed, self._wake = engine, seed, wake
        self._turns: dict[str, asyncio.Future[list[PartialSample]]] = {}  # request id -> its result
        self._queue: list[GroupRequest] = []  # turns to submit before the next step
        self._withdraw: list[str] = []  # turns of cancelled callers to take out before the next step

    def sync(self) -> None:
        """Between steps (the engine is not stepping): withdraw cancelled turns, submit new ones."""
        held = set(self.engine.group_ids()) if self._withdraw else set()
        for rid in self._withdraw:
            if rid in held:
                self.engine.take(rid)
        self._withdraw.clear()
        queue, self._queue = self._queue, []
        for request in queue:
            turn = self._turns.get(request.group_id)
            if turn is None or turn.done():
                continue
            try:
                self.engine.submit(request)
            except EngineError:  # the context is full: the turn is empty and ends its caller's episode
                turn.set_result([PartialSample(ids([]), floats([]), ids([]), "length")] * request.n_samples)

    def deliver(self, group: FinishedGroup) -> bool:
        """A group back from the engine: True when it is one of these turns (its caller takes it)."""
        turn = self._turns.get(group.group_id)
        if turn is None:
            return False
        if not turn.done():
            turn.set_result(group.samples)
        return True

    def abort(self, prefix: str) -> None:
        """Answer every waiting turn whose id starts with `prefix` with empty samples (finish `abort`): the
        worker took them out of the engine (a handover), and a caller that is not cancelled with them (an
        HTTP request of an agent run) must not wait forever."""
        for rid, turn in list(self._turns.items()):
            if rid.startswith(prefix) and not turn.done():
                turn.set_result([PartialSample(ids([]), floats([]), ids([]), "abort")])
        self._queue = [r for r in self._queue if not r.group_id.startswith(prefix)]

    def pending(self) -> bool:
        return bool(self._queue or self._withdraw)

    async def generate(self, request_id: str, context: list[int], sampling: Sampling, n: int = 1,
                       key: str | None = None) -> list[PartialSample]:
        """`n` samples continuing `context`, decoded by the engine beside everything else."""
        turn: asyncio.Future[list[PartialSample]] = asyncio.get_running_loop().create_future()
        self._turns[request_id] = turn
        self._queue.append(GroupRequest(request_id, context, sampling, n, seed=self.seed, key=key))
        self._wake()
        try:
            return await turn
        except asyncio.CancelledError:
            self._withdraw.append(request_id)
            raise
        finally:
            self._turns.pop(request_id, None)


async def drive(engine: Engine, turns: EngineTurns, stop: asyncio.Event, idle_s: float = 0.002) -> None:
    """The worker loop's part for turns alone: step the engine while it has work, until `stop`."""
    while not stop.is_set():
        turns.sync()
        if engine.has_work():
            for group in await asyncio.to_thread(engine.step):
                turns.deliver(group)
        else:
            await asyncio.sleep(idle_s)
