"""Export a simulated step as Chrome / Perfetto trace JSON (opens in ui.perfetto.dev)."""
from __future__ import annotations

from perfmodel.step.predict import Prediction

LANES = {"compute": 1, "dma": 2, "link": 3, "aux": 4}  # aux: a GPU engine's second stream


def chrome_trace(p: Prediction) -> dict:
    """Trace Event Format: one process per prediction, one thread per lane (compute, DMA, link, and
    a GPU serving engine's second stream)."""
    if not p.timeline.events:
        raise ValueError("prediction has no recorded events: call predict(..., record=True)")
    events = [{"ph": "M", "name": "process_name", "pid": 1,
               "args": {"name": f"{p.model} on {p.hardware} ({p.deployment.engine}, batch {p.deployment.batch})"}}]
    events += [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": lane}}
               for lane, tid in LANES.items()]
    for lane, name, layer, t0, t1 in p.timeline.events:
        events.append({"ph": "X", "pid": 1, "tid": LANES[lane], "name": name, "cat": f"layer_{layer:02d}",
                       "ts": t0 * 1e6, "dur": max(0.0, t1 - t0) * 1e6, "args": {"layer": layer}})
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "metadata": {"step_s": p.step_s, "tokens_per_s": p.tokens_per_s}}
