"""The eval books of `fleetrl audit` (DESIGN.md §12): every eval prompt dispatched was returned once,
is still in flight, or was dead-lettered; none is lost.

The proof reads the trainer checkpoint's eval books (`eval_book.py`) and the topics (`audit.TopicView`):

* every prompt of an evaluation the checkpoint holds, below its `next_index` (dispatched before the
  checkpoint), is returned (once: the book keeps the first return), still in flight, or dead-lettered
  with a reason in the topics; anything else is lost;
* an eval prompt record of an evaluation the checkpoint does not hold, or past its `next_index`, was
  dispatched after the checkpoint (by a trainer that died before its next one): not lost, as for
  training groups;
* an evaluation is complete when each of its prompts returned or was dead-lettered (its figures are over
  the ones that returned); the audit lists the unfinished ones.
Eval groups that came back more than once on `trajectories` are counted (`returned_again`): the book
measured only the first.

The prompts of `fleetrl eval` requests on the fleet (group ids `<run>-evalreq-<request>-...`) belong to no
book of the trainer: they are counted apart (`requests`, `request_prompts`: the prompt records the audit
reads, from the checkpoint's settled watermark on), never lost, never dispatched after the checkpoint (the
command itself reported their return, or named what was missing; their groups, which the trainer skipped
and committed, lie below the offsets the audit reads `trajectories` from).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetrl.trainer.eval_book import EvalBook, eval_group_id, eval_request_of, parse_eval_group_id


@dataclass(slots=True)
class EvalAudit:
    scheduled: int = 0
    complete: int = 0
    unfinished: list[str] = field(default_factory=list)
    """`<set>@<version>` of each evaluation not complete in the checkpoint."""
    dispatched: int = 0
    """Eval prompts dispatched before the checkpoint (by its books)."""
    returned: int = 0
    in_flight: int = 0
    resent: int = 0
    dead_lettered: int = 0
    after_checkpoint: int = 0
    returned_again: int = 0
    """Eval groups that arrived on `trajectories` more than once (a re-sent prompt, a redelivery)."""
    lost: list[str] = field(default_factory=list)
    requests: int = 0
    """`fleetrl eval --where fleet` requests seen in the prompts topics (counted apart from the books)."""
    request_prompts: int = 0
    """Their eval prompts (distinct group ids, from the settled watermark on)."""

    def problems(self) -> list[str]:
        return [f"{len(self.lost)} eval prompt(s) lost: {self.lost[:10]}"] if self.lost else []


def reconcile_evals(dispatched: dict[str, list[tuple[str, int]]], arrived: dict[str, list[tuple[str, int]]],
                    dead: dict[str, list[str]], state: dict[str, Any] | None, run: str) -> EvalAudit:
    """The eval books of the checkpoint `state` against the topics' prompt, trajectory and dead-letter records."""
    book = EvalBook(run)
    book.restore((state or {}).get("eval"))
    out = EvalAudit(scheduled=len(book.evals))
    for ev in book.evals.values():
        out.complete += ev.settled
        if not ev.settled:
            out.unfinished.append(f"{ev.set_name}@{ev.version}")
        out.resent += ev.resent
        for index in range(ev.next_index):
            gid = eval_group_id(run, ev.set_name, ev.version, index)
            out.dispatched += 1
            if index in ev.returned:
                out.returned += 1
            elif index in ev.in_flight:
                out.in_flight += 1
            elif gid in dead:
                out.dead_lettered += 1
            else:
                out.lost.append(gid)
    requests = {gid: eval_request_of(gid, run) for gid in dispatched}
    mine = [gid for gid, request in requests.items() if request is not None]
    out.requests, out.request_prompts = len({requests[g] for g in mine}), len(mine)
    for gid in dispatched:
        parsed = parse_eval_group_id(gid, run)
        if parsed is None:
            continue
        known = book.evals.get((parsed[0], parsed[1]))
        if known is None or parsed[2] >= known.next_index:
            out.after_checkpoint += 1
    out.returned_again = sum(len(places) - 1 for gid, places in arrived.items()
                             if len(places) > 1 and parse_eval_group_id(gid, run) is not None)
    return out
