terraform {
  required_version = ">= 1.10"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.90, < 6.0"
    }
  }
  # Configure a remote backend (S3 with locking) before a real apply; state holds no secrets
  # (they are write-only), but it does hold the fleet's topology.
}
