# Exactly what a rollout node needs: read its region store, the home store and peer stores;
# write versions, holder markers and the replicator lease into its region store; write its
# holder markers into the home store; read its own secrets.

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  name_prefix        = substr("${local.prefix}-", 0, 38)
  assume_role_policy = data.aws_iam_policy_document.assume.json
  tags               = local.tags
}

locals {
  readable_buckets = concat([module.store.bucket_arn, var.home_store.bucket_arn], var.peer_store_bucket_arns)
  node_secret_arns = distinct(concat(
    [for s in values(merge(var.node_secret_env, local.kafka_password_secret)) : s.arn],
    [for s in values(var.node_secret_files) : s.arn],
  ))
}

data "aws_iam_policy_document" "node" {
  statement {
    sid       = "ListStores"
    actions   = ["s3:ListBucket"]
    resources = local.readable_buckets
  }
  statement {
    sid       = "ReadStores"
    actions   = ["s3:GetObject"]
    resources = [for b in local.readable_buckets : "${b}/*"]
  }
  statement {
    sid       = "ReplicateIntoRegionStore"
    actions   = ["s3:PutObject", "s3:DeleteObject"]
    resources = ["${module.store.bucket_arn}/hub/*"]
  }
  statement {
    sid       = "HolderMarkersInHomeStore"
    actions   = ["s3:PutObject"]
    resources = ["${var.home_store.bucket_arn}/${var.home_store.prefix}/*/holders/*"]
  }
  statement {
    sid       = "ReadOwnSecrets"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = local.node_secret_arns
  }
  dynamic "statement" {
    for_each = local.msk ? [1] : []
    content {
      sid       = "DecryptKafkaSecret"
      actions   = ["kms:Decrypt"]
      resources = [aws_kms_key.kafka[0].arn]
    }
  }
}

resource "aws_iam_role_policy" "node" {
  name   = "fleetrl-node"
  role   = aws_iam_role.node.id
  policy = data.aws_iam_policy_document.node.json
}

resource "aws_iam_role_policy_attachment" "ssm" {
  count      = var.enable_ssm ? 1 : 0
  role       = aws_iam_role.node.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_instance_profile" "node" {
  name_prefix = substr("${local.prefix}-", 0, 38)
  role        = aws_iam_role.node.name
  tags        = local.tags
}
