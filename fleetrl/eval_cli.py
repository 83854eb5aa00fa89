"""`fleetrl eval`: one evaluation of one policy version (or an exported folder), here, with the torch engine.

    fleetrl eval --config fleet.yaml --version N|latest [--set NAME] [--json]
    fleetrl eval --config fleet.yaml --model ./exported-folder [--set NAME]

It reads the version from the home store (`--version`) or loads a Hugging Face folder (`--model`, e.g.
one `fleetrl hub export` wrote), generates every prompt of each eval set (`eval.sets`, or `--set`) with
the set's sampling on one local torch engine, scores them with the set's reward (default the run's) and
prints the figures of docs/eval.md as a table: the same prompts, rewards and estimators as the
evaluations the trainer runs on the fleet. It sits in `fleetrl/` because it needs both the trainer's
figures and the rollout engine. Running it on the fleet (prompts through Kafka) is the trainer's job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from fleetrl.config import ConfigError, EvalSetConfig, FleetConfig
from fleetrl.trainer.eval_book import eval_group_id
from fleetrl.trainer.eval_figures import EvalFigures, ReturnedGroup, figures

_MAX_STEPS = 1_000_000


def run_eval(args: argparse.Namespace, config: FleetConfig) -> int:
    sets = _sets(config, args.set)
    engine, version, codec = _engine(config, args)
    rows = [_evaluate(config, s, engine, version, codec).row() for s in sets]
    engine.close()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    _print_table(rows, args.model or f"version {version}")
    return 0


def _sets(config: FleetConfig, name: str | None) -> list[EvalSetConfig]:
    sets = config.eval.sets
    if not sets:
        raise ConfigError("fleet.yaml", "eval.sets", None, "no eval set to run: add one (docs/eval.md)")
    if name is None:
        return list(sets)
    try:
        return [config.eval.set(name)]
    except KeyError as exc:
        raise ConfigError("fleet.yaml", "eval.sets", None, str(exc.args[0])) from None


def _engine(config: FleetConfig, args: argparse.Namespace) -> tuple[Any, int, Any]:
    """The torch engine with the weights to evaluate, their version (0 for a folder) and the tokenizer."""
    from fleetrl.rollout.tokenize import load_codec
    from fleetrl.rollout.torch_engine import TorchEngine

    engine_cfg = config.regions[0].engine
    if engine_cfg.kind != "torch":
        engine_cfg = _torch_engine_config()
    if args.model is not None:
        # The run's tokenizer: a folder run's (the export carries it), or the tiny model's character tokenizer.
        tokenizer = config.model.tokenizer if config.model.path is not None else config.model.tokenizer or "char"
        model_cfg = config.model.model_copy(update={"path": args.model, "tokenizer": tokenizer, "lora": None})
        engine = TorchEngine.from_config(model_cfg, engine_cfg)
        return engine, 0, load_codec(model_cfg, sorted(engine.eos_ids))
    from fleetrl.hub import Hub, UnknownVersion

    with Hub.from_config(config) as hub:
        version = hub.latest() if args.eval_version == "latest" else int(args.eval_version)
        held = hub.versions()
        if version is None or version not in held:
            raise UnknownVersion(f"the home store of run {config.run!r} holds no version {args.eval_version} "
                                 f"(it holds {f'{held[0]}..{held[-1]}' if held else 'none'})", argument="--version")
        state = hub.materialize(version)
    engine = TorchEngine.from_config(config.model, engine_cfg)
    engine.stage_weights(state, version)
    return engine, version, load_codec(config.model, sorted(engine.eos_ids))


def _torch_engine_config() -> Any:
    from fleetrl.config import TorchEngineConfig

    return TorchEngineConfig()


def _evaluate(config: FleetConfig, s: EvalSetConfig, engine: Any, version: int, codec: Any) -> EvalFigures:
    """Generate and score every prompt of the set; the figures of the evaluation."""
    from fleetrl.broker import Sampling
    from fleetrl.rollout.engine import GroupRequest
    from fleetrl.rollout.rewards import GroupInput, build_rewards
    from fleetrl.rollout.tasks import get_task
    from fleetrl.trainer_cli import eval_prompts

    items = eval_prompts(config)[s.name]
    sampling = Sampling(temperature=s.wire_temperature, top_p=s.top_p,
                        max_new_tokens=s.max_new_tokens or config.algorithm.max_new_tokens)
    prompt_ids = [codec.render(i.messages) if i.messages is not None else codec.encode(i.prompt) for i in items]
    # The fleet's group ids and seed: sampling is counter-based (rollout/sampling.py), so this reproduces the
    # samples the fleet drew for the same version (up to floating-point ties).
    gids = [eval_group_id(config.run, s.name, version, n) for n in range(len(items))]
    for gid, ids in zip(gids, prompt_ids, strict=True):
        engine.submit(GroupRequest(gid, ids, sampling, s.samples_per_prompt, seed=config.rollout.seed))
    finished: dict[str, Any] = {}
    for _ in range(_MAX_STEPS):
        for group in engine.step():
            finished[group.group_id] = group.samples
        if len(finished) == len(items):
            break
    rewards = build_rewards(s.reward or config.reward, get_task)
    returned = []
    for n, item in enumerate(items):
        samples = finished[gids[n]]
        group = GroupInput(prompt=item.prompt or None, messages=item.messages,
                           completions=[codec.decode(x.completion_ids) for x in samples],
                           completion_ids=[[int(t) for t in x.completion_ids] for x in samples],
                           reference=item.reference, columns=dict(item.columns or {}))
        scores = asyncio.run(rewards.score(item.task, group))
        returned.append(ReturnedGroup("local", tuple(scores.rewards), tuple(len(x.completion_ids) for x in samples),
                                      tuple(x.finish_reason or "abort" for x in samples)))
    return figures(s.name, version, returned, s.samples_per_prompt, s.pass_threshold)


def _print_table(rows: list[dict[str, Any]], what: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fleetrl eval: {what}", title_justify="left")
    columns = ["set", "version", "prompts", "samples", "pass@1", "pass@k", "reward_mean", "length_mean", "truncated"]
    for c in columns:
        table.add_column(c)
    for r in rows:
        k = r["k"]
        table.add_row(*[f"{r[f'pass@{k}']} (k={k})" if c == "pass@k" else str(r[c]) for c in columns])
    Console(file=sys.stdout, width=None if sys.stdout.isatty() else 140).print(table)
