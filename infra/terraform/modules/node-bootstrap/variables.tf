variable "fleet_yaml" {
  type        = string
  description = "The fleet.yaml every FleetRL daemon on the node starts with (from the fleet-config module)."
  validation {
    condition     = length(trimspace(var.fleet_yaml)) > 0
    error_message = "fleet_yaml must not be empty."
  }
}

variable "fleetrl_package" {
  type        = string
  description = "pip requirement that installs FleetRL on the node, e.g. \"fleetrl[gpu]==0.1.0\" or a wheel URL."
  validation {
    condition     = can(regex("^[^\\s'\"]+$", var.fleetrl_package))
    error_message = "fleetrl_package must be one pip requirement without spaces or quotes."
  }
}

variable "python" {
  type        = string
  default     = "python3"
  description = "Python (3.11+) on the image used to create FleetRL's virtualenv."
  validation {
    condition     = can(regex("^[A-Za-z0-9_./-]+$", var.python))
    error_message = "python must be a command name or an absolute path."
  }
}

variable "region" {
  type        = string
  default     = null
  description = "Rollout region of the node. When set, the node runs the systemd units shipped in the FleetRL package (`fleetrl units install`): fleetrl-agent.service and fleetrl-replicator@<region>.service, with a drop-in for what the package cannot know."
  validation {
    condition     = var.region == null || can(regex("^[a-z0-9][a-z0-9-]{0,62}$", var.region))
    error_message = "region must be a FleetRL name: [a-z0-9-], at most 63 characters, not starting with \"-\"."
  }
}

variable "agent_stop_timeout_s" {
  type        = number
  default     = 110
  description = "With region: TimeoutStopSec of fleetrl-agent.service (its drop-in), the time between SIGTERM and SIGKILL; keep it under the cloud's notice (AWS spot: 120 s)."
  validation {
    condition     = var.agent_stop_timeout_s >= 30 && var.agent_stop_timeout_s <= 600
    error_message = "agent_stop_timeout_s must be within 30-600 s (a spot notice gives 120 s)."
  }
}

variable "services" {
  type = list(object({
    name           = string
    description    = string
    args           = list(string)
    pre_args       = optional(list(list(string)), [])
    stop_timeout_s = optional(number, 90)
  }))
  default     = []
  description = "FleetRL daemons the package ships no unit for (the trainer), rendered as systemd units: `fleetrl <args> --config /etc/fleetrl/fleet.yaml --log-json`. $${FLEETRL_NODE} in args is the node's identity."
  validation {
    condition     = alltrue([for s in var.services : can(regex("^fleetrl-[a-z0-9-]+$", s.name))])
    error_message = "Service names must look like fleetrl-<name>."
  }
  validation {
    condition     = length(var.services) > 0 || var.region != null
    error_message = "Give a region (a rollout node runs the packaged units) or at least one service."
  }
  validation {
    condition     = var.region == null || length(setintersection([for s in var.services : s.name], ["fleetrl-agent", "fleetrl-replicator"])) == 0
    error_message = "With region set, fleetrl-agent and fleetrl-replicator come from the package: do not list them in services."
  }
  validation {
    condition     = alltrue([for s in var.services : s.stop_timeout_s >= 5 && s.stop_timeout_s <= 600])
    error_message = "stop_timeout_s must be within 5-600 s (spot instances get a two-minute notice)."
  }
}

variable "secret_env" {
  type = map(object({
    arn      = string
    json_key = optional(string)
  }))
  default     = {}
  description = "Environment variable name => secret (and JSON key inside it) fetched at boot into the units' EnvironmentFile."
  validation {
    condition     = alltrue([for k in keys(var.secret_env) : can(regex("^[A-Z_][A-Z0-9_]*$", k)) && !strcontains(k, "__")])
    error_message = "Environment variable names must be upper-case and must not contain \"__\" (FLEETRL_A__B is a config override)."
  }
}

variable "secret_files" {
  type = map(object({
    arn      = string
    json_key = optional(string)
  }))
  default     = {}
  description = "Absolute file path => secret written there at boot (readable by the fleetrl group), e.g. the hub's Ed25519 public key."
  validation {
    condition     = alltrue([for k in keys(var.secret_files) : startswith(k, "/etc/fleetrl/") || startswith(k, "/run/fleetrl/")])
    error_message = "Secret files must live under /etc/fleetrl/ or /run/fleetrl/."
  }
}

variable "state_dirs" {
  type        = list(string)
  default     = []
  description = "Extra absolute directories the daemons write (e.g. the trainer's checkpoint_dir); created and owned by the fleetrl user."
  validation {
    condition     = alltrue([for d in var.state_dirs : startswith(d, "/")])
    error_message = "state_dirs must be absolute paths."
  }
}

variable "mounts" {
  type = list(object({
    device = string
    path   = string
  }))
  default     = []
  description = "Block devices to format (when blank) and mount before FleetRL starts, e.g. the trainer's checkpoint volume."
  validation {
    condition     = alltrue([for m in var.mounts : startswith(m.device, "/dev/") && startswith(m.path, "/")])
    error_message = "mounts need a /dev/... device and an absolute path."
  }
}
