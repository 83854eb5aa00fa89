# Only the ports the design uses: Kafka SASL/SCRAM 9096 (9092-9096 for an external cluster),
# MQTT 1883/8883 to the home region, HTTPS for AWS APIs and the package index, and the agents'
# Prometheus port for scrapers. No SSH: shells go through Session Manager when enabled.

resource "aws_security_group" "node" {
  name_prefix = "${local.prefix}-node-"
  description = "FleetRL rollout nodes of ${var.name}"
  vpc_id      = var.vpc_id
  tags        = local.tags
  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "node_metrics" {
  for_each          = toset(var.metrics_cidrs)
  security_group_id = aws_security_group.node.id
  description       = "Prometheus scrape of the region agent"
  ip_protocol       = "tcp"
  from_port         = var.agent_metrics_port
  to_port           = var.agent_metrics_port
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "node_https" {
  security_group_id = aws_security_group.node.id
  description       = "AWS APIs (S3, Secrets Manager) and the Python package index"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_vpc_security_group_egress_rule" "node_mqtt" {
  for_each          = { for pair in setproduct(var.home_cidrs, [1883, 8883]) : "${pair[0]}-${pair[1]}" => pair }
  security_group_id = aws_security_group.node.id
  description       = "MQTT control plane in the home region"
  ip_protocol       = "tcp"
  from_port         = each.value[1]
  to_port           = each.value[1]
  cidr_ipv4         = each.value[0]
}

resource "aws_vpc_security_group_egress_rule" "node_kafka_msk" {
  count                        = local.msk ? 1 : 0
  security_group_id            = aws_security_group.node.id
  description                  = "Region Kafka (MSK SASL/SCRAM)"
  ip_protocol                  = "tcp"
  from_port                    = local.kafka_port
  to_port                      = local.kafka_port
  referenced_security_group_id = aws_security_group.kafka[0].id
}

resource "aws_vpc_security_group_egress_rule" "node_kafka_external" {
  for_each          = local.msk ? toset([]) : toset(var.kafka.external_cidrs)
  security_group_id = aws_security_group.node.id
  description       = "Region Kafka (external cluster)"
  ip_protocol       = "tcp"
  from_port         = 9092
  to_port           = 9096
  cidr_ipv4         = each.value
}

resource "aws_security_group" "kafka" {
  count       = local.msk ? 1 : 0
  name_prefix = "${local.prefix}-kafka-"
  description = "FleetRL MSK brokers of ${var.name}"
  vpc_id      = var.vpc_id
  tags        = local.tags
  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "kafka_nodes" {
  count                        = local.msk ? 1 : 0
  security_group_id            = aws_security_group.kafka[0].id
  description                  = "Rollout nodes of the region"
  ip_protocol                  = "tcp"
  from_port                    = local.kafka_port
  to_port                      = local.kafka_port
  referenced_security_group_id = aws_security_group.node.id
}

resource "aws_vpc_security_group_ingress_rule" "kafka_home" {
  for_each          = local.msk ? toset(var.home_cidrs) : toset([])
  security_group_id = aws_security_group.kafka[0].id
  description       = "The trainer in the home region"
  ip_protocol       = "tcp"
  from_port         = local.kafka_port
  to_port           = local.kafka_port
  cidr_ipv4         = each.value
}
