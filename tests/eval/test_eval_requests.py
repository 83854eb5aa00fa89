"""`fleetrl eval` requests beside a running trainer: group ids that name the request, the trainer skipping
(and counting) what it did not schedule, the audit counting them apart, and pins of their own."""

from __future__ import annotations

import pathlib

import pytest
from test_eval_books import _answer, _config, _runner

from fleetrl.broker import EvalTag, PromptRecord
from fleetrl.config import parse_config
from fleetrl.trainer.audit import TopicView, reconcile
from fleetrl.trainer.eval_book import eval_group_id, eval_request_of, parse_eval_group_id

HUB_KEY = "6680e5459cd0040518f9d6b4ec6f916984f5a12f538b6eea69e195dc1a06cc09"  # Ed25519 private key (hex)


def test_a_request_names_itself_in_its_group_ids_and_the_trainers_ids_name_none() -> None:
    mine = eval_group_id("my-run", "held-out", 12, 3, request="r1a2")
    assert parse_eval_group_id(mine, "my-run", "r1a2") == ("held-out", 12, 3)
    assert parse_eval_group_id(mine, "my-run") is None and parse_eval_group_id(mine, "my-run", "other") is None
    assert eval_request_of(mine, "my-run") == "r1a2"
    trainers = eval_group_id("my-run", "held-out", 12, 3)
    assert eval_request_of(trainers, "my-run") is None and parse_eval_group_id(trainers, "my-run", "r1a2") is None
    assert eval_request_of("my-run-evalreq-r1a2-junk", "my-run") is None


async def test_the_trainer_skips_a_requests_groups_even_for_an_evaluation_it_runs_itself() -> None:
    """The trainer evaluates h@0; a `fleetrl eval` request evaluates h@0 too. The request's groups are
    counted `foreign` and change nothing in the trainer's books; the request's runner takes only its own."""
    config = _config({"sets": [{"name": "h", "num_prompts": 2}], "before_training": True, "max_share": 1.0})
    trainer_sent: list[tuple[str, PromptRecord]] = []
    trainer = _runner(config, trainer_sent)
    trainer.on_start(0, 0)
    await trainer.dispatch(0.0, {})
    request_sent: list[tuple[str, PromptRecord]] = []
    request = _runner(config, request_sent)
    request.request = "q1"
    request.schedule(0, 0, ["h"])
    await request.dispatch(0.0, {})
    assert [r.group_id for _, r in request_sent] == [eval_group_id("ev", "h", 0, i, "q1") for i in range(2)]
    assert all(r.eval == EvalTag("h", 0) and r.min_version == 0 for _, r in request_sent)
    for region, r in request_sent:
        trainer.on_group(_answer(r, region, [1.0]), step=3)
        request.on_group(_answer(r, region, [1.0]), step=0)
    book = trainer.book.evals[("h", 0)]
    assert trainer.book.foreign == 2 and trainer.book.orphans == 0
    assert not book.returned and len(book.in_flight) == 2 and trainer.unfinished
    assert not request.unfinished and request.book.rows()[0]["pass@1"] == 1.0
    for region, r in trainer_sent:  # the trainer's own groups: the request's runner ignores them
        request.on_group(_answer(r, region, [0.0]), step=0)
        trainer.on_group(_answer(r, region, [0.0]), step=3)
    assert request.book.orphans == 0 and request.book.rows()[0]["pass@1"] == 1.0
    assert not trainer.unfinished and trainer.book.rows()[0]["pass@1"] == 0.0
    assert trainer.state()["foreign"] == 2  # in the checkpoint


def test_the_audit_counts_requests_apart_from_the_books_and_from_foreign_prompts() -> None:
    config = _config({"sets": [{"name": "h", "num_prompts": 1}], "before_training": True})
    runner = _runner(config, [])
    runner.on_start(0, 0)
    state = {"step": 0, "collector": {"trained": [], "stale": {}, "pending": []},
             "dispatcher": {"next_index": 0, "in_flight": {}}, "eval": runner.state()}
    q = [eval_group_id("ev", "h", 0, i, "q1") for i in range(3)] + [eval_group_id("ev", "h", 7, 0, "q2")]
    view = TopicView(dispatched={g: [("a", 0)] for g in q}, arrived={g: [("a", 0)] for g in q[:3]})
    report = reconcile(view, state, "ev")
    e = report.eval
    assert (e.requests, e.request_prompts) == (2, 4)
    assert report.foreign_prompts == 0 and report.dispatched == 0 and not report.lost
    assert (e.dispatched, e.after_checkpoint, e.returned_again, e.lost) == (0, 0, 0, [])
    assert report.ok


