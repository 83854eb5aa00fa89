# The trainer reads and writes the home store and reads its secrets; the MQTT broker reads only
# its password.

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "trainer" {
  name_prefix        = substr("${local.prefix}-trainer-", 0, 38)
  assume_role_policy = data.aws_iam_policy_document.assume.json
  tags               = local.tags
}

data "aws_iam_policy_document" "trainer" {
  statement {
    sid       = "ListHomeStore"
    actions   = ["s3:ListBucket"]
    resources = [module.store.bucket_arn]
  }
  statement {
    sid       = "PublishToHomeStore"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"]
    resources = ["${module.store.bucket_arn}/hub/*"]
  }
  statement {
    sid       = "ReadOwnSecrets"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = distinct([for s in values(local.trainer_secret_env) : s.arn])
  }
  # Spot pools priced from EC2's spot price history (fleet.yaml `price: {source: aws}`): a read-only
  # action that takes no resource-level permissions.
  statement {
    sid       = "ReadSpotPrices"
    actions   = ["ec2:DescribeSpotPriceHistory"]
    resources = ["*"]
  }
  dynamic "statement" {
    for_each = length(var.kafka_kms_key_arns) > 0 ? [1] : []
    content {
      sid       = "DecryptKafkaSecrets"
      actions   = ["kms:Decrypt"]
      resources = var.kafka_kms_key_arns
    }
  }
}

resource "aws_iam_role_policy" "trainer" {
  name   = "fleetrl-trainer"
  role   = aws_iam_role.trainer.id
  policy = data.aws_iam_policy_document.trainer.json
}

resource "aws_iam_instance_profile" "trainer" {
  name_prefix = substr("${local.prefix}-trainer-", 0, 38)
  role        = aws_iam_role.trainer.name
  tags        = local.tags
}

resource "aws_iam_role" "mqtt" {
  count              = local.mosquitto ? 1 : 0
  name_prefix        = substr("${local.prefix}-mqtt-", 0, 38)
  assume_role_policy = data.aws_iam_policy_document.assume.json
  tags               = local.tags
}

data "aws_iam_policy_document" "mqtt" {
  count = local.mosquitto ? 1 : 0
  statement {
    sid       = "ReadMqttPassword"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [aws_secretsmanager_secret.mqtt[0].arn]
  }
}

resource "aws_iam_role_policy" "mqtt" {
  count  = local.mosquitto ? 1 : 0
  name   = "fleetrl-mqtt"
  role   = aws_iam_role.mqtt[0].id
  policy = data.aws_iam_policy_document.mqtt[0].json
}

resource "aws_iam_instance_profile" "mqtt" {
  count       = local.mosquitto ? 1 : 0
  name_prefix = substr("${local.prefix}-mqtt-", 0, 38)
  role        = aws_iam_role.mqtt[0].name
  tags        = local.tags
}

resource "aws_iam_role_policy_attachment" "ssm" {
  for_each   = var.enable_ssm ? toset(concat([aws_iam_role.trainer.name], aws_iam_role.mqtt[*].name)) : toset([])
  role       = each.value
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}
