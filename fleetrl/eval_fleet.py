"""`fleetrl eval --where fleet`: one evaluation through the running fleet's Kafka (docs/eval.md).

Is the fleet up? `probe` asks, within `--probe-s`: the MQTT control plane's retained heartbeats must show
a serving node (`up`, an engine up, its heartbeat younger than three `mqtt.heartbeat_interval_s`) in a
region, and that region's Kafka must answer (its `trajectories` topic described and opened). The regions
that pass are the fleet this evaluation uses; none passing is `FleetDown`, naming what each region lacked.

The evaluation is the trainer's own machinery (`trainer/eval_runner.py`) with a request id: the prompts go
out on the regions' `prompts` topics as eval prompts pinned at the version, with group ids that name the
request (`<run>-evalreq-<request>-<set>-<version>-<index>`), placed by region credits fed by the
heartbeats, within `eval.max_share`, re-sent after `eval.deadline_s` of silence or at once when their region
goes silent (no serving node). The version is pinned in the home store as `<run>/pins/<N>-<request>` while
it runs (retention keeps it; the trainer's own pin of the same version is another object) and released
after, finished or not.

The groups are read back from each region's `trajectories` with a `LogTail` placed at the log's end before
the first prompt goes out: a reader outside every consumer group, so the trainer's group
`fleetrl.<run>.trainer` keeps every record (the trainer skips these groups: `EvalRunner.on_group`), and no
group is joined (seconds on tansu) or left behind. Only this request's groups are decoded and counted,
each once. The run ends when every prompt has returned, or fails after `--timeout-s`
(`eval.finish_timeout_s` by default) naming what is missing. The figures are `eval_figures.py`'s, as in
the local mode and the trainer's evaluations.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, TextIO

from fleetrl.broker import (
    BrokerError,
    ControlPlane,
    GroupRecord,
    Heartbeat,
    KafkaError,
    LogTail,
    Producer,
    PromptRecord,
    RecordError,
    decode_record,
)
from fleetrl.config import EvalSetConfig, FleetConfig
from fleetrl.hub import Hub
from fleetrl.trainer.credits import RegionCredits
from fleetrl.trainer.dispatcher import PromptItem
from fleetrl.trainer.eval_book import eval_request_of
from fleetrl.trainer.eval_dead import EvalDeadLetters
from fleetrl.trainer.eval_runner import EvalRunner

READ_MAX_RECORDS = 256
READ_TIMEOUT_S = 0.2


class FleetDown(Exception):
    """`--where fleet` and no region both shows a serving node and answers on Kafka."""


class EvalUnfinished(Exception):
    """Not every prompt returned within the bound."""


@dataclass(slots=True)
class FleetLink:
    """The fleet as the probe found it: per usable region a producer (`prompts`) and a tail (`trajectories`)."""

    control: ControlPlane
    producers: dict[str, Producer] = field(default_factory=dict)
    tails: dict[str, LogTail] = field(default_factory=dict)
    dead: EvalDeadLetters | None = None
    """The regions' dead letters: a prompt a worker dead-lettered ends the evaluation without it."""


def serving_nodes(nodes: Mapping[tuple[str, str], Heartbeat], now: float, stale_after_s: float) -> dict[str, int]:
    """Serving nodes per region: `up` with an engine up, and a heartbeat younger than `stale_after_s`."""
    out: dict[str, int] = {}
    for (region, _), beat in nodes.items():
        if beat.serving and now - beat.ts <= stale_after_s:
            out[region] = out.get(region, 0) + 1
    return out


