"""Placement filter plugins (and the demand prefilter): one module per plugin, each with a ``NAME``."""
