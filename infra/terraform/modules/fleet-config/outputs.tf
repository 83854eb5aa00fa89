output "fleet_yaml" {
  description = "The rendered fleet.yaml (validate with `fleetrl config check`)."
  value       = local.fleet_yaml
}
