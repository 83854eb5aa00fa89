"""Checks of a run's workload before any process starts: the model folder, the tokenizer, the task,
the dataset and its columns, the reward functions and endpoint, the environment (DESIGN.md §11), and the
libraries of the experiment trackers `tracking.report_to` names (DESIGN.md §12).

The pydantic models check the shape of `fleet.yaml`; what needs the filesystem, an import or the
network is checked here, by `fleetrl config check`, `fleetrl demo`, the trainer and the agents, so
that a run with a missing folder, an unknown task or a reward that does not import fails with one
line naming the field instead of a crash in a worker. This module sits in `fleetrl/` because it
reads both the trainer's dataset loader and the rollout reward registry.
"""

from __future__ import annotations

import json
import pathlib
import socket
import urllib.parse
from collections.abc import Callable, Sequence
from typing import NoReturn

from fleetrl.config import ConfigError, FleetConfig

_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_URL_CONNECT_S = 3.0
Fail = Callable[[str, str], NoReturn]


def check_workload(config: FleetConfig, source: str = "fleet.yaml",
                   parts: Sequence[str] = ("model", "task", "reward", "dataset")) -> None:
    """Raise `ConfigError` (one line: file, field, what is wrong) for the first problem found in `parts`
    (`model` covers the tokenizer)."""
    def fail(field: str, message: str) -> NoReturn:
        raise ConfigError(source, field, None, message)

    if "model" in parts:
        _check_model(config, fail)
    chat_template = _check_tokenizer(config, fail) if "model" in parts else True
    if "task" in parts:
        _check_task(config, fail)
    if "reward" in parts:  # what the rollout worker runs: reward functions and environments
        _check_rewards(config, fail)
        _check_env(config, fail)
    if "dataset" in parts and config.dataset.path is not None:
        _check_dataset(config, chat_template, fail)
    if "dataset" in parts:
        _check_eval_sets(config, fail)
    if "tracking" in parts:
        _check_trackers(config, fail)


def _check_model(config: FleetConfig, fail: Fail) -> None:
    path = config.model.path
    if path is None:
        return
    folder = pathlib.Path(path)
    if not folder.is_dir():
        fail("model.path", f"{folder} is not a folder")
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except OSError as exc:
        fail("model.path", f"{folder}: cannot read config.json: {exc.strerror}")
    except json.JSONDecodeError as exc:
        fail("model.path", f"{folder}/config.json is not JSON: {exc.msg}")
    if not isinstance(cfg, dict) or not cfg.get("architectures"):
        fail("model.path", f"{folder}/config.json names no architectures: not a Hugging Face model folder")
    if not any((folder / f).is_file() for f in _MODEL_FILES):
        fail("model.path", f"{folder}: no model.safetensors nor model.safetensors.index.json")


