variable "run" {
  type        = string
  description = "Run id: part of every Kafka topic, MQTT path and store key (fleet.yaml `run`)."
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,62}$", var.run))
    error_message = "run must match ^[a-z0-9][a-z0-9-]{0,62}$ (lower-case letters, digits, dashes)."
  }
}

variable "home" {
  type = object({
    store_url               = string
    store_region            = string
    mqtt_url                = string
    mqtt_username           = optional(string)
    mqtt_password_env       = optional(string)
    mqtt_ca_file            = optional(string)
    signing_scheme          = string
    signing_key_env         = string
    signing_public_key_file = optional(string)
  })
  description = "Outputs of the home-region module: home store, MQTT endpoint and signing settings."
  validation {
    condition     = can(regex("^s3://[a-z0-9][a-z0-9.-]{2,62}(/.*)?$", var.home.store_url))
    error_message = "home.store_url must be s3://bucket[/prefix]."
  }
  validation {
    condition     = can(regex("^mqtts?://[^:/]+(:[0-9]+)?/?$", var.home.mqtt_url))
    error_message = "home.mqtt_url must look like mqtt://host:port or mqtts://host:port."
  }
  validation {
    condition     = contains(["hmac-sha256", "ed25519"], var.home.signing_scheme)
    error_message = "home.signing_scheme must be hmac-sha256 or ed25519."
  }
}

variable "regions" {
  type = list(object({
    name                    = string
    kafka_bootstrap         = string
    kafka_security_protocol = string
    kafka_sasl_mechanism    = optional(string)
    kafka_sasl_username     = optional(string)
    kafka_password_env      = optional(string)
    store_url               = string
    store_region            = string
    link_costs              = optional(map(number), {})
    nodes                   = optional(list(string), [])
    weight                  = optional(number, 1)
    # What the region's capacity costs (fleet.yaml capacity, pools, transfer_usd_per_gb): US dollars per
    # node-hour of its on-demand and spot nodes; spot_history: read EC2's spot price history instead.
    capacity = optional(string, "on_demand")
    prices = optional(object({
      on_demand = optional(number)
      spot      = optional(number)
      spot_history = optional(object({
        region_name        = string
        instance_types     = list(string)
        availability_zones = optional(list(string), [])
      }))
    }), {})
    transfer_usd_per_gb = optional(number, 0)
    # fleet.yaml preemption of the region's nodes ({source = "aws"} on EC2); null: SIGTERM only.
    preemption = optional(map(string))
    # The engine fields FleetRL knows (fleetrl.config TorchEngineConfig / VllmEngineConfig); unset
    # ones are left out of fleet.yaml so the config's own defaults apply.
    engine = object({
      kind                   = string
      device                 = optional(string)
      max_batch              = optional(number)
      threads                = optional(number)
      dtype                  = optional(string)
      gpu_memory_utilization = optional(number)
      tensor_parallel_size   = optional(number)
      max_num_seqs           = optional(number)
      enforce_eager          = optional(bool)
    })
  }))
  description = "One entry per rollout region, from the rollout-region modules' `fleet_region` outputs."
  validation {
    condition     = length(var.regions) >= 1
    error_message = "A fleet needs at least one rollout region."
  }
  validation {
    condition     = alltrue([for r in var.regions : can(regex("^[a-z0-9][a-z0-9-]{0,62}$", r.name)) && r.name != "home"])
    error_message = "Region names must match ^[a-z0-9][a-z0-9-]{0,62}$ and must not be \"home\" (reserved for the home store)."
  }
  validation {
    condition     = length(distinct([for r in var.regions : r.name])) == length(var.regions)
    error_message = "Region names must be unique."
  }
  validation {
    condition     = alltrue([for r in var.regions : contains(["torch", "vllm"], r.engine.kind)])
    error_message = "engine.kind must be torch or vllm."
  }
  validation {
    condition = alltrue([for r in var.regions : contains(["on_demand", "spot"], r.capacity) && !(
    r.prices.spot != null && r.prices.spot_history != null)])
    error_message = "capacity must be on_demand or spot; a spot price is a number (prices.spot) or EC2's history (prices.spot_history), not both."
  }
  validation {
    condition = alltrue([for r in var.regions : alltrue([
      for k in keys(r.link_costs) : contains(concat(["home"], [for o in var.regions : o.name]), k)
    ])])
    error_message = "link_costs keys must be \"home\" or the name of another region."
  }
}

variable "hub" {
  type        = any
  default     = {}
  description = "Extra fleet.yaml `hub` settings (anchor_interval, retention_versions, ...). home_store and signing come from `home`."
  validation {
    condition     = length(setintersection(toset(keys(var.hub)), toset(["home_store", "signing"]))) == 0
    error_message = "hub.home_store and hub.signing are set from the home-region outputs; do not set them here."
  }
}

variable "model" {
  type        = any
  default     = {}
  description = "fleet.yaml `model` section (path, tokenizer, publish_dtype, tiny)."
}

variable "algorithm" {
  type        = any
  default     = {}
  description = "fleet.yaml `algorithm` section (groups_per_step, n_samples, max_staleness, lr, ...)."
}

variable "dataset" {
  type        = any
  default     = {}
  description = "fleet.yaml `dataset` section (task, path, ...)."
}

variable "kafka" {
  type        = any
  default     = {}
  description = "fleet.yaml `kafka` section shared by every region cluster (replication_factor, max_message_bytes, ...)."
}

variable "rollout" {
  type        = any
  default     = {}
  description = "fleet.yaml `rollout` section; metrics_port is set from agent_metrics_port."
}

variable "trainer" {
  type        = any
  default     = {}
  description = "fleet.yaml `trainer` section (device, checkpoint_dir, ...); metrics_port is set from trainer_metrics_port."
}

variable "trainer_metrics_port" {
  type        = number
  default     = 9400
  description = "Prometheus port of the trainer; the home security group opens the same port."
  validation {
    condition     = var.trainer_metrics_port >= 1024 && var.trainer_metrics_port <= 65535
    error_message = "trainer_metrics_port must be an unprivileged port (1024-65535)."
  }
}

variable "agent_metrics_port" {
  type        = number
  default     = 9401
  description = "Prometheus port of region agents; the rollout security groups open the same port."
  validation {
    condition     = var.agent_metrics_port >= 1024 && var.agent_metrics_port <= 65535
    error_message = "agent_metrics_port must be an unprivileged port (1024-65535)."
  }
}
