"""Length-aware placement: the dispatcher weighs each group by its prompt's predicted completion length."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleetrl.broker import PromptRecord
from fleetrl.config import FleetConfig
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.dispatcher import Dispatcher
from fleetrl.trainer.lengths import PromptLengths, content_key

LONG, SHORT = ("reverse", "long=", "gnol"), ("reverse", "s=", "s")


def _config(length_aware: bool) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": "len", "algorithm": {"max_staleness": 4, "groups_per_step": 8, "n_samples": 2},
        "rollout": {"length_aware": length_aware},
        "regions": [{"name": r, "kafka": "127.0.0.1:9092", "store": f"/tmp/{r}"} for r in ("a", "b")],
    })


def test_prompt_lengths_predict_relative_work() -> None:
    lengths = PromptLengths(max_prompts=2)
    long_key, short_key = content_key(*LONG[:2], None), content_key(*SHORT[:2], None)
    assert lengths.relative_work(long_key) == 1.0  # nothing seen yet
    lengths.observe(long_key, 60.0)
    lengths.observe(short_key, 4.0)
    assert lengths.relative_work(long_key) == pytest.approx(60 / 32)
    assert lengths.relative_work(short_key) == pytest.approx(4 / 32)
    assert lengths.relative_work(content_key("reverse", "new=", None)) == 1.0
    lengths.observe(content_key("reverse", "x=", None), 32.0)  # the least recently used prompt goes
    assert lengths.relative_work(long_key) == 1.0


def test_a_long_group_goes_where_tokens_return_fastest_short_ones_by_backlog() -> None:
    # Region a returns an average group in 1 s, b in 3 s; both return 0.5 groups/s; a holds one group.
    credits = RegionCredits({"a": 1.0, "b": 1.0}, window_s=10, tokens_per_group=1)
    for region, latency in (("a", 1.0), ("b", 3.0)):
        credits.on_dispatch(region, 0.0)
        for t in range(5):
            credits.on_arrival(region, 10.0 + t / 10, latency)
    held = {"a": 1, "b": 0}
    assert credits.pick(held, 11.0) == "b"  # by counts: b's idle backlog beats a's
    assert credits.pick(held, 11.0, work=60 / 32) == "a"  # a long group: b's latency x 1.9 > a's backlog
    assert credits.pick(held, 11.0, work=4 / 32) == "b"  # a short one still fills the idle region


@pytest.mark.parametrize("length_aware", [True, False])
def test_the_dispatcher_weighs_placement_by_the_prompts_predicted_length(length_aware: bool) -> None:
    sent: list[tuple[str, PromptRecord]] = []

    async def send(region: str, record: PromptRecord) -> None:
        sent.append((region, record))

    credits = RegionCredits({"a": 1.0, "b": 1.0}, window_s=10, tokens_per_group=1)
    for region, latency in (("a", 1.0), ("b", 3.0)):
        credits.on_dispatch(region, 0.0)
        for t in range(5):
            credits.on_arrival(region, 10.0 + t / 10, latency)
    d = Dispatcher(_config(length_aware), iter([SHORT, LONG]), send, credits)
    d.lengths.observe(content_key(*LONG[:2], None), 60.0)  # what the last epoch's answers ran to
    d.lengths.observe(content_key(*SHORT[:2], None), 4.0)
    asyncio.run(d.dispatch(0, 0, 11.0, lambda gid: False, released=0))
    # The short group goes to a (both idle: a's latency is lower); then the long one: by counts b's
    # empty backlog wins, by predicted length a's faster return does.
    assert [(r, rec.prompt) for r, rec in sent] == [("a", "s="), ("a" if length_aware else "b", "long=")]


def test_arrivals_teach_the_dispatcher_the_prompts_lengths() -> None:
    async def send(region: str, record: Any) -> None:
        return None

    d = Dispatcher(_config(True), iter([LONG]), send, RegionCredits({"a": 1.0, "b": 1.0}, window_s=10,
                                                                      tokens_per_group=1))
    asyncio.run(d.dispatch(0, 0, 0.0, lambda gid: False, released=0))
    (gid,) = d.in_flight
    d.observe_lengths(gid, 48.0)
    assert d.lengths.mean() == 48.0 and d.lengths.relative_work(content_key(*LONG[:2], None)) == 1.0
