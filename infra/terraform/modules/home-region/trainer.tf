# The trainer: one on-demand GPU instance. Its checkpoints live on their own volume, so a new
# fleet.yaml (which replaces the instance) resumes from the last checkpoint.

module "bootstrap" {
  source          = "../node-bootstrap"
  fleet_yaml      = var.fleet_yaml
  fleetrl_package = var.fleetrl_package
  # The packaged fleetrl-trainer.service: `fleetrl topics create` (idempotent: every start makes
  # sure each region has the run's topics), then `fleetrl trainer`.
  trainer      = { stop_timeout_s = var.trainer.stop_timeout_s }
  secret_env   = local.trainer_secret_env
  secret_files = local.node_secret_files
  state_dirs   = [var.trainer.checkpoint_dir]
  mounts = [{
    device = "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_${replace(aws_ebs_volume.checkpoints.id, "-", "")}"
    path   = var.trainer.checkpoint_dir
  }]
}

data "aws_subnet" "trainer" {
  id = var.subnet_id
}

resource "aws_ebs_volume" "checkpoints" {
  #checkov:skip=CKV_AWS_189:Encrypted with the account's default EBS key; a customer key adds nothing for checkpoints that the home store can rebuild.
  #checkov:skip=CKV2_AWS_9:Backups are a site policy (AWS Backup plan); the trained versions also live in the home store.
  availability_zone = data.aws_subnet.trainer.availability_zone
  size              = var.trainer.root_volume_gb
  type              = "gp3"
  encrypted         = true
  tags              = merge(local.tags, { Name = "${local.prefix}-checkpoints" })
}

resource "aws_instance" "trainer" {
  ami                         = var.trainer.ami_id
  instance_type               = var.trainer.instance_type
  subnet_id                   = var.subnet_id
  vpc_security_group_ids      = [aws_security_group.trainer.id]
  iam_instance_profile        = aws_iam_instance_profile.trainer.name
  ebs_optimized               = true
  monitoring                  = var.detailed_monitoring
  user_data_base64            = base64gzip(module.bootstrap.cloud_config)
  user_data_replace_on_change = true

  metadata_options {
    http_endpoint = "enabled"
    http_tokens   = "required"
  }

  root_block_device {
    volume_type = "gp3"
    volume_size = 200
    encrypted   = true
  }

  tags = merge(local.tags, { Name = "${local.prefix}-trainer" })
}

resource "aws_volume_attachment" "checkpoints" {
  device_name = "/dev/sdf"
  volume_id   = aws_ebs_volume.checkpoints.id
  instance_id = aws_instance.trainer.id
}
