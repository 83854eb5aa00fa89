"""The bounded ledger: folded index ranges, settled watermarks, checkpoint size, and the audit's use of them."""

from __future__ import annotations

import pathlib
import random

import pytest
from trainer_groups import make_group

from fleetrl.broker import encode_record
from fleetrl.trainer import checkpoint
from fleetrl.trainer.audit import TopicView, reconcile
from fleetrl.trainer.collector import Collector
from fleetrl.trainer.errors import CheckpointError
from fleetrl.trainer.ledger import IndexRanges, group_index

RUN = "r"
PARTITIONS = 4


def gid(i: int) -> str:
    return f"{RUN}-{i:09d}"


def test_index_ranges_merge_and_refuse_overlaps() -> None:
    r = IndexRanges()
    for i in (0, 2, 1, 5, 4, 9):
        assert r.add(i)
    assert not r.add(1)
    assert r.rows() == [[0, 3], [4, 6], [9, 10]] and len(r) == 6
    assert 4 in r and 3 not in r and 10 not in r
    assert r.covers_below(3) and not r.covers_below(4)
    assert IndexRanges.from_rows(r.rows()).rows() == r.rows()
    with pytest.raises(ValueError, match="overlaps"):
        IndexRanges.from_rows([[0, 3], [2, 5]])


def test_group_index_only_for_dispatcher_ids() -> None:
    assert group_index("r-000000042", "r") == 42
    assert group_index("r-x1", "r") is None and group_index("other-000000001", "r") is None


def _run(n: int, tmp: pathlib.Path, stuck: int | None = None) -> tuple[Collector, pathlib.Path]:
    """`n` groups dispatched round-robin over the partitions and settled in order (one in 20 stale),
    except `stuck` (dead-lettered, never settles); a checkpoint state written with checkpoint.commit."""
    rng = random.Random(0)
    c = Collector(RUN, max_staleness=1, ledger_detail_groups=256)
    offsets = [0] * PARTITIONS
    for i in range(n):
        p = i % PARTITIONS
        c.note_dispatched(gid(i), "a", p, offsets[p])
        offsets[p] += 1
        if i == stuck:
            continue
        g = make_group(gid(i), RUN, version=0 if rng.random() < 0.05 else 5, n=2)
        assert c.offer(g, version=5) in ("accepted", "stale")
        batch, _ = c.take(1, version=5)
        c.mark_trained(batch, step=i, version=5)
    tmp.mkdir()
    folder = checkpoint.commit(tmp, checkpoint.begin(tmp, 1), {"run": RUN, "step": 1, "collector": c.state()}, keep=1)
    return c, folder / checkpoint.STATE_FILE


def test_checkpoint_after_20000_groups_within_2x_of_2000(tmp_path: pathlib.Path) -> None:
    _, small_file = _run(2_000, tmp_path / "small", stuck=7)
    big, big_file = _run(20_000, tmp_path / "big", stuck=7)
    small_bytes, big_bytes = small_file.stat().st_size, big_file.stat().st_size
    print(f"ledger state bytes: 2000 groups {small_bytes}, 20000 groups {big_bytes}, "
          f"ratio {big_bytes / small_bytes:.2f}")
    assert big_bytes <= 2 * small_bytes
    # Nothing is forgotten: every group is still settled (a redelivery is a duplicate), the counts add up.
    assert big.ledger.trained_count + big.ledger.stale_count == 20_000 - 1
    assert big.ledger.stale_count > 500 and len(big.trained) <= 256
    again = make_group(gid(3), RUN, version=5, n=2)
    assert big.offer(again, version=5) == "duplicate"
    stuck = make_group(gid(7), RUN, version=5, n=2)
    assert big.offer(stuck, version=5) == "accepted"  # the dead-lettered one may still arrive, once


def test_watermark_stops_at_an_unsettled_group_in_its_partition_only(tmp_path: pathlib.Path) -> None:
    c, state_file = _run(2_000, tmp_path / "ck", stuck=7)
    marks = checkpoint.read_state(state_file.parent)["collector"]["ledger"]["watermarks"]
    # group 7 went to partition 3 at offset 1: that partition's watermark waits for it; the others
    # are past everything folded (their oldest unfolded group is among the newest 256 rows)
    by_p = dict(marks["a"])
    assert by_p[3] == 1
    assert all(400 < by_p[p] <= 500 for p in (0, 1, 2))
    # once the stuck group settles and is folded, its partition moves on, never back
    c.ledger.detail_groups = 1
    for i in (7, 2_000):
        c.note_dispatched(gid(i), "a", 0, 500) if i == 2_000 else None
        c.offer(make_group(gid(i), RUN, version=5, n=2), version=5)
        c.mark_trained(c.take(1, 5)[0], step=9_999 + i, version=5)
    after = dict(c.state()["ledger"]["watermarks"]["a"])
    assert after[3] == 500 and all(after[p] >= by_p[p] for p in by_p)


