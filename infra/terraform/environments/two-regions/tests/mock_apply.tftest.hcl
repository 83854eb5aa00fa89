# `terraform test` with mocked AWS providers: applies the whole environment without credentials,
# so every expression and template is evaluated; tests/infra reads the state (fleet.yaml, user data).
mock_provider "aws" {
  alias  = "home"
  source = "./tests/mocks"
}

mock_provider "aws" {
  alias  = "region_a"
  source = "./tests/mocks"
}

mock_provider "aws" {
  alias  = "region_b"
  source = "./tests/mocks"
}

# Mock providers serve no ephemeral resources, so this file runs through tests/infra (pytest),
# which swaps modules/generated-secret for a stub with the same interface in a scratch copy.
variables {
  run = "qwen-math-r1"
  home = {
    aws_region = "us-east-1"
    vpc_id     = "vpc-0a1b2c3d4e5f60718"
    subnet_id  = "subnet-0a1b2c3d4e5f60718"
    cidr       = "10.0.0.0/16"
    trainer    = { ami_id = "ami-0a1b2c3d4e5f60718", instance_type = "p5.48xlarge" }
    mqtt       = { ami_id = "ami-0a1b2c3d4e5f60719" }
  }
  regions = [
    {
      name       = "us-west-2"
      aws_region = "us-west-2"
      vpc_id     = "vpc-0b1b2c3d4e5f60718"
      subnet_ids = ["subnet-0b1b2c3d4e5f60711", "subnet-0b1b2c3d4e5f60712", "subnet-0b1b2c3d4e5f60713"]
      cidr       = "10.1.0.0/16"
      link_costs = { home = 2, eu-west-1 = 8 }
      node = {
        ami_id = "ami-0b1b2c3d4e5f60718", instance_types = ["g6e.xlarge", "g5.2xlarge"], max_size = 8, desired_capacity = 4
        # A mixed-instances group: one on-demand node, spot above it, each pool priced.
        on_demand_base_capacity = 1, on_demand_price = 3.4, spot_max_price = "2.5", spot_allocation_strategy = "capacity-optimized"
      }
    },
    {
      name       = "eu-west-1"
      aws_region = "eu-west-1"
      vpc_id     = "vpc-0c1b2c3d4e5f60718"
      subnet_ids = ["subnet-0c1b2c3d4e5f60711", "subnet-0c1b2c3d4e5f60712", "subnet-0c1b2c3d4e5f60713"]
      cidr       = "10.2.0.0/16"
      link_costs = { home = 5, us-west-2 = 8 }
      node       = { ami_id = "ami-0c1b2c3d4e5f60718", instance_types = ["g6e.xlarge"], max_size = 4, desired_capacity = 2, spot = false }
    },
  ]
  algorithm = { groups_per_step = 64, n_samples = 16, lr = 1e-6 }
}

run "renders_fleet_yaml" {
  command = apply

  assert {
    condition     = yamldecode(output.fleet_yaml).regions[0].kafka.security_protocol == "SASL_SSL"
    error_message = "MSK regions must be reached over SASL_SSL."
  }
  assert {
    condition     = yamldecode(output.fleet_yaml).regions[1].kafka.sasl_password_env == "FLEETRL_KAFKA_PASSWORD_EU_WEST_1"
    error_message = "Each region's Kafka password needs its own environment variable."
  }
  assert {
    condition     = yamldecode(output.fleet_yaml).trainer.metrics_port == 9400 && yamldecode(output.fleet_yaml).rollout.metrics_port == 9401
    error_message = "Metrics ports must match the security groups."
  }
  assert {
    condition = (yamldecode(output.fleet_yaml).regions[0].capacity == "spot"
      && yamldecode(output.fleet_yaml).regions[0].pools[0] == { capacity = "on_demand", price = 3.4 }
      && yamldecode(output.fleet_yaml).regions[0].pools[1].price.source == "aws"
    && yamldecode(output.fleet_yaml).regions[0].pools[1].price.instance_types == ["g6e.xlarge", "g5.2xlarge"])
    error_message = "A mixed group's pools carry their capacity and price: on demand fixed, spot from EC2's history."
  }
  assert {
    condition     = yamldecode(output.fleet_yaml).regions[1].capacity == "on_demand" && !contains(keys(yamldecode(output.fleet_yaml).regions[1]), "pools")
    error_message = "An on-demand group without a price renders no pools."
  }
}

