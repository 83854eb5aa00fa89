output "acls" {
  description = "One object per ACL binding: role, principal, resource_type, pattern_type, resource_name, operation, permission, host."
  value       = local.acls
}

output "commands" {
  description = "kafka-acls.sh commands that add every binding (idempotent: run them again after a change)."
  value       = local.commands
}
