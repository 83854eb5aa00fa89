# An object store of the tensor hub (DESIGN.md §5): private, encrypted, TLS only, versioned.
# The hub's own gc deletes what no retained version needs; for a region's replica store the
# lifecycle rule is a backstop that expires objects older than the retention window (the home
# store, the source of truth, sets no expiry).

resource "aws_s3_bucket" "store" {
  #checkov:skip=CKV_AWS_18:Access logs would need a log bucket per region; CloudTrail data events are the account's choice.
  #checkov:skip=CKV_AWS_144:Replication between stores is FleetRL's own replicator (verified, holder-marked); S3 CRR would copy twice.
  #checkov:skip=CKV2_AWS_62:No consumer of S3 event notifications: replicators poll `latest`.
  bucket_prefix = "${var.bucket_prefix}-"
  force_destroy = var.force_destroy
  tags          = var.tags
}

resource "aws_s3_bucket_public_access_block" "store" {
  bucket                  = aws_s3_bucket.store.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "store" {
  bucket = aws_s3_bucket.store.id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "store" {
  bucket = aws_s3_bucket.store.id
  rule {
    # The AWS-managed key: readers in other regions of the account decrypt through S3 without grants.
    apply_server_side_encryption_by_default {
      sse_algorithm = "aws:kms"
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_versioning" "store" {
  bucket = aws_s3_bucket.store.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "store" {
  bucket = aws_s3_bucket.store.id
  rule {
    id     = var.expiry_days == null ? "expire-deleted-versions" : "expire-replicas-after-retention-window"
    status = "Enabled"
    filter {
      prefix = "${var.path}/"
    }
    dynamic "expiration" {
      for_each = var.expiry_days == null ? [] : [var.expiry_days]
      content {
        days = expiration.value
      }
    }
    noncurrent_version_expiration {
      noncurrent_days = 1
    }
  }
  rule {
    id     = "abort-incomplete-uploads"
    status = "Enabled"
    filter {}
    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }
  }
  depends_on = [aws_s3_bucket_versioning.store]
}

resource "aws_s3_bucket_policy" "store" {
  bucket = aws_s3_bucket.store.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Sid       = "TlsOnly"
      Effect    = "Deny"
      Principal = "*"
      Action    = "s3:*"
      Resource  = [aws_s3_bucket.store.arn, "${aws_s3_bucket.store.arn}/*"]
      Condition = { Bool = { "aws:SecureTransport" = "false" } }
    }]
  })
  depends_on = [aws_s3_bucket_public_access_block.store]
}
