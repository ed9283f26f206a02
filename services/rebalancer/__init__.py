"""Rebalancer: detects imbalance and plans migrations and defragmentation."""
