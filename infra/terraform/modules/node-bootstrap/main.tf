# Renders the cloud-config of a FleetRL node: install FleetRL into a virtualenv, write fleet.yaml,
# a oneshot unit that fetches secrets into an EnvironmentFile at boot (so no secret is ever in user
# data or Terraform state), and the daemons' systemd units, then start them.
#
# A rollout node (var.region) runs the units shipped in the FleetRL package, installed by
# `fleetrl units install` from the very version pip installed; this module writes only what the
# package cannot know: /etc/fleetrl/node.env (the region) and drop-ins (ordering after the secrets
# unit, the agent's stop timeout). Daemons the package ships no unit for (the trainer) are rendered
# from templates/fleetrl.service.tftpl.
locals {
  venv        = "/opt/fleetrl/venv"
  fleetrl_bin = "${local.venv}/bin/fleetrl"
  common_args = ["--config", "/etc/fleetrl/fleet.yaml", "--log-json"]
  packaged    = var.region != null

  units = { for s in var.services : s.name => templatefile("${path.module}/templates/fleetrl.service.tftpl", {
    description    = s.description
    exec_start     = join(" ", concat([local.fleetrl_bin], s.args, local.common_args))
    exec_pre       = [for p in s.pre_args : join(" ", concat([local.fleetrl_bin], p, local.common_args))]
    stop_timeout_s = s.stop_timeout_s
  }) }

  # FLEETRL_NODE comes from /run/fleetrl/env (fleetrl-secrets.service: the EC2 instance id).
  node_env = local.packaged ? "FLEETRL_REGION=${var.region}\n" : null
  after_secrets = join("\n", [
    "# Written by Terraform (node-bootstrap): start after the boot-time secrets fetch, which also",
    "# writes FLEETRL_NODE and the secrets the config reads from environment variables.",
    "[Unit]",
    "Requires=fleetrl-secrets.service",
    "After=fleetrl-secrets.service",
    "",
  ])
  drop_ins = { for name, text in {
    "fleetrl-agent.service"       = "${local.after_secrets}\n[Service]\nTimeoutStopSec=${var.agent_stop_timeout_s}\n"
    "fleetrl-replicator@.service" = local.after_secrets
  } : name => text if local.packaged }
  packaged_units = local.packaged ? ["fleetrl-agent.service", "fleetrl-replicator@${var.region}.service"] : []

  secrets_spec = jsonencode({ env = var.secret_env, files = var.secret_files })

  install_sh = templatefile("${path.module}/templates/install.sh.tftpl", {
    python     = var.python
    venv       = local.venv
    package    = var.fleetrl_package
    state_dirs = concat(["/var/lib/fleetrl"], var.state_dirs)
    mounts     = var.mounts
    packaged   = local.packaged
  })

  write_files = concat(
    [
      { path = "/etc/fleetrl/fleet.yaml", permissions = "0644", content = var.fleet_yaml },
      { path = "/etc/fleetrl/secrets.json", permissions = "0644", content = local.secrets_spec },
      { path = "/usr/local/lib/fleetrl/fetch-secrets.py", permissions = "0755", content = file("${path.module}/templates/fetch-secrets.py") },
      { path = "/usr/local/lib/fleetrl/install.sh", permissions = "0755", content = local.install_sh },
      { path = "/etc/systemd/system/fleetrl-secrets.service", permissions = "0644", content = file("${path.module}/templates/fleetrl-secrets.service") },
    ],
    local.packaged ? [{ path = "/etc/fleetrl/node.env", permissions = "0644", content = local.node_env }] : [],
    [for name, text in local.drop_ins : { path = "/etc/systemd/system/${name}.d/10-node-bootstrap.conf", permissions = "0644", content = text }],
    [for name, unit in local.units : { path = "/etc/systemd/system/${name}.service", permissions = "0644", content = unit }],
  )

  cloud_config = "#cloud-config\n${yamlencode({
    write_files = local.write_files
    runcmd = [
      ["/usr/local/lib/fleetrl/install.sh"],
      ["systemctl", "daemon-reload"],
      concat(["systemctl", "enable", "--now", "fleetrl-secrets.service"], [for name in keys(local.units) : "${name}.service"], local.packaged_units),
    ]
  })}"
}
