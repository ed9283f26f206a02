"""`hetsched sim`: replay a workload trace against a fleet under each placement policy (the command in
``command.py``, the runs in ``run.py``, the tables, JSON and plots in ``report.py``)."""

from hetsched.cli.sim.command import app

__all__ = ["app"]
