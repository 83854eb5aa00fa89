variable "run" {
  type        = string
  description = "Run id (fleet.yaml `run`): part of every topic, MQTT path, store key and resource name."
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,62}$", var.run))
    error_message = "run must match ^[a-z0-9][a-z0-9-]{0,62}$."
  }
}

variable "home" {
  type = object({
    aws_region = string
    vpc_id     = string
    subnet_id  = string
    cidr       = string
    trainer = object({
      ami_id         = string
      instance_type  = string
      root_volume_gb = optional(number, 500)
      checkpoint_dir = optional(string, "/var/lib/fleetrl/checkpoints")
    })
    mqtt = optional(object({
      mode                = optional(string, "mosquitto")
      ami_id              = optional(string)
      instance_type       = optional(string, "t3.small")
      url                 = optional(string)
      password_secret_arn = optional(string)
      ca_file             = optional(string)
    }), {})
  })
  description = "The home region: AWS region, network, trainer node and MQTT broker."
  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.home.aws_region))
    error_message = "home.aws_region must be an AWS region such as us-east-1."
  }
  validation {
    condition     = can(cidrhost(var.home.cidr, 0)) && var.home.cidr != "0.0.0.0/0"
    error_message = "home.cidr must be the home VPC's CIDR block."
  }
}

variable "regions" {
  type = list(object({
    name       = string
    aws_region = string
    vpc_id     = string
    subnet_ids = list(string)
    cidr       = string
    link_costs = optional(map(number), { home = 1 })
    engine = optional(object({
      kind                   = string
      gpu_memory_utilization = optional(number)
      tensor_parallel_size   = optional(number)
      max_num_seqs           = optional(number)
      dtype                  = optional(string)
      device                 = optional(string)
      max_batch              = optional(number)
    }), { kind = "vllm" })
    node = object({
      ami_id                  = string
      instance_types          = list(string)
      min_size                = optional(number, 0)
      max_size                = number
      desired_capacity        = number
      spot                    = optional(bool, true)
      on_demand_base_capacity = optional(number, 0)
      # The mixed-instances group and its prices (modules/rollout-region `node`).
      on_demand_percentage_above_base_capacity = optional(number)
      spot_allocation_strategy                 = optional(string, "price-capacity-optimized")
      spot_max_price                           = optional(string)
      on_demand_price                          = optional(number)
      spot_price                               = optional(number)
      spot_price_from_aws                      = optional(bool, true)
    })
    transfer_usd_per_gb = optional(number, 0)
    kafka = optional(object({
      mode                 = optional(string, "msk")
      broker_instance_type = optional(string, "kafka.m7g.large")
      broker_count         = optional(number, 3)
      broker_volume_gb     = optional(number, 500)
      # mode = "external": an existing cluster (see modules/rollout-region `kafka`); null = the module's default.
      bootstrap           = optional(string)
      security_protocol   = optional(string)
      sasl_mechanism      = optional(string)
      password_secret_arn = optional(string)
      external_cidrs      = optional(list(string), [])
    }), {})
  }))
  description = "The two rollout regions: FleetRL name, AWS region, network, nodes, Kafka (MSK brokers, or mode = \"external\" with its bootstrap), engine and link costs."
  validation {
    condition     = length(var.regions) == 2
    error_message = "This environment has exactly two rollout regions (add a provider alias and a module block for more)."
  }
  validation {
    condition     = alltrue([for r in var.regions : can(regex("^[a-z0-9][a-z0-9-]{0,62}$", r.name)) && r.name != "home"])
    error_message = "Region names must match ^[a-z0-9][a-z0-9-]{0,62}$ and must not be \"home\"."
  }
  validation {
    condition     = length(distinct([for r in var.regions : r.name])) == 2
    error_message = "The two regions need different names."
  }
  validation {
    condition     = alltrue([for r in var.regions : can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", r.aws_region))])
    error_message = "regions[].aws_region must be an AWS region such as us-west-2."
  }
  validation {
    condition     = alltrue([for r in var.regions : can(cidrhost(r.cidr, 0)) && r.cidr != "0.0.0.0/0"])
    error_message = "regions[].cidr must be the region VPC's CIDR block."
  }
}

variable "metrics_cidrs" {
  type        = list(string)
  default     = []
  description = "CIDRs of Prometheus scrapers (trainer 9400, agents 9401)."
  validation {
    condition     = alltrue([for c in var.metrics_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "metrics_cidrs must be valid CIDR blocks, never 0.0.0.0/0."
  }
}

variable "signing_scheme" {
  type        = string
  default     = "ed25519"
  description = "Manifest signatures: ed25519 (default; key pair stored by the operator after the first apply, nodes get only the public key) or hmac-sha256 (generated, shared by every node: any node can sign)."
  validation {
    condition     = contains(["hmac-sha256", "ed25519"], var.signing_scheme)
    error_message = "signing_scheme must be hmac-sha256 or ed25519."
  }
}

variable "fleetrl_version" {
  type        = string
  default     = "0.1.0"
  description = "FleetRL release installed on every node (pip)."
  validation {
    condition     = can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+([a-z0-9.+-]*)$", var.fleetrl_version))
    error_message = "fleetrl_version must be a version such as 0.1.0."
  }
}

variable "model" {
  type        = any
  default     = {}
  description = "fleet.yaml `model` section (path and tokenizer of the checkpoint baked into the images, publish_dtype)."
}

variable "algorithm" {
  type        = any
  default     = {}
  description = "fleet.yaml `algorithm` section."
}

variable "dataset" {
  type        = any
  default     = {}
  description = "fleet.yaml `dataset` section."
}

variable "kafka" {
  type        = any
  default     = { replication_factor = 3 }
  description = "fleet.yaml `kafka` section (replication_factor must not exceed the broker count)."
}

variable "rollout" {
  type        = any
  default     = {}
  description = "fleet.yaml `rollout` section (metrics_port is fixed at 9401)."
}

variable "trainer" {
  type        = any
  default     = { device = "cuda" }
  description = "fleet.yaml `trainer` section (checkpoint_dir and metrics_port are set from the home node)."
}

variable "hub" {
  type        = any
  default     = {}
  description = "fleet.yaml `hub` settings besides home_store and signing (anchor_interval, retention_versions, ...)."
}

variable "generate_secrets" {
  type        = bool
  default     = true
  description = "Generate the HMAC key, MQTT and Kafka passwords (ephemeral, write-only: never in state). false: put the values into the created secrets yourself."
}

variable "detailed_monitoring" {
  type        = bool
  default     = true
  description = "CloudWatch detailed (1-minute) monitoring on the trainer, the MQTT broker and the rollout nodes. false for accounts without it, and for emulated APIs (moto has no MonitorInstances)."
}

variable "enable_ssm" {
  type        = bool
  default     = false
  description = "Allow Session Manager shells on every node (no SSH port is ever opened)."
}

variable "force_destroy_stores" {
  type        = bool
  default     = false
  description = "Let `terraform destroy` delete non-empty stores (home included). For throw-away runs only."
}

variable "tags" {
  type        = map(string)
  default     = {}
  description = "Tags on every resource."
}
