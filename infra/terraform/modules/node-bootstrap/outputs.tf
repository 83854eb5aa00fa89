output "cloud_config" {
  description = "cloud-init user data (#cloud-config) for the node; base64gzip it for launch templates."
  value       = local.cloud_config
}

output "drop_ins" {
  description = "Drop-ins for the units shipped in the FleetRL package that the node runs, by unit name."
  value       = local.drop_ins
}

output "enabled_units" {
  description = "Every FleetRL unit the node enables and starts at boot, in order."
  value       = local.enabled_units
}
