output "fleet_yaml" {
  description = "The fleet.yaml every node runs: `terraform output -raw fleet_yaml > fleet.yaml && fleetrl config check fleet.yaml`."
  value       = module.fleet_config.fleet_yaml
}

output "asg_names" {
  description = "Auto-scaling group of each rollout region, by FleetRL region name (scale to 0 to drain a region)."
  value = {
    (var.regions[0].name) = module.region_a.asg_name
    (var.regions[1].name) = module.region_b.asg_name
  }
}

output "signing_secret_arn" {
  description = "Secret of the hub signing key (for ed25519, store the hex private key here after the first apply)."
  value       = module.home.signing_secret_arn
}

output "signing_public_key_secret_arn" {
  description = "Secret of the Ed25519 public key (ed25519 only)."
  value       = module.home.signing_public_key_secret_arn
}

output "trainer_instance_id" {
  description = "Instance id of the trainer (Session Manager target when enable_ssm is on)."
  value       = module.home.trainer_instance_id
}

output "kafka_acl_commands" {
  description = "kafka-acls.sh commands that grant each role its ACLs, by FleetRL region (run them with an admin client config)."
  value = {
    (var.regions[0].name) = module.region_a.kafka_acls.commands
    (var.regions[1].name) = module.region_b.kafka_acls.commands
  }
}
