variable "bucket_prefix" {
  type        = string
  description = "Prefix of the generated bucket name (S3 appends a unique suffix)."
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{2,35}$", var.bucket_prefix))
    error_message = "bucket_prefix must be 3-36 lower-case letters, digits or dashes."
  }
}

variable "path" {
  type        = string
  default     = "hub"
  description = "Key prefix of the hub inside the bucket (the store URL is s3://bucket/path)."
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]*$", var.path))
    error_message = "path must be one lower-case path segment."
  }
}

variable "expiry_days" {
  type        = number
  default     = null
  description = "Expire current objects under `path` after this many days (replica stores); null keeps them (the home store)."
  validation {
    condition     = var.expiry_days == null || try(var.expiry_days >= 7, false)
    error_message = "expiry_days must be null or at least 7."
  }
}

variable "force_destroy" {
  type        = bool
  default     = false
  description = "Let `terraform destroy` delete the bucket with its objects."
}

variable "tags" {
  type        = map(string)
  default     = {}
  description = "Tags of the bucket."
}
