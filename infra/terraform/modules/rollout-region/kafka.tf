# The region's Kafka: MSK with SASL/SCRAM over TLS (port 9096). The SCRAM password is generated
# ephemerally and written write-only into Secrets Manager, so it is never in Terraform state.

resource "aws_kms_key" "kafka" {
  count                   = local.msk ? 1 : 0
  description             = "${local.prefix}: MSK data at rest, its broker logs and its SCRAM secret"
  enable_key_rotation     = true
  deletion_window_in_days = 7
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "AccountAdministersKeyThroughIAM"
        Effect    = "Allow"
        Principal = { AWS = "arn:${local.partition}:iam::${local.account_id}:root" }
        Action    = "kms:*"
        Resource  = "*"
      },
      {
        Sid       = "BrokerLogsInCloudWatch"
        Effect    = "Allow"
        Principal = { Service = "logs.${local.region}.amazonaws.com" }
        Action    = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey"]
        Resource  = "*"
        Condition = {
          ArnLike = { "kms:EncryptionContext:aws:logs:arn" = "arn:${local.partition}:logs:${local.region}:${local.account_id}:log-group:/fleetrl/*" }
        }
      },
    ]
  })
  tags = local.tags
}

resource "aws_cloudwatch_log_group" "kafka" {
  #checkov:skip=CKV_AWS_338:Broker logs are for debugging; retention is a variable (kafka.log_retention_days), one year is not needed.
  count             = local.msk ? 1 : 0
  name              = "/fleetrl/${var.run}/${var.name}/msk"
  retention_in_days = var.kafka.log_retention_days
  kms_key_id        = aws_kms_key.kafka[0].arn
  tags              = local.tags
}

resource "aws_msk_configuration" "kafka" {
  count          = local.msk ? 1 : 0
  name           = local.prefix
  kafka_versions = [var.kafka.version]
  # Topics are created by `fleetrl topics create` with their own max.message.bytes (16 MiB); the
  # broker limits are raised to match so replication of large trajectory records never stalls.
  # SCRAM authenticates every client. Kafka ACLs are not an AWS resource: the kafka_acls output
  # renders them (kafka-acls.sh commands); once applied, kafka.enforce_acls = true denies the rest.
  server_properties = <<-EOT
    auto.create.topics.enable=false
    allow.everyone.if.no.acl.found=${!var.kafka.enforce_acls}
    message.max.bytes=${var.max_message_bytes}
    replica.fetch.max.bytes=${var.max_message_bytes}
    replica.fetch.response.max.bytes=${max(var.max_message_bytes, 10485760)}
    default.replication.factor=${min(3, var.kafka.broker_count)}
    min.insync.replicas=${var.kafka.broker_count >= 3 ? 2 : 1}
  EOT
}

resource "aws_msk_cluster" "kafka" {
  #checkov:skip=CKV_AWS_291:Public access is off by default (no connectivity_info block); the check wants it spelled out.
  count                  = local.msk ? 1 : 0
  cluster_name           = substr(local.prefix, 0, 64)
  kafka_version          = var.kafka.version
  number_of_broker_nodes = var.kafka.broker_count

  broker_node_group_info {
    instance_type   = var.kafka.broker_instance_type
    client_subnets  = var.subnet_ids
    security_groups = [aws_security_group.kafka[0].id]
    storage_info {
      ebs_storage_info {
        volume_size = var.kafka.broker_volume_gb
      }
    }
  }

  configuration_info {
    arn      = aws_msk_configuration.kafka[0].arn
    revision = aws_msk_configuration.kafka[0].latest_revision
  }

  client_authentication {
    unauthenticated = false
    sasl {
      scram = true
    }
  }

  encryption_info {
    encryption_at_rest_kms_key_arn = aws_kms_key.kafka[0].arn
    encryption_in_transit {
      client_broker = "TLS"
      in_cluster    = true
    }
  }

  logging_info {
    broker_logs {
      cloudwatch_logs {
        enabled   = true
        log_group = aws_cloudwatch_log_group.kafka[0].name
      }
    }
  }

  tags = local.tags
}


resource "aws_secretsmanager_secret" "kafka" {
  #checkov:skip=CKV2_AWS_57:MSK SCRAM secrets rotate by bumping kafka_password_version (a new write-only value); an automatic rotation Lambda would race running clients.
  count = local.msk ? 1 : 0
  # MSK only accepts SCRAM secrets whose name starts with AmazonMSK_ and that use a customer key.
  name_prefix             = "AmazonMSK_${local.prefix}-"
  description             = "SCRAM credentials of ${local.prefix} (JSON: username, password)"
  kms_key_id              = aws_kms_key.kafka[0].arn
  recovery_window_in_days = 7
  tags                    = local.tags
}


module "kafka_password" {
  source        = "../generated-secret"
  count         = local.generate ? 1 : 0
  secret_id     = aws_secretsmanager_secret.kafka[0].id
  username      = var.kafka.sasl_username
  value_version = var.kafka_password_version
}

resource "aws_msk_scram_secret_association" "kafka" {
  count           = local.msk ? 1 : 0
  cluster_arn     = aws_msk_cluster.kafka[0].arn
  secret_arn_list = [aws_secretsmanager_secret.kafka[0].arn]
  depends_on      = [module.kafka_password]
}

locals {
  kafka_bootstrap           = local.msk ? aws_msk_cluster.kafka[0].bootstrap_brokers_sasl_scram : var.kafka.bootstrap
  kafka_security_protocol   = local.msk ? "SASL_SSL" : var.kafka.security_protocol
  kafka_sasl                = local.msk || startswith(var.kafka.security_protocol, "SASL")
  kafka_password_secret_arn = local.msk ? aws_secretsmanager_secret.kafka[0].arn : var.kafka.password_secret_arn
  kafka_password_secret = local.kafka_password_secret_arn == null ? {} : {
    (local.kafka_password_env) = { arn = local.kafka_password_secret_arn, json_key = local.msk ? "password" : var.kafka.password_json_key }
  }
}

# The ACLs each role needs on this cluster (trainer, rollout nodes, operator tools), rendered: neither
# the AWS provider nor MSK's API manages Kafka ACLs. With one SCRAM user per region (the default) every
# role maps to it, so the grants are the union; give roles their own users to separate them.
module "kafka_acls" {
  source    = "../kafka-acls"
  run       = var.run
  bootstrap = local.kafka_bootstrap
  principals = {
    for role in ["trainer", "rollout", "operator"] :
    role => coalesce(var.kafka.acl_principals[role], "User:${var.kafka.sasl_username}")
  }
}
