# Mosquitto on a small instance, password auth, on the private (peered) network. Retained
# messages (the policy version, heartbeats) persist on its disk, and nothing depends on them
# alone: a node that missed one recovers from the object store (DESIGN.md §4).

resource "aws_instance" "mqtt" {
  count                  = local.mosquitto ? 1 : 0
  ami                    = var.mqtt.ami_id
  instance_type          = var.mqtt.instance_type
  subnet_id              = var.subnet_id
  vpc_security_group_ids = [aws_security_group.mqtt[0].id]
  iam_instance_profile   = aws_iam_instance_profile.mqtt[0].name
  ebs_optimized          = true
  monitoring             = var.detailed_monitoring
  user_data_base64 = base64gzip(templatefile("${path.module}/templates/mosquitto.cloud-config.tftpl", {
    fetch_secrets = file("${path.module}/../node-bootstrap/templates/fetch-secrets.py")
    secrets_spec = jsonencode({ env = {
      MQTT_PASSWORD = { arn = aws_secretsmanager_secret.mqtt[0].arn, json_key = "password" }
    }, files = {} })
    username = var.mqtt.username
  }))

  metadata_options {
    http_endpoint = "enabled"
    http_tokens   = "required"
  }

  root_block_device {
    volume_type = "gp3"
    volume_size = 20
    encrypted   = true
  }

  tags = merge(local.tags, { Name = "${local.prefix}-mqtt" })
}

locals {
  mqtt_url = local.mosquitto ? "mqtt://${aws_instance.mqtt[0].private_ip}:1883" : var.mqtt.url
}