async def probe(config: FleetConfig, stack: AsyncExitStack, wait_s: float) -> FleetLink:
    """The usable regions, with their clients entered into `stack`; `FleetDown` within about `wait_s`."""
    try:
        control = await asyncio.wait_for(stack.enter_async_context(ControlPlane(
            config, f"fleetrl-eval-{os.getpid()}", connect_timeout_s=wait_s)), wait_s + 5.0)
    except (BrokerError, TimeoutError, OSError) as exc:
        raise FleetDown(f"the MQTT control plane ({config.mqtt.url}) did not answer within {wait_s:g} s: {exc}; "
                        f"run with --where local to evaluate here") from exc
    stale_after_s = 3 * config.mqtt.heartbeat_interval_s
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    listed = {r.name for r in config.regions}
    # The retained heartbeats come in a burst right after subscribing: wait until every region serves, or the
    # burst is over with some region serving, or the bound passes.
    while (left := deadline - loop.time()) > 0:
        live = serving_nodes(control.nodes, time.time(), stale_after_s)
        if listed <= live.keys() or (not await control.changed(min(left, 0.5)) and live):
            break
    live = serving_nodes(control.nodes, time.time(), stale_after_s)
    link, why = FleetLink(control), {r: "no serving node heartbeat" for r in sorted(listed - live.keys())}
    for region in sorted(listed & live.keys()):
        try:
            await asyncio.wait_for(_open_region(config, region, link, stack), wait_s)
        except TimeoutError:
            why[region] = f"Kafka did not answer within {wait_s:g} s"
        except (KafkaError, OSError) as exc:
            why[region] = f"Kafka did not answer: {exc}"
    if link.tails:  # open before the first prompt goes out: the tail starts at the end
        link.dead = await stack.enter_async_context(EvalDeadLetters(config, f"fleetrl-eval-{os.getpid()}-dead",
                                                                    list(link.tails), window=0))
        await asyncio.wait_for(link.dead.start(), wait_s)
    if not link.tails:
        raise FleetDown(f"no region of run {config.run!r} is up: " + "; ".join(f"{r}: {w}" for r, w in why.items())
                        + " (fleetrl status shows the heartbeats; --where local evaluates here)")
    return link


async def _open_region(config: FleetConfig, region: str, link: FleetLink, stack: AsyncExitStack) -> None:
    client = f"fleetrl-eval-{os.getpid()}-{region}"
    link.producers[region] = await stack.enter_async_context(Producer(config, region, client))
    link.tails[region] = await stack.enter_async_context(LogTail(config, region, "trajectories", client, window=0))


