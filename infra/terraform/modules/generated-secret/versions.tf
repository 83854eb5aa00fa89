terraform {
  required_version = ">= 1.11"
  required_providers {
    # >= 5.90: ephemeral random passwords and write-only secret values keep secrets out of state.
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.90, < 6.0"
    }
  }
}
