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
  description = "Rollout region of the node: it runs the packaged units fleetrl-agent.service and fleetrl-replicator@<region>.service (`fleetrl units install`), with drop-ins for what the package cannot know. Give this or trainer."
  validation {
    condition     = var.region == null || can(regex("^[a-z0-9][a-z0-9-]{0,62}$", var.region))
    error_message = "region must be a FleetRL name: [a-z0-9-], at most 63 characters, not starting with \"-\"."
  }
}

variable "agent_stop_timeout_s" {
  type        = number
  default     = 110
  description = "On a rollout node: TimeoutStopSec of fleetrl-agent.service (its drop-in), the time between SIGTERM and SIGKILL; keep it under the cloud's notice (AWS spot: 120 s)."
  validation {
    condition     = var.agent_stop_timeout_s >= 30 && var.agent_stop_timeout_s <= 600
    error_message = "agent_stop_timeout_s must be within 30-600 s (a spot notice gives 120 s)."
  }
}

variable "trainer" {
  type = object({
    stop_timeout_s = optional(number, 120)
  })
  default     = null
  description = "Set on the trainer node: it runs the packaged fleetrl-trainer.service (`fleetrl topics create`, then `fleetrl trainer`); stop_timeout_s is its TimeoutStopSec (a step plus trainer.drain_timeout_s)."
  validation {
    condition     = (var.trainer == null) != (var.region == null)
    error_message = "Give a region (a rollout node) or trainer (the trainer node), not both."
  }
  validation {
    condition     = var.trainer == null || try(var.trainer.stop_timeout_s >= 5 && var.trainer.stop_timeout_s <= 600, false)
    error_message = "trainer.stop_timeout_s must be within 5-600 s."
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
