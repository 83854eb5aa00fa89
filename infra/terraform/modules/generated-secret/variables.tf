variable "secret_id" {
  type        = string
  description = "Secrets Manager secret (id or ARN) that receives the generated value."
}

variable "value_version" {
  type        = number
  description = "Version of the write-only value: bump it to generate and store a new one."
  validation {
    condition     = var.value_version >= 1 && floor(var.value_version) == var.value_version
    error_message = "value_version must be a positive integer."
  }
}

variable "username" {
  type        = string
  default     = null
  description = "When set, the secret is JSON {\"username\", \"password\"} (MSK SCRAM, MQTT); else the bare value."
}

variable "length" {
  type        = number
  default     = 40
  description = "Length of the generated value (letters and digits only, safe in environment files)."
  validation {
    condition     = var.length >= 32 && var.length <= 4096
    error_message = "length must be within 32 and 4096."
  }
}
