"""`fleetrl trainer` as a process: one learner per rank, the trainer loop on rank 0.

Launched plainly it is one process; under `torchrun --nproc-per-node N` every rank builds the
(sharded) learner, rank 0 runs the loop and the other ranks follow its commands. SIGTERM and SIGINT
set a stop event: the loop finishes the step it is in, then checkpoints and commits within
`trainer.drain_timeout_s`, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from fleetrl.config import FleetConfig
from fleetrl.log import get_logger
from fleetrl.trainer.dispatcher import PromptItem

if TYPE_CHECKING:
    from fleetrl.trainer.learner import Learner
    from fleetrl.trainer.service import TrainerResult

log = get_logger(__name__)


def run_daemon(config: FleetConfig, prompts: Callable[[], Iterator[PromptItem]],
               max_steps: int | None = None, eval_prompts: Mapping[str, Sequence[PromptItem]] | None = None) -> int:
    """Train until `max_steps` (default `algorithm.max_steps`) or a signal; returns the exit code.
    `eval_prompts`: each eval set's prompts (`eval.sets`)."""
    import torch

    from fleetrl.trainer.dist import DistContext
    from fleetrl.trainer.learner import Learner

    torch.set_num_threads(config.trainer.threads)
    ctx = DistContext.from_env(config.trainer.device)
    try:
        _run_rank(config, prompts, max_steps, Learner(config.model, config.algorithm, ctx, config.trainer.emulate),
                  eval_prompts)
        return 0
    finally:
        ctx.close()  # the learner is unreachable by now (see DistContext.close)


def _run_rank(config: FleetConfig, prompts: Callable[[], Iterator[PromptItem]], max_steps: int | None,
              learner: Learner, eval_prompts: Mapping[str, Sequence[PromptItem]] | None = None) -> None:
    if not learner.ctx.is_leader:
        learner.follow()
        return
    try:
        result = asyncio.run(_lead(config, prompts, learner, max_steps, eval_prompts))
    finally:
        learner.stop_followers()
    log.info("trainer.finished", steps=result.steps, version=result.version,
             trained_groups=result.trained_groups, stale_groups=result.stale_groups)


async def _lead(config: FleetConfig, prompts: Callable[[], Iterator[PromptItem]], learner: Learner,
                max_steps: int | None, eval_prompts: Mapping[str, Sequence[PromptItem]] | None) -> TrainerResult:
    from fleetrl.trainer.metrics import TrainerMetrics
    from fleetrl.trainer.service import Trainer

    metrics = TrainerMetrics()
    if config.trainer.metrics_port is not None:
        port = metrics.serve(config.trainer.metrics_port)
        log.info("trainer.metrics", port=port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _stopper(stop, sig))
    try:
        return await Trainer(config, prompts, learner, metrics=metrics, eval_prompts=eval_prompts).run(max_steps, stop)
    finally:
        metrics.close()


def _stopper(stop: asyncio.Event, sig: signal.Signals) -> Callable[[], None]:
    def handler() -> None:
        log.info("trainer.stopping", signal=sig.name)
        stop.set()

    return handler
