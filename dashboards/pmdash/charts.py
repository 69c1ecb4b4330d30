"""Chart pieces more than one view draws: Vega-Lite specs drawn by Streamlit (SVG, inline data), the cause
colours, and the simulated step's lanes (DMA engine, compute unit, links) as a Gantt chart with op names.

Every chart is a Vega-Lite spec of plain dicts with its data inline in its layers, each row naming its
`series` (the legend entry it belongs to): Vega-Lite's bundle costs the browser about a second less per
page load than Plotly's. A lane's events of one op and layer that follow each other without a gap (the
tiles of one weight stream) are merged into one bar, so a layer is a few dozen bars, not hundreds; a
range wider than EVENT_LAYERS is drawn as one bar per layer and lane.
"""
from __future__ import annotations

import math

import numpy as np
import streamlit as st

from . import common as c

LANES = ("dma", "compute", "aux", "link")  # aux: a GPU serving engine's second stream
LANE_NAMES = {"dma": "DMA engine", "compute": "compute unit", "aux": "second stream", "link": "links"}
LANE_COLORS = {"dma": "#ff7f0e", "compute": "#1f77b4", "aux": "#9467bd", "link": "#2ca02c"}
CAUSE_COLORS = {"weight_streaming": "#ff7f0e", "expert_fetch": "#ffbb78", "collective": "#2ca02c",
                "launch": "#9467bd", "fill_drain": "#c5b0d5", "compute": "#1f77b4", "draft": "#8c564b"}
EXTRA_COLORS = ("#17becf", "#e377c2", "#bcbd22", "#7f7f7f", "#8c564b", "#d62728")
EVENT_LAYERS = 16   # a layer range at most this wide is drawn op by op
DEFAULT_LAYERS = 4  # the timeline opens on this many layers after the embedding


def color(name: str, i: int) -> str:
    """A cause's colour; a cause the model adds later gets one of the spare colours."""
    return CAUSE_COLORS.get(name, EXTRA_COLORS[i % len(EXTRA_COLORS)])


# Vega-Lite symbol shapes: built-in names or SVG paths in the unit square
X_SHAPE = "M-1,-1L1,1M-1,1L1,-1"
STAR_SHAPE = ("M0,-1L0.22,-0.31L0.95,-0.31L0.36,0.12L0.59,0.81L0,0.38L-0.59,0.81L-0.36,0.12L-0.95,-0.31"
              "L-0.22,-0.31Z")
LEGEND = {"orient": "bottom", "columns": 2, "labelLimit": 420, "title": None, "symbolOpacity": 1}
# a panel's legends above its plot, one block per channel (colour, line style, marker), each titled
TOP_LEGEND = {"orient": "top", "direction": "vertical", "columns": 1, "labelLimit": 520, "symbolOpacity": 1,
              "titleFontWeight": "bold", "titleFontSize": 11, "labelFontSize": 12, "columnPadding": 24}
Y_EXTENT = 78  # px of a left y axis (ticks, labels, title): charts stacked as panels line up their plots

# A measured point's marker by the kind of its source: the same whatever else is plotted
SOURCE_SHAPES = {"published": "circle", "measured by this project": "square", "your upload": "triangle-up"}


def plain(v):
    """A value as JSON takes it: numpy scalars as Python numbers, NaN and infinities as None."""
    if isinstance(v, np.generic):
        v = v.item()
    return None if isinstance(v, float) and not math.isfinite(v) else v


def rows(**columns) -> list[dict]:
    """Inline Vega-Lite data from equal-length columns (or scalars repeated), as plain values."""
    n = max((len(v) for v in columns.values() if isinstance(v, (list, tuple, np.ndarray))), default=1)
    cols = {k: list(v) if isinstance(v, (list, tuple, np.ndarray)) else [v] * n for k, v in columns.items()}
    return [{k: plain(cols[k][i]) for k in cols} for i in range(n)]


def layer(data: list[dict], mark: dict | str, **encoding) -> dict:
    """One layer: its own data, mark and encoding (Streamlit keeps a layer's inline data in the spec)."""
    return {"data": {"values": data}, "mark": mark, "encoding": encoding}


def quant(field: str, title: str | None = None, **kw) -> dict:
    """A quantitative field."""
    return {"field": field, "type": "quantitative", "title": field if title is None else title, **kw}


def nominal(field: str, title: str | None = None, **kw) -> dict:
    """A nominal field."""
    return {"field": field, "type": "nominal", "title": field if title is None else title, **kw}


def tip(*fields: tuple) -> list[dict]:
    """A tooltip: (field, title[, d3 format]) each; the series first, so the hover names its entry."""
    out = [{"field": "series", "type": "nominal", "title": "series"}]
    for f in fields:
        out.append({"field": f[0], "title": f[1], **({"format": f[2]} if len(f) > 2 else {})})
    return out