def test_restore_round_trip_and_format_1(tmp_path: pathlib.Path) -> None:
    c, _ = _run(3_000, tmp_path / "ck")
    state = c.state()
    back = Collector(RUN, 1, ledger_detail_groups=256)
    back.restore(state)
    assert back.state()["ledger"] == state["ledger"] and back.ledger.trained_count == c.ledger.trained_count
    # A format-1 state (every row detailed, no positions): no watermark until everything drawn
    # before the resume is folded.
    old = {"trained": [[gid(i), 0, "a", i, 5, 0] for i in range(10)], "stale": {}, "pending": [], "duplicates": 0}
    legacy = Collector(RUN, 1, ledger_detail_groups=1)
    legacy.restore(old, drawn=12)
    assert legacy.state()["ledger"]["watermarks"] == {}
    for i in (10, 11, 12):
        legacy.note_dispatched(gid(i), "a", 0, 100 + i)
        assert legacy.state()["ledger"]["watermarks"] == {}  # 10 and 11 were drawn before the resume
        legacy.offer(make_group(gid(i), RUN, version=5, n=2), version=5)
        legacy.mark_trained(legacy.take(1, 5)[0], step=20 + i, version=5)
    legacy.note_dispatched(gid(13), "a", 0, 113)  # in flight
    assert legacy.state()["ledger"]["watermarks"] == {"a": [[0, 112]]}  # 12's row is still detailed
    bad = dict(state, ledger={**state["ledger"], "folded_trained": 1})
    with pytest.raises(CheckpointError, match="folded groups"):
        Collector(RUN, 1).restore(bad)


def _view(dispatched: list[int], start: int = 0, watermark: int = 0) -> TopicView:
    view = TopicView(dispatched={gid(i): [("a", 0)] for i in dispatched})
    view.log_starts, view.read_from = {"a": {0: start}}, {"a": {0: watermark}}
    return view


def _state(c: Collector, drawn: int) -> dict[str, object]:
    return {"step": 3, "collector": c.state(), "dispatcher": {"next_index": drawn, "in_flight": {}}}


def test_audit_counts_folded_groups_and_catches_rows_inside_them(tmp_path: pathlib.Path) -> None:
    c, _ = _run(600, tmp_path / "ck")
    state = _state(c, 600)
    report = reconcile(_view(list(range(300, 600)), watermark=75), state, RUN)
    assert report.ok, report.problems()
    assert report.trained + report.stale == 600 and report.settled_folded == 600 - 256 - len(c.stale)
    assert report.watermarks == {"a": {str(p): o for p, o in state["collector"]["ledger"]["watermarks"]["a"]}}
    # A detailed trained row of a group the ranges already hold: trained twice.
    twice = dict(state, collector={**state["collector"],
                                   "trained": [*state["collector"]["trained"], [gid(0), 1, "a", 99, 5, 0]]})
    assert reconcile(_view([]), twice, RUN).trained_twice == [gid(0)]
    # Counts that do not match the ranges: the ledger is not to be trusted.
    ledger = state["collector"]["ledger"]
    lying_ledger = {**ledger, "folded_trained": ledger["folded_trained"] + 1}
    lying = dict(state, collector={**state["collector"], "ledger": lying_ledger})
    assert any("folded groups" in p for p in reconcile(_view([]), lying, RUN).problems())


def test_audit_fails_when_retention_cut_above_the_watermark(tmp_path: pathlib.Path) -> None:
    c, _ = _run(40, tmp_path / "ck")
    state = _state(c, 40)
    everything = list(range(40))
    assert reconcile(_view(everything, start=5, watermark=5), state, RUN).ok  # cut exactly at it: fine
    cut = reconcile(_view(everything, start=6, watermark=5), state, RUN)
    assert not cut.ok and cut.cut_by_retention == ["a prompts partition 0: log starts at 6, watermark 5"]


def test_pending_groups_survive_a_checkpoint() -> None:
    c = Collector(RUN, 1)
    g = make_group(gid(1), RUN, version=5, n=2)
    c.offer(g, version=5)
    back = Collector(RUN, 1)
    back.restore(c.state())
    assert list(back.pending) == [gid(1)] and encode_record(back.pending[gid(1)]) == encode_record(g)


