output "cloud_config" {
  description = "cloud-init user data (#cloud-config) for the node; base64gzip it for launch templates."
  value       = local.cloud_config
}

output "units" {
  description = "Rendered systemd units by name (without .service), for inspection and tests."
  value       = local.units
}
