"""Custom rewards: TRL's `reward_funcs` signature (sync and async), weights, a remote endpoint on loopback,
and each way a reward fails turned into a `RewardError` with the traceback's last line."""

from __future__ import annotations

import json
import pathlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from slowdown import scaled

from fleetrl.config import RewardConfig, RewardFunctionConfig
from fleetrl.rollout.errors import RewardError
from fleetrl.rollout.rewards import CustomRewards, GroupInput, load_function

HERE = str(pathlib.Path(__file__).parent)
CHAT = [{"role": "user", "content": "Say red."}]
TIMEOUT_S = 5.0  # an ordinary call never reaches it; the slow one blocks until the test lets it go


@pytest.fixture(autouse=True)
def _slow_reward() -> Iterator[None]:
    """`picky`'s slow call blocks until the test lets it go (well past `reward.timeout_s`)."""
    import reward_fns

    reward_fns.RELEASE_SLOW.clear()
    yield
    reward_fns.RELEASE_SLOW.set()


def _rewards(*fns: tuple[str, float], signature: str = "trl", **extra: Any) -> CustomRewards:
    return CustomRewards(RewardConfig(functions=[RewardFunctionConfig(fn=f, weight=w, signature=signature)
                                                 for f, w in fns], python_path=[HERE], **extra))


def _group(completions: list[str], messages: Any = CHAT, **columns: Any) -> GroupInput:
    return GroupInput(prompt=None if messages else "Say red.", messages=messages, completions=completions,
                      completion_ids=[[1, 2]] * len(completions), columns=columns)


async def test_trl_signature_sync_and_async_weighted() -> None:
    r = _rewards(("reward_fns:length_reward", 0.5), ("reward_fns:keyword_reward", 2.0))
    got = await r.score("keywords", _group(["red red", "blue"], keyword="red"))
    # length 7 * 0.5 + 1 * 2.0 = 5.5; length 4 * 0.5 + 0 = 2.0
    assert got.rewards == [5.5, 2.0]
    # each function's unweighted mean over the group travels too (the trainer's step log shows it)
    assert got.parts == {"reward_fns:length_reward": 5.5, "reward_fns:keyword_reward": 0.5}
    assert r.stats["reward_fns:keyword_reward"].as_dict() == {"mean": 0.5, "groups": 1, "errors": 0}


async def test_arguments_are_what_trl_passes() -> None:
    """Conversational rows: prompts and completions are message lists; columns arrive as lists."""
    import reward_fns

    reward_fns.seen.calls.clear()
    r = _rewards(("reward_fns:seen", 1.0))
    await r.score("keywords", _group(["a", "b"], keyword="red", answer=3))
    call = reward_fns.seen.calls[-1]
    assert call["prompts"] == [CHAT, CHAT]
    assert call["completions"] == [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]]
    assert call["completion_ids"] == [[1, 2], [1, 2]]
    assert (call["keyword"], call["answer"]) == (["red", "red"], [3, 3])
    await r.score("keywords", _group(["a"], messages=None))
    assert reward_fns.seen.calls[-1]["prompts"] == ["Say red."] and reward_fns.seen.calls[-1]["completions"] == ["a"]


