# The home region: the trainer, the home store (source of truth of every version), the MQTT
# control plane and the hub's signing key. Secrets are generated ephemerally and written
# write-only into Secrets Manager; nodes fetch them at boot, so Terraform state never holds them.
data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}
data "aws_region" "current" {}

locals {
  prefix    = "fleetrl-${var.run}-home"
  partition = data.aws_partition.current.partition
  region    = data.aws_region.current.name
  tags      = merge(var.tags, { "fleetrl:run" = var.run, "fleetrl:region" = "home" })
  hmac      = var.signing_scheme == "hmac-sha256"
  mosquitto = var.mqtt.mode == "mosquitto"

  signing_key_env   = "FLEETRL_HUB_KEY"
  mqtt_password_env = "FLEETRL_MQTT_PASSWORD"
  public_key_file   = "/etc/fleetrl/hub.pub"
}

module "store" {
  source        = "../s3-store"
  bucket_prefix = substr("fleetrl-${var.run}-home", 0, 36)
  force_destroy = var.force_destroy_store
  tags          = local.tags
}
