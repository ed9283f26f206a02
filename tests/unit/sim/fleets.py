"""Inventory YAML of a one-node fleet for the simulator's tests (region r, cluster c, rack k, 30 kW)."""

from __future__ import annotations


def one_node_fleet(name: str, *, gpus: int, topology: str, sku: str = "H100-SXM-80GB") -> str:
    return f"""
regions:
  - name: r
    clusters:
      - name: c
        racks:
          - name: k
            power_kw: 30
            nodes:
              - name: {name}
                sku: {sku}
                gpus: {gpus}
                topology: "{topology}"
"""
