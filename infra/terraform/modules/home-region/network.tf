# Only the ports the design uses: MQTT 1883 (Mosquitto, private network), Kafka 9092-9096 of the
# rollout regions, HTTPS for AWS APIs and the package index, the trainer's Prometheus port.

resource "aws_security_group" "trainer" {
  name_prefix = "${local.prefix}-trainer-"
  description = "FleetRL trainer"
  vpc_id      = var.vpc_id
  tags        = local.tags
  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "trainer_metrics" {
  for_each          = toset(var.metrics_cidrs)
  security_group_id = aws_security_group.trainer.id
  description       = "Prometheus scrape of the trainer"
  ip_protocol       = "tcp"
  from_port         = var.trainer_metrics_port
  to_port           = var.trainer_metrics_port
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "trainer_https" {
  security_group_id = aws_security_group.trainer.id
  description       = "AWS APIs (S3, Secrets Manager) and the Python package index"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_vpc_security_group_egress_rule" "trainer_kafka" {
  for_each          = toset(var.fleet_cidrs)
  security_group_id = aws_security_group.trainer.id
  description       = "Kafka of the rollout regions (9092 plaintext, 9094 TLS, 9096 SASL/SCRAM)"
  ip_protocol       = "tcp"
  from_port         = 9092
  to_port           = 9096
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "trainer_mqtt" {
  count                        = local.mosquitto ? 1 : 0
  security_group_id            = aws_security_group.trainer.id
  description                  = "MQTT control plane"
  ip_protocol                  = "tcp"
  from_port                    = 1883
  to_port                      = 1883
  referenced_security_group_id = aws_security_group.mqtt[0].id
}

resource "aws_vpc_security_group_egress_rule" "trainer_mqtt_external" {
  count             = local.mosquitto ? 0 : 1
  security_group_id = aws_security_group.trainer.id
  description       = "External MQTT endpoint over TLS"
  ip_protocol       = "tcp"
  from_port         = 8883
  to_port           = 8883
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_security_group" "mqtt" {
  count       = local.mosquitto ? 1 : 0
  name_prefix = "${local.prefix}-mqtt-"
  description = "FleetRL MQTT broker (Mosquitto)"
  vpc_id      = var.vpc_id
  tags        = local.tags
  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "mqtt_trainer" {
  count                        = local.mosquitto ? 1 : 0
  security_group_id            = aws_security_group.mqtt[0].id
  description                  = "The trainer"
  ip_protocol                  = "tcp"
  from_port                    = 1883
  to_port                      = 1883
  referenced_security_group_id = aws_security_group.trainer.id
}

resource "aws_vpc_security_group_ingress_rule" "mqtt_fleet" {
  for_each          = local.mosquitto ? toset(var.fleet_cidrs) : toset([])
  security_group_id = aws_security_group.mqtt[0].id
  description       = "Rollout nodes of the fleet"
  ip_protocol       = "tcp"
  from_port         = 1883
  to_port           = 1883
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "mqtt_packages" {
  for_each          = local.mosquitto ? toset(["80", "443"]) : toset([])
  security_group_id = aws_security_group.mqtt[0].id
  description       = "Package repositories (apt uses HTTP) and Secrets Manager"
  ip_protocol       = "tcp"
  from_port         = tonumber(each.value)
  to_port           = tonumber(each.value)
  cidr_ipv4         = "0.0.0.0/0"
}