def test_a_requests_pin_is_its_own(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer and a request pin one version; each releases only its own pin."""
    from fleetrl.hub import Hub

    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    store = (tmp_path / "store").as_uri()
    import yaml

    config = parse_config(yaml.safe_dump({
        "run": "pins", "model": {"tiny": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                          "num_hidden_layers": 1}},
        "hub": {"home_store": store}, "regions": [{"name": "r1", "kafka": "127.0.0.1:1", "store": store}]}),
        source="pins.yaml", env={"FLEETRL_HUB_KEY": HUB_KEY})
    with Hub.from_config(config) as hub:
        hub.pin(0, True)
        hub.pin(0, True, holder="q1")
        hub.pin(0, False, holder="q1")
        assert hub.pinned() == [0]  # the trainer's pin stays
        hub.pin(0, True, holder="q1")
        hub.pin(0, False)
        assert hub.pinned() == [0]  # and the request's
        hub.pin(0, False, holder="q1")
        assert hub.pinned() == []


async def test_a_dead_lettered_eval_prompt_ends_its_evaluation_without_it() -> None:
    """Of 3 prompts, one is dead-lettered by a worker: the evaluation ends with 2 returned, its figures over
    them and the count in its row. A dead letter of an attempt older than the one in flight changes nothing,
    and a request's runner ignores the trainer's dead letters (and the other way round)."""
    config = _config({"sets": [{"name": "h", "num_prompts": 3}], "before_training": True, "max_share": 1.0,
                      "deadline_s": 30})
    sent: list[tuple[str, PromptRecord]] = []
    runner = _runner(config, sent)
    runner.on_start(0, 0)
    await runner.dispatch(0.0, {})
    await runner.dispatch(40.0, {})  # all three silent past the deadline: attempt 1 of each
    gids = [eval_group_id("ev", "h", 0, i) for i in range(3)]
    runner.on_dead_letter(gids[2], 0, "reward_error")  # the first attempt's: the second may still return
    assert runner.book.evals[("h", 0)].dead == []
    request = _runner(config, [])
    request.request = "q1"
    request.schedule(0, 0, ["h"])
    request.on_dead_letter(gids[2], 1, "reward_error")  # not the request's
    runner.on_dead_letter(eval_group_id("ev", "h", 0, 2, "q1"), 1, "reward_error")  # not the trainer's
    assert request.book.evals[("h", 0)].dead == [] and runner.book.evals[("h", 0)].dead == []
    runner.on_dead_letter(gids[2], 1, "reward_error")
    assert runner.unfinished and runner.book.evals[("h", 0)].dead == [2]
    for region, r in sent[3:5]:
        runner.on_group(_answer(r, region, [1.0]), step=0)
    assert not runner.unfinished
    row = runner.book.rows()[0]
    assert (row["prompts"], row["pass@1"], row["dead_lettered"]) == (2, 1.0, 1)
    restored = _runner(config, [])
    restored.restore(runner.state())
    assert not restored.unfinished and restored.book.evals[("h", 0)].dead == [2]


def test_the_audit_counts_a_dead_lettered_eval_prompt_and_the_evaluation_complete() -> None:
    from fleetrl.trainer.eval_audit import reconcile_evals
    from fleetrl.trainer.eval_book import Flight

    config = _config({"sets": [{"name": "h", "num_prompts": 2}], "before_training": True})
    runner = _runner(config, [])
    runner.on_start(0, 0)
    ev = runner.book.evals[("h", 0)]
    ev.next_index = 2
    ev.in_flight = {0: Flight("a", 0, 0.0), 1: Flight("a", 0, 0.0)}
    gids = [eval_group_id("ev", "h", 0, i) for i in range(2)]
    runner.on_dead_letter(gids[0], 0, "reward_error")
    runner.on_dead_letter(gids[1], 0, "eval_version_gone")
    assert not runner.unfinished and runner.book.rows() == []  # nothing returned: no figures
    audit = reconcile_evals({g: [("a", 0)] for g in gids}, {}, {g: ["reward_error"] for g in gids},
                            {"eval": runner.state()}, "ev")
    assert (audit.complete, audit.unfinished, audit.dead_lettered, audit.lost) == (1, [], 2, [])
