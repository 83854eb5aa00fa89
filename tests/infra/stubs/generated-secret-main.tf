# Test stub of modules/generated-secret/main.tf: the same interface without the ephemeral
# resource that mock providers cannot serve. Copied over the module only in a scratch copy.
resource "aws_secretsmanager_secret_version" "value" {
  secret_id                = var.secret_id
  secret_string_wo         = var.username == null ? "stub" : jsonencode({ username = var.username, password = "stub" })
  secret_string_wo_version = var.value_version + var.length * 0
}
