# Pure rendering: no provider, so the fleet.yaml this module writes can be rendered (and tested)
# without cloud credentials or a provider mirror.
terraform {
  required_version = ">= 1.10"
}
