"""The trainer's checkpoints: what one holds, when its offsets are committed, and how a start resumes.

`Checkpoints` is the part of the trainer loop (`service.py`) that makes a restart exact. After a step,
`save` writes every rank's weight shards and the loop's state (step, version, the collector's ledger,
the dispatcher, the cost meter, the consumers' offsets) as one atomic checkpoint (`checkpoint.py`), and
only then commits the offsets it covers. `restore_or_start` takes the newest checkpoint up again, or
publishes the first version on a first start.

A SIGKILL anywhere leaves the newest checkpoint consistent with itself: restart loads it, seeks
every consumer to the offsets it recorded and re-reads what came after, and the collector's ledger
makes anything it already trained a duplicate. If the store's newest version is not the
checkpoint's (a version published after it from weights now lost, or the checkpoint's own version
still in flight when the process died), the checkpoint's weights are published again as the next
version, a delta against the store's newest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

from fleetrl.config import FleetConfig
from fleetrl.crashpoints import crash_point
from fleetrl.log import get_logger
from fleetrl.trainer import checkpoint
from fleetrl.trainer.collector import Collector
from fleetrl.trainer.cost import CostMeter
from fleetrl.trainer.dispatcher import Dispatcher, PromptItem
from fleetrl.trainer.eval_runner import EvalRunner
from fleetrl.trainer.learner import Learner
from fleetrl.trainer.metrics import TrainerMetrics
from fleetrl.trainer.publisher import WeightPublisher
from fleetrl.trainer.regions import RegionClients
from fleetrl.trainer.tracking import TrainerTracking

log = get_logger("fleetrl.trainer.service")  # its events are the trainer loop's, as before the split


class Checkpoints:
    """Saves and restores the trainer loop's state; `offsets` is the one map the region consumers
    report into (handed to `RegionClients` once restored)."""

    def __init__(self, config: FleetConfig, learner: Learner, collector: Collector, dispatcher: Dispatcher,
                 cost: CostMeter, metrics: TrainerMetrics, tracking: TrainerTracking | None = None,
                 evals: EvalRunner | None = None) -> None:
        self.config, self.learner, self.collector = config, learner, collector
        self.tracking = tracking
        self.dispatcher, self.cost, self.metrics, self.evals = dispatcher, cost, metrics, evals
        self.saved_step = -1
        self.offsets: dict[str, dict[tuple[str, int], int]] = {r.name: {} for r in config.regions}

    async def restore_or_start(self, publisher: WeightPublisher,
                               prompts: Callable[[], Iterator[PromptItem]]) -> tuple[int, int]:
        """The step and the version the loop goes on from: the newest checkpoint's, or 0 and a first
        version published (or taken up again) on a start without one."""
        ckpt = checkpoint.latest(self.config.trainer.checkpoint_dir, self.config.run)
        if self.learner.lora is not None:  # the adapter's versions need their base in the store first
            await publisher.ensure_base(self.learner.base_state, self.learner.lora)
        if ckpt is None:
            return 0, await self._first_version(publisher)
        if ckpt.shards is not None:  # every rank reads its own shards
            await asyncio.to_thread(self.learner.load_shards, str(ckpt.shards))
        else:  # a checkpoint of full state dicts (written before checkpoints were sharded)
            msd, osd = await asyncio.to_thread(ckpt.weights)
            await asyncio.to_thread(self.learner.load_state, msd, osd)
        s = ckpt.state
        step, version, self.saved_step = int(s["step"]), int(s["version"]), int(s["step"])
        self.collector.restore(s["collector"], drawn=int(s["dispatcher"]["next_index"]))
        self.cost.restore(s.get("cost", {}))
        if self.evals is not None:
            self.evals.restore(s.get("eval"))
        if self.tracking is not None:  # the same tracker run goes on (a checkpoint from before tracking: a new one)
            self.tracking.restore(s.get("tracking"), step)
        self.dispatcher.restore(s["dispatcher"], prompts())
        self.offsets = {r: {(t, int(p)): int(o) for t, p, o in rows} for r, rows in s["offsets"].items()}
        for r in self.config.regions:
            self.offsets.setdefault(r.name, {})
        pointer, latest = await asyncio.to_thread(publisher.store_versions)
        if latest != version or pointer != latest:
            # A version published after this checkpoint came from weights that are now lost (or the
            # checkpoint's own version never landed, or landed without `latest` moving): supersede it
            # with the checkpoint's weights as the next version after the store's newest, so that
            # engines converge on what we hold and `latest` names it.
            pv = await publisher.publish(await asyncio.to_thread(self.learner.published_state))
            log.warning("trainer.republished", checkpoint_version=version, hub_latest=pointer,
                        hub_newest=latest, version=pv.version)
            if pv.version != version:  # (the same number: only `latest` was moved to it)
                # The groups in flight made with the checkpoint's weights are as fresh as they were:
                # their staleness counts steps along the weights' lineage, not version numbers.
                self.collector.note_republished(pv.version, version)
            version = pv.version
        else:
            # The checkpoint's version is the store's newest; its announcement may not have gone out
            # (killed between moving `latest` and announcing): `_loop` announces it again.
            await asyncio.to_thread(publisher.adopt, latest)
        log.info("trainer.started", resumed=True, checkpoint=str(ckpt.path), step=step, version=version,
                 pending=len(self.collector.pending), in_flight=len(self.dispatcher.in_flight))
        return step, version

    async def _first_version(self, publisher: WeightPublisher) -> int:
        state = await asyncio.to_thread(self.learner.published_state)
        _, newest = await asyncio.to_thread(publisher.store_versions)
        if newest is not None:
            # Not the run's first start: a trainer killed before its first checkpoint may have
            # dispatched prompts whose groups arrive now; the ledger must treat them as unplaced.
            self.collector.ledger.restarted_without_checkpoint()
        if newest is not None and await asyncio.to_thread(publisher.holds, state, newest):
            # A start killed before its first checkpoint published these very weights: take that
            # version up again (announced by `_loop`) rather than publish them anew, which would
            # make every group already generated with it stale.
            await asyncio.to_thread(publisher.adopt, newest)
            version = newest
        else:
            version = (await publisher.publish(state)).version
        log.info("trainer.started", version=version, resumed=False)
        return version

    async def save(self, step: int, version: int, clients: RegionClients, *, amend: bool = False) -> None:
        """Save everything the next start needs, then (only then) commit the offsets it covers. `amend`: the
        step's checkpoint exists already; replace its loop state (what settled since: evaluations)."""
        if step == self.saved_step and not amend:
            return
        t0 = time.monotonic()
        covered = clients.take_handled()
        for region, consumer in clients.consumers.items():
            for tp, off in consumer.committable_offsets(covered.get(region, [])).items():
                self.offsets[region][tp] = max(off, self.offsets[region].get(tp, 0))
        state = {
            "run": self.config.run, "step": step, "version": version, "saved_at": time.time(),
            "collector": self.collector.state(), "dispatcher": self.dispatcher.state(), "cost": self.cost.state(),
            **({"eval": self.evals.state()} if self.evals is not None else {}),
            **({"tracking": self.tracking.state()} if self.tracking is not None else {}),
            "offsets": {r: [[t, p, o] for (t, p), o in sorted(tps.items())] for r, tps in self.offsets.items()},
        }
        directory = self.config.trainer.checkpoint_dir
        if step == self.saved_step:
            path = await asyncio.to_thread(checkpoint.amend_state, directory, step, state)
            log.info("checkpoint.amended", step=step, path=str(path))
            await clients.commit(covered)
            return
        tmp = await asyncio.to_thread(checkpoint.begin, directory, step)
        await asyncio.to_thread(self.learner.save_shards, str(tmp / checkpoint.WEIGHTS_DIR))
        crash_point("trainer.checkpoint.weights_written")
        path = await asyncio.to_thread(checkpoint.commit, directory, tmp, state, self.config.trainer.keep_checkpoints)
        self.saved_step = step
        self.metrics.checkpoint_seconds.observe(time.monotonic() - t0)
        log.info("checkpoint.saved", step=step, path=str(path))
        crash_point("trainer.checkpoint.renamed")
        await clients.commit(covered)
        crash_point("trainer.offsets.committed")
