# One rollout region: an autonomous cell with its own Kafka, its own object store and an
# auto-scaling group of (spot) GPU nodes running the region agent and the region's replicator.
data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}
data "aws_region" "current" {}

locals {
  msk        = var.kafka.mode == "msk"
  generate   = local.msk && var.generate_secrets
  prefix     = "fleetrl-${var.run}-${var.name}"
  kafka_port = 9096 # MSK's SASL/SCRAM listener
  account_id = data.aws_caller_identity.current.account_id
  partition  = data.aws_partition.current.partition
  region     = data.aws_region.current.name
  tags       = merge(var.tags, { "fleetrl:run" = var.run, "fleetrl:region" = var.name })
  # One variable per region: the trainer holds the passwords of every region's cluster at once.
  kafka_password_env = "FLEETRL_KAFKA_PASSWORD_${trim(replace(upper(var.name), "/[^A-Z0-9]+/", "_"), "_")}"
}

module "store" {
  source        = "../s3-store"
  bucket_prefix = substr("fleetrl-${var.name}", 0, 36)
  expiry_days   = var.store_expiry_days
  force_destroy = var.force_destroy_store
  tags          = local.tags
}
