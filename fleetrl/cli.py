"""The `fleetrl` command (DESIGN.md §9).

The whole argument tree is declared here with argparse and nothing heavy imported, so `--help`
answers at once; each sub-command names its handler as `"module:function"`, imported only when that
command runs. A handler takes `(args, config)` and returns an exit code. Fatal errors end as one
clear line on stderr and a non-zero exit (2 for a bad config or usage, 1 otherwise). A bad argument
is refused before any work starts, by its `type=` (fleetrl/cli_args.py) as argparse parses, or, when
only the config or a store can tell (`--region`, `--store`, a version), once they are read: one line
naming the argument, exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fleetrl import cli_args
from fleetrl.cli_args import OneLineParser, check_names, refusal_line

Handler = Callable[[argparse.Namespace, Any], int]
ALL_CHECKS = ("model", "task", "reward", "dataset", "tracking")
"""Workload checks (fleetrl/workload.py) a command runs after loading the config: a daemon checks what
its host needs (the trainer has no use for the reward module, the agents none for the dataset)."""


def _common(p: argparse.ArgumentParser, *, config: bool = True) -> None:
    if config:
        p.add_argument("--config", "-c", default="fleet.yaml", help="fleet.yaml of the run (default: %(default)s)")
    p.add_argument("--log-json", action="store_true", help="log JSON events (default: JSON unless on a TTY)")
    p.add_argument("--log-level", default="INFO", type=cli_args.log_level, help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument("--debug", action="store_true", help="show tracebacks of fatal errors")


def _cmd(sub: Any, name: str, handler: str, help: str, *, config: bool = True) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
    _common(p, config=config)
    p.set_defaults(handler=handler, needs_config=config, command_prog=p.prog)
    return p


def _region(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--region", "-r", required=required, help="region name" + ("" if required else " (default: all)"))


def _json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")


def _group(sub: Any, name: str, help: str, dest: str) -> Any:
    return sub.add_parser(name, help=help).add_subparsers(dest=dest, metavar="SUBCOMMAND", required=True)


def _add_config(sub: Any) -> None:
    config = _group(sub, "config", "check or document fleet.yaml", "config_command")
    p = _cmd(config, "check", "fleetrl.config_cli:check", "validate fleet.yaml and print the resolved config")
    p.set_defaults(workload=ALL_CHECKS)
    p.add_argument("file", nargs="?", help="fleet.yaml to check (default: --config)")
    _json(p)
    p = _cmd(config, "reference", "fleetrl.config_cli:reference", "print the configuration reference (Markdown)",
             config=False)
    p.add_argument("--update", metavar="FILE", type=cli_args.existing_file,
                   help="rewrite the reference between the markers in FILE")


def _add_topics(sub: Any) -> None:
    topics = _group(sub, "topics", "manage the Kafka topics of every region", "topics_command")
    for name, helptext in [
        ("create", "create the run's topics on every region cluster (idempotent)"),
        ("list", "list the run's topics and their partition counts"),
        ("describe", "show partitions and configs of the run's topics"),
        ("lag", "per-partition lag of the rollout and trainer consumer groups"),
    ]:
        p = _cmd(topics, name, f"fleetrl.broker.cli:topics_{name}", helptext)
        _region(p)
        _json(p)
    dlq = _group(topics, "dlq", "dead-lettered records", "dlq_command")
    p = _cmd(dlq, "show", "fleetrl.broker.cli:dlq_show", "print dead-lettered records with their reasons")
    _region(p)
    _json(p)
    p.add_argument("--limit", type=cli_args.positive_int, default=50, help="at most this many records per region")
    p = _cmd(dlq, "replay", "fleetrl.broker.cli:dlq_replay", "re-produce chosen dead letters to their topic")
    _region(p, required=True)
    p.add_argument("--offset", dest="offsets", type=cli_args.partition_offset, action="append", default=[],
                   help="PARTITION:OFFSET of a dead letter to replay (repeatable)")
    p.add_argument("--all", action="store_true", help="replay every dead letter of the region")
    p.add_argument("--dry-run", action="store_true", help="show what would be replayed")
    _json(p)


def _add_hub(sub: Any) -> None:
    hub = _group(sub, "hub", "the tensor hub: versions in object stores", "hub_command")
    p = _cmd(hub, "publish", "fleetrl.hub.cli:publish", "publish a safetensors file or folder as the next version")
    p.add_argument("path", type=cli_args.existing_path, help="a .safetensors file or a folder of them")
    p = _cmd(hub, "pull", "fleetrl.hub.cli:pull", "materialize a version into a safetensors file")
    # dest differs from the name: `args.version` is the top-level --version flag
    p.add_argument("hub_version", metavar="version", type=cli_args.version, help="version number or 'latest'")
    p.add_argument("out", type=cli_args.output_file, help="output .safetensors path")
    p.add_argument("--store", default="home", help="store to read from (default: %(default)s)")
    p = _cmd(hub, "verify", "fleetrl.hub.cli:verify", "check signature and every hash of a version")
    p.add_argument("hub_version", metavar="version", nargs="?", type=cli_args.version,
                   help="version number or 'latest'")
    p.add_argument("--store", default="home",
                   help="store to read from; with --all also a comma list or 'all' (default: %(default)s)")
    p.add_argument("--all", action="store_true",
                   help="every version of the store(s): gapless, `latest` the newest, each one verified")
    p = _cmd(hub, "ls", "fleetrl.hub.cli:ls", "list versions, their encodings, sizes and holders")
    p.add_argument("--store", default="home", help="store to list (default: %(default)s)")
    _json(p)
    p = _cmd(hub, "export", "fleetrl.export_cli:export",
             "write a version as a Hugging Face model folder (a LoRA adapter version: as a peft adapter folder)")
    p.add_argument("--version", dest="hub_version", required=True, type=cli_args.version,
                   help="version number or 'latest'")
    p.add_argument("--out", required=True, type=cli_args.new_path, help="the folder to write (must not exist)")
    p.add_argument("--merged", action="store_true",
                   help="a LoRA adapter version: merge it into its base and write a full Hugging Face folder")
    p.add_argument("--max-shard-size", default="5GB", type=cli_args.byte_size,
                   help="largest safetensors shard (default: %(default)s)")
    p.add_argument("--store", default="home", help="store to read from (default: %(default)s)")
    p = _cmd(hub, "gc", "fleetrl.hub.cli:gc", "delete objects no retained version needs")
    p.add_argument("--store", default="home", help="store to collect (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted")


def _add_daemons(sub: Any) -> None:
    p = _cmd(sub, "trainer", "fleetrl.trainer_cli:run_trainer", "run the central trainer (daemon)")
    p.set_defaults(workload=("model", "task", "dataset", "tracking"))
    p.add_argument("--steps", type=cli_args.positive_int, default=None,
                   help="stop after this many steps (default: config)")
    p = _cmd(sub, "agent", "fleetrl.regions.cli:run_agent", "run a region agent on a rollout node (daemon)")
    p.set_defaults(workload=("model", "task", "reward"))
    _region(p, required=True)
    p.add_argument("--node", "-n", required=True,
                   help="node name ([a-z0-9-], need not be listed in the config: auto-scaled nodes use instance ids)")
    p.add_argument("--notice-file", default=None, metavar="PATH",
                   help="preemption notice: when this file appears, hand over, go offline and exit 0")
    p = _cmd(sub, "replicator", "fleetrl.regions.replicas:run_replicator",
             "replicate versions into a region store and announce them (daemon)")
    _region(p, required=True)
    p.add_argument("--once", action="store_true", help="replicate what is missing, then exit")


def _add_operations(sub: Any) -> None:
    p = _cmd(sub, "status", "fleetrl.broker.fleet_status:status", "fleet view from the MQTT retained state")
    _json(p)
    p.add_argument("--wait-s", type=cli_args.non_negative_seconds, default=2.0,
                   help="how long to collect retained messages, at most: it shows the fleet as soon as it has the "
                        "policy and a heartbeat of every node the config lists (and what else came with them)")
    p.add_argument("--watch", type=cli_args.positive_seconds, default=None, metavar="S",
                   help="stay connected and redraw every S seconds (Ctrl-C ends it)")
    ctl = sub.add_parser("control", help="send a command to every node of a region").add_subparsers(
        dest="command_name", metavar="COMMAND", required=True
    )
    for name, helptext in [
        ("drain", "stop admitting work; hand unfinished groups over as partials"),
        ("resume", "admit work again after a drain"),
        ("stop", "hand over, then stop the agents"),
    ]:
        p = _cmd(ctl, name, "fleetrl.broker.cli:control", helptext)
        _region(p, required=True)
        p.add_argument("--reason", default="", help="recorded with the command")
    p = _cmd(sub, "eval", "fleetrl.eval_cli:run_eval",
             "evaluate one policy version (or an exported folder) on the eval sets: through the fleet when it is "
             "up, else here with the torch engine (docs/eval.md)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--version", dest="eval_version", metavar="N|latest", type=cli_args.version,
                       help="a version of the run's home store, or `latest`")
    which.add_argument("--model", metavar="PATH", help="a Hugging Face folder (`fleetrl hub export` writes one)")
    p.add_argument("--set", metavar="NAME", default=None, help="only this eval set (default: every one)")
    p.add_argument("--where", type=cli_args.eval_where, default="auto", metavar="auto|fleet|local",
                   help="fleet: send the prompts through the regions' Kafka (an error when no region shows a "
                        "serving node on MQTT and answers on Kafka); local: generate here with the torch engine; "
                        "auto: the fleet when it is up, else here (default: %(default)s; --model is always local)")
    p.add_argument("--timeout-s", type=cli_args.positive_seconds, default=None, metavar="S",
                   help="on the fleet: fail when not every prompt returned within S s "
                        "(default: eval.finish_timeout_s)")
    p.add_argument("--probe-s", type=cli_args.positive_seconds, default=5.0, metavar="S",
                   help="how long to look for the fleet (MQTT heartbeats, each region's Kafka) "
                        "(default: %(default)s)")
    _json(p)
    p = _cmd(sub, "audit", "fleetrl.trainer.cli:audit",
             "prove every dispatched group was trained once, counted stale or dead-lettered")
    _json(p)


def _add_units(sub: Any) -> None:
    units = _group(sub, "units", "the systemd units of FleetRL's daemons", "units_command")
    p = _cmd(units, "install", "fleetrl.regions.units:run_units",
             "write fleetrl-agent.service, fleetrl-replicator@.service and fleetrl-trainer.service "
             "(or print them)", config=False)
    p.add_argument("--dest", default=None, metavar="DIR",
                   help="unit folder to write into, e.g. /etc/systemd/system (default: print the units)")
    p.add_argument("--prefix", default="/opt/fleetrl/venv", metavar="VENV",
                   help="virtualenv whose bin/fleetrl the units start (default: %(default)s)")
    p.add_argument("--config", dest="unit_config", default="/etc/fleetrl/fleet.yaml", metavar="PATH",
                   help="fleet.yaml the units pass to the daemons (default: %(default)s)")


def _partition(text: str) -> Any:
    from fleetrl.demo.chaos import parse_partition

    return parse_partition(text)


def _kill_kinds(text: str) -> tuple[str, ...]:
    from fleetrl.demo.chaos import parse_kill_only

    return parse_kill_only(text)


def _crash_points(text: str) -> tuple[str, ...]:
    from fleetrl.demo.chaos import parse_crash_at

    return parse_crash_at(text)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fleetrl", description="Cross-region, asynchronous RL post-training over message brokers."
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = _cmd(sub, "demo", "fleetrl.demo.runner:run_demo", "run the whole pipeline on this machine (embedded stack)")
    p.set_defaults(workload=ALL_CHECKS)
    p.epilog = ("Starts tansu per region and an MQTT broker on the config's loopback ports, then the trainer, one "
                "replicator per region and one agent per node as processes; prints progress, runs the audit and "
                "a summary, and stops everything it started (also on Ctrl-C or a failure). Every run starts "
                "fresh: the work directory's stores, checkpoints and logs are wiped first (there is no resume).")
    p.add_argument("--steps", type=cli_args.positive_int, default=None,
                   help="optimizer steps (default: algorithm.max_steps)")
    p.add_argument("--workdir", default=None, type=cli_args.folder_to_make,
                   help="folder for stores, checkpoints and logs, WIPED at the start of each run "
                        "(default: .fleetrl/demo next to the config; a non-empty folder the demo did not make "
                        "is refused)")
    p.add_argument("--duration", type=cli_args.positive_seconds, default=None, metavar="S",
                   help="stop the trainer (SIGTERM: it drains and checkpoints) after S s, then audit as usual")
    p.add_argument("--stall-timeout", type=cli_args.positive_seconds, default=300.0, metavar="S",
                   help="fail the run when no optimizer step comes for S s (default 300; a hang detector: raise it "
                        "on a machine much slower than 2 cores)")
    p.add_argument("--out", default=None, metavar="DIR", type=cli_args.folder_to_make,
                   help="where summary.json, metrics.jsonl and reward.png go (default: the work dir)")
    p.add_argument("--report-to", default=None, metavar="TRACKER[,TRACKER]", type=cli_args.trackers,
                   help="experiment trackers the trainer feeds (tensorboard, mlflow, wandb, trackio; overrides "
                        "tracking.report_to); their files go under OUT/tracking/ (docs/tracking.md)")
    chaos = p.add_argument_group("faults (on the real processes; see docs/demo.md)")
    chaos.add_argument("--kill-every", type=cli_args.positive_seconds, default=None, metavar="S",
                       help="SIGKILL a process (trainer, agent, worker, replicator; with --durable a region's "
                            "broker; the kinds take turns) every S s and restart it, as systemd would")
    chaos.add_argument("--kill-only", default=None, metavar="KIND[,KIND]", type=_kill_kinds,
                       help="kill only these kinds: trainer, agent, worker, replicator, broker (default: all)")
    chaos.add_argument("--preempt-every", type=cli_args.positive_seconds, default=None, metavar="S",
                       help="send a random live node a preemption notice every S s and start a replacement node")
    chaos.add_argument("--partition", action="append", default=None, metavar="REGION:START:SECONDS",
                       type=_partition, help="cut REGION's links home (Kafka to the trainer, MQTT, the home "
                                             "store) from START s for SECONDS s; repeatable")
    chaos.add_argument("--fuzz-rate", type=cli_args.fraction, default=0.0, metavar="R",
                       help="fraction of hostile records in prompts and trajectories, from a fuzzing producer")
    chaos.add_argument("--fuzz-records", type=cli_args.positive_int, default=None, metavar="N",
                       help="send exactly N hostile records (at --fuzz-rate among the valid ones, else all at "
                            "once) and end the run once every one is dead-lettered, however long that takes")
    chaos.add_argument("--until-faults", action="store_true",
                       help="end the run (the trainer drains) once every fault asked for has happened and been "
                            "recovered from: each --kill-only kind killed, each partition healed, a node preempted, "
                            "every crash point fired")
    chaos.add_argument("--durable", action="store_true",
                       help="regions' tansu keep their log in S3 (a moto server), surviving a broker kill")
    chaos.add_argument("--recover", type=cli_args.positive_seconds, default=None, metavar="S",
                       help="after its restart a killed process is spared from kills for S s, and a restarted "
                            "trainer until it checkpoints, at most 6 x S s (default 20; raise it on a machine much "
                            "slower than 2 cores)")
    chaos.add_argument("--seed", type=int, default=0, help="seed of the fault schedule and the fuzzer")
    chaos.add_argument("--crash-at", action="append", default=None, metavar="POINT[@N][,POINT...]",
                       type=_crash_points,
                       help="crash the process that reaches each named crash point there (SIGKILL) and restart "
                            "it; each process kind runs its points in order (docs/crashpoints.md); repeatable")
    for add in (_add_config, _add_topics, _add_hub, _add_daemons, _add_operations, _add_units):
        add(sub)
    return parser


def _load_handler(spec: str) -> Handler:
    module, _, func = spec.partition(":")
    handler: Handler = getattr(importlib.import_module(module), func)
    return handler


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from fleetrl import __version__

        print(f"fleetrl {__version__}")
        return 0
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2

    from fleetrl.runtime import DAEMONS, no_progress_bars

    if args.command in DAEMONS:
        no_progress_bars()  # before anything imports tqdm
    from fleetrl.config import ConfigError, load_config, register_all
    from fleetrl.log import configure, redact

    configure(json=True if args.log_json else None, level=args.log_level)
    try:
        config = None
        if args.needs_config:
            source = getattr(args, "file", None) or args.config
            config = load_config(source)
            register_all(config)  # from here on, no log event or error line shows a configured secret
            check_names(args, config, str(source))
            if getattr(args, "workload", None):
                from fleetrl.workload import check_workload

                check_workload(config, str(source), args.workload)
        return _load_handler(args.handler)(args, config)
    except ConfigError as exc:
        print(redact(f"fleetrl: config error: {exc}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        refusal = refusal_line(args.command_prog, exc)
        if refusal is not None:  # an argument that the config or a store refuses (fleetrl/cli_args.py)
            print(redact(refusal), file=sys.stderr)
            return 2
        if args.debug:
            raise
        print(redact(f"fleetrl: error: {type(exc).__name__}: {exc}"), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
