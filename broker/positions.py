"""Where a consumer stands in the partitions it holds: read positions, backlog, lag.

The consumer (`consumer.py`) asks these of its aiokafka client: whether a stream has records past
this member's read position (`has_backlog`: priority polling, and a trainer's handover reading to
the end), and how many records wait in what it holds (`lag`). A partition a rebalance revoked while
one of these awaited is skipped: its new owner answers for it.
"""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import IllegalStateError

from fleetrl.broker.clients import bounded, translated


async def position(c: AIOKafkaConsumer, tp: TopicPartition, timeout_s: float) -> int | None:
    """This member's read position in `tp`; None once a rebalance has revoked it (its new owner reads it)."""

    async def held() -> int | None:
        try:
            return await c.position(tp)
        except IllegalStateError:  # caught before bounded() turns it into a KafkaError
            return None

    return await bounded(held(), timeout_s, "position")


async def has_backlog(c: AIOKafkaConsumer, tps: list[TopicPartition], timeout_s: float) -> bool:
    """Whether any of `tps` holds records past this member's read position, as of now: the end is
    asked of the broker (ListOffsets) when this is called, so it covers every record acknowledged
    before the call."""
    with translated(f"read end offsets of {tps[0].topic}"):
        ends = await bounded(c.end_offsets(tps), timeout_s, "end offsets")
        for tp in tps:
            if tp not in c.assignment():  # revoked during an await (aiokafka asserts on it)
                continue
            # tansu with S3 storage under-reports ListOffsets; the fetched high watermark is right.
            end = max(ends[tp], c.highwater(tp) or 0)
            at = await position(c, tp, timeout_s)
            if at is not None and at < end:
                return True
    return False


async def lag(c: AIOKafkaConsumer, timeout_s: float) -> int | None:
    """Records waiting in the partitions `c` holds: log end minus read position, summed.

    None while no fetch has answered for any of them (nothing is known yet). It costs no request:
    the log end is the high watermark each fetch response carries (right where tansu's
    ListOffsets is not, see `fleetrl.broker.lag`), and a fetched partition's position is local.
    Unlike `fleetrl topics lag` (end - committed), records read but not yet committed do not count.
    """
    total: int | None = None
    for tp in c.assignment():
        if tp not in c.assignment():  # revoked during the await of an earlier one
            continue
        end = c.highwater(tp)
        if end is None:
            continue
        at = await position(c, tp, timeout_s)
        if at is None:  # revoked by a rebalance meanwhile: its new owner reports it
            continue
        total = (total or 0) + max(0, end - at)
    return total
