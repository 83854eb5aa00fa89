# Home plus two rollout regions. Each region module reports its Kafka and store in a
# provider-neutral `fleet_region`; the fleet-config module renders fleet.yaml from them, and the
# very same text is written onto every node, so what the daemons run is what was provisioned.

locals {
  agent_metrics_port   = 9401
  trainer_metrics_port = 9400
  fleet_cidrs          = [for r in var.regions : r.cidr]
  checkpoint_dir       = var.home.trainer.checkpoint_dir
}

module "home" {
  source    = "../../modules/home-region"
  providers = { aws = aws.home }

  run                  = var.run
  vpc_id               = var.home.vpc_id
  subnet_id            = var.home.subnet_id
  fleet_cidrs          = local.fleet_cidrs
  metrics_cidrs        = var.metrics_cidrs
  trainer              = var.home.trainer
  mqtt                 = var.home.mqtt
  signing_scheme       = var.signing_scheme
  fleet_yaml           = module.fleet_config.fleet_yaml
  fleetrl_package      = "fleetrl==${var.fleetrl_version}"
  kafka_secrets        = merge(module.region_a.kafka_password_secret, module.region_b.kafka_password_secret)
  kafka_kms_key_arns   = compact([module.region_a.kafka_kms_key_arn, module.region_b.kafka_kms_key_arn])
  trainer_metrics_port = local.trainer_metrics_port
  enable_ssm           = var.enable_ssm
  detailed_monitoring  = var.detailed_monitoring
  generate_secrets     = var.generate_secrets
  force_destroy_store  = var.force_destroy_stores
}

module "region_a" {
  source    = "../../modules/rollout-region"
  providers = { aws = aws.region_a }

  name                   = var.regions[0].name
  run                    = var.run
  vpc_id                 = var.regions[0].vpc_id
  subnet_ids             = var.regions[0].subnet_ids
  home_cidrs             = [var.home.cidr]
  metrics_cidrs          = var.metrics_cidrs
  kafka                  = var.regions[0].kafka
  node                   = var.regions[0].node
  engine                 = var.regions[0].engine
  link_costs             = var.regions[0].link_costs
  transfer_usd_per_gb    = var.regions[0].transfer_usd_per_gb
  home_store             = { bucket_arn = module.home.store_bucket_arn, prefix = module.home.store_prefix }
  peer_store_bucket_arns = [module.region_b.store_bucket_arn]
  node_secret_env        = module.home.node_secret_env
  node_secret_files      = module.home.node_secret_files
  fleet_yaml             = module.fleet_config.fleet_yaml
  fleetrl_package        = "fleetrl[gpu]==${var.fleetrl_version}"
  agent_metrics_port     = local.agent_metrics_port
  enable_ssm             = var.enable_ssm
  detailed_monitoring    = var.detailed_monitoring
  generate_secrets       = var.generate_secrets
  force_destroy_store    = var.force_destroy_stores
}

module "region_b" {
  source    = "../../modules/rollout-region"
  providers = { aws = aws.region_b }

  name                   = var.regions[1].name
  run                    = var.run
  vpc_id                 = var.regions[1].vpc_id
  subnet_ids             = var.regions[1].subnet_ids
  home_cidrs             = [var.home.cidr]
  metrics_cidrs          = var.metrics_cidrs
  kafka                  = var.regions[1].kafka
  node                   = var.regions[1].node
  engine                 = var.regions[1].engine
  link_costs             = var.regions[1].link_costs
  transfer_usd_per_gb    = var.regions[1].transfer_usd_per_gb
  home_store             = { bucket_arn = module.home.store_bucket_arn, prefix = module.home.store_prefix }
  peer_store_bucket_arns = [module.region_a.store_bucket_arn]
  node_secret_env        = module.home.node_secret_env
  node_secret_files      = module.home.node_secret_files
  fleet_yaml             = module.fleet_config.fleet_yaml
  fleetrl_package        = "fleetrl[gpu]==${var.fleetrl_version}"
  agent_metrics_port     = local.agent_metrics_port
  enable_ssm             = var.enable_ssm
  detailed_monitoring    = var.detailed_monitoring
  generate_secrets       = var.generate_secrets
  force_destroy_store    = var.force_destroy_stores
}

module "fleet_config" {
  source = "../../modules/fleet-config"

  run                  = var.run
  home                 = module.home.fleet_home
  regions              = [module.region_a.fleet_region, module.region_b.fleet_region]
  hub                  = var.hub
  model                = var.model
  algorithm            = var.algorithm
  dataset              = var.dataset
  kafka                = var.kafka
  rollout              = var.rollout
  trainer              = merge(var.trainer, { checkpoint_dir = local.checkpoint_dir })
  trainer_metrics_port = local.trainer_metrics_port
  agent_metrics_port   = local.agent_metrics_port
}
