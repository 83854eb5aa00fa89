"""The consumer's place in its group: the assignment strategy, the rebalance callbacks, leaving.

`consumer.py` joins its group with the strategy of `kafka.partition_assignment` (`assignor`), hears
each revocation and assignment through `RebalanceListener` (it forgets a revoked partition's offsets
and applies the seeks waiting for an assigned one), and on close leaves the group explicitly where
aiokafka would not (`leave_generation_zero`: tansu's first generation is 0).
"""

from __future__ import annotations

from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.assignors.sticky.sticky_assignor import StickyPartitionAssignor
from aiokafka.protocol.group import LeaveGroupRequest

from fleetrl.broker.assignor import RendezvousAssignor
from fleetrl.broker.clients import bounded
from fleetrl.broker.errors import KafkaError
from fleetrl.log import get_logger

log = get_logger(__name__)
Partitions = Callable[[set[TopicPartition]], None]


def assignor(kind: str, client_id: str) -> type[AbstractPartitionAssignor]:
    """The group's assignment strategy (`kafka.partition_assignment`; rendezvous: broker/assignor.py).
    aiokafka's sticky assignor keeps the member's last assignment and generation on the class, so each
    consumer gets a subclass of its own: two consumers of one process (tests, a trainer's several
    groups) would otherwise describe each other's partitions."""
    if kind == "round_robin":
        return RoundRobinPartitionAssignor
    if kind == "rendezvous":
        return RendezvousAssignor
    return type(f"Sticky_{client_id}", (StickyPartitionAssignor,), {})


class RebalanceListener(ConsumerRebalanceListener):
    """Forwards aiokafka's rebalance callbacks to the owning consumer's."""

    def __init__(self, on_revoked: Partitions, on_assigned: Partitions) -> None:
        self._on_revoked, self._on_assigned = on_revoked, on_assigned

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._on_assigned(assigned)


async def leave_generation_zero(consumer: AIOKafkaConsumer, timeout_s: float, group: str, client_id: str) -> None:
    """Leave the group explicitly when its generation is 0.

    tansu numbers a group's first generation 0 where Kafka starts at 1, and aiokafka sends
    LeaveGroup only from generation > 0: without this, the next member to join waits a whole
    session timeout for this one to expire.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None or getattr(coordinator, "generation", -1) != 0:
        return
    request = LeaveGroupRequest(coordinator.group_id, coordinator.member_id)
    try:
        await bounded(coordinator._send_req(request), timeout_s, f"leave group {group!r}")
    except KafkaError as exc:
        log.warning("consumer.leave_failed", group=group, client_id=client_id, error=str(exc))
    coordinator.reset_generation()
