"""The eval section's refusals, the trainer's eval books and runner (send injected), and the audit's eval books."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import yaml

from fleetrl.broker import EvalTag, GroupRecord, KafkaError, PromptRecord, Sample
from fleetrl.config import ConfigError, FleetConfig, parse_config
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.dispatcher import PromptItem
from fleetrl.trainer.eval_audit import reconcile_evals
from fleetrl.trainer.eval_book import eval_group_id, parse_eval_group_id
from fleetrl.trainer.eval_runner import EvalRunner


def _config(eval_section: dict[str, Any], **algorithm: Any) -> FleetConfig:
    data = {"run": "ev", "algorithm": {"groups_per_step": 4, "n_samples": 2, "max_staleness": 1, **algorithm},
            "eval": eval_section,
            "regions": [{"name": "a", "kafka": "127.0.0.1:1", "store": "/tmp/x"},
                        {"name": "b", "kafka": "127.0.0.1:2", "store": "/tmp/y"}]}
    return parse_config(yaml.safe_dump(data), source="eval-test.yaml", env={})


@pytest.mark.parametrize(("section", "field", "words"), [
    ({"sets": [{"name": "h", "seed": 0}]}, "eval.sets[h].seed", "training prompts"),
    ({"sets": [{"name": "h", "task": "copy"}]}, "eval.sets[h].task", "dataset.tasks"),
    ({"sets": [{"name": "h"}, {"name": "h"}]}, "eval.sets[h].name", "defined twice"),
    ({"sets": [{"name": "h", "samples_per_prompt": 4}]}, "eval.sets[h].samples_per_prompt", "temperature > 0"),
    ({"sets": [{"name": "h"}], "max_share": 0}, "eval.max_share", "greater than 0"),
    ({"sets": [{"name": "H!"}]}, "eval.sets[H!].name", "pattern"),
])
def test_a_bad_eval_section_is_refused_naming_the_field(section: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(section)
    assert err.value.field == field and words in err.value.message


def test_eval_of_lora_or_episodes_is_refused_naming_the_section() -> None:
    cases = (({"model": {"lora": {"r": 4}}}, "LoRA"), ({"dataset": {"env": {"name": "gsm8k"}}}, "episodes"))
    for extra, words in cases:
        data = {"run": "ev", "eval": {"sets": [{"name": "h"}]}, **extra,
                "regions": [{"name": "a", "kafka": "127.0.0.1:1", "store": "/tmp/x"}]}
        with pytest.raises(ConfigError) as err:
            parse_config(yaml.safe_dump(data), source="eval-test.yaml", env={})
        assert err.value.field == "eval.sets" and words in err.value.message


def test_eval_sets_widen_the_record_bounds() -> None:
    from fleetrl.broker import RecordLimits

    config = _config({"sets": [{"name": "h", "samples_per_prompt": 16, "temperature": 1.0, "max_new_tokens": 99}]})
    limits = RecordLimits.from_config(config)
    assert limits.max_samples_per_group == 16 and limits.max_tokens_per_sample == 99


def test_group_ids_round_trip_with_dashes_in_the_set_name() -> None:
    gid = eval_group_id("my-run", "held-out", 12, 3)
    assert parse_eval_group_id(gid, "my-run") == ("held-out", 12, 3)
    assert parse_eval_group_id("my-run-000000012", "my-run") is None
    assert parse_eval_group_id(gid, "other") is None


class Log:
    def __init__(self) -> None:
        self.scalars_at: list[tuple[int, dict[str, float]]] = []
        self.tables: list[tuple[int, str]] = []

    def scalars(self, step: int, figures: Any) -> None:
        self.scalars_at.append((step, dict(figures)))

    def table(self, step: int, name: str, columns: Any, rows: Any) -> None:
        self.tables.append((step, name))


def _runner(config: FleetConfig, sent: list[tuple[str, PromptRecord]], fail: set[str] | None = None,
            log: Log | None = None) -> EvalRunner:
    async def send(region: str, record: PromptRecord) -> None:
        if fail and region in fail:
            raise KafkaError(f"{region} is down", retriable=True)
        sent.append((region, record))

    credits = RegionCredits({"a": 1.0, "b": 1.0}, window_s=10, tokens_per_group=8)
    items = {"h": [PromptItem("reverse", f"ab{i}=", f"{i}ba") for i in range(5)]}
    return EvalRunner(config, items, send, credits, log)


def _answer(record: PromptRecord, region: str, rewards: list[float]) -> GroupRecord:
    assert record.eval is not None
    samples = [Sample(np.zeros(3, np.int32), np.zeros(3, np.float32), np.full(3, record.eval.version, np.int32), r,
                      "stop") for r in rewards]
    return GroupRecord(record.group_id, record.run, record.task, record.attempt, region, "n", np.zeros(1, np.int32),
                       samples, eval=record.eval)


async def test_an_evaluation_goes_out_within_its_share_and_reports_at_the_publishing_step() -> None:
    config = _config({"sets": [{"name": "h", "num_prompts": 5, "samples_per_prompt": 2, "temperature": 1.0}],
                      "every_versions": 2, "before_training": True, "max_share": 0.25})
    sent: list[tuple[str, PromptRecord]] = []
    log = Log()
    runner = _runner(config, sent, log=log)
    pins: list[tuple[int, bool]] = []
    runner.pin = lambda version, pinned: pins.append((version, pinned))
    assert runner.max_in_flight == 3  # 0.25 of (1 + 1 + 1) steps x 4 groups
    runner.on_start(version=0, step=0)
    runner.on_published(version=1, step=1, last=False)  # not a multiple of 2
    runner.on_published(version=2, step=2, last=False)
    assert sorted(runner.book.evals) == [("h", 0), ("h", 2)]
    assert await runner.dispatch(100.0, {}) == 3  # the share, not the 10 prompts
    assert await runner.dispatch(101.0, {}) == 0
    first = [r for _, r in sent]
    assert all(r.eval == EvalTag("h", 0) and r.min_version == 0 and r.n_samples == 2 for r in first)
    assert [r.group_id for r in first] == [eval_group_id("ev", "h", 0, i) for i in range(3)]
    assert {region for region, _ in sent} == {"a", "b"}  # one round's prompts spread over the regions
    for region, r in sent:
        runner.on_group(_answer(r, region, [1.0, 0.0]), step=5)
    runner.on_group(_answer(first[0], "a", [1.0, 1.0]), step=5)  # a second copy: not counted again
    assert runner.book.evals[("h", 0)].duplicates == 1
    while runner.unfinished and len(sent) < 10:
        n = len(sent)
        await runner.dispatch(102.0, {})
        for region, r in sent[n:]:
            runner.on_group(_answer(r, region, [1.0, 0.0] if r.eval == EvalTag("h", 0) else [1.0, 1.0]), step=9)
    assert not runner.unfinished and len(sent) == 10
    await runner.dispatch(103.0, {})  # nothing left to send: the versions are released from retention
    assert pins == [(0, True), (2, True), (0, False), (2, False)]
    rows = runner.book.rows()
    assert [(r["version"], r["step"], r["pass@1"], r["pass@2"]) for r in rows] == [(0, 0, 0.5, 1.0), (2, 2, 1.0, 1.0)]
    assert [step for step, _ in log.scalars_at] == [0, 2]  # the steps that published the versions
    assert log.scalars_at[0][1]["eval/h/pass@1"] == 0.5 and "eval/h/pass@2" in log.scalars_at[0][1]
    assert log.tables == [(0, "eval/h"), (2, "eval/h")]
    restored = _runner(config, [])
    restored.restore(runner.state())
    assert restored.book.rows() == rows and not restored.unfinished


async def test_a_silent_eval_prompt_is_sent_again_elsewhere_and_a_failed_send_waits() -> None:
    config = _config({"sets": [{"name": "h", "num_prompts": 1}], "before_training": True, "deadline_s": 30})
    sent: list[tuple[str, PromptRecord]] = []
    runner = _runner(config, sent, fail={"a", "b"})
    runner.on_start(0, 0)
    assert await runner.dispatch(0.0, {}) == 0  # the region refused: kept, unsent
    assert not runner.book.evals[("h", 0)].in_flight[0].sent
    runner.send = _runner(config, sent).send  # the link is back
    assert await runner.dispatch(1.0, {}) == 1
    region, first = sent[-1]
    assert first.attempt == 0
    assert await runner.dispatch(20.0, {}) == 0  # within the deadline: nothing again
    assert await runner.dispatch(40.0, {}) == 1  # silent past it: the next attempt, another region
    again_region, again = sent[-1]
    assert again.group_id == first.group_id and again.attempt == 1 and again_region != region
    assert runner.book.evals[("h", 0)].resent == 1
    assert runner.region_gone(again_region) == 1  # its region is gone: sent again at once, elsewhere
    assert await runner.dispatch(41.0, {}) == 1
    assert sent[-1][0] != again_region and sent[-1][1].attempt == 2
    assert runner.region_gone("nowhere") == 0


async def test_an_eval_prompt_whose_region_refuses_the_send_goes_to_another_region_at_once() -> None:
    """A region whose cluster is not connected (a trainer that started with one region of two) must not
    hold the evaluation's prompts: like the training dispatcher, the send fails over to the next region
    (before, every round placed them on the same refusing region again, and the evaluation never ran)."""
    config = _config({"sets": [{"name": "h", "num_prompts": 3}], "before_training": True})
    sent: list[tuple[str, PromptRecord]] = []
    runner = _runner(config, sent, fail={"b"})
    runner.on_start(0, 0)
    for now in (0.0, 1.0):
        await runner.dispatch(now, {"a": 5})  # training keeps `a` busy: placement alone would pick `b`
    assert len(sent) == 3 and {region for region, _ in sent} == {"a"}
    assert all(f.sent and f.region == "a" for f in runner.book.evals[("h", 0)].in_flight.values())


def test_the_audit_finds_a_lost_eval_prompt_and_counts_later_ones_apart() -> None:
    config = _config({"sets": [{"name": "h", "num_prompts": 3}], "before_training": True})
    runner = _runner(config, [])
    runner.on_start(0, 0)
    ev = runner.book.evals[("h", 0)]
    from fleetrl.trainer.eval_book import Flight
    from fleetrl.trainer.eval_figures import ReturnedGroup

    ev.next_index = 2
    ev.returned[0] = ReturnedGroup("a", (1.0,), (3,), ("stop",))
    ev.in_flight[1] = Flight("b", 0, 0.0)
    state = {"eval": runner.state()}
    gids = [eval_group_id("ev", "h", 0, i) for i in range(3)]
    topics = {gids[0]: [("a", 0)], gids[1]: [("b", 0)], gids[2]: [("a", 0)],
              eval_group_id("ev", "h", 4, 0): [("a", 0)]}
    ok = reconcile_evals(topics, {gids[0]: [("a", 0), ("a", 0)]}, {}, state, "ev")
    assert (ok.dispatched, ok.returned, ok.in_flight, ok.after_checkpoint, ok.returned_again) == (2, 1, 1, 2, 1)
    assert ok.lost == [] and ok.unfinished == ["h@0"] and not ok.problems()
    del ev.in_flight[1]
    lost = reconcile_evals(topics, {}, {}, {"eval": runner.state()}, "ev")
    assert lost.lost == [gids[1]] and lost.problems()
    dead = reconcile_evals(topics, {}, {gids[1]: ["reward_error"]}, {"eval": runner.state()}, "ev")
    assert dead.lost == [] and dead.dead_lettered == 1
