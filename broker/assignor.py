"""How a consumer group spreads partitions over its members: balanced rendezvous hashing.

A region of preemptible nodes changes its rollout group's members every few seconds. Two things make
such a group expensive: partitions that move (a moved partition re-delivers its uncommitted prompts to
the new owner) and rebalances that do not settle.

aiokafka's sticky assignor moves little, but it carries each member's last assignment in its
JoinGroup metadata, which therefore changes at every rebalance. tansu, the embedded broker, starts a
new generation whenever a member of a formed group joins with changed metadata, so in a churning group
members that rejoin after a rebalance start the next one: the cost bench saw rollout groups held in
rebalances for minutes. Round robin sends the same metadata every time but reshuffles nearly every
partition on each change.

This assignor sends the same metadata every time (the subscription, no user data) and still moves
little: every (member, partition) pair gets a pseudo-random weight from a hash of the member's id and
the partition, and partitions go to the members that weigh them most, in a balanced way (every member
gets the floor or the ceiling of partitions / members). A member's id is the one the broker gave it
for its life in the group, so the weights, and with them the assignment of the members that stay,
do not change when another member joins or leaves, except where balance needs them to.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Mapping

from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata
from aiokafka.structs import TopicPartition


def weight(member_id: str, tp: TopicPartition) -> int:
    """The member's pseudo-random preference for the partition (the same in every process)."""
    digest = hashlib.blake2b(f"{member_id}\0{tp.topic}\0{tp.partition}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous(
    members: Mapping[str, set[str]], partitions: Iterable[TopicPartition]
) -> dict[str, list[TopicPartition]]:
    """Partitions to members (member id -> the topics it subscribes): each partition of a topic goes to
    one member subscribed to it. With equal subscriptions every member gets the floor or the ceiling
    of partitions / members. Pairs are taken strongest weight first, each member up to the floor, then
    the rest up to the ceiling; the outcome depends only on the members and partitions, not on their
    order."""
    out: dict[str, list[TopicPartition]] = {m: [] for m in members}
    by_topic: dict[str, list[TopicPartition]] = defaultdict(list)
    for tp in sorted(set(partitions)):
        by_topic[tp.topic].append(tp)
    for topic, tps in sorted(by_topic.items()):
        subscribed = sorted(m for m, topics in members.items() if topic in topics)
        if not subscribed:
            continue
        # Balanced per topic, so that each member holds a share of every stream (prompts and partials)
        floor, extra = divmod(len(tps), len(subscribed))
        pairs = sorted(((weight(m, tp), m, tp) for m in subscribed for tp in tps), reverse=True)
        owner: dict[TopicPartition, str] = {}
        here: dict[str, int] = {m: 0 for m in subscribed}
        for cap in (floor, floor + 1):
            for _, m, tp in pairs:
                if tp in owner or here[m] >= cap:
                    continue
                if cap > floor:  # the ceiling: `extra` members, each one partition above the floor
                    if extra == 0:
                        break
                    extra -= 1
                owner[tp] = m
                here[m] += 1
        for tp, m in owner.items():
            out[m].append(tp)
    return out


class RendezvousAssignor(AbstractPartitionAssignor):
    """Balanced rendezvous hashing (this module's docstring), with metadata that never changes."""

    name = "fleetrl-rendezvous"
    version = 0

    @classmethod
    def assign(
        cls, cluster: ClusterMetadata, members: Mapping[str, ConsumerProtocolMemberMetadata]
    ) -> dict[str, ConsumerProtocolMemberAssignment]:
        subscriptions = {m: set(meta.subscription) for m, meta in members.items()}
        partitions = [TopicPartition(topic, p) for topic in set().union(*subscriptions.values())
                      for p in (cluster.partitions_for_topic(topic) or ())]
        out = {}
        for member, tps in rendezvous(subscriptions, partitions).items():
            topics: dict[str, list[int]] = defaultdict(list)
            for tp in tps:
                topics[tp.topic].append(tp.partition)
            layout = sorted((topic, sorted(ps)) for topic, ps in topics.items())
            out[member] = ConsumerProtocolMemberAssignment(cls.version, layout, b"")
        return out

    @classmethod
    def metadata(cls, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
        return ConsumerProtocolMemberMetadata(cls.version, sorted(topics), b"")

    @classmethod
    def on_assignment(cls, assignment: ConsumerProtocolMemberAssignment) -> None:
        pass