class FleetEval:
    """One `fleetrl eval` request on the fleet: `await FleetEval(...).run()` returns the table's rows."""

    def __init__(self, config: FleetConfig, prompts: Mapping[str, Sequence[PromptItem]], sets: Sequence[str],
                 link: FleetLink, *, timeout_s: float, progress_s: float = 5.0, out: TextIO = sys.stderr,
                 request: str | None = None) -> None:
        self.config, self.link, self.sets, self.timeout_s = config, link, list(sets), timeout_s
        self.progress_s, self.out = progress_s, out
        self.request = request or uuid.uuid4().hex[:10]
        a = config.algorithm
        self.credits = RegionCredits({r.name: r.weight for r in config.regions if r.name in link.tails},
                                     window_s=config.trainer.throughput_window_s,
                                     tokens_per_group=a.n_samples * a.max_new_tokens)
        self.runner = EvalRunner(config, prompts, self._send, self.credits, request=self.request)
        self._gone: set[str] = set()

    async def run(self, hub: Hub, version: int) -> list[dict[str, Any]]:
        self.runner.pin = lambda v, pinned: hub.pin(v, pinned, holder=self.request)
        self.runner.schedule(version, 0, self.sets)
        try:
            await self._until_done()
        finally:
            await self.runner.release_pins()
        return [{k: v for k, v in ev.row.items() if k != "step"} for ev in self.runner.book.evals.values()
                if ev.row is not None]

    async def _until_done(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        next_report = loop.time() + self.progress_s
        while self.runner.unfinished:
            if loop.time() >= deadline:
                raise EvalUnfinished(f"request {self.request}: {self._progress()} within --timeout-s "
                                     f"{self.timeout_s:g} s (eval.finish_timeout_s by default); its pin is released")
            now = time.time()
            self._watch_regions(now)
            await self.runner.dispatch(now, {})
            await self._read(now)
            if self.link.dead is not None:
                await self.link.dead.poll(self.runner.on_dead_letter)
            if loop.time() >= next_report:
                print(f"fleetrl eval: {self._progress()}, {deadline - loop.time():.0f} s left", file=self.out)
                next_report = loop.time() + self.progress_s

    def _progress(self) -> str:
        parts = [f"{ev.set_name}@{ev.version} {len(ev.returned)}/{ev.prompts} returned"
                 + (f", {len(ev.dead)} dead-lettered" if ev.dead else "")
                 + (f" ({ev.resent} re-sent)" if ev.resent else "") for ev in self.runner.book.evals.values()]
        return ", ".join(parts)

    def _watch_regions(self, now: float) -> None:
        """Feed the credits, and send a silent region's prompts again elsewhere (as the trainer does)."""
        nodes = self.link.control.nodes
        for (region, node), beat in list(nodes.items()):
            if region in self.credits.regions:
                self.credits.on_heartbeat(region, node, beat.state, beat.tokens_per_s, min(beat.ts, now),
                                          busy_tokens_per_s=beat.busy_tokens_per_s, serving=beat.serving)
        live = serving_nodes(nodes, now, 3 * self.config.mqtt.heartbeat_interval_s)
        for region in set(self.link.tails) - live.keys() - self._gone:
            moved = self.runner.region_gone(region)
            print(f"fleetrl eval: region {region} went silent; {moved} prompt(s) sent again elsewhere", file=self.out)
        self._gone = set(self.link.tails) - live.keys()

    async def _send(self, region: str, record: PromptRecord) -> None:
        await self.link.producers[region].send("prompts", record.group_id, record)

    async def _read(self, now: float) -> None:
        regions = list(self.link.tails)
        results = await asyncio.gather(*(self.link.tails[r].read(READ_MAX_RECORDS, READ_TIMEOUT_S) for r in regions),
                                       return_exceptions=True)
        for region, result in zip(regions, results, strict=True):
            if isinstance(result, BaseException):
                if not getattr(result, "retriable", False):
                    raise result
                print(f"fleetrl eval: reading region {region} failed ({result}); trying again", file=self.out)
                continue
            for raw in result:
                gid = raw.key.decode(errors="replace") if raw.key else ""
                if eval_request_of(gid, self.config.run) != self.request:
                    continue  # the trainer's work, or another request's
                try:
                    record = decode_record(raw.value)
                except RecordError:
                    continue  # the trainer dead-letters what does not decode; a copy would follow
                if isinstance(record, GroupRecord) and record.eval is not None:
                    self.credits.on_arrival(region, now)
                    self.runner.on_group(record, 0)


def resolve_version(config: FleetConfig, hub: Hub, arg: str) -> int:
    """The version `--version` names (`latest` or N), which the home store must hold."""
    from fleetrl.hub import UnknownVersion

    version = hub.latest() if arg == "latest" else int(arg)
    held = hub.versions()
    if version is None or version not in held:
        raise UnknownVersion(f"the home store of run {config.run!r} holds no version {arg} "
                             f"(it holds {f'{held[0]}..{held[-1]}' if held else 'none'})", argument="--version")
    return version


def fleet_rows(config: FleetConfig, sets: Sequence[EvalSetConfig], version_arg: str, *, timeout_s: float | None,
               probe_s: float, prompts: Mapping[str, Sequence[PromptItem]]) -> tuple[int, list[dict[str, Any]]]:
    """(version, rows) of one evaluation on the fleet; `FleetDown` when it is not up."""
    return asyncio.run(_fleet_rows(config, sets, version_arg, timeout_s, probe_s, prompts))


async def _fleet_rows(config: FleetConfig, sets: Sequence[EvalSetConfig], version_arg: str,
                      timeout_s: float | None, probe_s: float,
                      prompts: Mapping[str, Sequence[PromptItem]]) -> tuple[int, list[dict[str, Any]]]:
    async with AsyncExitStack() as stack:
        link = await probe(config, stack, probe_s)
        hub = Hub.from_config(config)
        stack.callback(hub.close)
        version = await asyncio.to_thread(resolve_version, config, hub, version_arg)
        names = [s.name for s in sets]
        print(f"fleetrl eval: version {version} on region(s) {', '.join(link.tails)}: "
              f"{sum(s.num_prompts for s in sets)} prompt(s) of {', '.join(names)}", file=sys.stderr)
        job = FleetEval(config, prompts, names, link,
                        timeout_s=timeout_s if timeout_s is not None else config.eval.finish_timeout_s)
        rows = await job.run(hub, version)
        for ev in job.runner.book.evals.values():
            if ev.row is None:
                raise EvalUnfinished(f"eval set {ev.set_name!r} at version {version}: every one of its {ev.prompts} "
                                     f"prompt(s) was dead-lettered by the workers (fleetrl topics dlq show)")
        return version, rows
