output "cloud_config" {
  description = "cloud-init user data (#cloud-config) for the node; base64gzip it for launch templates."
  value       = local.cloud_config
}

output "units" {
  description = "Systemd units rendered from the template (services), by name without .service; packaged units are not here (see drop_ins)."
  value       = local.units
}

output "drop_ins" {
  description = "Drop-ins for the units shipped in the FleetRL package, by unit name (empty unless region is set)."
  value       = local.drop_ins
}

output "enabled_units" {
  description = "Every FleetRL unit the node enables and starts at boot, in order."
  value       = concat(["fleetrl-secrets.service"], [for name in keys(local.units) : "${name}.service"], local.packaged_units)
}
