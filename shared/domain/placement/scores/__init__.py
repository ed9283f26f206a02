"""Placement score plugins: one module per plugin, each with a ``NAME``; every score is in [0, 1]."""
