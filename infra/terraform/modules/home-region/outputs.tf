output "store_url" {
  description = "URL of the home store (s3://bucket/hub)."
  value       = module.store.url
}

output "store_bucket_arn" {
  description = "ARN of the home store bucket (rollout nodes read it and write holder markers)."
  value       = module.store.bucket_arn
}

output "store_prefix" {
  description = "Key prefix of the hub inside the home store bucket."
  value       = "hub"
}

output "mqtt_url" {
  description = "MQTT URL of the control plane."
  value       = local.mqtt_url
}

output "signing_secret_arn" {
  description = "Secret holding the hub signing key (for ed25519: put the hex private key here after the first apply)."
  value       = aws_secretsmanager_secret.signing.arn
}

output "signing_public_key_secret_arn" {
  description = "Secret holding the Ed25519 public key (PEM) readers verify with; null for hmac-sha256."
  value       = local.hmac ? null : aws_secretsmanager_secret.signing_public[0].arn
}

output "node_secret_env" {
  description = "Secrets every rollout node needs, keyed by environment variable (input of rollout-region)."
  value       = local.node_secret_env
}

output "node_secret_files" {
  description = "Secrets written to files on rollout nodes (input of rollout-region)."
  value       = local.node_secret_files
}

output "trainer_instance_id" {
  description = "Instance id of the trainer."
  value       = aws_instance.trainer.id
}

output "fleet_home" {
  description = "The home entry for the fleet-config module (provider-neutral)."
  value = {
    store_url               = module.store.url
    store_region            = local.region
    mqtt_url                = local.mqtt_url
    mqtt_username           = var.mqtt.username
    mqtt_password_env       = local.mqtt_secret_arn == null ? null : local.mqtt_password_env
    mqtt_ca_file            = var.mqtt.ca_file
    signing_scheme          = var.signing_scheme
    signing_key_env         = local.signing_key_env
    signing_public_key_file = local.hmac ? null : local.public_key_file
  }
}
