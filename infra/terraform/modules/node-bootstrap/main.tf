# Renders the cloud-config of a FleetRL node: install FleetRL into a virtualenv, write fleet.yaml,
# a oneshot unit that fetches secrets into an EnvironmentFile at boot (so no secret is ever in user
# data or Terraform state), and one systemd unit per daemon, then start them.
locals {
  venv        = "/opt/fleetrl/venv"
  fleetrl_bin = "${local.venv}/bin/fleetrl"
  common_args = ["--config", "/etc/fleetrl/fleet.yaml", "--log-json"]

  units = { for s in var.services : s.name => templatefile("${path.module}/templates/fleetrl.service.tftpl", {
    description    = s.description
    exec_start     = join(" ", concat([local.fleetrl_bin], s.args, local.common_args))
    exec_pre       = [for p in s.pre_args : join(" ", concat([local.fleetrl_bin], p, local.common_args))]
    stop_timeout_s = s.stop_timeout_s
  }) }

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
    ],
    [for name, unit in local.units : { path = "/etc/systemd/system/${name}.service", permissions = "0644", content = unit }],
  )

  cloud_config = "#cloud-config\n${yamlencode({
    write_files = local.write_files
    runcmd = [
      ["/usr/local/lib/fleetrl/install.sh"],
      ["systemctl", "daemon-reload"],
      concat(["systemctl", "enable", "--now", "fleetrl-secrets.service"], [for name in keys(local.units) : "${name}.service"]),
    ]
  })}"
}
