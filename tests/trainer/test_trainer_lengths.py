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


@pytest.mark.parametrize("length_aware", [True, False])
def test_placement_balances_predicted_work_not_group_counts(length_aware: bool) -> None:
    sent: list[tuple[str, PromptRecord]] = []

    async def send(region: str, record: PromptRecord) -> None:
        sent.append((region, record))

    order = [LONG, SHORT, LONG, SHORT, SHORT, SHORT]
    d = Dispatcher(_config(length_aware), iter(order), send,
                   RegionCredits({"a": 1.0, "b": 1.0}, window_s=10, tokens_per_group=1))
    d.lengths.observe(content_key(*LONG[:2], None), 60.0)  # what the last epoch's answers ran to
    d.lengths.observe(content_key(*SHORT[:2], None), 4.0)
    asyncio.run(d.dispatch(0, 0, 0.0, lambda gid: False, released=0))
    assert len(sent) == 6
    tokens: dict[str, int] = {"a": 0, "b": 0}
    for region, record in sent:
        tokens[region] += 60 if record.prompt == "long=" else 4
    if length_aware:  # one long group each, the short ones fill the gap
        assert abs(tokens["a"] - tokens["b"]) <= 8
    else:  # alternating counts put both long groups in one region
        assert abs(tokens["a"] - tokens["b"]) >= 56


def test_arrivals_teach_the_dispatcher_the_prompts_lengths() -> None:
    async def send(region: str, record: Any) -> None:
        return None

    d = Dispatcher(_config(True), iter([LONG]), send, RegionCredits({"a": 1.0, "b": 1.0}, window_s=10,
                                                                      tokens_per_group=1))
    asyncio.run(d.dispatch(0, 0, 0.0, lambda gid: False, released=0))
    (gid,) = d.in_flight
    d.observe_lengths(gid, 48.0)
    assert d.lengths.mean() == 48.0 and d.lengths.relative_work(content_key(*LONG[:2], None)) == 1.0
