"""What a launch measures about the machines it runs on, kept apart from the YAML.

[Note: the spec is the config, the measurements are the world] The YAML's
:class:`~geopipe.config.ClusterSpec` is what the user asked for: it is never patched, and its
digest is the run's config hash, so two launches of one YAML record the same hash however
fast their devices and links measure. What a launch measures — each site's compute speed,
each WAN link's latency and rate, each site's codec speeds — lives here, one home each, and
reaches the cost model through :func:`costed`, the one place where a measurement takes the
place of the YAML's nominal figure. Everything that prices (the planner, calibration,
recovery's templates, site copies' pacing) reads that costed view; everything that
identifies the run (checkpoints, status) reads the spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from geopipe.config import ClusterSpec

__all__ = ["DeviceSpeed", "LinkRate", "Measurements", "costed"]


@dataclass(frozen=True)
class DeviceSpeed:
    """One site's measured compute: the achieved fraction of the YAML's peak, and the
    backward/forward time ratio. ``tflops`` replaces the peak only when the YAML's nominal
    peak cannot be right (the machine computed faster than it)."""

    efficiency: float
    backward_forward_ratio: float
    tflops: float | None = None
    # fixed forward seconds per layer per micro-batch beyond the FLOPs (SiteSpec's
    # layer_overhead_ms): 0 where only one micro-batch size was timed
    layer_overhead_s: float = 0.0


@dataclass(frozen=True)
class LinkRate:
    """One WAN link as probed over the data plane (one direction; a mirrored YAML entry
    takes it for both)."""

    src: str
    dst: str
    latency_s: float
    bandwidth_bps: float


@dataclass(frozen=True)
class Measurements:
    """Device speeds per site, link rates per direction and codec speeds per site (GB/s by
    codec). Empty means "the YAML's nominal figures": what ``geopipe plan`` and a dry run
    price with, and what a launch that does not profile keeps."""

    devices: dict[str, DeviceSpeed] = field(default_factory=dict)
    links: tuple[LinkRate, ...] = ()
    codecs: dict[str, dict[str, float]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.devices or self.links or self.codecs)

    def merged(self, newer: Measurements) -> Measurements:
        """These measurements with ``newer``'s taking the place of any they repeat (a link
        probed at launch after the machine was profiled, say)."""
        got = {(lk.src, lk.dst): lk for lk in self.links}
        got.update({(lk.src, lk.dst): lk for lk in newer.links})
        codecs = {s: dict(v) for s, v in self.codecs.items()}
        for site, speeds in newer.codecs.items():
            codecs[site] = {**codecs.get(site, {}), **speeds}
        return Measurements({**self.devices, **newer.devices}, tuple(got.values()), codecs)

    @classmethod
    def from_dict(cls, doc: dict) -> Measurements:
        """The inverse of :meth:`to_dict` (a run's plan event, replayed)."""
        devices = {
            s: DeviceSpeed(
                d["efficiency"],
                d["backward_forward_ratio"],
                d.get("tflops"),
                d.get("layer_overhead_ms", 0.0) / 1e3,
            )
            for s, d in doc.get("devices", {}).items()
        }
        links = tuple(
            LinkRate(x["from"], x["to"], x["latency_ms"] / 1e3, x["bandwidth_mbps"] * 1e6)
            for x in doc.get("links", [])
        )
        codecs = {s: dict(v) for s, v in doc.get("codec_gb_per_s", {}).items()}
        return cls(devices, links, codecs)

    def to_dict(self) -> dict:
        """For the metrics' plan event and status.json."""
        return {
            "devices": {
                s: {
                    "efficiency": d.efficiency,
                    "backward_forward_ratio": d.backward_forward_ratio,
                    **({"tflops": d.tflops} if d.tflops is not None else {}),
                    **_overhead(d),
                }
                for s, d in self.devices.items()
            },
            "links": [
                {
                    "from": lk.src,
                    "to": lk.dst,
                    "latency_ms": lk.latency_s * 1e3,
                    "bandwidth_mbps": lk.bandwidth_bps / 1e6,
                }
                for lk in self.links
            ],
            "codec_gb_per_s": self.codecs,
        }


def _overhead(d: DeviceSpeed) -> dict:
    return {"layer_overhead_ms": d.layer_overhead_s * 1e3} if d.layer_overhead_s else {}


def costed(spec: ClusterSpec, measured: Measurements) -> ClusterSpec:
    """The copy of ``spec`` the cost model reads: each measured figure in the place of the
    YAML's nominal one, except codec speeds the YAML sets, which stand (an operator who
    writes one knows better than a quick timing on a busy host). ``spec`` itself is not
    touched; with nothing measured it is returned as it is."""
    if not measured:
        return spec
    sites = []
    for s in spec.sites:
        update: dict = {}
        dev = measured.devices.get(s.name)
        if dev is not None:
            update["device_efficiency"] = dev.efficiency
            update["backward_forward_ratio"] = dev.backward_forward_ratio
            if dev.layer_overhead_s:
                update["layer_overhead_ms"] = dev.layer_overhead_s * 1e3
            if dev.tflops is not None:
                update["device_tflops"] = dev.tflops
        speeds = measured.codecs.get(s.name)
        if speeds:
            update["codec_gb_per_s"] = {**speeds, **s.codec_gb_per_s}
        sites.append(s.model_copy(update=update) if update else s)
    got = {(lk.src, lk.dst): lk for lk in measured.links}
    links = []
    for lk in spec.links:
        m = got.get((lk.src, lk.dst)) or got.get((lk.dst, lk.src))
        if m is not None:
            lk = lk.model_copy(
                update={"latency_ms": m.latency_s * 1e3, "bandwidth_gbps": m.bandwidth_bps / 1e9}
            )
        links.append(lk)
    return spec.model_copy(update={"sites": sites, "links": links})
