"""Prometheus metrics of the trainer (units in the names) on their own registry.

A registry per trainer keeps tests that build several trainers in one process apart; the daemon
serves it on `trainer.metrics_port`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleetrl.metrics import MetricsRegistry

_STEP_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100)


class TrainerMetrics(MetricsRegistry):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.reward_mean = Gauge("fleetrl_trainer_reward_mean", "Mean reward of the last step's samples", registry=r)
        self.staleness = Histogram(
            "fleetrl_trainer_staleness_versions",
            "Version lag of each trained group (learner - oldest token, in steps along the weights' lineage)",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16), registry=r,
        )
        self.stale_dropped = Counter(
            "fleetrl_trainer_stale_groups_dropped_total", "Groups dropped as staler than the bound",
            ["region"], registry=r,
        )
        self.duplicates = Counter(
            "fleetrl_trainer_duplicate_groups_total", "Groups dropped as already trained, dropped or buffered",
            ["region"], registry=r,
        )
        self.groups = Counter("fleetrl_trainer_groups_received_total", "Valid groups received", ["region"],
                              registry=r)
        self.region_rate = Gauge("fleetrl_trainer_region_groups_per_second",
                                 "Measured throughput of a region (credit basis)", ["region"], registry=r)
        self.dispatched = Counter("fleetrl_trainer_groups_dispatched_total", "Prompt records sent",
                                  ["region"], registry=r)
        self.redispatched = Counter("fleetrl_trainer_groups_redispatched_total",
                                    "Groups sent again as prompts after their region went silent, drained or "
                                    "offline", registry=r)
        self.partials_moved = Counter("fleetrl_trainer_partials_moved_total",
                                      "Partials of a gone region re-dispatched to another region with their tokens",
                                      registry=r)
        self.foreign = Counter("fleetrl_trainer_foreign_records_total", "Records of another run dead-lettered",
                               ["region"], registry=r)
        self.dead_lettered = Counter(
            "fleetrl_trainer_dead_lettered_records_total",
            "Records the trainer sent to a region's dead-letter topic, by reason (malformed, out of bounds, "
            "another run's)", ["region", "reason"], registry=r)
        self.consumer_lag = Gauge(
            "fleetrl_trainer_consumer_lag_records",
            "Records waiting in the region's trajectories topic: log end minus the trainer's read position, "
            "over the partitions it holds", ["region"], registry=r)
        self.step_seconds = Histogram("fleetrl_trainer_step_seconds", "Wall time of one optimizer step",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.publish_seconds = Histogram("fleetrl_trainer_weight_publish_seconds",
                                         "Time to publish one version through the hub", buckets=_STEP_BUCKETS,
                                         registry=r)
        self.publish_stall_seconds = Histogram(
            "fleetrl_trainer_weight_publish_stall_seconds",
            "Time a step waits on publishing: the previous publish when still in flight, plus its update's "
            "wait for the snapshot's cast (the cast and the whole publish when inline)",
            buckets=_STEP_BUCKETS, registry=r)
        self.publish_bytes = Counter("fleetrl_trainer_weight_publish_bytes_total",
                                     "Bytes written to the home store by publishes", registry=r)
        self.last_publish_bytes = Gauge("fleetrl_trainer_weight_publish_last_bytes",
                                        "Bytes written by the last publish", registry=r)
        self.round_trip = Histogram(
            "fleetrl_trainer_group_round_trip_seconds",
            "A group's round trip in phases (trainer/round_trips.py): to_worker (dispatch to the worker's "
            "receipt), wait (for its min_version weights and a worker slot), generate (to the scored group), "
            "back (to the trainer's hands); across clocks, so a skew moves time between neighbours",
            ["region", "phase"], buckets=(0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100), registry=r)
        self.checkpoint_seconds = Histogram("fleetrl_trainer_checkpoint_seconds", "Time to write a checkpoint",
                                            buckets=_STEP_BUCKETS, registry=r)
        self.version = Gauge("fleetrl_trainer_policy_version", "Newest published policy version", registry=r)
        self.steps = Counter("fleetrl_trainer_steps_total", "Optimizer steps", registry=r)
        self.eval_pass_at_1 = Gauge("fleetrl_trainer_eval_pass_at_1_ratio",
                                    "pass@1 of the newest complete evaluation of a held-out eval set", ["set"],
                                    registry=r)
        self.eval_reward_mean = Gauge("fleetrl_trainer_eval_reward_mean",
                                      "Mean reward of the newest complete evaluation of a held-out eval set",
                                      ["set"], registry=r)
        self.eval_version = Gauge("fleetrl_trainer_eval_policy_version", "Policy version of the newest complete "
                                  "evaluation of a held-out eval set", ["set"], registry=r)
        self.eval_groups_in_flight = Gauge("fleetrl_trainer_eval_groups_in_flight", "Eval groups dispatched and not "
                                           "returned (bounded by eval.max_share)", registry=r)
        self.eval_foreign = Counter("fleetrl_trainer_eval_foreign_groups_total", "Eval groups of `fleetrl eval` "
                                    "requests the trainer read and skipped (not its evaluations)", registry=r)
        self.eval_dead_lettered = Counter("fleetrl_trainer_eval_dead_lettered_total", "Eval prompts a worker "
                                          "dead-lettered: their evaluation ends without them", registry=r)
        self.clip_fraction = Gauge("fleetrl_trainer_clip_fraction_ratio",
                                   "Fraction of the last step's tokens whose PPO ratio was clipped (over every "
                                   "update of the step)", registry=r)
        self.approx_kl = Gauge("fleetrl_trainer_approx_kl_nats",
                               "Mean per-token KL estimate (k3) between the last step's starting weights and "
                               "each of its updates (0 with one update per step)", registry=r)
        self.tracking_dropped = Counter(
            "fleetrl_trainer_tracking_dropped_total",
            "Experiment records (a step's figures, a table) dropped for a tracker whose queue was full "
            "(tracking.queue_size): the trainer never waits on a tracker", ["tracker"], registry=r)
        self._cost_metrics(r)

    def _cost_metrics(self, r: CollectorRegistry) -> None:
        """What the fleet costs (trainer/cost.py, docs/cost.md): the part is `cost`, not `trainer`, since
        the figures are the fleet's, measured from the nodes' heartbeats."""
        pool = ["region", "capacity"]
        self.cost_usd = Counter("fleetrl_cost_usd_total",
                                "US dollars paid for the region's nodes of this capacity type: node-seconds from "
                                "their heartbeats times the pool's price per node-hour", pool, registry=r)
        self.cost_node_seconds = Counter("fleetrl_cost_node_seconds_total",
                                         "Node-seconds paid (between a node's heartbeats while not offline)", pool,
                                         registry=r)
        self.cost_tokens_sampled = Counter("fleetrl_cost_tokens_sampled_total",
                                           "Tokens the pool's engines sampled (their heartbeats' tokens_sampled): what "
                                           "the money bought, used or not", pool, registry=r)
        self.cost_usd_per_hour = Gauge("fleetrl_cost_usd_per_hour", "Spend rate now: live nodes times their price",
                                       pool, registry=r)
        self.cost_price = Gauge("fleetrl_cost_price_usd_per_node_hour", "Price of a node-hour of the pool in use",
                                pool, registry=r)
        self.cost_transfer_usd = Counter("fleetrl_cost_transfer_usd_total",
                                         "US dollars for the bytes of trajectories that crossed the region's link "
                                         "(regions[].transfer_usd_per_gb)", ["region"], registry=r)
        self.cost_groups_resent = Counter("fleetrl_cost_groups_resent_total",
                                          "Groups of the region sent again from scratch (a preempted, gone or silent "
                                          "region's, partials too stale to move): its work on them was lost",
                                          ["region"], registry=r)
        self.cost_tokens_regenerated = Counter(
            "fleetrl_cost_tokens_regenerated_total",
            "Tokens the region sampled that training cannot use, where the trainer holds them: duplicate and "
            "stale arrivals, handed-over partials too stale to move or superseded", ["region"], registry=r)
        self.cost_useful_group_usd = Gauge(
            "fleetrl_cost_useful_group_usd",
            "Price of a useful group in the region as price-aware placement sees it: spend rate over the groups/s "
            "its serving nodes deliver net of preemption waste, plus its link (NaN: it delivers none)",
            ["region"], registry=r)

