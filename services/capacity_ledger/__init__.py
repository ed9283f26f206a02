"""Capacity ledger: the system of record for HBM reserved on every accelerator."""
