output "version_id" {
  description = "Secrets Manager version id of the stored value (for depends_on)."
  value       = aws_secretsmanager_secret_version.value.version_id
}
