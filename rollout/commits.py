"""In-order commits: a partition's offset moves only past groups whose effect is durable.

Groups finish out of order (a short group dispatched after a long one finishes first), while a
Kafka commit point covers every offset below it. `CommitQueue` remembers, per partition, the
deliveries this worker still owes an effect for, in offset order, and hands out only the prefix
that is done; the consumer then commits one past the last of them (DESIGN.md §3, at-least-once).
`Committer` is the worker's side of it: the queue, the consumer, and one commit at a time.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable

from fleetrl.broker import Consumer, Delivery, KafkaError
from fleetrl.crashpoints import crash_point
from fleetrl.log import get_logger

log = get_logger(__name__)

TP = tuple[str, int]


class CommitQueue:
    def __init__(self, remember: int = 4096) -> None:
        self._owed: dict[TP, OrderedDict[int, tuple[Delivery, bool]]] = {}
        self._handed: OrderedDict[tuple[TP, int], None] = OrderedDict()
        self._remember = remember

    def owe(self, d: Delivery) -> None:
        """A delivery was taken on; its offset may not be committed until `done(d)`."""
        self._owed.setdefault(d.tp, OrderedDict())[d.offset] = (d, False)

    def done(self, d: Delivery) -> None:
        """The delivery's effect (a produced record) is acknowledged. One forgotten meanwhile (its
        partition moved to another member) stays forgotten: its new owner commits it."""
        queue = self._owed.get(d.tp)
        if queue is not None and d.offset in queue:
            queue[d.offset] = (d, True)

    def owes(self, d: Delivery) -> bool:
        """This record was taken on and not yet handed out for commit (a re-delivery of it is the same work)."""
        return d.offset in self._owed.get(d.tp, ())

    def handed_out(self, d: Delivery) -> bool:
        """This record's effect was durable and its offset handed out for commit: a re-delivery (the commit
        lost to a rebalance) needs no work, only the commit (the last `remember` records)."""
        return (d.tp, d.offset) in self._handed

    def forget(self, keep: Callable[[Delivery], bool]) -> list[Delivery]:
        """Drop the owed deliveries `keep` refuses (their partition went to another member, which reads
        them again from the committed offset); returns them."""
        dropped = []
        for queue in self._owed.values():
            for offset, (d, _) in list(queue.items()):
                if not keep(d):
                    dropped.append(d)
                    del queue[offset]
        return dropped

    def ready(self) -> list[Delivery]:
        """Deliveries that may be committed now (each partition's done prefix); forgets them."""
        out: list[Delivery] = []
        for queue in self._owed.values():
            for offset in sorted(queue):
                delivery, finished = queue[offset]
                if not finished:
                    break
                out.append(delivery)
                del queue[offset]
                self._handed[(delivery.tp, offset)] = None
        while len(self._handed) > self._remember:
            self._handed.popitem(last=False)
        return out

    def outstanding(self) -> int:
        return sum(len(q) for q in self._owed.values())


class Committer:
    """The worker's commits: a delivery's offset moves once its effect is durable, one commit at a time.

    `consumer` is set when the worker opens it (before the first delivery is taken on)."""

    consumer: Consumer

    def __init__(self) -> None:
        self.queue = CommitQueue()
        self._lock = asyncio.Lock()

    async def done(self, d: Delivery) -> None:
        """The delivery's effect is acknowledged: commit every partition's done prefix."""
        self.queue.done(d)
        async with self._lock:
            ready = self.queue.ready()
            if ready:
                await self.consumer.commit(ready)
                crash_point("rollout.offsets.committed")

    async def past_dead_letters(self) -> None:
        """Commit past dead letters now, up to the first offset still owed an effect: otherwise a worker
        that completes no further group on that partition would leave them to be re-read and
        dead-lettered again by whoever reads it next."""
        try:
            async with self._lock:
                await self.consumer.commit([])
        except KafkaError as exc:  # the dead letters are safe in their topic; at worst they are re-read
            log.warning("worker.dead_letter_commit_failed", error=str(exc))
