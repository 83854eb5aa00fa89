"""`fleetrl config check` refuses a workload it cannot run with one line naming the field, before any
process starts: a missing model folder, an unknown task, a reward that does not import or is not
callable, an unreachable reward URL, a missing column, chat rows for a tokenizer without a chat template."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import pytest
import yaml

from fleetrl import devstack
from fleetrl.cli import main

HERE = pathlib.Path(__file__).parent


def _config(tmp: pathlib.Path, model_path: pathlib.Path | None, **sections: Any) -> pathlib.Path:
    data: dict[str, Any] = {
        "run": "wl", "regions": [{"name": "r1", "kafka": "127.0.0.1:9", "store": str(tmp / "store")}],
        "hub": {"home_store": str(tmp / "home")}, **sections,
    }
    if model_path is not None:
        data["model"] = {"path": str(model_path), **data.get("model", {})}
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _chat_rows(tmp: pathlib.Path) -> pathlib.Path:
    path = tmp / "rows.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "Say red."}], "keyword": "red"}) + "\n")
    return path


def _check(path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(["config", "check", str(path)])
    err = capsys.readouterr().err.strip()
    return rc, err


def test_a_good_workload_passes(tmp_path: pathlib.Path, qwen2_folder: pathlib.Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    path = _config(tmp_path, qwen2_folder, dataset={"task": "keywords", "path": str(_chat_rows(tmp_path))},
                   reward={"functions": [{"fn": "reward_fns:keyword_reward"}], "python_path": [str(HERE)]})
    assert main(["config", "check", str(path)]) == 0
    assert "# ok: run 'wl'" in capsys.readouterr().out


@pytest.mark.parametrize(("case", "field", "message"), [
    ("no_model", "model.path", "is not a folder"),
    ("task", "dataset.task", "unknown task 'nosuch'"),
    ("gym", "dataset.task", "unknown reasoning-gym dataset 'nosuch'"),
    ("import", "reward.functions[0].fn", "cannot import 'reward_fns_nosuch'"),
    ("callable", "reward.functions[0].fn", "int is not callable"),
    ("url", "reward.url", "is unreachable"),
    ("column", "dataset.columns.reference", "no column 'answer'"),
    ("template", "model.tokenizer", "has no chat template"),
])
def test_bad_workload_is_one_line_naming_the_field(tmp_path: pathlib.Path, qwen2_folder: pathlib.Path,
                                                   capsys: pytest.CaptureFixture[str], case: str, field: str,
                                                   message: str) -> None:
    rows = str(_chat_rows(tmp_path))
    fns = {"python_path": [str(HERE)]}
    if case == "no_model":
        path = _config(tmp_path, tmp_path / "nonexistent")
    elif case in ("task", "gym"):
        path = _config(tmp_path, None, dataset={"task": "nosuch" if case == "task" else "reasoning_gym:nosuch"})
    elif case == "import":
        path = _config(tmp_path, None, reward={"functions": [{"fn": "reward_fns_nosuch:f"}], **fns})
    elif case == "callable":
        path = _config(tmp_path, None, reward={"functions": [{"fn": "reward_fns:NOT_CALLABLE"}], **fns})
    elif case == "url":
        path = _config(tmp_path, None, reward={"url": f"http://127.0.0.1:{devstack.free_port()}/score"})
    elif case == "column":
        path = _config(tmp_path, qwen2_folder, dataset={"path": rows, "task": "reverse",
                                                        "columns": {"reference": "answer"}})
    else:  # a tokenizer folder without its chat template, for chat rows
        plain = tmp_path / "plain-tokenizer"
        shutil.copytree(qwen2_folder, plain)
        (plain / "chat_template.jinja").unlink()
        path = _config(tmp_path, qwen2_folder, model={"tokenizer": str(plain)},
                       dataset={"path": rows, "task": "reverse"})
    rc, err = _check(path, capsys)
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    assert f"fleet.yaml: {field}: " in err and message in err, err


@pytest.mark.parametrize(("name", "message"), [
    ("no_such_env", "not a skyrl-gym environment id"),
    ("skyrl_envs_nosuch:Env", "cannot import 'skyrl_envs_nosuch'"),
    ("skyrl_envs:NoSuchEnv", "has no environment class or factory 'NoSuchEnv'"),
])
def test_bad_environment_is_one_line_naming_the_field(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                      name: str, message: str) -> None:
    path = _config(tmp_path, None, dataset={"task": "reverse", "env": {"name": name, "python_path": [str(HERE)]}})
    rc, err = _check(path, capsys)
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "fleet.yaml: dataset.env.name: " in err and message in err, err


def test_a_verifiers_environment_that_does_not_load_is_one_line_naming_it(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    # With the `verifiers` extra: verifiers' own "not found"; without it: "needs the `verifiers` extra".
    env = {"kind": "verifiers", "name": "vf_nosuch", "python_path": [str(HERE)]}
    rc, err = _check(_config(tmp_path, None, dataset={"task": "sums", "env": env}), capsys)
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "fleet.yaml: dataset.env.name: vf_nosuch: " in err, err
    rc, err = _check(_config(tmp_path, None, dataset={"task": "sums", "env": {**env, "name": "vf_sums:run"}}), capsys)
    assert rc == 2 and "dataset.env" in err and "not a function" in err, err


def test_a_skyrl_environment_passes(tmp_path: pathlib.Path, qwen2_folder: pathlib.Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = _config(tmp_path, qwen2_folder, dataset={"task": "lookup", "path": str(_chat_rows(tmp_path)),
                                                    "env": {"name": "skyrl_envs:LookupEnv", "python_path": ["."]}})
    shutil.copy(HERE / "skyrl_envs.py", tmp_path / "skyrl_envs.py")  # python_path is relative to the config
    assert main(["config", "check", str(path)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(("name", "message"), [
    ("agent_fns", "named `package.module:function`"),
    ("agent_fns_nosuch:run", "cannot import 'agent_fns_nosuch'"),
    ("agent_fns:_not_there", "has no `async def _not_there(client, prompt, **row)`"),
    ("reward_fns:length_reward", "has no `async def length_reward(client, prompt, **row)`"),  # not async
])
def test_bad_agent_is_one_line_naming_the_field(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                name: str, message: str) -> None:
    path = _config(tmp_path, None, dataset={"task": "reverse", "env": {"kind": "openai_agent", "name": name,
                                                                        "python_path": [str(HERE)]}})
    rc, err = _check(path, capsys)
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "fleet.yaml: dataset.env.name: " in err and message in err, err


def test_an_agent_passes(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _config(tmp_path, None, dataset={"task": "reverse", "env": {"kind": "openai_agent",
                                                                        "name": "agent_fns:three_turns",
                                                                        "python_path": [str(HERE)]}})
    assert main(["config", "check", str(path)]) == 0, capsys.readouterr().err
