variable "run" {
  type        = string
  description = "Run id (fleet.yaml `run`); names resources so several runs can share an account."
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,62}$", var.run))
    error_message = "run must match ^[a-z0-9][a-z0-9-]{0,62}$."
  }
}

variable "vpc_id" {
  type        = string
  description = "Home VPC (trainer and MQTT broker), peered with every rollout region's VPC."
  validation {
    condition     = can(regex("^vpc-[0-9a-f]{8,17}$", var.vpc_id))
    error_message = "vpc_id must look like vpc-0123456789abcdef0."
  }
}

variable "subnet_id" {
  type        = string
  description = "Private subnet of the trainer and the MQTT broker."
  validation {
    condition     = can(regex("^subnet-[0-9a-f]{8,17}$", var.subnet_id))
    error_message = "subnet_id must look like subnet-0123456789abcdef0."
  }
}

variable "fleet_cidrs" {
  type        = list(string)
  description = "CIDRs of the rollout regions' networks: their nodes reach MQTT here, the trainer reaches their Kafka there."
  validation {
    condition     = length(var.fleet_cidrs) > 0 && alltrue([for c in var.fleet_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "fleet_cidrs must be valid, non-empty CIDR blocks, never 0.0.0.0/0."
  }
}

variable "metrics_cidrs" {
  type        = list(string)
  default     = []
  description = "CIDRs of Prometheus scrapers allowed to reach the trainer's metrics port."
  validation {
    condition     = alltrue([for c in var.metrics_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "metrics_cidrs must be valid CIDR blocks, never 0.0.0.0/0."
  }
}

variable "trainer" {
  type = object({
    ami_id           = string
    instance_type    = string
    root_volume_gb   = optional(number, 500)
    root_device_name = optional(string, "/dev/xvda")
    checkpoint_dir   = optional(string, "/var/lib/fleetrl/checkpoints")
    stop_timeout_s   = optional(number, 120)
  })
  description = "The trainer node: a GPU image with drivers and Python 3.11+, its instance type and disk."
  validation {
    condition     = can(regex("^ami-[0-9a-f]{8,17}$", var.trainer.ami_id))
    error_message = "trainer.ami_id must look like ami-0123456789abcdef0."
  }
  validation {
    condition     = var.trainer.root_volume_gb >= 50 && var.trainer.root_volume_gb <= 16384
    error_message = "trainer.root_volume_gb must be within 50 and 16384."
  }
  validation {
    condition     = startswith(var.trainer.checkpoint_dir, "/")
    error_message = "trainer.checkpoint_dir must be an absolute path."
  }
}

variable "mqtt" {
  type = object({
    mode          = optional(string, "mosquitto")
    ami_id        = optional(string)
    instance_type = optional(string, "t3.small")
    username      = optional(string, "fleetrl")
    # mode = "external": an existing EMQX / HiveMQ / Mosquitto endpoint.
    url                 = optional(string)
    password_secret_arn = optional(string)
    password_json_key   = optional(string, "password")
    ca_file             = optional(string)
  })
  description = "The MQTT control plane: Mosquitto on an instance (mode = \"mosquitto\", an Ubuntu or Debian AMI) or an existing endpoint (mode = \"external\")."
  validation {
    condition     = contains(["mosquitto", "external"], var.mqtt.mode)
    error_message = "mqtt.mode must be mosquitto or external."
  }
  validation {
    condition     = var.mqtt.mode == "external" || can(regex("^ami-[0-9a-f]{8,17}$", var.mqtt.ami_id))
    error_message = "mqtt.mode = mosquitto needs mqtt.ami_id (ami-...)."
  }
  validation {
    condition     = var.mqtt.mode == "mosquitto" || can(regex("^mqtts?://[^:/]+(:[0-9]+)?/?$", var.mqtt.url))
    error_message = "mqtt.mode = external needs mqtt.url like mqtts://host:8883."
  }
}

variable "mqtt_password_version" {
  type        = number
  default     = 1
  description = "Bump to generate a new MQTT password (write-only, never in state); restart brokers and daemons after."
  validation {
    condition     = var.mqtt_password_version >= 1 && floor(var.mqtt_password_version) == var.mqtt_password_version
    error_message = "mqtt_password_version must be a positive integer."
  }
}

variable "signing_scheme" {
  type        = string
  default     = "ed25519"
  description = "Manifest signatures: ed25519 (default: a key pair you store after apply; only the trainer reads the private key, nodes get the public key and cannot sign) or hmac-sha256 (a key generated here and shared by every node, so any node can sign: single-tenant setups only)."
  validation {
    condition     = contains(["hmac-sha256", "ed25519"], var.signing_scheme)
    error_message = "signing_scheme must be hmac-sha256 or ed25519."
  }
}

variable "signing_key_version" {
  type        = number
  default     = 1
  description = "Bump to generate a new HMAC signing key (write-only, never in state)."
  validation {
    condition     = var.signing_key_version >= 1 && floor(var.signing_key_version) == var.signing_key_version
    error_message = "signing_key_version must be a positive integer."
  }
}

variable "force_destroy_store" {
  type        = bool
  default     = false
  description = "Let `terraform destroy` delete a non-empty home store. It holds every version: keep false in production."
}

variable "fleet_yaml" {
  type        = string
  description = "fleet.yaml the trainer starts with (the fleet-config module's output)."
}

variable "fleetrl_package" {
  type        = string
  default     = "fleetrl==0.1.0"
  description = "pip requirement that installs FleetRL on the trainer."
}

variable "kafka_secrets" {
  type = map(object({
    arn      = string
    json_key = optional(string)
  }))
  default     = {}
  description = "Every region's Kafka password secret keyed by its environment variable (rollout-region outputs kafka_password_secret)."
}

variable "kafka_kms_key_arns" {
  type        = list(string)
  default     = []
  description = "KMS keys of the regions' Kafka secrets (rollout-region outputs kafka_kms_key_arn); the trainer may decrypt with them."
  validation {
    condition     = alltrue([for a in var.kafka_kms_key_arns : can(regex("^arn:aws[a-z-]*:kms:", a))])
    error_message = "kafka_kms_key_arns must be KMS key ARNs."
  }
}

variable "trainer_metrics_port" {
  type        = number
  default     = 9400
  description = "Prometheus port of the trainer (fleet.yaml trainer.metrics_port)."
  validation {
    condition     = var.trainer_metrics_port >= 1024 && var.trainer_metrics_port <= 65535
    error_message = "trainer_metrics_port must be within 1024-65535."
  }
}

variable "detailed_monitoring" {
  type        = bool
  default     = true
  description = "CloudWatch detailed (1-minute) monitoring on the trainer and the MQTT broker instances; false where the account (or an emulated API such as moto) has none."
}

variable "enable_ssm" {
  type        = bool
  default     = false
  description = "Attach AmazonSSMManagedInstanceCore so operators can open a shell with Session Manager (no SSH port is ever opened)."
}

variable "tags" {
  type        = map(string)
  default     = {}
  description = "Tags added to every resource of the home region."
}

variable "generate_secrets" {
  type        = bool
  default     = true
  description = "Generate the HMAC signing key and the MQTT password (ephemeral, stored write-only). false: the secrets are created empty and you put the values yourself."
}
