"""The `hetsched` command line and the local stack launcher (`hetsched up`): clients of the six
services in `services/`, never imported by them."""
