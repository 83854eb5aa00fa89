# fleet.yaml is rendered from the outputs of the region modules, so the file the daemons start
# with names exactly the brokers, buckets and endpoints that were provisioned.
locals {
  fleet_yaml = templatefile("${path.module}/fleet.yaml.tftpl", {
    run     = var.run
    home    = var.home
    regions = var.regions
    hub     = var.hub
    model   = var.model
    algo    = var.algorithm
    dataset = var.dataset
    kafka   = var.kafka
    rollout = merge(var.rollout, { metrics_port = var.agent_metrics_port })
    trainer = merge(var.trainer, { metrics_port = var.trainer_metrics_port })
  })
}
