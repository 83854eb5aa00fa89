output "url" {
  description = "Store URL as fleet.yaml writes it (s3://bucket/path)."
  value       = "s3://${aws_s3_bucket.store.bucket}/${var.path}"
}

output "bucket" {
  description = "Bucket name."
  value       = aws_s3_bucket.store.bucket
}

output "bucket_arn" {
  description = "Bucket ARN."
  value       = aws_s3_bucket.store.arn
}
