# Values the mocked AWS provider returns where the environment parses them (ARNs, bootstrap
# strings, ids); everything else gets the mock's generated values.
mock_data "aws_caller_identity" {
  defaults = {
    account_id = "000000000000"
  }
}

mock_data "aws_partition" {
  defaults = {
    partition = "aws"
  }
}

mock_data "aws_region" {
  defaults = {
    name = "us-west-2"
  }
}

mock_data "aws_iam_policy_document" {
  defaults = {
    json = "{}"
  }
}

mock_resource "aws_msk_cluster" {
  defaults = {
    arn                          = "arn:aws:kafka:us-west-2:000000000000:cluster/fleetrl/0"
    bootstrap_brokers_sasl_scram = "b-1.fleetrl.kafka.us-west-2.amazonaws.com:9096,b-2.fleetrl.kafka.us-west-2.amazonaws.com:9096"
  }
}

mock_resource "aws_kms_key" {
  defaults = {
    arn = "arn:aws:kms:us-west-2:000000000000:key/00000000-0000-0000-0000-000000000000"
  }
}

mock_resource "aws_s3_bucket" {
  defaults = {
    bucket = "fleetrl-mock-bucket"
    arn    = "arn:aws:s3:::fleetrl-mock-bucket"
  }
}

mock_resource "aws_secretsmanager_secret" {
  defaults = {
    arn = "arn:aws:secretsmanager:us-east-1:000000000000:secret:fleetrl-mock-AbCdEf"
  }
}

mock_resource "aws_ebs_volume" {
  defaults = {
    id = "vol-0123456789abcdef0"
  }
}

mock_resource "aws_instance" {
  defaults = {
    private_ip = "10.0.1.10"
  }
}

mock_resource "aws_msk_configuration" {
  defaults = {
    arn             = "arn:aws:kafka:us-west-2:000000000000:configuration/fleetrl/0"
    latest_revision = 1
  }
}

mock_resource "aws_iam_role" {
  defaults = {
    arn = "arn:aws:iam::000000000000:role/fleetrl-mock"
  }
}

mock_resource "aws_iam_instance_profile" {
  defaults = {
    arn = "arn:aws:iam::000000000000:instance-profile/fleetrl-mock"
  }
}

mock_resource "aws_cloudwatch_log_group" {
  defaults = {
    arn = "arn:aws:logs:us-west-2:000000000000:log-group:/fleetrl/mock"
  }
}

mock_resource "aws_launch_template" {
  defaults = {
    arn            = "arn:aws:ec2:us-west-2:000000000000:launch-template/lt-0123456789abcdef0"
    id             = "lt-0123456789abcdef0"
    latest_version = 1
  }
}
