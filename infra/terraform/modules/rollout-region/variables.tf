variable "name" {
  type        = string
  description = "FleetRL region name (fleet.yaml regions[].name), used in topics, MQTT paths and store names."
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,62}$", var.name)) && var.name != "home"
    error_message = "name must match ^[a-z0-9][a-z0-9-]{0,62}$ and must not be \"home\" (reserved for the home store)."
  }
}

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
  description = "VPC of the region's brokers and rollout nodes; peered (or transit-gateway linked) with the home VPC."
  validation {
    condition     = can(regex("^vpc-[0-9a-f]{8,17}$", var.vpc_id))
    error_message = "vpc_id must look like vpc-0123456789abcdef0."
  }
}

variable "subnet_ids" {
  type        = list(string)
  description = "Private subnets in distinct availability zones for brokers and nodes (MSK needs 2 or 3)."
  validation {
    condition     = length(var.subnet_ids) >= 2 && alltrue([for s in var.subnet_ids : can(regex("^subnet-[0-9a-f]{8,17}$", s))])
    error_message = "Give at least two subnet ids (subnet-...) in distinct availability zones."
  }
}

variable "home_cidrs" {
  type        = list(string)
  description = "CIDRs of the home region network: the trainer reaches this region's Kafka from there, nodes reach MQTT there."
  validation {
    condition     = length(var.home_cidrs) > 0 && alltrue([for c in var.home_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "home_cidrs must be valid, non-empty CIDR blocks, never 0.0.0.0/0."
  }
}

variable "metrics_cidrs" {
  type        = list(string)
  default     = []
  description = "CIDRs of Prometheus scrapers allowed to reach the agents' metrics port."
  validation {
    condition     = alltrue([for c in var.metrics_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "metrics_cidrs must be valid CIDR blocks, never 0.0.0.0/0."
  }
}

variable "kafka" {
  type = object({
    mode                 = optional(string, "msk")
    version              = optional(string, "3.6.0")
    broker_instance_type = optional(string, "kafka.m7g.large")
    broker_count         = optional(number, 3)
    broker_volume_gb     = optional(number, 500)
    sasl_username        = optional(string, "fleetrl")
    log_retention_days   = optional(number, 30)
    # Kafka ACLs (rendered as the kafka_acls output): each role's principal, User:<sasl_username> by
    # default; enforce_acls = true sets allow.everyone.if.no.acl.found=false on MSK once they are applied.
    acl_principals = optional(object({
      trainer  = optional(string)
      rollout  = optional(string)
      operator = optional(string)
    }), {})
    enforce_acls = optional(bool, false)
    # mode = "external": an existing cluster (Redpanda, Confluent, self-managed brokers).
    bootstrap           = optional(string)
    security_protocol   = optional(string, "SASL_SSL")
    sasl_mechanism      = optional(string, "SCRAM-SHA-512")
    password_secret_arn = optional(string)
    password_json_key   = optional(string, "password")
    external_cidrs      = optional(list(string), [])
  })
  default     = {}
  description = "The region's Kafka: an MSK cluster with SASL/SCRAM (mode = \"msk\") or an existing cluster (mode = \"external\"), and the principal of each role for its ACLs."
  validation {
    condition     = contains(["msk", "external"], var.kafka.mode)
    error_message = "kafka.mode must be msk or external."
  }
  validation {
    condition     = var.kafka.broker_count >= 2 && var.kafka.broker_count % length(var.subnet_ids) == 0
    error_message = "kafka.broker_count must be at least 2 and a multiple of the number of subnets."
  }
  validation {
    condition     = var.kafka.mode == "msk" || (var.kafka.bootstrap != null && length(var.kafka.external_cidrs) > 0)
    error_message = "kafka.mode = external needs kafka.bootstrap and kafka.external_cidrs."
  }
  validation {
    condition     = contains(["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"], var.kafka.security_protocol)
    error_message = "kafka.security_protocol must be PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL."
  }
}

variable "kafka_password_version" {
  type        = number
  default     = 1
  description = "Bump to generate and store a new SCRAM password (the secret value is write-only, never in state)."
  validation {
    condition     = var.kafka_password_version >= 1 && floor(var.kafka_password_version) == var.kafka_password_version
    error_message = "kafka_password_version must be a positive integer."
  }
}

variable "max_message_bytes" {
  type        = number
  default     = 16777216
  description = "Largest record the brokers accept; must be at least fleet.yaml kafka.max_message_bytes (16 MiB)."
  validation {
    condition     = var.max_message_bytes >= 1048576 && var.max_message_bytes <= 104857600
    error_message = "max_message_bytes must be within 1 MiB and 100 MiB."
  }
}

variable "store_expiry_days" {
  type        = number
  default     = 30
  description = "Region-store objects older than this expire; set it above the time the hub's retention window spans (the home store keeps the source of truth)."
  validation {
    condition     = var.store_expiry_days >= 7
    error_message = "store_expiry_days must be at least 7."
  }
}

variable "force_destroy_store" {
  type        = bool
  default     = false
  description = "Let `terraform destroy` delete a non-empty region store (a replica; the home store keeps every version)."
}

variable "home_store" {
  type = object({
    bucket_arn = string
    prefix     = string
  })
  description = "The home store (home-region outputs): nodes read it for peer references and write their holder markers there."
  validation {
    condition     = can(regex("^arn:aws[a-z-]*:s3:::[a-z0-9][a-z0-9.-]{2,62}$", var.home_store.bucket_arn))
    error_message = "home_store.bucket_arn must be an S3 bucket ARN."
  }
}

variable "peer_store_bucket_arns" {
  type        = list(string)
  default     = []
  description = "Other regions' store buckets the replicator may copy from when they are nearer than home (link_costs)."
  validation {
    condition     = alltrue([for a in var.peer_store_bucket_arns : can(regex("^arn:aws[a-z-]*:s3:::", a))])
    error_message = "peer_store_bucket_arns must be S3 bucket ARNs."
  }
}

variable "node" {
  type = object({
    ami_id                  = string
    instance_types          = list(string)
    min_size                = optional(number, 0)
    max_size                = number
    desired_capacity        = number
    spot                    = optional(bool, true)
    on_demand_base_capacity = optional(number, 0)
    # The mixed-instances group: on_demand_base_capacity on-demand nodes first, then this share of the
    # nodes above the base on demand and the rest spot (null: 0 with spot = true, 100 without).
    on_demand_percentage_above_base_capacity = optional(number)
    spot_allocation_strategy                 = optional(string, "price-capacity-optimized")
    spot_max_price                           = optional(string) # USD per hour; null: up to the on-demand price
    # fleet.yaml prices (US dollars per node-hour) of the two pools: on_demand_price, and spot_price or,
    # with spot_price_from_aws, EC2's spot price history of instance_types read by the trainer.
    on_demand_price     = optional(number)
    spot_price          = optional(number)
    spot_price_from_aws = optional(bool, true)
    root_volume_gb      = optional(number, 200)
    root_device_name    = optional(string, "/dev/xvda")
    termination_grace_s = optional(number, 110)
  })
  description = "Rollout nodes: a GPU image with drivers and Python 3.11+, instance types for the mixed-instances policy (an on-demand base, spot above it), the group's size, and the prices fleet.yaml gives each pool."
  validation {
    condition     = can(regex("^ami-[0-9a-f]{8,17}$", var.node.ami_id))
    error_message = "node.ami_id must look like ami-0123456789abcdef0."
  }
  validation {
    condition     = length(var.node.instance_types) > 0
    error_message = "node.instance_types needs at least one instance type."
  }
  validation {
    condition     = var.node.min_size >= 0 && var.node.min_size <= var.node.desired_capacity && var.node.desired_capacity <= var.node.max_size && var.node.max_size <= 1000
    error_message = "Need 0 <= min_size <= desired_capacity <= max_size <= 1000."
  }
  validation {
    condition     = var.node.on_demand_base_capacity >= 0 && var.node.on_demand_base_capacity <= var.node.max_size
    error_message = "node.on_demand_base_capacity must be within 0 and max_size."
  }
  validation {
    condition     = var.node.on_demand_percentage_above_base_capacity == null ? true : (var.node.on_demand_percentage_above_base_capacity >= 0 && var.node.on_demand_percentage_above_base_capacity <= 100)
    error_message = "node.on_demand_percentage_above_base_capacity must be within 0 and 100."
  }
  validation {
    condition     = contains(["price-capacity-optimized", "capacity-optimized", "capacity-optimized-prioritized", "lowest-price"], var.node.spot_allocation_strategy)
    error_message = "node.spot_allocation_strategy must be price-capacity-optimized, capacity-optimized, capacity-optimized-prioritized or lowest-price."
  }
  validation {
    condition     = var.node.spot_max_price == null ? true : can(regex("^[0-9]+(\\.[0-9]+)?$", var.node.spot_max_price))
    error_message = "node.spot_max_price must be a price in US dollars per hour such as \"1.25\" (or null: up to the on-demand price)."
  }
  validation {
    condition     = alltrue([for p in [var.node.on_demand_price, var.node.spot_price] : p == null ? true : p >= 0])
    error_message = "node.on_demand_price and node.spot_price must not be negative."
  }
  validation {
    condition     = var.node.termination_grace_s >= 30 && var.node.termination_grace_s <= 600
    error_message = "node.termination_grace_s must be within 30-600 s (a spot notice gives 120 s)."
  }
}

variable "engine" {
  type = object({
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
  default     = { kind = "vllm" }
  description = "fleet.yaml engine of the region's nodes (torch or vllm and its settings)."
  validation {
    condition     = contains(["torch", "vllm"], var.engine.kind)
    error_message = "engine.kind must be torch or vllm."
  }
}

variable "link_costs" {
  type        = map(number)
  default     = { home = 1 }
  description = "fleet.yaml link_costs: cost of reading from `home` or another region's store; lower is nearer."
  validation {
    condition     = alltrue([for v in values(var.link_costs) : v >= 0])
    error_message = "link_costs must not be negative."
  }
}

variable "transfer_usd_per_gb" {
  type        = number
  default     = 0
  description = "fleet.yaml transfer_usd_per_gb: US dollars per GB of trajectories crossing the region's link to home (inter-region data transfer); 0: not counted."
  validation {
    condition     = var.transfer_usd_per_gb >= 0
    error_message = "transfer_usd_per_gb must not be negative."
  }
}

variable "fleet_yaml" {
  type        = string
  description = "fleet.yaml the nodes start with (the fleet-config module's output)."
}

variable "fleetrl_package" {
  type        = string
  default     = "fleetrl[gpu]==0.1.0"
  description = "pip requirement that installs FleetRL with its vLLM extra on the nodes."
}

variable "node_secret_env" {
  type = map(object({
    arn      = string
    json_key = optional(string)
  }))
  default     = {}
  description = "Secrets every node needs (the home-region output node_secret_env: hub key, MQTT password); the region's Kafka password is added here."
}

variable "node_secret_files" {
  type = map(object({
    arn      = string
    json_key = optional(string)
  }))
  default     = {}
  description = "Secrets written to files on the nodes (the home-region output node_secret_files, e.g. the Ed25519 public key)."
}

variable "agent_metrics_port" {
  type        = number
  default     = 9401
  description = "Prometheus port of the agents (fleet.yaml rollout.metrics_port)."
  validation {
    condition     = var.agent_metrics_port >= 1024 && var.agent_metrics_port <= 65535
    error_message = "agent_metrics_port must be within 1024-65535."
  }
}

variable "detailed_monitoring" {
  type        = bool
  default     = true
  description = "CloudWatch detailed (1-minute) monitoring on the rollout nodes (launch template); false where the account (or an emulated API such as moto) has none."
}

variable "enable_ssm" {
  type        = bool
  default     = false
  description = "Attach AmazonSSMManagedInstanceCore so operators can open a shell with Session Manager (no SSH port is ever opened)."
}

variable "tags" {
  type        = map(string)
  default     = {}
  description = "Tags added to every resource of the region."
}

variable "generate_secrets" {
  type        = bool
  default     = true
  description = "Generate the Kafka SCRAM password (ephemeral, stored write-only). false: the secret is created empty and you put {\"username\", \"password\"} yourself."
}
