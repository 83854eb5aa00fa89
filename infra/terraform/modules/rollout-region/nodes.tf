# Spot GPU nodes by default, with capacity rebalancing and a mixed-instances policy: an on-demand
# base (node.on_demand_base_capacity), spot above it (node.on_demand_percentage_above_base_capacity on
# demand, the rest spot), a spot allocation strategy and an optional maximum price. Every node runs
# the region agent and a replicator (a lease in the region store picks the active one), from the
# systemd units shipped in the FleetRL package; an agent learns whether its instance is spot from the
# instance metadata (both kinds share the launch template) and says so in its heartbeat.

locals {
  on_demand_above = coalesce(var.node.on_demand_percentage_above_base_capacity, var.node.spot ? 0 : 100)
  has_on_demand   = var.node.on_demand_base_capacity > 0 || local.on_demand_above > 0
  has_spot        = local.on_demand_above < 100 && var.node.max_size > var.node.on_demand_base_capacity
  # fleet.yaml's pool prices: each capacity the group can launch, priced where a price is known.
  prices = {
    on_demand = local.has_on_demand ? var.node.on_demand_price : null
    spot      = local.has_spot ? var.node.spot_price : null
    spot_history = local.has_spot && var.node.spot_price == null && var.node.spot_price_from_aws ? {
      region_name = local.region, instance_types = var.node.instance_types, availability_zones = []
    } : null
  }
}

module "bootstrap" {
  source          = "../node-bootstrap"
  fleet_yaml      = var.fleet_yaml
  fleetrl_package = var.fleetrl_package
  # The package's own units: fleetrl-agent.service and fleetrl-replicator@<region>.service.
  region               = var.name
  agent_stop_timeout_s = var.node.termination_grace_s
  secret_env           = merge(var.node_secret_env, local.kafka_password_secret)
  secret_files         = var.node_secret_files
}

resource "aws_launch_template" "node" {
  name_prefix            = "${local.prefix}-"
  description            = "FleetRL rollout node of ${var.name}"
  image_id               = var.node.ami_id
  update_default_version = true
  ebs_optimized          = true
  # cloud-init unpacks gzip; secrets are fetched at boot, never part of user data.
  user_data              = base64gzip(module.bootstrap.cloud_config)
  vpc_security_group_ids = [aws_security_group.node.id]

  iam_instance_profile {
    arn = aws_iam_instance_profile.node.arn
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  # The host name is the instance id: a valid FleetRL node name, stable for the node's life.
  private_dns_name_options {
    hostname_type = "resource-name"
  }

  block_device_mappings {
    device_name = var.node.root_device_name
    ebs {
      volume_size           = var.node.root_volume_gb
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }

  monitoring {
    enabled = var.detailed_monitoring
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(local.tags, { Name = "${local.prefix}-node" })
  }

  tag_specifications {
    resource_type = "volume"
    tags          = local.tags
  }

  tags = local.tags
}

resource "aws_autoscaling_group" "nodes" {
  name_prefix         = "${local.prefix}-"
  min_size            = var.node.min_size
  max_size            = var.node.max_size
  desired_capacity    = var.node.desired_capacity
  vpc_zone_identifier = var.subnet_ids
  capacity_rebalance  = true
  health_check_type   = "EC2"

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = var.node.on_demand_base_capacity
      on_demand_percentage_above_base_capacity = local.on_demand_above
      spot_allocation_strategy                 = var.node.spot_allocation_strategy
      spot_max_price                           = var.node.spot_max_price
    }
    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.node.id
        version            = aws_launch_template.node.latest_version
      }
      dynamic "override" {
        for_each = var.node.instance_types
        content {
          instance_type = override.value
        }
      }
    }
  }

  # A node being scaled in stays up (Terminating:Wait) long enough for the agent to hand its
  # partial groups over; the agent's watcher sees it in IMDS autoscaling/target-lifecycle-state.
  initial_lifecycle_hook {
    name                 = "fleetrl-drain"
    lifecycle_transition = "autoscaling:EC2_INSTANCE_TERMINATING"
    default_result       = "CONTINUE"
    heartbeat_timeout    = var.node.termination_grace_s
  }

  # A new fleet.yaml (a new launch template version) rolls through the region, half at a time.
  instance_refresh {
    strategy = "Rolling"
    preferences {
      min_healthy_percentage = 50
    }
  }

  dynamic "tag" {
    for_each = merge(local.tags, { Name = "${local.prefix}-node" })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }

  lifecycle {
    # Operators drain or grow a region with `aws autoscaling set-desired-capacity` too.
    ignore_changes = [desired_capacity]
  }
}
