"""A real-network test bed on one host: one network namespace per site, joined only by a
user-space forwarder that adds one-way latency and a rate (kernel netem is absent here), with
optionally a Ray node per site. Answers "what would my job do over a 40 ms link" before
anyone rents GPUs in two regions. Needs root and ``/dev/net/tun``.

A tool layer: it imports nothing from the runtime (the runtime and the benchmarks use it,
never the other way round).
"""

from geopipe.testbed.bed import Bed, BedUnavailable, running
from geopipe.testbed.plan import BedError, BedPlan

__all__ = ["Bed", "BedError", "BedPlan", "BedUnavailable", "running"]
