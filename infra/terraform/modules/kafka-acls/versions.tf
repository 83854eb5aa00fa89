# Pure rendering: no provider. Neither the AWS provider nor MSK's API manages Kafka ACLs (they live
# in the cluster and are set through the Kafka admin API), so this module renders them: as data a
# Kafka provider or a pipeline can consume, and as kafka-acls.sh commands.
terraform {
  required_version = ">= 1.10"
}