def test_a_copy_arriving_while_its_group_is_in_the_running_step_is_a_duplicate() -> None:
    """The trainer takes arrivals in while the learner steps: a redelivered copy of a group the step
    took must not be buffered again (it would be trained twice); given back, the group is buffered."""
    c = Collector(RUN, 1)
    a, b = make_group(gid(1), RUN, version=5, n=2), make_group(gid(2), RUN, version=5, n=2)
    c.offer(a, version=5)
    c.offer(b, version=5)
    batch, _ = c.take(1, version=5)
    assert [g.group_id for g in batch] == [gid(1)] and c.is_resolved(gid(1))
    assert c.offer(make_group(gid(1), RUN, version=5, n=2), version=5) == "duplicate"
    assert list(c.pending) == [gid(2)]
    c.mark_trained(batch, step=1, version=5)
    assert c.in_step == {} and c.offer(make_group(gid(1), RUN, version=5, n=2), version=5) == "duplicate"
    batch, _ = c.take(1, version=5)
    c.give_back(batch)
    assert c.in_step == {} and list(c.pending) == [gid(2)]


def test_a_group_a_killed_trainer_dispatched_after_its_checkpoint_is_folded_at_once() -> None:
    """The trainer checkpoints after dispatching groups 0-7, dispatches 8 and 9 (offsets 2 of
    partitions 0 and 1) and is killed. Restarted from the checkpoint, it trains 8 when its trajectory
    arrives without sending its prompt again: it cannot know where that record lies, only that it is
    somewhere at or after the checkpoint's end of its partition. The next checkpoint folds 8 at once,
    however new, so no watermark needs to wait for its record (the audit would otherwise look for it):
    holding the watermarks at the resumed ends until 8 folded in its turn kept them there for good
    when the trainer restarted before `detail_groups` newer groups settled."""
    c = Collector(RUN, max_staleness=1, ledger_detail_groups=2)
    for i in range(8):
        c.note_dispatched(gid(i), "a", i % 2, i // 2)
    for i in range(8):
        assert c.offer(make_group(gid(i), RUN, version=5, n=2), version=5) == "accepted"
        batch, _ = c.take(1, version=5)
        c.mark_trained(batch, step=i, version=5)
    state = c.state()
    assert state["ledger"]["ends"] == {"a": [[0, 4], [1, 4]]}
    restarted = Collector(RUN, max_staleness=1, ledger_detail_groups=4)
    restarted.restore(state, drawn=8)
    assert restarted.offer(make_group(gid(8), RUN, version=5, n=2), version=5) == "accepted"  # unplaced
    for i in range(9, 14):  # prompts the restarted trainer sends itself, far past the checkpoint's ends
        restarted.note_dispatched(gid(i), "a", i % 2, 10 + i)
    batch, _ = restarted.take(1, version=5)
    restarted.mark_trained(batch, step=9, version=5)
    for i in range(9, 11):
        restarted.offer(make_group(gid(i), RUN, version=5, n=2), version=5)
        batch, _ = restarted.take(1, version=5)
        restarted.mark_trained(batch, step=i + 1, version=5)
    assert restarted.ledger.unplaced == {gid(8)}
    # The checkpoint folds 8 although it is among the newest rows (detail_groups 4: 6 is folded as the
    # oldest), so the watermark of partition 0 moves past the checkpoint's end (4) to the oldest record of
    # a group not folded (10, at 20); partition 1 stays at 7's record, still a detail row.
    ledger = restarted.state()["ledger"]
    assert group_index(gid(8), RUN) in restarted.ledger.folded and not restarted.ledger.unplaced
    assert [e.group_id for e in restarted.ledger.trained] == [gid(7), gid(9), gid(10)]
    assert ledger["watermarks"] == {"a": [[0, 20], [1, 3]]}, ledger["watermarks"]
    again = Collector(RUN, max_staleness=1, ledger_detail_groups=4)  # and a restart keeps them there
    again.restore(restarted.state(), drawn=14)
    assert again.state()["ledger"]["watermarks"] == {"a": [[0, 20], [1, 3]]}
    assert again.ledger.settled(gid(8))  # and 8 is still known as trained: it will not be trained again


def test_prompts_of_ids_the_trainer_never_issues_are_reported_apart_not_lost() -> None:
    """A fuzzer's prompt record (run's topic, foreign id) was never dispatched by the trainer: the
    audit reports it apart; a dispatcher id with no trace anywhere is still lost."""
    c = Collector(RUN, max_staleness=1)
    view = TopicView(dispatched={gid(0): [("a", 0)], "fuzz-nan-7": [("a", 0)], gid(1): [("a", 0)]})
    c.note_dispatched(gid(0), "a", 0, 0)
    c.note_dispatched(gid(1), "a", 0, 1)
    assert c.offer(make_group(gid(0), RUN, version=5, n=2), version=5) == "accepted"
    batch, _ = c.take(1, version=5)
    c.mark_trained(batch, step=1, version=5)
    state = {"step": 1, "collector": c.state(), "dispatcher": {"next_index": 2, "in_flight": {}}}
    report = reconcile(view, state, RUN)
    assert report.foreign_prompts == 1 and report.dispatched == 2
    assert report.lost == [gid(1)] and not report.ok


@pytest.mark.parametrize("restarted_after_a_dead_one", [True, False])
def test_groups_a_trainer_killed_before_its_first_checkpoint_dispatched_are_unplaced(
        restarted_after_a_dead_one: bool) -> None:
    """A first trainer dispatched groups 0-3 (partition 0, offsets 0-3) and died before any checkpoint.
    Its successor starts from nothing: it sends 0 and 1 again (offsets 4 and 5) and trains them, and
    trains 2 and 3 when the dead one's trajectories arrive, without sending them (they are settled).
    Told that it restarted, its ledger folds 2 and 3 (unplaced) and the audit, reading from the
    watermark, balances; a first start that misses this keeps them detailed with no place, the
    watermark passes over their records, and the audit finds them trained but never dispatched."""
    c = Collector(RUN, max_staleness=1, ledger_detail_groups=64)
    if restarted_after_a_dead_one:
        c.ledger.restarted_without_checkpoint()
    for i in (0, 1):
        c.note_dispatched(gid(i), "a", 0, 4 + i)
    for i in range(4):
        assert c.offer(make_group(gid(i), RUN, version=0, n=2), version=0) == "accepted"
    batch, _ = c.take(4, version=0)
    c.mark_trained(batch, step=1, version=0)
    state = {"step": 1, "collector": c.state(), "dispatcher": {"next_index": 4, "in_flight": {}}}
    mark = state["collector"]["ledger"]["watermarks"]["a"][0][1]
    # what the audit reads from the watermark on: the successor's records at 4 and 5, the dead one's below
    records = {0: gid(0), 1: gid(1), 2: gid(2), 3: gid(3), 4: gid(0), 5: gid(1)}
    view = TopicView(dispatched={g: [("a", 0)] for o, g in records.items() if o >= mark},
                     read_from={"a": {0: mark}}, log_starts={"a": {0: 0}})
    report = reconcile(view, state, RUN)
    if restarted_after_a_dead_one:
        assert report.ok and report.trained == 4, report.problems()
    else:
        assert report.trained_not_dispatched == [gid(2), gid(3)]


def test_staleness_counts_steps_along_the_weights_lineage_across_republishes() -> None:
    """A trainer checkpointed at version 10, published 11 and 12, and died; its restart republished the
    checkpoint's weights as 13. Groups made with 10 are as fresh at 13 as at 10; groups made with 11 and
    12 came from weights now lost, 1 and 2 steps off the checkpoint. A second restart (checkpoint at
    15, versions 16-17 lost, republished as 18) chains on the first. The pairs survive a checkpoint."""
    c = Collector(RUN, max_staleness=1)  # a lag over 2 is stale
    assert c.lag_of(10, 13) == 3  # no republish: version numbers
    c.note_republished(13, 10)
    assert [c.lag_of(m, 13) for m in (8, 9, 10, 11, 12, 13)] == [2, 1, 0, 1, 2, 0]
    assert [c.lag_of(m, 15) for m in (10, 12, 13, 14, 15)] == [2, 4, 2, 1, 0]
    assert c.lag_of(10, 12) == 2  # asked about a version before the republish: plain numbers
    assert c.offer(make_group(gid(1), RUN, version=10), 13) == "accepted"  # was stale by numbers (lag 3)
    assert c.offer(make_group(gid(2), RUN, version=12), 14) == "stale"  # 2 lost steps + 1 step since

    c.note_republished(18, 15)
    assert [c.lag_of(m, 18) for m in (10, 13, 15, 16, 17)] == [2, 2, 0, 1, 2]
    assert c.lag_of(12, 19) == 1 + 0 + (15 - 13) + 2  # 18->19, 15=18, 13->15, lost 10->12
    back = Collector(RUN, max_staleness=1)
    back.restore(c.state())
    assert back.republished == [(13, 10), (18, 15)] and back.lag_of(10, 18) == 2
    with pytest.raises(ValueError, match="republished version 18"):
        back.note_republished(18, 17)
