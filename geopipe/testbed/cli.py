"""``geopipe testbed …`` (also ``python -m geopipe.testbed …``): a real emulated WAN on one host.

    sudo geopipe testbed up --sites east,west --latency-ms 40 --rate-mbit 200 --ray
    sudo geopipe testbed exec east -- geopipe launch clusters/testbed-2dc.yaml
    sudo geopipe testbed set --latency-ms 20
    sudo geopipe testbed status
    sudo geopipe testbed down

Errors in the options print one line naming the option and exit with status 2; a machine
without root or ``/dev/net/tun`` is told so (status 3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from geopipe.testbed import netns
from geopipe.testbed.bed import Bed, BedUnavailable, state_dir, stop_forwarders
from geopipe.testbed.plan import BedError, BedPlan

__all__ = ["build_parser", "main"]

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3


def add_subcommands(p: argparse.ArgumentParser) -> None:
    """The test bed's subcommands, on ``p`` (shared by ``geopipe testbed`` and ``-m``)."""
    p.add_argument("--prefix", default="gptb", help="namespace name prefix (gptb-<site>)")
    p.add_argument(
        "--state-dir",
        default=None,
        help="where the bed's state lives (default $GEOPIPE_TESTBED_DIR or /run/geopipe-testbed)",
    )
    sub = p.add_subparsers(dest="tb_command", required=True)
    up = sub.add_parser("up", help="create the namespaces and the emulated WAN between them")
    up.add_argument("--sites", default="east,west", help="comma-separated site names")
    up.add_argument("--latency-ms", type=float, default=40.0, help="one-way latency")
    up.add_argument("--rate-mbit", type=float, default=200.0, help="rate of each direction")
    up.add_argument("--queue-ms", type=float, default=100.0, help="router buffer (drop-tail)")
    up.add_argument(
        "--ray",
        action="store_true",
        help="also start a Ray head in the first site and a raylet in each other",
    )
    up.add_argument(
        "--cpus-per-site",
        type=int,
        default=2,
        help="CPUs (and site:<name> devices) each Ray node offers",
    )
    ex = sub.add_parser("exec", help="run a command inside a site's namespace")
    ex.add_argument("site")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")
    st = sub.add_parser("set", help="change the link in place (no restart)")
    st.add_argument("--latency-ms", type=float, default=None)
    st.add_argument("--rate-mbit", type=float, default=None)
    st.add_argument("--cut", action="store_true", help="pass nothing (100 %% loss): a partition")
    st.add_argument("--heal", action="store_true", help="end a --cut")
    ss = sub.add_parser("status", help="sites, addresses, link, forwarder, Ray")
    ss.add_argument("--json", action="store_true")
    sub.add_parser("down", help="stop everything in the namespaces (by PID) and remove them")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="geopipe testbed",
        description="A real-network test bed: one namespace per site, a user-space WAN.",
    )
    add_subcommands(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute parsed ``args`` (see :func:`add_subcommands`)."""
    root = Path(args.state_dir) if args.state_dir else None
    try:
        return _dispatch(args, root)
    except BedUnavailable as exc:
        print(f"geopipe testbed: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except BedError as exc:
        print(f"geopipe testbed: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _dispatch(args: argparse.Namespace, root: Path | None) -> int:
    c = args.tb_command
    if c == "up":
        sites = tuple(s.strip() for s in args.sites.split(",") if s.strip())
        plan = BedPlan(
            sites,
            args.latency_ms,
            args.rate_mbit,
            args.queue_ms,
            args.prefix,
            ray=args.ray,
            cpus_per_site=args.cpus_per_site,
        )
        bed = Bed.up(plan, root)
        _print_status(bed.status())
        if bed.plan.ray_address:
            print(
                f"\nRay: address {bed.plan.ray_address} (ray.address in the YAML; "
                f"emulate_links: false). Run a job with:\n  geopipe testbed exec "
                f"{sites[0]} -- geopipe launch CLUSTER.yaml"
            )
        return 0
    why = netns.unavailable()
    if why:  # every command below reads or changes namespaces
        raise BedUnavailable(f"the test bed {why}")
    if c == "down" and not (root or state_dir()).joinpath(f"{args.prefix}.json").exists():
        return _down_orphans(args.prefix, root)
    bed = Bed.load(args.prefix, root)
    if c == "exec":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            raise BedError("exec: give a command after the site, e.g. `exec east -- ip addr`")
        argv = bed.argv(args.site, cmd)
        os.execvpe(argv[0], argv, bed.env())
    if c == "set":
        cut = True if args.cut else False if args.heal else None
        if args.cut and args.heal:
            raise BedError("set: --cut or --heal, not both")
        if args.latency_ms is None and args.rate_mbit is None and cut is None:
            raise BedError("set: give --latency-ms, --rate-mbit, --cut or --heal")
        bed.plan.with_link(args.latency_ms, args.rate_mbit, cut)  # validates before touching
        bed.set_link(args.latency_ms, args.rate_mbit, cut)
        state = "CUT (nothing passes)" if bed.plan.cut else "up"
        print(
            f"link now {bed.plan.latency_ms:g} ms one-way, {bed.plan.rate_mbit:g} Mbit/s, {state}"
        )
        return 0
    if c == "status":
        st = bed.status()
        print(json.dumps(st, indent=1)) if args.json else _print_status(st)
        return 0
    stopped = bed.down()  # "down"
    print(f"test bed down: {len(stopped)} process(es) stopped, namespaces removed")
    return 0


def _down_orphans(prefix: str, root: Path | None) -> int:
    """``down`` without a state file (it was removed, or ``up`` died early): remove the
    namespaces named ``<prefix>-*`` and what runs in them."""
    sites = tuple(ns[len(prefix) + 1 :] for ns in netns.listed() if ns.startswith(prefix + "-"))
    if not sites:
        print(f"no test bed is up (no namespaces {prefix}-*)")
        return 0
    plan = BedPlan((*sites, *(("orphan-pad",) if len(sites) < 2 else ())), prefix=prefix)
    bed = Bed(plan, root)
    stopped = stop_forwarders(prefix) + bed.down()  # down() also removes what they wrote
    print(f"test bed down: {len(stopped)} process(es) stopped, {len(sites)} namespace(s) removed")
    return 0


def _print_status(st: dict) -> None:
    fw = st["forwarder"]
    print(
        f"link: {st['latency_ms']:g} ms one-way, {st['rate_mbit']:g} Mbit/s per direction, "
        f"{st['queue_ms']:g} ms buffer"
    )
    for site, s in st["sites"].items():
        state = "up" if s["up"] else "MISSING"
        print(
            f"  {site:<12} {s['namespace']:<18} {s['address']:<15} {state}, "
            f"{s['processes']} process(es)"
        )
    cpu = f", {fw['cpu_s']:.1f} s CPU" if fw.get("cpu_s") is not None else ""
    print(f"forwarder: pid {fw['pid']} {'running' if fw['running'] else 'NOT RUNNING'}{cpu}")
    for d, c in fw.get("directions", {}).items():
        print(
            f"  {d}: {c['packets']} packets, {c['wire_bytes'] / 1e6:.1f} MB, {c['dropped']} dropped"
        )
    if st.get("ray_address"):
        print(f"ray: {st['ray_address']}")


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
