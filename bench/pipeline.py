"""The headline number: asynchronous training against the synchronous baseline on the same fleet.

Runs the real system twice per seed on one fleet description, `algorithm.mode: sync` then `async`:
one tansu broker per region, an MQTT broker, the trainer, and one region agent per node (each
supervising its rollout worker process), all as processes started with the `fleetrl` CLI. Both runs
have the same groups per step. Sync spreads each step's groups over the regions by their measured
capacity (trainer/credits.py), as a synchronous trainer over the same workers would: the baseline
does not starve its own fast region. The fleet is heterogeneous and unreliable, as the papers'
settings are:

* regions with different per-token speeds: `regions[].engine.emulate.step_delay_s` sleeps after
  every decoding step of the real torch engine (a throttle: THIS IS EMULATED, and said so below);
* a long-tailed completion-length distribution: the samples of `engine.emulate.tail_p` of the
  prompts run to `max_new_tokens`, the others stop after 1..`short_tokens` tokens (emulated lengths
  of the real engine, `tail_by_prompt`; the tiny random model has no length distribution of its
  own); `--prompts` distinct prompts are cycled as epochs, so each comes back;
* length-aware scheduling (`rollout.length_aware`, on by default) against off: each run pair is
  repeated with it off, and the sync step's wall time and the async throughput printed side by side;
* preemptions: every `--preempt-every` seconds a random live node gets a notice through its agent's
  `--notice-file` (the agent hands its groups over as partials and exits 0), and a replacement node
  starts, as a spot fleet does (only nodes whose worker is up are preempted);
* a link delay between home and every region: `regions[].emulate_link_delay_s` holds each prompt
  that long in the trainer before it is produced to the region's Kafka, and each trajectory that long
  after the trainer fetched it (a throttle in the trainer's transport: EMULATED, and said so below).
  Weights are not delayed: the regions' stores are the home store (one directory) and the policy
  announcement goes over loopback MQTT.

Throughput is measured from the end of step `max_staleness + 2` to the end of the last: start-up
(brokers, processes, Kafka group joins) counts in neither run, and the async run's window starts
and ends with a full pipeline, so work it generated ahead before the window is no head start. The
full run trains on until that window covers five preemption intervals (`--window-intervals`), so
where one preemption falls no longer decides the ratio; `--quick` trains exactly `--steps` steps.

`--profile production` keeps every process and sets the throttles in the proportions of a 7B policy
on H100s (decode time per token, a long-tailed length law, training time emulated in the learner,
WAN round trip, weight transfer per version), each number with its source (`--help`, and
docs/pipeline.md).

Printed per run: the window's length and the preemptions inside it, groups trained per second,
tokens sampled per second, engine-idle fraction per region (1 - time in engine steps / worker
uptime, over the measured window), trainer-idle fraction (1 - time stepping and publishing /
window), mean and max staleness of the trained groups; at preemptions, the tokens workers handed
over and the trainer moved to another region (kept, not regenerated), the groups restarted from
scratch and the handovers that ran out of time (their tokens are regenerated); tokens sampled and
trained, and the mean reward of the last 3 steps (the reward comparison takes both runs at the
smaller step count: equal samples); a group's round trip in phases (to the worker, waiting there for
its weights, generating, back to the trainer: the trainer's per-step means, trainer/round_trips.py).
The last line:

    result: throughput_ratio=... reward_delta=... engine_idle_async=... engine_idle_sync=...
            engine_idle_sync_r0=... engine_idle_async_r0=... window_s_sync=... preemptions_sync=...
            rt_to_worker_async=... rt_wait_async=... rt_generate_async=... rt_back_async=... ...
            sync_step_s_la_on=... sync_step_s_la_off=... async_groups_s_la_on=... async_groups_s_la_off=...

    .venv/bin/python bench/pipeline.py [--quick] [--seeds N] [--profile defaults|production]
                                       [--grid tail|preempt] [--workload tools]
    .venv/bin/python bench/pipeline.py --cost [--quick] [--seeds N] [--cost-grid] [--discount 0.65]
                                       [--spot-preempt-every 60] [--od-nodes 3] [--base-nodes 1]

`--cost` runs an on-demand fleet against a hybrid one at the same dollars per hour instead
(bench/cost_fleet.py; results: docs/cost.md).

The fleet description and one run's processes and figures are bench/fleet_run.py's (cost_fleet.py builds
on them too). `FLEETRL_BENCH_KEEP=DIR` keeps every run's config and logs under DIR. Results: docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

from fleet_run import Fleet, Run, RunResult

from fleetrl.hub.signing import generate_ed25519
from fleetrl.trainer.round_trips import PHASES

PRODUCTION_SCALE = {"tokens": 256, "time": 128}
"""`--profile production`: one bench token stands for 256 real tokens and one bench second for 128 real
seconds, so every proportion below holds while a run fits in minutes on 2 CPU cores."""

PRODUCTION_SOURCES = """\
production profile: a 7B policy (Qwen2.5-7B, 7.62 B parameters) trained with GRPO in the shape of DAPO's
runs, scaled by 1/256 in tokens and 1/128 in time (a bench token is 256 real tokens, a bench second 128
real seconds); each number, its source, and what it becomes here:
  * decode: 20 ms per decoding step of a 7B engine on one H100 at ~100 concurrent sequences, i.e. ~5,000
    tokens/s, as Red Hat's MLPerf Inference v5.1 result measured (Llama-3.1-8B, vLLM, one H100: 5,103
    tokens/s Server, 5,777 Offline; redhat.com/en/blog/efficient-and-reproducible-llm-inference-red-hat-
    mlperf-inference-v51-results); the slow region an A100, 2x slower (Lambda's vLLM benchmark, "H100 ~2x
    better throughput and lower latency than A100": github.com/LambdaLabsML/vllm-benchmark) -> step delay
    0.040 s (H100 region) and 0.080 s (A100 region) per bench token;
  * tokens per sample: DAPO's budget, 16,384 tokens (+4,096 soft overlong; 512 prompts x 16 samples a
    step: Yu et al. 2025, arXiv:2503.14476); a 10 % tail runs to the budget, the rest stop uniformly within
    4,096 (mean ~3,500: an ASSUMPTION, not a measurement) -> max_new_tokens 64, short_tokens 16, tail 10 %;
  * training: 8N FLOPs per token (6N forward + backward, Kaplan et al. 2020, arXiv:2001.08361, plus 2N to
    recompute the old log-probs) over a DAPO step's 8,192 x ~3,700 tokens on 64 H100s (989 TFLOP/s dense
    bf16, NVIDIA H100 datasheet) at 40 % MFU (ASSUMPTION) = 72 s a step -> 0.0025 s per trained bench token
    (a bench step's ~225 tokens: 0.56 s), slept in the learner after its real step;
  * WAN: 150 ms round trip home <-> region (issue 25's figure; a cross-continent inter-region RTT, e.g.
    cloudping.co's AWS matrix) -> 0.0006 s one way, through the trainer's link-delay throttle;
  * weights: 15.2 GB of bf16 per version dense; ~220 MB as a delta (the README's hub figure, 2.9 MB a
    version for a 100.7 M-parameter Qwen2 at lr 1e-6 by bench/hub_delta.py, scaled by parameters), ~0.2 s
    over a 10 Gbit/s inter-region link (bandwidth an ASSUMPTION) plus the replicator's round trips: ~0.5 s
    -> 0.004 s added to each worker's pull of each version.
  Not scaled (the bench's own floor, far above these proportions): Kafka fetch waits, the trainer's 0.2 s
  poll, the tiny model's CPU decode step (~5 ms) and learner step, and a replacement node's 10-30 s start."""

PROFILES: dict[str, dict[str, Any]] = {
    "defaults": {"slowdowns": (0.0, 0.03), "tail_p": 0.15, "short_tokens": 4, "max_new_tokens": 48,
                 "link_delay_s": 0.05},
    "production": {"slowdowns": (0.040, 0.080), "tail_p": 0.10, "short_tokens": 16, "max_new_tokens": 64,
                   "link_delay_s": 0.0006, "weight_transfer_s": 0.004, "learner_token_s": 0.0025},
}
"""Throttle settings per `--profile` (production: see PRODUCTION_SOURCES)."""



def run_once(fleet: Fleet, mode: str, seed: int, timeout_s: float) -> RunResult:
    keep = os.environ.get("FLEETRL_BENCH_KEEP")  # a folder: keep each run's logs there
    with tempfile.TemporaryDirectory(prefix=f"fleetrl-pipe-{mode}-", dir=keep) as tmp:
        root = pathlib.Path(tmp)
        if keep:
            root = pathlib.Path(keep) / f"{mode}-{seed}-{int(time.time())}"
        run = Run(fleet, mode, seed, root)
        try:
            run.start()
            run.wait_trainer(timeout_s)
        finally:
            run.stop()
        return run.result()


def show(r: RunResult) -> None:
    regions = " ".join(f"{reg}={r.engine_idle(reg):.2f}" for reg in sorted(r.uptime_s))
    print(f"  {r.mode:5s}: window {r.wall_s:.1f} s ({r.steps} steps in all), {r.preemptions} preemption(s) inside "
          f"it ({r.preemptions_total} in the run); {r.groups} groups = {r.groups_per_s:.3f} groups/s, "
          f"{r.tokens_per_s:.1f} tokens/s; engine idle {r.engine_idle():.2f} ({regions}); trainer idle "
          f"{r.trainer_idle:.2f}; staleness mean {r.lag_mean:.2f} max {r.lag_max:.0f}; at preemptions: "
          f"tokens handed over {r.tokens_handed_over}, moved to another region {r.tokens_moved} "
          f"(kept), groups restarted from scratch {r.groups_restarted} and handovers timed out "
          f"{r.handover_timeouts} (their tokens regenerated); tokens sampled {r.tokens_sampled}, trained "
          f"{r.tokens_trained}; reward (last 3 of {r.steps} steps) {r.reward():.3f}", flush=True)
    if r.round_trip:
        print(f"  {r.mode:5s}: a group's round trip (mean): "
              + ", ".join(f"{ph} {r.round_trip[ph]:.3f} s" for ph in PHASES if ph in r.round_trip)
              + f" = {sum(r.round_trip.values()):.3f} s; admitted to trained {r.admission_cap / r.groups_per_s:.3f} s "
              f"at most ({r.admission_cap} groups admitted and untrained at {r.groups_per_s:.2f} groups/s, "
              "Little's law)", flush=True)


def compare(fleet: Fleet, seeds: int, timeout_s: float, length_aware_off: bool = True) -> dict[str, float]:
    """sync vs async per seed (length-aware on, the default); with `length_aware_off`, both again with
    `rollout.length_aware: false`, side by side."""
    pairs, off_pairs = [], []
    for seed in range(seeds):
        print(f"seed {seed}:", flush=True)
        sync = run_once(fleet, "sync", seed, timeout_s)
        show(sync)
        asyn = run_once(fleet, "async", seed, timeout_s)
        show(asyn)
        pairs.append((sync, asyn))
        if length_aware_off:
            off = replace(fleet, length_aware=False)
            print("  length-aware scheduling off:", flush=True)
            off_pairs.append((run_once(off, "sync", seed, timeout_s), run_once(off, "async", seed, timeout_s)))
            for r in off_pairs[-1]:
                show(r)
            print(f"  length-aware on | off: sync step {sync.step_s:.2f} s | {off_pairs[-1][0].step_s:.2f} s; "
                  f"async {asyn.groups_per_s:.3f} | {off_pairs[-1][1].groups_per_s:.3f} groups/s", flush=True)
    ratios = [a.groups_per_s / s.groups_per_s for s, a in pairs]
    # Equal samples: with `window_s` the runs train different step counts; compare at the shorter one.
    equal = [min(s.steps, a.steps) for s, a in pairs]
    rewards = [(s.reward(n), a.reward(n)) for (s, a), n in zip(pairs, equal, strict=True)]
    out = {
        "throughput_ratio": statistics.fmean(ratios),
        "throughput_ratio_median": statistics.median(ratios),
        "throughput_ratio_min": min(ratios), "throughput_ratio_max": max(ratios),
        "reward_delta": statistics.fmean(a - s for s, a in rewards),
        "reward_sync_spread": max(s for s, _ in rewards) - min(s for s, _ in rewards),
        "engine_idle_async": statistics.fmean(a.engine_idle() for _, a in pairs),
        "engine_idle_sync": statistics.fmean(s.engine_idle() for s, _ in pairs),
        "trainer_idle_async": statistics.fmean(a.trainer_idle for _, a in pairs),
        "trainer_idle_sync": statistics.fmean(s.trainer_idle for s, _ in pairs),
        "staleness_async": statistics.fmean(a.lag_mean for _, a in pairs),
    }
    for region in sorted({r for s, a in pairs for r in (*s.uptime_s, *a.uptime_s)}):
        for mode, i in (("sync", 0), ("async", 1)):
            runs = [pair[i] for pair in pairs if region in pair[i].uptime_s]
            if runs:
                out[f"engine_idle_{mode}_{region}"] = statistics.fmean(r.engine_idle(region) for r in runs)
    for mode, i in (("sync", 0), ("async", 1)):
        out[f"window_s_{mode}"] = statistics.fmean(pair[i].wall_s for pair in pairs)
        out[f"preemptions_{mode}"] = statistics.fmean(pair[i].preemptions for pair in pairs)
        for ph in PHASES:
            got = [pair[i].round_trip[ph] for pair in pairs if ph in pair[i].round_trip]
            if got:
                out[f"rt_{ph}_{mode}"] = statistics.fmean(got)
    if off_pairs:
        out.update({
            "sync_step_s_la_on": statistics.fmean(s.step_s for s, _ in pairs),
            "sync_step_s_la_off": statistics.fmean(s.step_s for s, _ in off_pairs),
            "async_groups_s_la_on": statistics.fmean(a.groups_per_s for _, a in pairs),
            "async_groups_s_la_off": statistics.fmean(a.groups_per_s for _, a in off_pairs),
        })
    return out


def grid(axis: str, base: dict[str, Any], fleet: Fleet, timeout_s: float) -> None:
    """Print a markdown table of throughput_ratio: slow-region step delay x (tail share | preemption)."""
    columns: list[float] = [0.0, 0.15, 0.3] if axis == "tail" else [0.0, 30.0, 15.0]
    head = [f"{c:.0%}" for c in columns] if axis == "tail" else [f"every {c:g} s" if c else "none" for c in columns]
    name = "tail share" if axis == "tail" else "preemption"
    print(f"| slow-region step delay \\ {name} | " + " | ".join(head) + " |")
    print("|---|---|---|---|", flush=True)
    for slow in (0.0, 0.03, 0.08):
        cells = []
        for c in columns:
            over = {"tail_p": c} if axis == "tail" else {"preempt_every_s": c}
            cell = Fleet(**{**base, "slowdowns": (fleet.slowdowns[0], slow), "tail_p": fleet.tail_p, **over})
            cells.append(f"{compare(cell, 1, timeout_s, length_aware_off=False)['throughput_ratio']:.2f}")
        print(f"| {slow:g} s | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short fleet run (under two minutes on 2 cores)")
    parser.add_argument("--seeds", type=int, default=1, help="repeat with this many seeds and report the spread")
    parser.add_argument("--grid", choices=["tail", "preempt"], default=None,
                        help="a table first: the ratio as the slow region's step delay grows against the tail "
                             "share or against the preemption rate (3 x 3 cells, one seed each)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="defaults",
                        help="the throttles: `defaults` (the figures of docs/pipeline.md so far) or `production`, "
                             "proportioned as a 7B policy on H100s; its sources: "
                             + PRODUCTION_SOURCES.replace("%", "%%"))
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per run (default: 20, --quick 10); the full run goes on until its window "
                             "also covers --window-intervals preemption intervals")
    parser.add_argument("--window-intervals", type=float, default=None,
                        help="measure each run over at least this many preemption intervals (default 5; "
                             "--quick 0: exactly --steps steps)")
    parser.add_argument("--slowdown", type=float, default=None,
                        help="step delay of the slow region (s; default: the profile's, 0.03 at the defaults)")
    parser.add_argument("--tail-p", type=float, default=None,
                        help="share of samples that run to max_new_tokens (default: the profile's, 0.15)")
    parser.add_argument("--preempt-every", type=float, default=None,
                        help="seconds between preemptions (0: none; default 20, --quick 15)")
    parser.add_argument("--link-delay", type=float, default=None,
                        help="one-way home-region link delay (s; default: the profile's, 0.05)")
    parser.add_argument("--no-length-aware-off", action="store_true",
                        help="skip the runs with length-aware scheduling off (half the time; --quick skips "
                             "them unless --length-aware-off)")
    parser.add_argument("--length-aware-off", action="store_true",
                        help="also with --quick: repeat each pair with length-aware scheduling off")
    parser.add_argument("--workload", choices=["reverse", "tools"], default="reverse",
                        help="tools: multi-turn episodes whose tool calls have a long latency tail (EMULATED)")
    cost = parser.add_argument_group("cost", "--cost: an on-demand fleet against a hybrid (on-demand base + spot) "
                                             "at the same dollars per hour (bench/cost_fleet.py, docs/cost.md)")
    cost.add_argument("--cost", action="store_true", help="run the cost comparison instead of sync vs async")
    cost.add_argument("--cost-grid", action="store_true",
                      help="with --cost, instead of the seeds: a table of cost_efficiency over spot discount x "
                           "spot node life (3 x 3 cells, one seed each; the on-demand run once)")
    cost.add_argument("--discount", type=float, default=0.65, help="spot's discount off on-demand (default 0.65)")
    cost.add_argument("--spot-preempt-every", type=float, default=60.0,
                      help="seconds a spot node lives before its preemption notice (0: never; default 60)")
    cost.add_argument("--od-nodes", type=int, default=3, help="nodes of the on-demand fleet (default 3)")
    cost.add_argument("--base-nodes", type=int, default=1,
                      help="on-demand nodes of the hybrid; the rest of the budget buys spot nodes (default 1)")
    cost.add_argument("--price", type=float, default=2.0, help="on-demand dollars per node-hour (default 2.0)")
    cost.add_argument("--session-timeout", type=float, default=2.0,
                      help="rollout.group_session_timeout_s of both fleets (default 2; tansu holds every join for "
                           "half of it, and the spot region's group changes members every few seconds)")
    cost.add_argument("--rebalance-lead", type=float, default=0.0,
                      help="start a spot node's replacement this many seconds before its notice (EC2 capacity "
                           "rebalancing on a rebalance recommendation; default 0: at the notice)")
    args = parser.parse_args()
    # A hang-up or TERM ends the bench through its `finally`s, so every process it started is stopped.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    os.environ.setdefault("FLEETRL_HUB_KEY", generate_ed25519()[0])
    if args.cost:
        import cost_fleet

        cost_fleet.main(args)
        return
    steps = args.steps or (10 if args.quick else 20)
    preempt = args.preempt_every if args.preempt_every is not None else (15.0 if args.quick else 20.0)
    intervals = args.window_intervals if args.window_intervals is not None else (0.0 if args.quick else 5.0)
    profile = dict(PROFILES[args.profile])
    if args.slowdown is not None:
        profile["slowdowns"] = (profile["slowdowns"][0], args.slowdown)
    for key, value in (("tail_p", args.tail_p), ("link_delay_s", args.link_delay)):
        if value is not None:
            profile[key] = value
    base: dict[str, Any] = {**profile, "steps": steps, "preempt_every_s": preempt, "workload": args.workload,
                            "window_s": intervals * preempt}
    fleet = Fleet(**base)
    if args.profile == "production":
        print(PRODUCTION_SOURCES, flush=True)
    print(f"fleet ({args.profile}): {len(fleet.slowdowns)} regions x {fleet.nodes} node(s); per-step delay per region "
          f"{list(fleet.slowdowns)} s (EMULATED: a sleep after each decoding step of the real torch engine); "
          f"completion lengths EMULATED: the samples of {fleet.tail_p:.0%} of the prompts run to max_new_tokens="
          f"{fleet.max_new_tokens}, the rest stop after 1-{fleet.short_tokens} tokens; {fleet.prompts} prompts cycled; "
          f"preemption every {fleet.preempt_every_s:g} s with replacement; "
          f"link delay home<->region {fleet.link_delay_s:g} s each way (EMULATED in the trainer's Kafka clients); "
          f"weight transfer {fleet.weight_transfer_s:g} s per version and worker, learner {fleet.learner_token_s:g} s "
          f"per trained token (EMULATED; 0: none); {fleet.groups_per_step} groups x {fleet.n_samples} samples per "
          f"step, {fleet.steps} steps per run"
          + (f" and on until the measured window lasts {fleet.window_s:g} s ({intervals:g} preemption intervals)"
             if fleet.window_s else "")
          + f"; sync spreads each step by region capacity; async max_staleness {fleet.max_staleness}; "
          f"workload {fleet.workload}"
          + (" (episodes of 3 model turns; tool calls 0.05 s, 10% 1 s: EMULATED)" if fleet.workload == "tools" else ""),
          flush=True)
    timeout_s = 300.0 if args.quick else 600.0 + 2 * fleet.window_s  # bounds: start-up on a busy machine
    if args.grid:
        grid(args.grid, base, fleet, timeout_s)
    off = args.length_aware_off or not (args.quick or args.no_length_aware_off)  # --quick: two runs, not four
    out = compare(fleet, args.seeds, timeout_s, length_aware_off=off)
    print("result: " + " ".join(f"{k}={v:.3f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
