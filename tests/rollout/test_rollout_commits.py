"""`CommitQueue`: offsets move only past done work, in order; a rebalance's re-deliveries and moves."""

from __future__ import annotations

from fleetrl.broker import Delivery, PromptRecord, Sampling
from fleetrl.rollout.commits import CommitQueue


def _d(partition: int, offset: int) -> Delivery:
    record = PromptRecord(group_id=f"g{partition}-{offset}", run="r", task="reverse", n_samples=1,
                          sampling=Sampling(), prompt="ab")
    return Delivery("prompts-topic", partition, offset, None, record, {}, "prompts")


def test_only_the_done_prefix_is_handed_out_and_remembered() -> None:
    q = CommitQueue()
    a, b, c = _d(0, 0), _d(0, 1), _d(0, 2)
    for d in (a, b, c):
        q.owe(d)
    q.done(b)
    assert q.ready() == [] and q.owes(b)  # b waits behind a
    q.done(a)
    assert q.ready() == [a, b]
    assert not q.owes(a) and q.handed_out(a) and q.handed_out(b) and not q.handed_out(c) and q.owes(c)


def test_forget_drops_what_keep_refuses_and_a_late_done_of_it_is_ignored() -> None:
    q = CommitQueue()
    kept, moved, moved_later = _d(0, 5), _d(1, 7), _d(1, 8)
    for d in (kept, moved, moved_later):
        q.owe(d)
    assert q.forget(lambda d: d.partition == 0) == [moved, moved_later]
    assert q.outstanding() == 1 and not q.owes(moved)
    q.done(moved)  # its group finished after the partition went elsewhere: the new owner commits it
    q.done(kept)
    assert q.ready() == [kept] and q.outstanding() == 0


def test_handed_out_remembers_a_bounded_number() -> None:
    q = CommitQueue(remember=2)
    ds = [_d(0, i) for i in range(3)]
    for d in ds:
        q.owe(d)
        q.done(d)
    assert q.ready() == ds
    assert [q.handed_out(d) for d in ds] == [False, True, True]
