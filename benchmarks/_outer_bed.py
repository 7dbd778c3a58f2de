"""The test-bed half of benchmarks/outer_loop.py: geopipe runs inside the bed (a driver in the
first site's namespace, attached to the bed's Ray, ``emulate_links: false``) and the torchft
peer across it.

A *setting* is a dict: ``name``, ``strategy`` (pipeline, outer, auto), ``outer`` (plan.outer's
keys), ``steps``, ``sites`` (default both) and the link the YAML states (``latency_ms``,
``rate_mbit``: the bed's, so the planner plans with the link it gets). Each setting's summary:
wall seconds per inner step over whole outer rounds after calibration
(:func:`_outer_runs.wall_per_step`), tokens/s from it, the controller's forecast and the
launch's prediction, what the strategy chose, the rounds' exposed transfer and bytes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _outer_runs import GLOBAL_BATCH, SEQ, metrics, outer_doc, wall_per_step  # noqa: E402

KEEP_VAR = "GEOPIPE_BENCH_KEEP"  # set: the runs' directories are kept (their path is printed)
CALIBRATION_STEPS = 3  # geopipe.runtime.control.calibration's (imported there: DeepSpeed)


def window(n_steps: int, h: int | None) -> tuple[int, int]:
    """Indices ``(a, b)`` of the steps whose completions bound the measured span: after
    calibration, and for an outer loop whole rounds only (the apply after step ``k*h - 1``
    delays step ``k*h``), from the second round's end where the run holds two more: the
    forecast counts the layout's first round, which runs cold, until a later one is
    measured ([Note: the layout's first round runs cold] in
    geopipe.runtime.control.outercal)."""
    a = CALIBRATION_STEPS - 1
    if h and 1 < h <= n_steps:  # an H beyond the run: no round inside it
        a = max(h - 1, (a + h) // h * h - 1)
        if n_steps >= 4 * h:
            a = max(a, 2 * h - 1)
        b = (n_steps // h) * h - 1
    else:
        b = n_steps - 1
    return a, b


def in_spans(steps: list[dict]) -> bool:
    """Whether the run's steps came back a span at a time (an outer run's calls: every step
    of a span has its span's ``completed_at``), so a window cut at whole rounds would cut
    spans, whose steps all end at once (:func:`span_window`)."""
    done = [s["completed_at"] for s in steps[CALIBRATION_STEPS:]]
    return any(x == y for x, y in pairwise(done))


def span_window(steps: list[dict], start: int, period: int = 1) -> tuple[int, int]:
    """The window of a run recorded in spans: from the first span end at or after ``start``
    (the first whole round's end: the forecast is judged once the first round is measured)
    that is an apply point (every ``period`` steps: the runtime ends its spans there, [Note:
    spans end at applies]) to the last step (a round's end), so whole apply periods, each
    with its apply; from calibration's last single step when that leaves no span."""
    last = len(steps) - 1
    ends = [
        i
        for i, (x, y) in enumerate(pairwise(s["completed_at"] for s in steps))
        if x != y and i >= start and (i + 1) % period == 0
    ]
    a = ends[0] if ends and ends[0] < last else CALIBRATION_STEPS - 1
    return a, last


def steps_for(h: int | None, rounds: int = 2, minimum: int = 12) -> int:
    """Steps that leave ``rounds`` whole rounds after the first (or ``minimum``)."""
    if not h or h <= 1:
        return minimum
    return max(minimum, (rounds + 1) * h)


def summary(run_dir: Path, n_steps: int) -> dict:
    steps, events = metrics(run_dir)
    plan = next(e for e in events if e["event"] == "plan")
    outer = plan.get("outer")
    h = outer["h"] if outer else None
    a, b = window(len(steps), h)
    if in_spans(steps):  # recorded a span at a time: cut at span ends
        a, b = span_window(steps, a, h // outer["fragments"] if outer else 1)
    span = [s for s in steps if a <= s["step"] <= b]
    wall = wall_per_step(span, 0) if len(span) >= 2 else None
    rounds = [e for e in events if e["event"] == "outer_round"]
    fc = [s["predicted_iteration_time_s"] for s in span[1:] if s.get("predicted_iteration_time_s")]
    forecast = statistics.median(fc) if fc else None
    launch = (plan.get("predicted") or {}).get("iteration_time_s")
    return {
        "kind": "outer" if outer else "pipeline",
        "outer": outer,
        "schedule": json_plan(plan).get("schedule"),
        "micro_batch_size": json_plan(plan).get("micro_batch_size"),
        "codecs": json_plan(plan).get("codecs"),
        "steps": len(steps),
        "span": [a, b],
        "wall_step_s": wall,
        "tokens_per_s": GLOBAL_BATCH * SEQ / wall if wall else None,
        "iteration_median_s": statistics.median(s["iteration_time_s"] for s in span)
        if span
        else None,
        "forecast_s": forecast,
        "forecast_error": abs(forecast / wall - 1) if forecast and wall else None,
        "launch_predicted_s": launch,
        "launch_error": abs(launch / wall - 1) if launch and wall else None,
        "rounds": len(rounds),
        "exposed_s": sum(r["exposed_s"] for r in rounds),
        "round_bytes": sum(r["bytes"] for r in rounds),
        "digests_equal": all(r["digests_equal"] for r in rounds),
        "links_measured": plan.get("links_measured", []),
        "losses": [round(s["loss"], 4) for s in steps[:: max(1, len(steps) // 10)]],
        "window_at": [span[0]["completed_at"], span[-1]["completed_at"]] if span else None,
    }


def cpu_per_step(cpu: dict, span: list[int]) -> dict:
    """The window's CPU accounting with the host's and the actors' CPU seconds per step
    ("other" added to the actors': an actor whose title was being rewritten at the first
    sample that saw it is read as "other" until a later one sees its title)."""
    n = span[1] - span[0]
    if not cpu or n <= 0:
        return cpu
    k = cpu["cpu_s"]
    return {
        **cpu,
        "host_per_step_s": round(cpu["host_busy_cores"] * cpu["seconds"] / n, 5),
        "actors_per_step_s": round((k.get("actor", 0) + k.get("other", 0)) / n, 5),
    }


def brief_error(exc: BaseException) -> str:
    """An error in one line: Ray's colour codes out, its first and last lines kept (the
    remote traceback between them is long and says less than the exception at its end)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", f"{type(exc).__name__}: {exc}")
    lines = [x.strip() for x in text.splitlines() if x.strip() and set(x.strip()) != {"^"}]
    return " | ".join(lines if len(lines) <= 3 else [lines[0], *lines[-2:]])[:1500]


def json_plan(plan_event: dict) -> dict:
    p = plan_event.get("plan")
    return p if isinstance(p, dict) else {}


def role(address: str, settings: list[dict]) -> None:
    """Inside the first site's namespace: attach to the bed's Ray, run every setting."""
    import ray
    from _common import run, spec_of
    from _cpu_account import CpuSampler

    out = {}
    tmp = Path(tempfile.mkdtemp(prefix="geopipe-outerbed-"))
    try:
        for s in settings:
            link = {k: s[k] for k in ("latency_ms", "rate_mbit") if k in s}
            doc = outer_doc(s["name"], s["steps"], s.get("outer", {}), s["strategy"], **link)
            if "sites" in s:
                doc["sites"] = [x for x in doc["sites"] if x["name"] in s["sites"]]
                doc["links"] = [] if len(s["sites"]) == 1 else doc["links"]
            doc["plan"]["micro_batch_size"] = s.get("micro_batch_size", {"min": 1, "max": 8})
            if "global_batch" in s:  # one group's share, alone
                doc["training"]["global_batch_size"] = s["global_batch"]
            doc["ray"].update(address=address, emulate_links=False)
            doc["plan"]["calibrate"] = True  # plan from this machine's speed, not the YAML's
            t0 = time.monotonic()
            cpu = CpuSampler().start()  # where the host's CPU went over the window
            try:
                run(spec_of(doc), s["steps"], tmp / s["name"])
                cpu.stop()
                r = summary(tmp / s["name"], s["steps"])
                if r.get("window_at"):
                    r["cpu"] = cpu_per_step(cpu.over(*r["window_at"]), r["span"])
            except Exception as exc:  # one setting's failure is reported, the rest still run
                cpu.stop()
                r = {"error": brief_error(exc)}
                try:  # every step ran and the failure came after (the final save)?
                    done = summary(tmp / s["name"], s["steps"])
                    if done["steps"] >= s["steps"]:
                        r = {**done, "end_error": r["error"]}
                except Exception:  # nothing measured: the error stands
                    pass
            r["seconds"] = round(time.monotonic() - t0, 1)
            r["load"] = round(os.getloadavg()[0], 2)
            out[s["name"]] = r
            _say(s["name"], r)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if os.environ.get(KEEP_VAR):  # kept for a look at the runs' metrics
            print(f"the runs' directories: {tmp}", file=sys.stderr, flush=True)
        else:  # ~120 MB of checkpoints a call: a sweep left gigabytes in /tmp
            shutil.rmtree(tmp, ignore_errors=True)
    print("RESULT " + json.dumps(out), flush=True)


def _say(name: str, r: dict) -> None:
    if "error" in r:
        print(f"  {name}: failed: {r['error'][:300]}", file=sys.stderr, flush=True)
        return
    o = r["outer"]
    what = (
        f"outer H={o['h']} F={o['fragments']} tau={o['overlap']} {o['codec']}" if o else "pipeline"
    )
    wall = r["wall_step_s"]
    print(
        f"  {name}: {what}: {wall if wall is None else round(wall, 4)} s/step "
        f"(forecast {r['forecast_s']}, exposed {r['exposed_s']:.2f} s over {r['rounds']} "
        f"rounds; load {r['load']})",
        file=sys.stderr,
        flush=True,
    )
    if r.get("cpu"):
        print(f"    cpu over the window: {json.dumps(r['cpu'])}", file=sys.stderr, flush=True)


def run_settings(bed, settings: list[dict], timeout_s: float = 3600) -> dict:
    """Run ``settings`` in one driver process inside the bed's first site."""
    p = bed.popen(
        bed.plan.sites[0],
        [
            sys.executable,
            str(HERE / "outer_loop.py"),
            "--role",
            "bed",
            "--address",
            bed.plan.ray_address,
            "--settings",
            json.dumps(settings),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        out, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {s["name"]: {"error": f"the bed driver exited ({p.returncode})"} for s in settings}


def run_peer(bed, h: int, steps: int, mode: str = "torchft", timeout_s: float = 600) -> dict:
    """torchft's DiLoCo (or the plain one) with one replica per site of the bed."""
    py, peer = sys.executable, str(HERE / "_outer_peer.py")
    sites = bed.plan.sites
    addrs = [bed.plan.address(s) for s in sites]
    common = ["--peers", str(len(sites)), "--steps", str(steps), "--h", str(h)]
    lh = None
    if mode == "torchft":
        port = 29510
        lh = bed.popen(
            sites[0],
            [py, peer, "--mode", "lighthouse", "--port", str(port), "--peers", str(len(sites))],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        time.sleep(2.0)
        extra = ["--lighthouse", f"http://{addrs[0]}:{port}"]
    else:
        extra = ["--master", f"{addrs[0]}:29520"]
    logs = [Path(tempfile.mkdtemp(prefix="geopipe-peer-")) / f"replica{g}.log" for g in range(2)]
    procs = [
        bed.popen(
            s,
            [py, peer, "--mode", mode, "--replica", str(g), "--address", addrs[g], *common, *extra],
            stdout=subprocess.PIPE,
            stderr=open(logs[g], "w"),  # noqa: SIM115 - the child holds it
            text=True,
            cwd=ROOT,
        )
        for g, s in enumerate(sites)
    ]
    results: list[dict] = []
    try:
        for g, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            r = next((json.loads(x[7:]) for x in out.splitlines() if x.startswith("RESULT ")), None)
            tail = " | ".join(logs[g].read_text(errors="replace").strip().splitlines()[-3:])
            results.append(
                r or {"ok": False, "error": f"replica {g} exited ({p.returncode}): {tail}"}
            )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if lh is not None:
            try:
                lh.communicate(input="", timeout=30)  # its stdin closed: it shuts down
            except subprocess.TimeoutExpired:
                lh.kill()
                lh.communicate()
    bad = [r for r in results if not r.get("ok")]
    if bad:
        return {"ok": False, "mode": mode, "error": bad[0].get("error")}
    times = [r["step_s"] for r in results]
    return {
        "ok": True,
        "mode": mode,
        "step_s": max(times),  # the slower replica's: both wait for each other every round
        "replica_step_s": times,
        "outer_steps": results[0].get("outer_steps"),
        "losses": results[0]["losses"],
    }
