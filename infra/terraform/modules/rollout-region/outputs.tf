output "kafka_bootstrap" {
  description = "Bootstrap servers of the region's Kafka (host:port,...)."
  value       = local.kafka_bootstrap
}

output "kafka_password_env" {
  description = "Environment variable that holds this region's Kafka password on nodes and on the trainer."
  value       = local.kafka_password_env
}

output "kafka_password_secret" {
  description = "Secret source of the region's Kafka password, keyed by its environment variable (for the trainer)."
  value       = local.kafka_password_secret
}

output "kafka_kms_key_arn" {
  description = "KMS key encrypting the Kafka secret (the trainer needs kms:Decrypt on it); null for an external cluster."
  value       = local.msk ? aws_kms_key.kafka[0].arn : null
}

output "kafka_acls" {
  description = "The Kafka ACLs each role needs on this region's cluster: bindings (acls) and kafka-acls.sh commands that add them."
  value       = { acls = module.kafka_acls.acls, commands = module.kafka_acls.commands }
}

output "store_url" {
  description = "URL of the region store as fleet.yaml writes it (s3://bucket/hub)."
  value       = module.store.url
}

output "store_bucket_arn" {
  description = "ARN of the region store bucket (peer regions may read it)."
  value       = module.store.bucket_arn
}

output "asg_name" {
  description = "Name of the rollout nodes' auto-scaling group (scale to 0 to drain the region)."
  value       = aws_autoscaling_group.nodes.name
}

output "node_security_group_id" {
  description = "Security group of the rollout nodes."
  value       = aws_security_group.node.id
}

output "fleet_region" {
  description = "The region's entry for the fleet-config module (provider-neutral: any cloud's module can produce it)."
  value = {
    name                    = var.name
    kafka_bootstrap         = local.kafka_bootstrap
    kafka_security_protocol = local.kafka_security_protocol
    kafka_sasl_mechanism    = local.kafka_sasl ? (local.msk ? "SCRAM-SHA-512" : var.kafka.sasl_mechanism) : null
    kafka_sasl_username     = local.kafka_sasl ? var.kafka.sasl_username : null
    kafka_password_env      = local.kafka_sasl ? local.kafka_password_env : null
    store_url               = module.store.url
    store_region            = local.region
    link_costs              = var.link_costs
    nodes                   = []
    weight                  = 1
    engine                  = var.engine
    # Nodes whose agent cannot tell count as the group's majority capacity; each pool has its price.
    capacity            = local.has_spot && local.on_demand_above < 50 ? "spot" : "on_demand"
    prices              = local.prices
    preemption          = { source = "aws" }
    transfer_usd_per_gb = var.transfer_usd_per_gb
  }
}
