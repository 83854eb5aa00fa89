# Pure rendering: no provider. The cloud-config it returns is plain cloud-init, usable by any
# cloud's instances; only fetch-secrets.py knows about AWS Secrets Manager.
terraform {
  required_version = ">= 1.10"
}
