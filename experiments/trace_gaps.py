"""Where a megakernel step runs outside its in-kernel markers: for a kept trace (`.xplane.pb` or
`.xplane.pb.gz`, `tpu_megakernel.py --keep-trace`), the first step's phases (`layer/attention`,
`layer/ffn`, ...) and, inside each, the stretches no nested marker covers, longest first.
No TPU needed.

    python experiments/trace_gaps.py experiments/results/tpu_v5e/k3-tp8-core_int4_b8.xplane.pb.gz
        [--min-us 2] [--step 0]

A marker nested in a phase (`q_proj`, `recurrence`, `state_store`, ...) covers its span; what
is left of the phase is code the markers do not name: a stall, or work between markers.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PHASES = ("embed", "head", "layer/attention", "layer/ffn")


def markers(path: Path) -> list[tuple[float, float, str]]:
    """(start ns, end ns, name) of every in-kernel marker of the trace, in time order."""
    from perfmodel.validate.traces import kernel_markers, load_xspace
    return kernel_markers(load_xspace(path))


def step_gaps(evs: list[tuple[float, float, str]], step: int = 0) -> list[dict]:
    """Per phase of step `step` (steps begin at an `embed` marker): its span and the stretches
    inside it no other marker covers, relative to the step's start, in us."""
    starts = [i for i, e in enumerate(evs) if e[2].endswith("embed")]
    if step >= len(starts):
        from perfmodel.util.errors import SpecError
        raise SpecError("step", step, f"the trace holds {len(starts)} steps")
    lo, hi = starts[step], starts[step + 1] if step + 1 < len(starts) else len(evs)
    t0, mine = evs[lo][0], evs[lo:hi]
    out, n_layer = [], 0
    for a, b, name in mine:
        phase = next((p for p in PHASES if name.endswith(p)), None)
        if phase is None:
            continue
        n_layer += phase == "layer/attention"
        inner = sorted((x, y) for x, y, nm in mine if a <= x and y <= b and (x, y, nm) != (a, b, name)
                       and not any(nm.endswith(p) for p in PHASES))
        gaps, t = [], a
        for x, y in inner:
            if x > t:
                gaps.append(((t - t0) / 1e3, (x - t) / 1e3))
            t = max(t, y)
        if b > t:
            gaps.append(((t - t0) / 1e3, (b - t) / 1e3))
        label = phase if phase in ("embed", "head") else f"layer {n_layer} {phase.split('/')[1]}"
        out.append({"phase": label, "start_us": (a - t0) / 1e3, "us": (b - a) / 1e3,
                    "gaps": sorted(gaps, key=lambda g: -g[1])})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--min-us", type=float, default=2.0, help="show stretches at least this long")
    ap.add_argument("--step", type=int, default=0)
    a = ap.parse_args(argv)
    from perfmodel.util.errors import SpecError
    try:
        rows = step_gaps(markers(a.trace), a.step)
    except (SpecError, OSError) as e:
        print(f"trace_gaps: error: {e}", file=sys.stderr)
        return 2
    for r in rows:
        shown = [f"{d:.2f} us at {s:.2f}" for s, d in r["gaps"] if d >= a.min_us]
        print(f"{r['phase']:18s} {r['us']:8.2f} us from {r['start_us']:8.2f}; outside its markers: "
              + (", ".join(shown) or "-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
