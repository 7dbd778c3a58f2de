"""The test bed's shape, as pure data: namespaces, addresses, and what the link costs.

One network namespace per site, each with one TUN device (``wan0``) holding the site's
address in one /24; the forwarder (:mod:`geopipe.testbed.forwarder`) is the only path
between them. Everything here is arithmetic on the settings, so it is tested without root.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

__all__ = [
    "DEFAULT_SUBNET",
    "HEADER_BYTES",
    "MSS_BYTES",
    "BedError",
    "BedPlan",
    "wire_bytes_of_gso",
]

DEFAULT_SUBNET = "10.231.0.0/24"
DEVICE = "wan0"
RAY_PORT = 6379
# One IP/TCP header per segment on the wire (20 + 20 + 12 bytes of timestamps option), and
# the payload of a full segment at MTU 1500: what the rate is charged for.
HEADER_BYTES = 52
MSS_BYTES = 1448
_SITE = re.compile(r"^[a-z][a-z0-9-]{0,11}$")


class BedError(ValueError):
    """A test-bed setting is wrong; the message names the option."""


@dataclass(frozen=True)
class BedPlan:
    """Sites, their namespaces and addresses, and the link between every pair of them.

    Every ordered pair of sites is its own link direction with one-way ``latency_ms`` and
    ``rate_mbit``; packets queue behind each other on a direction (drop-tail beyond
    ``queue_ms`` of backlog, a router's buffer).
    """

    sites: tuple[str, ...]
    latency_ms: float = 40.0
    rate_mbit: float = 200.0
    queue_ms: float = 100.0
    prefix: str = "gptb"
    subnet: str = DEFAULT_SUBNET
    ray: bool = False
    cpus_per_site: int = 2
    # filled in by `up`: the forwarder's pid and the Ray head's address
    forwarder_pid: int | None = None
    ray_address: str | None = None
    auth_mode: str = "token"
    cut: bool = False  # the link passes nothing (100 % loss) until healed: a partition

    def __post_init__(self) -> None:
        if len(self.sites) < 2:
            raise BedError(f"--sites: need at least two sites, got {list(self.sites)}")
        if len(set(self.sites)) != len(self.sites):
            raise BedError(f"--sites: a site is named twice in {list(self.sites)}")
        for s in self.sites:
            if not _SITE.match(s):
                raise BedError(
                    f"--sites: {s!r} is not a short lowercase name (letters, digits, '-'; "
                    "at most 12 characters, starting with a letter)"
                )
        if not self.latency_ms >= 0:
            raise BedError(f"--latency-ms must be >= 0, got {self.latency_ms}")
        if not self.rate_mbit > 0:
            raise BedError(f"--rate-mbit must be > 0, got {self.rate_mbit}")
        if not self.queue_ms > 0:
            raise BedError(f"--queue-ms must be > 0, got {self.queue_ms}")
        if self.cpus_per_site < 1:
            raise BedError(f"--cpus-per-site must be >= 1, got {self.cpus_per_site}")
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError as exc:
            raise BedError(f"--subnet: {exc}") from None
        if net.version != 4 or net.num_addresses - 2 < len(self.sites):
            raise BedError(f"--subnet {self.subnet} has no room for {len(self.sites)} sites")

    # -- names and addresses -------------------------------------------------------------------
    def namespace(self, site: str) -> str:
        self._check(site)
        return f"{self.prefix}-{site}"

    def address(self, site: str) -> str:
        """The site's address on ``wan0`` (hosts 1, 2, … of the subnet, in site order)."""
        net = ipaddress.ip_network(self.subnet)
        return str(net.network_address + 1 + self.sites.index(self._check(site)))

    @property
    def prefixlen(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    def site_of_address(self, addr: str) -> str | None:
        for s in self.sites:
            if self.address(s) == addr:
                return s
        return None

    @property
    def namespaces(self) -> list[str]:
        return [self.namespace(s) for s in self.sites]

    @property
    def head_address(self) -> str:
        """Where the Ray head listens: the first site's address."""
        return f"{self.address(self.sites[0])}:{RAY_PORT}"

    def _check(self, site: str) -> str:
        if site not in self.sites:
            raise BedError(f"unknown site {site!r}; the test bed has {', '.join(self.sites)}")
        return site

    # -- the link ------------------------------------------------------------------------------
    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3

    @property
    def rate_bps(self) -> float:
        return self.rate_mbit * 1e6

    def serialisation_s(self, wire_bytes: int) -> float:
        """Seconds a packet of ``wire_bytes`` occupies a link direction."""
        return wire_bytes * 8 / self.rate_bps

    def one_way_s(self, payload_bytes: int) -> float:
        """Ideal one-way time of a message of ``payload_bytes`` on an idle link: every
        segment's header paid, serialised once, plus the latency."""
        segs = max(1, -(-payload_bytes // MSS_BYTES))
        return self.latency_s + self.serialisation_s(payload_bytes + segs * HEADER_BYTES)

    @property
    def goodput_ceiling(self) -> float:
        """The fraction of the rate TCP payload can use (headers take the rest)."""
        return MSS_BYTES / (MSS_BYTES + HEADER_BYTES)

    # -- persistence ---------------------------------------------------------------------------
    def with_link(
        self, latency_ms: float | None, rate_mbit: float | None, cut: bool | None = None
    ) -> BedPlan:
        return replace(
            self,
            latency_ms=self.latency_ms if latency_ms is None else latency_ms,
            rate_mbit=self.rate_mbit if rate_mbit is None else rate_mbit,
            cut=self.cut if cut is None else cut,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> BedPlan:
        d = json.loads(text)
        d["sites"] = tuple(d["sites"])
        return cls(**d)

    def save(self, path: Path) -> None:
        """Atomically (the forwarder re-reads it on SIGHUP)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)


def wire_bytes_of_gso(data_len: int, gso_size: int, hdr_len: int) -> int:
    """Bytes on the wire of a GSO super-packet of ``data_len`` bytes (headers included once)
    that the NIC would cut into segments of ``gso_size`` payload bytes, each with its own
    ``hdr_len`` bytes of headers; a plain packet (``gso_size`` 0) is its own length."""
    if gso_size <= 0 or data_len <= hdr_len:
        return data_len
    segs = -(-(data_len - hdr_len) // gso_size)
    return data_len + (segs - 1) * hdr_len