def _check_tokenizer(config: FleetConfig, fail: Fail) -> bool:
    """Whether the tokenizer has a chat template (the char tokenizer has none)."""
    m = config.model
    source = m.tokenizer_source
    if source == "char":
        return False
    field = "model.tokenizer" if m.tokenizer is not None else "model.path"
    folder = pathlib.Path(source)
    if not folder.is_dir() or not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        fail(field, f"{folder}: no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return bool(isinstance(tok_cfg, dict) and tok_cfg.get("chat_template"))


def _check_task(config: FleetConfig, fail: Fail) -> None:
    from fleetrl.rollout import TaskError, get_task

    d = config.dataset
    if (d.path is not None and (config.reward.custom or d.env is not None)) or (d.env and d.env.kind == "verifiers"):
        return  # the task names are labels only: the custom reward or the environment scores every group
    for i, name in enumerate([d.task, *d.tasks]):
        try:
            get_task(name)
        except TaskError as exc:
            fail("dataset.task" if i == 0 else f"dataset.tasks[{i - 1}]",
                 f"{exc} (any label is allowed with dataset.path and a custom reward)")


def _check_rewards(config: FleetConfig, fail: Fail) -> None:
    from fleetrl.rollout.errors import RewardError
    from fleetrl.rollout.rewards import load_function

    r = config.reward
    for i, f in enumerate(r.functions):
        try:
            load_function(f.fn, r.python_path)
        except RewardError as exc:
            fail(f"reward.functions[{i}].fn", str(exc))
    if r.url is not None:
        _check_reachable(r.url, fail)


def _check_env(config: FleetConfig, fail: Fail) -> None:
    from fleetrl.rollout.episodes import load_env_factory
    from fleetrl.rollout.errors import EnvError

    env = config.dataset.env
    if env is None:
        return
    try:
        if env.kind == "openai_agent":
            _load_agent(env.name, env.python_path)
        elif env.kind == "verifiers":
            _load_verifiers(config)
        else:
            load_env_factory(env.name, env.python_path)
    except EnvError as exc:
        fail("dataset.env.name", str(exc))
    if env.max_episode_tokens is not None and env.max_episode_tokens < config.algorithm.max_new_tokens:
        fail("dataset.env.max_episode_tokens", f"{env.max_episode_tokens} is below algorithm.max_new_tokens "
                                               f"({config.algorithm.max_new_tokens}), the bound of one model turn")


def _check_eval_sets(config: FleetConfig, fail: Fail) -> None:
    """Each eval set's source reads (its file, its first row, or its task's generator) and its own reward
    functions import, as the training dataset's and reward's do."""
    from fleetrl.rollout import TaskError, get_task
    from fleetrl.rollout.errors import RewardError
    from fleetrl.rollout.rewards import load_function
    from fleetrl.trainer import DatasetError, load_rows
    from fleetrl.trainer.dataset import row_item

    for s in config.eval.sets:
        where = f"eval.sets[{s.name}]"
        d = s.dataset(config.dataset)
        reward = s.reward or config.reward
        for i, f in enumerate(reward.functions if s.reward is not None else []):
            try:
                load_function(f.fn, reward.python_path)
            except RewardError as exc:
                fail(f"{where}.reward.functions[{i}].fn", str(exc))
        if d.path is None:
            try:
                get_task(d.task)
            except TaskError as exc:
                fail(f"{where}.task", str(exc))
            continue
        try:
            rows = load_rows(d)
            if len(rows) == 0:
                fail(f"{where}.path", f"{d.path} holds no rows")
            row_item(rows[0], f"{d.path}: row 1", d)
        except DatasetError as exc:
            fail(f"{where}.path", str(exc).replace("dataset.", f"{where}."))


def _load_agent(name: str, python_path: list[str]) -> None:
    """An `openai_agent` function; the endpoint's libraries (the `agents` extra) must be installed."""
    from fleetrl.rollout.errors import EnvError

    try:
        from fleetrl.rollout.agent_episodes import load_agent
    except ImportError as exc:
        raise EnvError(f"{name}: kind openai_agent needs the `agents` extra (pip install 'fleetrl[agents]'): "
                       f"{exc}") from exc
    load_agent(name, python_path)


def _load_verifiers(config: FleetConfig) -> None:
    """A verifiers environment loads through verifiers' entry point, and its taskset yields tasks (unless the
    prompts come from `dataset.path`); it also needs the endpoint's libraries (the `agents` extra)."""
    from fleetrl.rollout.verifiers_env import load_verifiers_env, taskset_rows

    env_cfg = config.dataset.env
    assert env_cfg is not None
    _load_agent_libraries(env_cfg.name, "verifiers")
    env = load_verifiers_env(env_cfg)
    if config.dataset.path is None:
        taskset_rows(env, env_cfg.name, limit=config.dataset.num_prompts)


def _load_agent_libraries(name: str, kind: str) -> None:
    from fleetrl.rollout.errors import EnvError

    try:
        import fleetrl.rollout.agent_episodes  # noqa: F401  (the endpoint's libraries: starlette, uvicorn, openai)
    except ImportError as exc:
        raise EnvError(f"{name}: kind {kind} needs the `agents` extra (pip install 'fleetrl[agents]'): "
                       f"{exc}") from exc


def _check_reachable(url: str, fail: Fail) -> None:
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=_URL_CONNECT_S):
            pass
    except OSError as exc:
        fail("reward.url", f"{url} is unreachable: {exc.strerror or exc}")


def _check_dataset(config: FleetConfig, chat_template: bool, fail: Fail) -> None:
    from fleetrl.trainer import DatasetError, is_chat, load_rows
    from fleetrl.trainer.dataset import row_item

    d = config.dataset
    try:
        rows = load_rows(d)
    except DatasetError as exc:
        fail("dataset.path", str(exc))
    if len(rows) == 0:
        fail("dataset.path", f"{d.path} holds no rows")
    first = rows[0]
    c = d.columns
    for name in ("prompt", "messages", "reference"):
        column = getattr(c, name)
        if column is not None and (name != "prompt" or c.messages is None) and column not in first:
            fail(f"dataset.columns.{name}", f"no column {column!r} in {d.path}; columns: {sorted(first)}")
    try:
        row_item(first, f"{d.path}: row 1", d)
    except DatasetError as exc:
        fail("dataset.path", str(exc))
    if is_chat(first, d) and not chat_template:
        field = "model.tokenizer" if config.model.tokenizer is not None else "model.path"
        fail(field, f"the dataset's rows are chat messages but the tokenizer {config.model.tokenizer_source!r} "
                    f"has no chat template")


def _check_trackers(config: FleetConfig, fail: Fail) -> None:
    """Each tracker of `tracking.report_to` needs its library (its extra), found without importing it."""
    import importlib.util

    for i, name in enumerate(config.tracking.report_to):
        if importlib.util.find_spec(name) is None:
            fail(f"tracking.report_to[{i}]", f"{name} is not installed: pip install 'fleetrl[{name}]'")
