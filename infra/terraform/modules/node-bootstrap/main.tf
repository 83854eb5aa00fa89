# Renders the cloud-config of a FleetRL node: install FleetRL into a virtualenv, write fleet.yaml,
# a oneshot unit that fetches secrets into an EnvironmentFile at boot (so no secret is ever in user
# data or Terraform state), another that readies the NVIDIA devices, then start the daemons.
#
# Every daemon runs the systemd unit shipped in the FleetRL package (sandboxed, docs/security.md),
# installed by `fleetrl units install` from the very version pip installed: a rollout node
# (var.region) fleetrl-agent.service and fleetrl-replicator@<region>.service, the trainer node
# (var.trainer) fleetrl-trainer.service. This module writes only what the package cannot know:
# /etc/fleetrl/node.env (the region) and drop-ins (ordering after the secrets unit, stop timeouts,
# extra writable paths). No unit text is rendered here.
locals {
  venv    = "/opt/fleetrl/venv"
  rollout = var.region != null

  after_secrets = join("\n", [
    "# Written by Terraform (node-bootstrap): start after the boot-time secrets fetch, which also",
    "# writes FLEETRL_NODE and the secrets the config reads from environment variables.",
    "[Unit]",
    "Requires=fleetrl-secrets.service",
    "After=fleetrl-secrets.service fleetrl-gpu-devices.service",
    "",
  ])
  # The state directories (a checkpoint volume) are writable to the sandboxed daemons too.
  service_section = { for name, stop_s in {
    "fleetrl-agent.service"       = var.agent_stop_timeout_s
    "fleetrl-replicator@.service" = null
    "fleetrl-trainer.service"     = try(var.trainer.stop_timeout_s, null)
    } : name => join("\n", concat(
      ["[Service]"],
      stop_s == null ? [] : ["TimeoutStopSec=${stop_s}"],
      [for d in var.state_dirs : "ReadWritePaths=${d}"],
      [""],
  )) }
  daemon_units    = local.rollout ? ["fleetrl-agent.service", "fleetrl-replicator@.service"] : ["fleetrl-trainer.service"]
  drop_ins        = { for name in local.daemon_units : name => "${local.after_secrets}\n${local.service_section[name]}" }
  enabled_daemons = local.rollout ? ["fleetrl-agent.service", "fleetrl-replicator@${var.region}.service"] : ["fleetrl-trainer.service"]
  enabled_units   = concat(["fleetrl-secrets.service", "fleetrl-gpu-devices.service"], local.enabled_daemons)

  # FLEETRL_NODE comes from /run/fleetrl/env (fleetrl-secrets.service: the EC2 instance id).
  node_env     = local.rollout ? "FLEETRL_REGION=${var.region}\n" : null
  secrets_spec = jsonencode({ env = var.secret_env, files = var.secret_files })

  install_sh = templatefile("${path.module}/templates/install.sh.tftpl", {
    python     = var.python
    venv       = local.venv
    package    = var.fleetrl_package
    state_dirs = concat(["/var/lib/fleetrl"], var.state_dirs)
    mounts     = var.mounts
  })

  write_files = concat(
    [
      { path = "/etc/fleetrl/fleet.yaml", permissions = "0644", content = var.fleet_yaml },
      { path = "/etc/fleetrl/secrets.json", permissions = "0644", content = local.secrets_spec },
      { path = "/usr/local/lib/fleetrl/fetch-secrets.py", permissions = "0755", content = file("${path.module}/templates/fetch-secrets.py") },
      { path = "/usr/local/lib/fleetrl/install.sh", permissions = "0755", content = local.install_sh },
      { path = "/etc/systemd/system/fleetrl-secrets.service", permissions = "0644", content = file("${path.module}/templates/fleetrl-secrets.service") },
      { path = "/etc/systemd/system/fleetrl-gpu-devices.service", permissions = "0644", content = file("${path.module}/templates/fleetrl-gpu-devices.service") },
    ],
    local.rollout ? [{ path = "/etc/fleetrl/node.env", permissions = "0644", content = local.node_env }] : [],
    [for name, text in local.drop_ins : { path = "/etc/systemd/system/${name}.d/10-node-bootstrap.conf", permissions = "0644", content = text }],
  )

  cloud_config = "#cloud-config\n${yamlencode({
    write_files = local.write_files
    runcmd = [
      ["/usr/local/lib/fleetrl/install.sh"],
      ["systemctl", "daemon-reload"],
      concat(["systemctl", "enable", "--now"], local.enabled_units),
    ]
  })}"
}