@pytest.mark.parametrize(("mode", "message"), [
    ("raise", r"reward_fns:picky: ValueError: cannot score 2 completions$"),
    ("nan", r"reward_fns:picky: reward 0 is nan, not finite"),
    ("slow", r"reward_fns:picky: TimeoutError: took longer than reward.timeout_s=5.0$"),
    ("short", r"reward_fns:picky: returned 1 rewards for 2 completions"),
])
async def test_a_failing_reward_raises_reward_error(mode: str, message: str) -> None:
    import reward_fns

    r = _rewards(("reward_fns:picky", 1.0), timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(RewardError, match=message):
            await r.score("keywords", _group(["a", "b"], mode=mode))
    finally:
        reward_fns.RELEASE_SLOW.set()  # the slow call's thread returns (after its timeout fired)
    assert r.stats["reward_fns:picky"].errors == 1
    assert (await r.score("keywords", _group(["a", "b"], mode="ok"))).rewards == [1.0, 1.0]  # the next one is scored


@pytest.mark.parametrize(("spec", "message"), [
    ("reward_fns_nosuch:f", r"cannot import 'reward_fns_nosuch': ModuleNotFoundError"),
    ("reward_fns:nosuch", r"has no attribute 'nosuch'"),
    ("reward_fns:NOT_CALLABLE", r"int is not callable"),
])
def test_a_reward_that_cannot_be_used_is_named(spec: str, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        load_function(spec, [HERE])


class _Endpoint:
    """A reward model served over HTTP on loopback: the first `fail_first` requests get a 503."""

    def __init__(self, fail_first: int = 0, score: Any = None) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_first = fail_first
        score = score or (lambda body: [float(len(c[0]["content"])) for c in body["completions"]])
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.requests.append(body)
                if len(endpoint.requests) <= endpoint.fail_first:
                    self.send_response(503)
                    self.end_headers()
                    return
                answer = json.dumps({"rewards": score(body)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=scaled(5))


@pytest.fixture
def endpoint() -> Iterator[_Endpoint]:
    e = _Endpoint(fail_first=1)
    yield e
    e.close()


async def test_remote_reward_endpoint_with_a_retry(endpoint: _Endpoint) -> None:
    r = _rewards(("reward_fns:keyword_reward", 1.0), url=endpoint.url, url_weight=0.5, retries=2, timeout_s=5)
    got = await r.score("keywords", _group(["red", "bb"], keyword="red"))
    assert got.rewards == [1.0 + 0.5 * 3, 0.0 + 0.5 * 2] and got.parts == {"reward_fns:keyword_reward": 0.5, "url": 2.5}
    assert len(endpoint.requests) == 2  # a 503, then the answer
    assert endpoint.requests[-1]["keyword"] == ["red", "red"] and endpoint.requests[-1]["prompts"] == [CHAT, CHAT]


async def test_remote_reward_gives_up_after_its_retries() -> None:
    e = _Endpoint(fail_first=10)
    try:
        r = _rewards(url=e.url, retries=1, timeout_s=TIMEOUT_S)  # each attempt gets its 503 at once
        with pytest.raises(RewardError, match=r"url: HTTP 503 .* \(after 2 attempts\)"):
            await r.score("keywords", _group(["a"]))
    finally:
        e.close()
    assert len(e.requests) == 2


async def test_trl_own_reward_functions_run_unchanged() -> None:
    """TRL's shipped rewards (`trl.rewards`), named by import path: `think_format_reward` and the
    math-verify based `accuracy_reward`, which reads the dataset's `solution` column."""
    pytest.importorskip("trl")
    r = _rewards(("trl.rewards:think_format_reward", 1.0), ("trl.rewards:accuracy_reward", 1.0))
    got = await r.score("math", _group(["<think>\nsum it\n</think>\nThe answer is $\\boxed{12}$", "It is 13."],
                                       solution="$12$"))
    assert got.parts == {"trl.rewards:think_format_reward": 0.5, "trl.rewards:accuracy_reward": 0.5}
    assert got.rewards == [2.0, 0.0]


async def test_an_openrlhf_style_reward_server_reads_query_and_labels() -> None:
    """OpenRLHF's reward servers read `query` (the prompt as the model saw it + the completion) and
    `labels`, and answer `{"rewards": [...]}`: such a server needs no change."""
    e = _Endpoint(score=lambda body: [1.0 if q.endswith(lab) else 0.0 for q, lab in zip(body["query"], body["labels"],
                                                                                          strict=True)])
    try:
        r = _rewards(url=e.url, timeout_s=5)
        group = _group(["it is 12", "it is 13"])
        group.reference, group.queries = "12", ["<|im_start|>user\nSay 12<|im_end|>\n" + c for c in group.completions]
        assert (await r.score("math", group)).rewards == [1.0, 0.0]
    finally:
        e.close()
    assert e.requests[0]["labels"] == ["12", "12"] and e.requests[0]["query"][0].startswith("<|im_start|>user")


@pytest.mark.parametrize("data_source", ["float", "dict"])
async def test_a_verl_reward_function_runs_per_completion_on_verls_row_layout(data_source: str) -> None:
    """verl's parquet rows (`data_source`, `reward_model.ground_truth`, `extra_info`) and its
    `compute_score(data_source, solution_str, ground_truth, extra_info)`, float or dict result."""
    r = _rewards(("reward_fns:verl_compute_score", 1.0), signature="verl")
    group = _group(["it is 12", "it is 13"], data_source=data_source, ability="math",
                   reward_model={"style": "rule", "ground_truth": "12"}, extra_info={"index": 0})
    assert (await r.score("math", group)).rewards == [1.0, 0.0]


async def test_a_built_in_scorer_that_raises_fails_its_group_only() -> None:
    """A library scorer behind a built-in task raising on one group is a RewardError, not a worker crash."""
    from fleetrl.rollout.rewards import TaskRewards
    from fleetrl.rollout.tasks import StringTask

    class Fragile(StringTask):
        def reward(self, completion_text: str, reference: Any) -> float:
            if completion_text == "boom":
                raise ZeroDivisionError("division by zero")
            return 1.0

    fragile = Fragile("fragile", ":", lambda s: s)
    r = TaskRewards(lambda name: fragile)
    with pytest.raises(RewardError, match=r"task fragile: ZeroDivisionError: division by zero"):
        await r.score("fragile", _group(["ok", "boom"], messages=None))
    assert (await r.score("fragile", _group(["ok"], messages=None))).rewards == [1.0]
