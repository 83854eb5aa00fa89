# The Kafka ACLs each FleetRL role needs on one region cluster (docs/security.md states the same
# table, and a test compares the two). Operations are those the code's clients perform:
# * trainer: `fleetrl topics create` (its unit's ExecStartPre) creates and checks the run's topics;
#   it dispatches prompts, reads trajectories in its group, and dead-letters what fails validation;
#   when a region is gone it reads that region's partials (handover group) and writes them to another.
# * rollout (agent, workers): reads prompts and partials in the rollout group, writes partials,
#   trajectories and dead letters. No Create, Alter or Delete; never the trainer's group.
# * operator (`topics`, `dlq show|replay`, `audit`): reads every run topic with group-less readers,
#   describes the run's groups (lag), and `dlq replay` re-sends records to the data topics.
locals {
  prefix = "fleetrl.${var.run}."
  topic  = { for s in ["prompts", "partials", "trajectories", "dead-letter"] : s => "${local.prefix}${s}" }
  grants = {
    trainer = [
      { type = "Topic", pattern = "PREFIXED", name = local.prefix, ops = ["Create", "Describe", "DescribeConfigs"] },
      { type = "Topic", pattern = "LITERAL", name = local.topic["prompts"], ops = ["Write"] },
      { type = "Topic", pattern = "LITERAL", name = local.topic["partials"], ops = ["Read", "Write"] },
      { type = "Topic", pattern = "LITERAL", name = local.topic["trajectories"], ops = ["Read"] },
      { type = "Topic", pattern = "LITERAL", name = local.topic["dead-letter"], ops = ["Write"] },
      { type = "Group", pattern = "LITERAL", name = "${local.prefix}trainer", ops = ["Read"] },
      { type = "Group", pattern = "LITERAL", name = "${local.prefix}trainer.handover", ops = ["Read"] },
    ]
    rollout = [
      { type = "Topic", pattern = "LITERAL", name = local.topic["prompts"], ops = ["Describe", "Read"] },
      { type = "Topic", pattern = "LITERAL", name = local.topic["partials"], ops = ["Describe", "Read", "Write"] },
      { type = "Topic", pattern = "LITERAL", name = local.topic["trajectories"], ops = ["Describe", "Write"] },
      { type = "Topic", pattern = "LITERAL", name = local.topic["dead-letter"], ops = ["Describe", "Write"] },
      { type = "Group", pattern = "LITERAL", name = "${local.prefix}rollout", ops = ["Read"] },
    ]
    operator = [
      { type = "Topic", pattern = "PREFIXED", name = local.prefix, ops = ["Create", "Describe", "DescribeConfigs", "Read"] },
      { type = "Topic", pattern = "LITERAL", name = local.topic["prompts"], ops = ["Write"] },
      { type = "Topic", pattern = "LITERAL", name = local.topic["partials"], ops = ["Write"] },
      { type = "Topic", pattern = "LITERAL", name = local.topic["trajectories"], ops = ["Write"] },
      { type = "Group", pattern = "PREFIXED", name = local.prefix, ops = ["Describe"] },
    ]
  }
  rules = flatten([for role in ["trainer", "rollout", "operator"] : [
    for g in local.grants[role] : merge(g, { role = role, principal = var.principals[role] })
  ]])
  acls = flatten([for r in local.rules : [for op in r.ops : {
    role          = r.role
    principal     = r.principal
    resource_type = r.type
    pattern_type  = r.pattern
    resource_name = r.name
    operation     = op
    permission    = "Allow"
    host          = "*"
  }]])
  commands = [for r in local.rules : join(" ", concat(
    ["kafka-acls.sh", "--bootstrap-server", var.bootstrap, "--command-config", var.command_config, "--add",
    "--allow-principal", r.principal],
    flatten([for op in r.ops : ["--operation", op]]),
    [r.type == "Topic" ? "--topic" : "--group", r.name, "--resource-pattern-type", lower(r.pattern)],
  ))]
}
