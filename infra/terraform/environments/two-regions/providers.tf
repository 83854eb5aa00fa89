# One provider per AWS region; the rollout-region module takes whichever it is given, so a third
# region is one more provider alias and one more module block.
provider "aws" {
  alias  = "home"
  region = var.home.aws_region
  default_tags {
    tags = var.tags
  }
}

provider "aws" {
  alias  = "region_a"
  region = var.regions[0].aws_region
  default_tags {
    tags = var.tags
  }
}

provider "aws" {
  alias  = "region_b"
  region = var.regions[1].aws_region
  default_tags {
    tags = var.tags
  }
}
