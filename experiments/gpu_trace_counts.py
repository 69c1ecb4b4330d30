"""What the GPU did in each traced step of the GPU validation's runs, and how much of the wall
step three measured host mechanisms account for (docs/validation.md "GPU"):

    python experiments/gpu_trace_counts.py --traces DIR [--mode compiled]

DIR holds runs captured by experiments/validate_gpu.py (their traces are not in the repository;
tests/data/h200_trace.tar.xz holds one). Per run, medians over the traced steps after the first:
the GPU's events (kernels and copies), its device-to-host copies (each trip of a loop whose trip
count is a device value copies its condition back), the median event, the GPU's busy time, its
waits of 5 us or more, the wait before its first event, and the traced step against the untraced
wall step (capture.json). Then the account: the call's dispatch with the model's weight tree and
the loop trips at their measured costs (experiments/results/gpu_jax_overheads.json, taken on the
same GPU) plus the GPU's busy time, as a share of the wall step. Counts and shares, no fit.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path

from perfmodel.step.report import table
from perfmodel.util.errors import SpecError
from perfmodel.validate.traces import STEP_NAME, capture_meta, find_xplane, load_xspace

ROOT = Path(__file__).resolve().parent.parent
OVERHEADS = ROOT / "experiments" / "results" / "gpu_jax_overheads.json"
WAIT_NS = 5e3  # a gap this long is the GPU waiting on the host, not a launch inside a graph
D2H = "MemcpyD2H"


def step_counts(xplane: Path) -> list[dict]:
    """Per traced step (the first left out): events, D2H copies, median event, busy, waits, lead, window."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pd = load_xspace(xplane)
        steps, events = [], []
        for plane in pd.planes:
            for line in plane.lines:
                for e in line.events:
                    if e.name == STEP_NAME:
                        steps.append((e.start_ns, e.end_ns))
                    elif plane.name.startswith("/device:GPU"):
                        events.append((e.start_ns, e.end_ns, e.name))
    if not steps or not events:
        raise SpecError("trace", str(xplane), "needs decode_step annotations and GPU events")
    events.sort()
    out = []
    for t0, t1 in sorted(steps)[1:]:
        inside = [e for e in events if t0 <= e[0] < t1]
        if not inside:
            continue
        busy, waits, end = 0.0, 0, inside[0][0]
        for s, e, _ in inside:  # the union of the event intervals, and the gaps between them
            waits += s - end >= WAIT_NS
            busy += max(0.0, e - max(s, end))
            end = max(end, e)
        out.append({"events": len(inside), "d2h": sum(e[2] == D2H for e in inside),
                    "median_event_s": statistics.median(e - s for s, e, _ in inside) * 1e-9,
                    "busy_s": busy * 1e-9, "waits": waits,
                    "lead_s": (inside[0][0] - t0) * 1e-9, "window_s": (t1 - t0) * 1e-9})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", required=True, help="a directory of runs captured by validate_gpu.py")
    ap.add_argument("--mode", default="compiled", choices=("compiled", "op_by_op"))
    a = ap.parse_args(argv)
    runs = sorted(p.parent for p in Path(a.traces).glob("*/capture.json"))
    overheads = json.loads(OVERHEADS.read_text())
    rows, shares = [], []
    try:
        for run in runs:
            meta = capture_meta(run / "capture.json")
            if meta["mode"] != a.mode:
                continue
            per = step_counts(find_xplane(run))
            m = {k: statistics.median(s[k] for s in per) for k in per[0]}
            wall = statistics.median(meta["host_step_s"])
            dispatch = overheads["dispatch"][meta["model"]]["call_s"]
            account = dispatch + m["d2h"] * overheads["loop_trip"]["per_trip_s"] + m["busy_s"]
            shares.append(account / wall)
            rows.append([meta["model"], meta["batch"], meta["context"], int(m["events"]), int(m["d2h"]),
                         f"{m['median_event_s'] * 1e6:.2f}", f"{m['busy_s'] * 1e6:.0f}", int(m["waits"]),
                         f"{m['lead_s'] * 1e6:.0f}", f"{m['window_s'] / wall:.2f}", f"{wall * 1e6:.0f}",
                         f"{account / wall:.0%}"])
    except SpecError as e:
        print(f"gpu_trace_counts: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"gpu_trace_counts: --traces {a.traces}: no {a.mode} run captured there", file=sys.stderr)
        return 2
    print(table(["model", "batch", "context", "events", "D2H copies", "median event us", "busy us", "waits",
                 "lead us", "traced / wall", "wall us", "accounted"], rows))
    dispatch = ", ".join(f"{k} {v['call_s'] * 1e6:.0f} us" for k, v in overheads["dispatch"].items())
    print(f"\naccounted: dispatch ({dispatch})"
          f" + D2H copies x {overheads['loop_trip']['per_trip_s'] * 1e6:.1f} us a loop trip + the GPU's busy time, "
          f"of the wall step: {min(shares):.0%} to {max(shares):.0%}, median {statistics.median(shares):.0%} "
          f"(costs measured on {overheads['device']}, {overheads['date'][:10]}: experiments/gpu_jax_overheads.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
