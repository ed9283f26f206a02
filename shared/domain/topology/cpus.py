"""CPU lists as nvidia-smi and the kernel print them (``0-23,48-71``)."""

from __future__ import annotations

from collections.abc import Sequence


def cpu_list(cpus: Sequence[int]) -> str:
    """Sorted CPU numbers as a cpulist: consecutive runs as ``a-b``, comma-separated ("" for none)."""
    if not cpus:
        return ""
    ranges: list[str] = []
    start = previous = cpus[0]
    for cpu in [*cpus[1:], -1]:
        if cpu != previous + 1:
            ranges.append(f"{start}-{previous}" if start != previous else str(start))
            start = cpu
        previous = cpu
    return ",".join(ranges)
