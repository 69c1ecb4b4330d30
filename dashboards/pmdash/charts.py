"""Chart pieces more than one view draws: fixed margins, the cause colours, and the simulated step's
lanes (DMA engine, compute unit, links) as a Gantt chart with op names.

A lane's events of one op and layer that follow each other without a gap (the tiles of one weight
stream) are merged into one bar, so a layer is a few dozen bars, not hundreds; a range wider than
EVENT_LAYERS is drawn as one bar per layer and lane.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from . import common as c

LANES = ("dma", "compute", "link")
LANE_NAMES = {"dma": "DMA engine", "compute": "compute unit", "link": "links"}
LANE_COLORS = {"dma": "#ff7f0e", "compute": "#1f77b4", "link": "#2ca02c"}
CAUSE_COLORS = {"weight_streaming": "#ff7f0e", "expert_fetch": "#ffbb78", "collective": "#2ca02c",
                "launch": "#9467bd", "fill_drain": "#c5b0d5", "compute": "#1f77b4", "draft": "#8c564b"}
EXTRA_COLORS = ("#17becf", "#e377c2", "#bcbd22", "#7f7f7f", "#8c564b", "#d62728")
EVENT_LAYERS = 16   # a layer range at most this wide is drawn op by op
DEFAULT_LAYERS = 4  # the timeline opens on this many layers after the embedding


def color(name: str, i: int) -> str:
    """A cause's colour; a cause the model adds later gets one of the spare colours."""
    return CAUSE_COLORS.get(name, EXTRA_COLORS[i % len(EXTRA_COLORS)])


def fixed_margins(fig: go.Figure, left: int, right: int, bottom: int, top: int = 30) -> go.Figure:
    """Margins sized here for the axis labels, not measured by plotly.js on every redraw (its axis automargin
    costs the browser about 20 ms per chart and change); a legend still takes the room it needs."""
    fig.update_layout(margin=dict(l=left, r=right, b=bottom, t=top))
    fig.update_xaxes(automargin=False)
    fig.update_yaxes(automargin=False)
    return fig


def merged(t0: np.ndarray, t1: np.ndarray, key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of consecutive events with the same key, each starting before the one before it ended
    (within 1 ns; times in us): (first index, end time, count) per run."""
    if len(t0) == 0:
        return np.zeros(0, int), np.zeros(0), np.zeros(0, int)
    new = np.ones(len(t0), bool)
    new[1:] = (key[1:] != key[:-1]) | (t0[1:] > t1[:-1] + 1e-3)  # us
    first = np.flatnonzero(new)
    run = np.cumsum(new) - 1
    end = np.zeros(len(first))
    np.maximum.at(end, run, t1)
    return first, end, np.bincount(run)


@st.cache_data(show_spinner=False, max_entries=64)
def lanes(m_ref: tuple, h_ref: tuple, key: tuple, vmem: float | None, lo: int, hi: int) -> dict:
    """Per lane, bars in us for layers lo..hi: one per op (merged tile copies, with the op name) when the
    range is at most EVENT_LAYERS wide, else one per layer (its span, busy time in the hover)."""
    ev = c.predict_cached(m_ref, h_ref, key, vmem, record=True)["events"]
    sel = (ev["layer"] >= lo) & (ev["layer"] <= hi)
    by_op = hi - lo + 1 <= EVENT_LAYERS
    out = {}
    for lane in LANES:
        m = sel & (ev["lane"] == lane)
        if not m.any():
            continue
        t0, t1, layer, name = ev["t0_s"][m] * 1e6, ev["t1_s"][m] * 1e6, ev["layer"][m], ev["name"][m]
        if by_op:
            first, end, n = merged(t0, t1, np.char.add(np.char.add(name, "@"), layer.astype(str)))
            label = name[first]
            text = [f"{nm} (layer {l})" + (f": {k} copies" if k > 1 else "")
                    for nm, l, k in zip(label, layer[first], n)]
            out[lane] = {"base": t0[first], "x": end - t0[first], "text": np.array(text), "label": label}
            continue
        ids, inv = np.unique(layer, return_inverse=True)
        start = np.full(len(ids), np.inf)
        np.minimum.at(start, inv, t0)
        end = np.zeros(len(ids))
        np.maximum.at(end, inv, t1)
        busy = np.bincount(inv, weights=t1 - t0)
        count = np.bincount(inv)
        text = [f"layer {l}: {n} {lane} events, busy {b:.2f} us of a {e - s:.2f} us span"
                for l, n, b, s, e in zip(ids, count, busy, start, end)]
        out[lane] = {"base": start, "x": end - start, "text": np.array(text), "label": ids.astype(str)}
    return out


@st.cache_resource(show_spinner=False, max_entries=32)
def gantt(m_ref, h_ref, key, vmem, lo: int, hi: int, height: int = 300) -> tuple[go.Figure, int, bool]:
    """The lanes of layers lo..hi as horizontal bars (names inside the bars that have room)."""
    d = lanes(m_ref, h_ref, key, vmem, lo, hi)
    by_op = hi - lo + 1 <= EVENT_LAYERS
    n = sum(len(v["x"]) for v in d.values())
    fig = go.Figure()
    for lane, v in d.items():
        fig.add_trace(go.Bar(y=np.full(len(v["x"]), LANE_NAMES[lane]), x=v["x"], base=v["base"], orientation="h",
                             name=LANE_NAMES[lane], marker_color=LANE_COLORS[lane], marker_line_width=0.5,
                             marker_line_color="white", hovertext=v["text"], text=v["label"],
                             textposition="inside", insidetextanchor="middle", textangle=0,
                             hovertemplate="%{hovertext}<br>start %{base:.2f} us<br>length %{x:.3f} us"
                             "<extra>" + LANE_NAMES[lane] + "</extra>"))
    fig.update_layout(barmode="overlay", xaxis_title="time in step (us)", height=height, showlegend=False,
                      uniformtext=dict(minsize=9, mode="hide"),
                      yaxis=dict(categoryorder="array", categoryarray=[LANE_NAMES[l] for l in reversed(LANES)]))
    return fixed_margins(fig, left=110, right=20, bottom=50, top=20), n, by_op