def colors(names: dict[str, str]) -> dict:
    """A colour scale naming each series' colour (and so its legend entry)."""
    return {"domain": list(names), "range": list(names.values())}


def panel(layers: list[dict], height: int, legend: dict | None = None, **extra) -> dict:
    """A chart of a few layers whose left y axis takes Y_EXTENT px, so panels drawn one under the other (two
    charts: Streamlit fits only a single view to the page's width) share their x positions; they share their
    x range too when each is given the same `shared_x` scale."""
    return {"height": height, "layer": layers, "config": {"legend": legend or LEGEND, "axisLeft": {
        "minExtent": Y_EXTENT, "maxExtent": Y_EXTENT}}, **extra}


def shared_x(values, log: bool, pad: float = 0.06) -> dict:
    """An x scale whose range is fixed by `values` (padded by `pad` of the span, in log space on a log axis), not
    by what a layer happens to draw: panels stacked one under the other are given the same one. Its pixel padding
    is nil (Vega-Lite pads a continuous scale under bars by 5 px, which would shift a bar panel's x positions)."""
    vals = [float(v) for v in values if v is not None and (not log or v > 0)]
    if not vals:
        return {"type": "log" if log else "linear", "padding": 0}
    lo, hi = min(vals), max(vals)
    if log:
        a, b = math.log10(lo), math.log10(hi)
        span = (b - a) or 1.0
        return {"type": "log", "domain": [10 ** (a - pad * span), 10 ** (b + pad * span)], "nice": False, "padding": 0}
    span = (hi - lo) or max(abs(hi), 1.0)
    return {"type": "linear", "domain": [lo - pad * span, hi + pad * span], "nice": False, "zero": False, "padding": 0}


def show(spec: dict, key: str, **kw):
    """Draw a spec across the container (Vega-Lite draws it as SVG: each mark carries its hover text), inside
    an element with the class st-key-KEY and with KEY as the spec's name. A chart that selects is a widget
    with that key; another is drawn in a container with it."""
    spec = {"name": key, **spec}
    if "on_select" in kw:
        return st.vega_lite_chart(spec=spec, key=key, width="stretch", **kw)
    with st.container(key=key):
        return st.vega_lite_chart(spec=spec, width="stretch", **kw)


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


LABEL_PX = 7      # about one character of a bar's label, in pixels
PLOT_PX = 1100    # about the width of the plot area on a wide page, in pixels


@st.cache_resource(show_spinner=False, max_entries=32)
def gantt(m_ref, h_ref, key, vmem, lo: int, hi: int, height: int = 300) -> tuple[dict, int, bool]:
    """The lanes of layers lo..hi as horizontal bars, the names inside the bars that have room for them;
    scroll to zoom the time axis, drag to pan, double-click to reset."""
    d = lanes(m_ref, h_ref, key, vmem, lo, hi)
    by_op = hi - lo + 1 <= EVENT_LAYERS
    bars = [r for lane, v in d.items() for r in rows(
        series=LANE_NAMES[lane], start=v["base"], end=v["base"] + v["x"], length=v["x"], what=v["text"],
        label=v["label"])]
    n_bars = len(bars)
    span = max((r["end"] for r in bars), default=1.0) - min((r["start"] for r in bars), default=0.0) or 1.0
    labels = [r for r in bars if r["length"] / span * PLOT_PX > LABEL_PX * len(str(r["label"])) + 6]
    lane_axis = nominal("series", "", sort=[LANE_NAMES[l] for l in LANES])
    spec = {"height": height, "layer": [
        {**layer(bars, {"type": "bar", "stroke": "white", "strokeWidth": 0.5, "height": {"band": 0.8}},
                 y=lane_axis, x=quant("start", "time in step (us)"), x2={"field": "end"},
                 color={"field": "series", "type": "nominal", "scale": colors(
                     {LANE_NAMES[l]: LANE_COLORS[l] for l in LANES}), "legend": None},
                 tooltip=tip(("what", "what"), ("start", "start (us)", ".2f"), ("length", "length (us)", ".3f"))),
         "params": [{"name": "zoom", "select": {"type": "interval", "encodings": ["x"]}, "bind": "scales"}]},
        layer([dict(r, mid=(r["start"] + r["end"]) / 2) for r in labels],
              {"type": "text", "fontSize": 10, "color": "white"}, y=lane_axis, x=quant("mid", "time in step (us)"),
              text={"field": "label"}, tooltip=tip(("what", "what")))]}
    return spec, n_bars, by_op
