"""The six hetsched services, the local stack launcher and the CLI."""
