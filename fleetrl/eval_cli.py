"""`fleetrl eval`: one evaluation of one policy version (or an exported folder), on the fleet or here.

    fleetrl eval --config fleet.yaml --version N|latest [--set NAME] [--where auto|fleet|local] [--json]
    fleetrl eval --config fleet.yaml --model ./exported-folder [--set NAME]

`--where fleet` (and `auto`, the default, when the fleet is up) sends the prompts through the regions'
Kafka and reads the groups back (fleetrl/eval_fleet.py); `local`, `auto` when no region is up, and
`--model` generate here, with the torch engine:

It reads the version from the home store (`--version`) or loads a Hugging Face folder (`--model`, e.g.
one `fleetrl hub export` wrote), generates every prompt of each eval set (`eval.sets`, or `--set`) with
the set's sampling on one local torch engine, scores them with the set's reward (default the run's) and
prints the figures of docs/eval.md as a table: the same prompts, rewards and estimators as the
evaluations the trainer runs on the fleet. It sits in `fleetrl/` because it needs both the trainer's
figures and the rollout engine.
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
    where = getattr(args, "where", "local")
    if args.model is not None and where == "fleet":
        print(f"{args.command_prog}: error: argument --where: fleet evaluates a version of the home store "
              f"(--version); --model evaluates a folder here", file=sys.stderr)
        return 2
    if args.model is None and where != "local":
        from fleetrl.eval_fleet import FleetDown, fleet_rows
        from fleetrl.trainer_cli import eval_prompts

        try:
            version, rows = fleet_rows(config, sets, args.eval_version, timeout_s=args.timeout_s,
                                       probe_s=args.probe_s, prompts=eval_prompts(config))
        except FleetDown as exc:
            if where == "fleet":
                raise
            print(f"fleetrl eval: {exc}; evaluating here (--where auto)", file=sys.stderr)
        else:
            return _output(rows, f"version {version} on the fleet", args.json)
    engine, version, codec = _engine(config, args)
    rows = [_evaluate(config, s, engine, version, codec).row() for s in sets]
    engine.close()
    return _output(rows, args.model or f"version {version}", args.json)


def _output(rows: list[dict[str, Any]], what: str, as_json: bool) -> int:
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        _print_table(rows, what)
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
    from fleetrl.eval_fleet import resolve_version
    from fleetrl.hub import Hub

    with Hub.from_config(config) as hub:
        version = resolve_version(config, hub, args.eval_version)
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
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 140)
    console.print(table)
    for r in rows:
        if r.get("dead_lettered"):
            console.print(f"{r['set']}: {r['dead_lettered']} prompt(s) dead-lettered by the workers (`fleetrl "
                          f"topics dlq show`); the figures are over the {r['prompts']} that returned")
