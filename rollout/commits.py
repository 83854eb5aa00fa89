"""In-order commits: a partition's offset moves only past groups whose effect is durable.

Groups finish out of order (a short group dispatched after a long one finishes first), while a
Kafka commit point covers every offset below it. `CommitQueue` remembers, per partition, the
deliveries this worker still owes an effect for, in offset order, and hands out only the prefix
that is done; the consumer then commits one past the last of them (DESIGN.md §3, at-least-once).
"""

from __future__ import annotations

from collections import OrderedDict

from fleetrl.broker import Delivery

TP = tuple[str, int]


class CommitQueue:
    def __init__(self) -> None:
        self._owed: dict[TP, OrderedDict[int, tuple[Delivery, bool]]] = {}

    def owe(self, d: Delivery) -> None:
        """A delivery was taken on; its offset may not be committed until `done(d)`."""
        self._owed.setdefault(d.tp, OrderedDict())[d.offset] = (d, False)

    def done(self, d: Delivery) -> None:
        """The delivery's effect (a produced record) is acknowledged."""
        self._owed[d.tp][d.offset] = (d, True)

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
        return out

    def outstanding(self) -> int:
        return sum(len(q) for q in self._owed.values())
