"""Placement: decides where model replicas run and admits requests to them."""
