"""The rendezvous assignor (broker/assignor.py): balanced, moves little, and joins with the same
metadata every time, which is what keeps tansu from starting a new generation when a member of a
formed group joins again (checked against a real tansu at the end)."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
from aiokafka.structs import TopicPartition
from slowdown import scaled

from fleetrl.broker import Consumer, Producer, RecordLimits, ensure_topics, rollout_group
from fleetrl.broker.assignor import RendezvousAssignor, rendezvous
from fleetrl.config import FleetConfig

PARTS = [TopicPartition(t, i) for t in ("prompts", "partials") for i in range(16)]


def _members(n: int, trial: int = 0) -> list[str]:
    """Member ids as tansu makes them (`<client id>-<uuid>`), fixed so that the test is deterministic."""
    rng = random.Random(trial)
    return [f"fleetrl-rollout-r1-s{i}-{rng.getrandbits(128):032x}" for i in range(n)]


def _assign(members: list[str]) -> dict[str, list[TopicPartition]]:
    return rendezvous({m: {"prompts", "partials"} for m in members}, PARTS)


def _round_robin(members: list[str]) -> dict[str, list[TopicPartition]]:
    out: dict[str, list[TopicPartition]] = {m: [] for m in members}
    for member, tp in zip(itertools.cycle(sorted(members)), sorted(PARTS)):
        out[member].append(tp)
    return out


def _gained(before: dict[str, list[TopicPartition]], after: dict[str, list[TopicPartition]], stay: list[str]) -> int:
    """Partitions that members present before and after hold now and did not hold before."""
    return sum(tp not in before[m] for m in stay for tp in after[m])


@pytest.mark.parametrize("n", range(1, 8))
def test_every_partition_has_one_owner_and_each_topic_is_balanced(n: int) -> None:
    out = _assign(_members(n))
    owned = [tp for tps in out.values() for tp in tps]
    assert sorted(owned) == sorted(PARTS)  # each partition exactly once
    for topic in ("prompts", "partials"):
        counts = sorted(sum(tp.topic == topic for tp in tps) for tps in out.values())
        assert counts[-1] - counts[0] <= 1 and sum(counts) == 16, counts


def test_the_outcome_depends_on_the_members_not_on_their_order() -> None:
    members = _members(5)
    first = _assign(members)
    for order in (members[::-1], sorted(members), members[2:] + members[:2]):
        again = rendezvous({m: {"prompts", "partials"} for m in order}, reversed(PARTS))
        assert {m: sorted(v) for m, v in again.items()} == {m: sorted(v) for m, v in first.items()}


def test_a_topic_goes_only_to_its_subscribers() -> None:
    a, b, c = _members(3)
    out = rendezvous({a: {"prompts"}, b: {"prompts", "partials"}, c: {"partials"}}, PARTS)
    assert all(tp.topic == "prompts" for tp in out[a]) and all(tp.topic == "partials" for tp in out[c])
    assert sorted(tp for tps in out.values() for tp in tps) == sorted(PARTS)


def test_a_member_leaving_or_joining_moves_few_partitions_of_the_others() -> None:
    """Over 50 groups of five: a member leaving must move its own partitions, and a member joining its
    new share; beyond that rendezvous moves 3 of 32 on average (at most 6), where round robin moves 21."""
    extra = {"rendezvous": [], "round_robin": []}
    for trial in range(50):
        members = _members(5, trial)
        newcomer = f"fleetrl-rollout-r1-new-{trial}"
        for name, assign in (("rendezvous", _assign), ("round_robin", _round_robin)):
            full, fewer = assign(members), assign(members[1:])
            joined = assign([*members[1:], newcomer])
            extra[name].append(_gained(full, fewer, members[1:]) - len(full[members[0]]))  # beyond the orphans
            extra[name].append(_gained(fewer, joined, members[1:]))  # the stayers should gain nothing
    assert max(extra["rendezvous"]) <= 8 and sum(extra["rendezvous"]) / 100 <= 4
    assert sum(extra["round_robin"]) / 100 >= 15  # what the default of aiokafka does, for scale


def test_the_metadata_never_changes() -> None:
    """No user data: a member's JoinGroup metadata is its subscription, whatever it was assigned."""
    first = RendezvousAssignor.metadata(["prompts", "partials"])
    out = RendezvousAssignor.assign(_FakeCluster(), {m: first for m in _members(3)})
    for assignment in out.values():
        RendezvousAssignor.on_assignment(assignment)
        assert RendezvousAssignor.metadata(["partials", "prompts"]).encode() == first.encode()
    assert first.user_data == b""


class _FakeCluster:
    """The one method `assign` reads of aiokafka's ClusterMetadata."""

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {tp.partition for tp in PARTS if tp.topic == topic}


@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["rendezvous", "sticky"])
async def test_a_member_joining_again_starts_no_new_generation_on_tansu(
    fleet_config: FleetConfig, limits: RecordLimits, strategy: str
) -> None:
    """Member a of a formed group joins again (as after any rebalance it takes part in). With the
    rendezvous assignor its metadata is unchanged and tansu answers in the same generation: b goes on.
    With aiokafka's sticky assignor the metadata now carries a's assignment, and tansu starts a new
    generation that b must join too: in a group that changes members every few seconds, every such
    rejoin starts another rebalance (why the rollout group uses rendezvous)."""
    config = fleet_config.model_copy(update={"kafka": fleet_config.kafka.model_copy(
        update={"partition_assignment": strategy})})
    await ensure_topics(config, "r1")
    group = rollout_group(config.run)
    joins: list[int] = []  # a's completed joins (each ends with an assignment)
    async with Producer(config, "r1", "p") as producer, \
            Consumer(config, "r1", ["prompts"], group, limits, producer, "a", heartbeat_interval_s=0.3,
                     on_assigned=lambda _: joins.append(1)) as a, \
            Consumer(config, "r1", ["prompts"], group, limits, producer, "b", heartbeat_interval_s=0.3) as b:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + scaled(40)
        while not (a.assignment() and b.assignment()
                   and len(a.assignment() | b.assignment()) == config.kafka.partitions.prompts):
            assert loop.time() < deadline, "the group never settled"
            await asyncio.gather(a.poll(10, 0.2), b.poll(10, 0.2))
        generation, before = a._c._coordinator.generation, len(joins)
        a._c._coordinator.request_rejoin()
        deadline = loop.time() + scaled(40)
        while len(joins) == before:
            assert loop.time() < deadline, "a never joined again"
            await asyncio.gather(a.poll(10, 0.2), b.poll(10, 0.2))
        if strategy == "rendezvous":
            assert a._c._coordinator.generation == generation  # answered in the generation it had
        else:
            assert a._c._coordinator.generation > generation  # a new generation, which b must join too
