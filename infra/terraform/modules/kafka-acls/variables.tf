variable "run" {
  type        = string
  description = "Run id: topics are fleetrl.<run>.<stream>, consumer groups fleetrl.<run>.rollout and fleetrl.<run>.trainer."
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,62}$", var.run))
    error_message = "run must match ^[a-z0-9][a-z0-9-]{0,62}$ (lower-case letters, digits, dashes)."
  }
}

variable "principals" {
  type = object({
    trainer  = string
    rollout  = string
    operator = string
  })
  description = "Kafka principal of each role on this cluster (User:<SASL user name>). One user for every role is allowed: its grants are then the union."
  validation {
    condition     = alltrue([for p in values(var.principals) : can(regex("^User:[^\\s]+$", p))])
    error_message = "principals must look like User:<name> (no spaces)."
  }
}

variable "bootstrap" {
  type        = string
  description = "Bootstrap servers written into the rendered kafka-acls.sh commands."
}

variable "command_config" {
  type        = string
  default     = "admin.properties"
  description = "Client properties file (SASL/TLS of an admin user) that the rendered commands pass with --command-config."
}
