"""What-if view: tune prefetch depth, expert slots, VMEM, batch, context, engine, acceptance length.

Inputs are strict text fields; a bad one keeps the outputs of the last valid inputs, greyed out.
Figures are cached (st.plotly_chart then only copies and serialises them).
A configuration the model refuses shows its on-chip budget in MiB and the nearest ones that run,
and the prefetch sweep (what fits) stays live. Each chart section is a fragment: its own widgets
rerun only that section.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from . import common as c
from . import fit, measured
from .inputs import current_or_last, maybe_stale, number_field

LANES = ("dma", "compute", "link")
LANE_COLORS = {"dma": "#ff7f0e", "compute": "#1f77b4", "link": "#2ca02c"}
CAUSE_COLORS = {"weight_streaming": "#ff7f0e", "expert_fetch": "#ffbb78", "collective": "#2ca02c",
                "launch": "#9467bd", "fill_drain": "#c5b0d5", "compute": "#1f77b4", "draft": "#8c564b"}
KIND_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
ENGINES = ("megakernel", "multikernel")
VMEM_FIELDS = ("prefetch_bytes", "expert_slots", "onchip_bytes")
EVENT_LAYERS = 16      # a layer range at most this wide is drawn event by event
WEBGL_MARKS = 2000     # above this many marks a chart is drawn with WebGL
FIELD_KEYS = {"devices": "wi_devices", "tp": "wi_tp", "ep": "wi_ep", "batch": "wi_batch", "context": "wi_context",
              "prefetch_mib": "wi_prefetch", "expert_slots": "wi_slots"}


def fixed_margins(fig: go.Figure, left: int, right: int, bottom: int, top: int = 30) -> go.Figure:
    """Margins sized here for the axis labels, not measured by plotly.js on every redraw (its axis automargin
    costs the browser about 20 ms per chart and change); a legend still takes the room it needs."""
    fig.update_layout(margin=dict(l=left, r=right, b=bottom, t=top))
    fig.update_xaxes(automargin=False)
    fig.update_yaxes(automargin=False)
    return fig


# ----- inputs -------------------------------------------------------------------------------------

def inputs() -> tuple[dict | None, list[str]]:
    models, hws = c.model_options(), c.hardware_options()
    c.init(wi_model="kimi-k3", wi_hw="tpu-v7", wi_engine="megakernel", wi_batch="1", wi_devices="32", wi_tp="32",
           wi_ep="8", wi_context="4096", wi_prefetch="", wi_slots="", wi_vmem="", wi_spec=False, wi_draft="7")
    errs: list[str] = []
    r1 = st.columns(4)
    model = r1[0].selectbox("Model", models, key="wi_model")
    hw = r1[1].selectbox("Hardware", hws, key="wi_hw")
    engine = r1[2].radio("Engine", ENGINES, horizontal=True, key="wi_engine")
    batch = number_field(r1[3], "Batch (sequences)", "wi_batch", errors=errs)
    r2 = st.columns(4)
    devices = number_field(r2[0], "Devices", "wi_devices", errors=errs)
    tp = number_field(r2[1], "TP", "wi_tp", errors=errs)
    ep = number_field(r2[2], "EP groups", "wi_ep", errors=errs)
    context = number_field(r2[3], "Context (tokens in cache)", "wi_context", lo=0, hi=10_000_000, errors=errs)
    r3 = st.columns(4)
    hw_spec = c.load_hardware_ref(c.hardware_ref(hw))
    kind, preset_mib = hw_spec.onchip_kind, hw_spec.onchip_bytes / c.MiB
    prefetch = number_field(r3[0], "Prefetch depth (MiB per core)", "wi_prefetch", integer=False, lo=0.001, hi=1e7,
                            allow_empty=True, errors=errs, placeholder=f"default: half the {kind}",
                            help="Megakernel weight ring size (Deployment.prefetch_bytes). Empty: the default.")
    slots = number_field(r3[1], "Expert slots", "wi_slots", lo=1, hi=4096, allow_empty=True, errors=errs,
                         placeholder="default: as many as fit (<= top-k)",
                         help="Megakernel expert buffers (Deployment.expert_slots). Empty: the default.")
    vmem = number_field(r3[2], f"{kind} per core (MiB)", "wi_vmem", integer=False, lo=0.001, hi=1e7,
                        allow_empty=True, errors=errs, placeholder=f"preset: {preset_mib:g} MiB",
                        help="On-chip buffer per core (Hardware.onchip_bytes). Empty: the preset's.")
    with r3[3]:
        spec = st.toggle("Speculative decoding", key="wi_spec")
        draft = number_field(st, "Draft rows", "wi_draft", lo=1, hi=64, disabled=not spec, errors=errs if spec else None)
        top = float(draft or c.SPEC_DRAFT_ROWS) + 1
        if "wi_acc" in st.session_state and st.session_state["wi_acc"] > top:
            st.session_state["wi_acc"] = top
        acc = st.slider("Acceptance length (tokens / step)", 1.0, top, min(c.SPEC_ACCEPTANCE, top), step=0.5,
                        key="wi_acc", disabled=not spec)
    if errs:
        return None, errs
    key = c.dep_key(devices, tp, ep, engine, batch=batch, context=context, prefetch_mib=prefetch,
                    expert_slots=slots, draft_rows=draft if spec else 0, acceptance_length=acc if spec else None)
    return dict(model=model, hw=hw, key=key, vmem=vmem, engine=engine), []


def refs(x: dict) -> tuple:
    return c.model_ref(x["model"]), c.hardware_ref(x["hw"]), x["key"], x["vmem"]


def apply(key: tuple, vmem: float | None) -> None:
    """Button callback: put a suggested configuration into the fields."""
    for k, v in dict(key).items():
        if k in FIELD_KEYS:
            st.session_state[FIELD_KEYS[k]] = "" if v is None else f"{v:g}"
    st.session_state["wi_vmem"] = "" if vmem is None else f"{vmem:g}"


def infeasible(x: dict, r: dict) -> None:
    """One error box: why it cannot run, the on-chip budget in MiB, and the nearest configurations that run."""
    m_ref, h_ref, key, vmem = refs(x)
    lines = [f"**This configuration cannot run.** {r['error']}"]
    if r.get("field") in VMEM_FIELDS:
        b = fit.onchip_budget(m_ref, h_ref, key, vmem)
        if b:
            lines.append(fit.budget_text(b))
    st.error("\n\n".join(lines))
    near = fit.nearest_valid(m_ref, h_ref, key, vmem, r.get("field", ""))
    if near:
        st.markdown("**Nearest configurations that run:**")
        for i, n in enumerate(near):
            a, b = st.columns([3, 1])
            a.markdown(f"- {n['change']}: {n['tokens_per_s']:,.0f} tokens/s")
            b.button("Use this", key=f"wi_near_{i}", on_click=apply, args=(n["key"], n["vmem_mib"]))


# ----- the page -----------------------------------------------------------------------------------

def render() -> None:
    st.header("What-if: where the decode step goes")
    x, errs = inputs()
    reason = "; ".join(errs) if errs else None
    r = None
    if x is not None:
        with st.spinner("Running the model..."):
            r = c.predict_cached(*refs(x), record=True)
        if "error" in r:
            infeasible(x, r)
            reason = "this configuration cannot run"
    good, stale = current_or_last("wi", x if reason is None else None, reason)
    if good is None:
        st.info("No valid configuration yet: fix the inputs above.")
    else:
        rg = c.predict_cached(*refs(good), record=True)
        headline(good, rg, stale)
        breakdown_section(good, rg, stale)
        timeline_section(good, stale)
    if x is not None and (r.get("field") in VMEM_FIELDS or "error" not in r):
        prefetch_section(x, None)  # live also when the on-chip budget is refused: it shows what fits
    elif good is not None:
        prefetch_section(good, stale)
    if good is not None:
        roofline_section(good, stale)


def headline(x: dict, r: dict, stale: str | None) -> None:
    k = dict(x["key"])
    rep = measured.reported(x["model"], x["hw"], k["engine"], k["devices"], k["context"], k["batch"],
                            k["draft_rows"], k["acceptance_length"])
    with maybe_stale(stale, "wi_head"):
        m = st.columns(6)
        m[0].metric("tokens/s (predicted)", f"{r['tokens_per_s']:,.0f}")
        if rep is not None:
            m[1].metric("reported tokens/s", f"{rep['tokens_per_s']:,.0f}",
                        delta=f"prediction {r['tokens_per_s'] / rep['tokens_per_s'] - 1:+.1%}", delta_color="off",
                        help=f"{rep['origin']} ({rep['source']})")
        else:
            m[1].metric("reported tokens/s", "none", help="No published or host measurement for exactly this deployment.")
        m[2].metric("step time", f"{r['step_s'] * 1e3:.3f} ms")
        m[3].metric("bound", r["bound"])
        m[4].metric("HBM floor", f"{r['hbm_floor_s'] * 1e3:.3f} ms")
        m[5].metric("HBM utilisation", f"{r['hbm_utilisation']:.0%}")
        if rep is not None:
            st.caption(f"Reported: {rep['tokens_per_s']:,.0f} tokens/s, {rep['origin']} ({rep['source']}).")
        summary = {kk: r[kk] for kk in ("tokens_per_s", "step_s", "bound", "hbm_floor_s", "compute_floor_s",
                                        "hbm_utilisation", "bytes_per_device")}
        summary.update({f"{kk}_s": v for kk, v in r["breakdown_s"].items()})
        c.downloads(pd.DataFrame([summary]), "whatif_prediction", "wi_pred_dl",
                    {"model": x["model"], "hardware": x["hw"], "vmem_mib": x["vmem"], "inputs": k})
        c.show_command(c.cli_predict(x["model"], x["hw"], x["key"], [k["batch"]], x["vmem"]))


# ----- breakdown ----------------------------------------------------------------------------------

@st.cache_resource(show_spinner=False, max_entries=64)
def breakdown_figure(m_ref, h_ref, key, vmem, engine) -> tuple[go.Figure, pd.DataFrame, dict]:
    r = c.predict_cached(m_ref, h_ref, key, vmem, record=True)  # the headline's prediction, not another run
    other = "multikernel" if engine == "megakernel" else "megakernel"
    # recorded like the selected engine's: switching the engine then runs nothing
    ro = c.predict_cached(m_ref, h_ref, c.with_key(key, engine=other), vmem, record=True)
    bars = {engine + " (selected)": r}
    if "error" not in ro:
        bars[other] = ro
    rows = [{"engine": label, "cause": cause, "label": c.CAUSE_LABELS.get(cause, cause), "time_ms": s * 1e3,
             "share_of_step": s / res["step_s"] if res["step_s"] else 0.0}
            for label, res in bars.items() for cause, s in res["breakdown_s"].items()]
    df = pd.DataFrame(rows)
    fig = go.Figure()
    for cause in c.CAUSE_LABELS:
        g = df[df["cause"] == cause]
        if g.empty or not (g["time_ms"] > 0).any():
            continue
        fig.add_trace(go.Bar(x=g["engine"], y=g["time_ms"], name=c.CAUSE_LABELS[cause],
                             marker_color=CAUSE_COLORS[cause], customdata=g["share_of_step"],
                             hovertemplate="%{x}<br>" + c.CAUSE_LABELS[cause] +
                             ": %{y:.4f} ms (%{customdata:.1%} of the step)<extra></extra>"))
    fig.update_layout(barmode="stack", yaxis_title="time per decode step (ms)", height=380,
                      legend=dict(orientation="h", y=-0.15))
    return fixed_margins(fig, left=80, right=20, bottom=40), df, ro


def breakdown_section(x: dict, r: dict, stale: str | None) -> None:
    st.subheader("Step-time breakdown")
    with maybe_stale(stale, "wi_bd"):
        with st.spinner("Running the other engine..."):
            fig, df, ro = breakdown_figure(*refs(x), x["engine"])
        st.plotly_chart(fig, key="wi_breakdown")
        if "error" not in ro:
            gain = ro["step_s"] - r["step_s"] if x["engine"] == "megakernel" else r["step_s"] - ro["step_s"]
            st.caption(f"Prefetch gain (multi-kernel step - megakernel step) at these settings: {gain * 1e3:.3f} ms.")
        else:
            other = "multikernel" if x["engine"] == "megakernel" else "megakernel"
            st.caption(f"{other} at these settings: {ro['error']}")
        c.downloads(df, "whatif_breakdown", "wi_bd_dl", {"inputs": dict(x["key"]), "model": x["model"],
                                                         "hardware": x["hw"], "vmem_mib": x["vmem"]})


# ----- timeline -----------------------------------------------------------------------------------

@st.cache_data(show_spinner=False, max_entries=64)
def timeline_lanes(m_ref: tuple, h_ref: tuple, key: tuple, vmem: float | None, lo: int, hi: int,
                   events: bool) -> dict:
    """Per lane, bars in us for layers lo..hi: one per event, or one per layer (its span, busy time in hover)."""
    ev = c.predict_cached(m_ref, h_ref, key, vmem, record=True)["events"]
    sel = (ev["layer"] >= lo) & (ev["layer"] <= hi)
    out = {}
    for lane in LANES:
        m = sel & (ev["lane"] == lane)
        if not m.any():
            continue
        t0, t1, layer = ev["t0_s"][m] * 1e6, ev["t1_s"][m] * 1e6, ev["layer"][m]
        if events:
            text = np.char.add(np.char.add(ev["name"][m], " (layer "), layer.astype(str))
            out[lane] = {"base": t0, "x": t1 - t0, "text": np.char.add(text, ")")}
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
        out[lane] = {"base": start, "x": end - start, "text": np.array(text)}
    return out


@st.cache_resource(show_spinner=False, max_entries=32)
def timeline_figure(m_ref, h_ref, key, vmem, lo: int, hi: int, events: bool) -> tuple[go.Figure, int]:
    lanes = timeline_lanes(m_ref, h_ref, key, vmem, lo, hi, events)
    n = sum(len(d["x"]) for d in lanes.values())
    fig = go.Figure()
    for lane, d in lanes.items():
        if n > WEBGL_MARKS:  # thousands of bars: one WebGL line per lane, a thick segment per bar
            xs = np.column_stack([d["base"], d["base"] + d["x"], np.full(len(d["x"]), np.nan)]).ravel()
            fig.add_trace(go.Scattergl(x=xs, y=[lane] * len(xs), mode="lines", name=lane,
                                       line=dict(color=LANE_COLORS[lane], width=18),
                                       hovertext=np.repeat(d["text"], 3), hoverinfo="text+x"))
        else:
            fig.add_trace(go.Bar(y=np.full(len(d["x"]), lane), x=d["x"], base=d["base"], orientation="h",
                                 name=lane, marker_color=LANE_COLORS[lane], marker_line_width=0.5,
                                 marker_line_color="white", hovertext=d["text"],
                                 hovertemplate="%{hovertext}<br>start %{base:.2f} us<br>length %{x:.3f} us"
                                 "<extra>" + lane + "</extra>"))
    fig.update_layout(barmode="overlay", xaxis_title="time in step (us)", height=260,
                      yaxis=dict(categoryorder="array", categoryarray=list(reversed(LANES))), showlegend=False)
    return fixed_margins(fig, left=75, right=20, bottom=60, top=20), n


@st.fragment
def timeline_section(x: dict, stale: str | None) -> None:
    st.subheader("Simulated step timeline (DMA / compute / link)")
    m_ref, h_ref, key, vmem = refs(x)
    r = c.predict_cached(m_ref, h_ref, key, vmem, record=True)
    layers = [row["layer"] for row in r["layers"]]
    with maybe_stale(stale, "wi_tl"):
        lo, hi = st.select_slider(f"Layers shown (a range of at most {EVENT_LAYERS} layers is drawn event by "
                                  "event)", options=layers, value=(layers[0], layers[-1]),
                                  key=f"wi_layers_{len(layers)}")  # another model: a fresh, whole range
        events = hi - lo + 1 <= EVENT_LAYERS
        with st.spinner("Drawing the timeline..."):
            fig, n = timeline_figure(m_ref, h_ref, key, vmem, lo, hi, events)
        st.plotly_chart(fig, key="wi_timeline", config={"scrollZoom": True})
        unit = "events" if events else "layer spans (one bar per layer and lane; narrow the range for events)"
        st.caption(f"{n} {unit} in layers {lo}..{hi}; drag to zoom, double-click to reset.")
        d1, d2 = st.columns(2)
        d1.download_button("Download Perfetto trace (JSON)", lambda: c.chrome_trace_json(m_ref, h_ref, key, vmem),
                           file_name="whatif_timeline.trace.json", mime="application/json", key="wi_trace_dl",
                           on_click="ignore")
        d2.download_button("Download events (CSV)", lambda: events_csv(m_ref, h_ref, key, vmem, lo, hi),
                           file_name="whatif_events.csv", mime="text/csv", key="wi_events_dl", on_click="ignore")
        c.show_command(c.cli_trace(x["model"], x["hw"], key, vmem))


def events_csv(m_ref, h_ref, key, vmem, lo, hi) -> str:
    df = pd.DataFrame(c.predict_cached(m_ref, h_ref, key, vmem, record=True)["events"])
    return c.csv_download(df[(df["layer"] >= lo) & (df["layer"] <= hi)])


# ----- prefetch sweep -----------------------------------------------------------------------------

def depths_for(hw, current_mib: float) -> tuple[float, ...]:
    """Ring-tile multiples up to the on-chip buffer, and the current depth."""
    tile = hw.dma_tile_bytes / c.MiB
    cap = hw.onchip_bytes / c.MiB
    ks = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 24, 32, 48, 64)
    return tuple(sorted({round(k * tile, 6) for k in ks if k * tile <= cap} | {round(current_mib, 6)}))


@st.cache_data(show_spinner=False, max_entries=128)
def sweep_rows(m_ref, h_ref, key, vmem) -> tuple[list[dict], dict | None, float]:
    """The sweep, each depth with its ring banks and expert slots; the saturation point; the current depth."""
    hw = c.resolve_hw(h_ref, vmem)
    current = dict(key)["prefetch_mib"] or hw.onchip_bytes / 2 / c.MiB
    rows, sat = c.prefetch_sweep(m_ref, h_ref, key, vmem, depths_for(hw, current))
    for row in rows:
        b = fit.onchip_budget(m_ref, h_ref, c.with_key(key, prefetch_mib=row["prefetch_mib"]), vmem)
        row.update(banks=b["banks"], expert_slots=b["slots"])
    return rows, sat, current


@st.cache_resource(show_spinner=False, max_entries=64)
def sweep_figure(m_ref, h_ref, key, vmem, log_x: bool) -> go.Figure:
    rows, sat, current = sweep_rows(m_ref, h_ref, key, vmem)
    ok = pd.DataFrame([r for r in rows if "step_s" in r])
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.55, 0.45], vertical_spacing=0.06,
                        specs=[[{"secondary_y": True}], [{}]])
    if ok.empty:
        return fig
    hover = ok[["tokens_per_s", "banks", "expert_slots"]].to_numpy()
    fig.add_trace(go.Scatter(x=ok["prefetch_mib"], y=ok["step_s"] * 1e3, mode="lines+markers", name="step time",
                             line=dict(color="#1f77b4"), customdata=hover,
                             hovertemplate="prefetch %{x:g} MiB: %{customdata[1]} ring banks, %{customdata[2]} "
                             "expert slots<br>step %{y:.4f} ms<br>%{customdata[0]:,.0f} tokens/s<extra></extra>"),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=ok["prefetch_mib"], y=ok["expert_slots"], mode="lines+markers", name="expert slots",
                             line=dict(color="#7f7f7f", dash="dot", shape="hv"), marker=dict(symbol="square", size=6),
                             hovertemplate="%{y} expert slots<extra></extra>"), row=1, col=1, secondary_y=True)
    cur = ok[np.isclose(ok["prefetch_mib"], current)]
    if not cur.empty:
        fig.add_trace(go.Scatter(x=cur["prefetch_mib"], y=cur["step_s"] * 1e3, mode="markers+text", name="current",
                                 marker=dict(size=15, symbol="diamond", color="#2ca02c", line=dict(width=1)),
                                 text=["current"], textposition="bottom center",
                                 hovertemplate="current depth %{x:g} MiB<br>step %{y:.4f} ms<extra></extra>"),
                      row=1, col=1)
    if sat:
        fig.add_trace(go.Scatter(x=[sat["prefetch_mib"]], y=[sat["step_s"] * 1e3], mode="markers+text",
                                 name="saturation", marker=dict(size=16, symbol="star", color="#d62728"),
                                 text=[f"saturates at {sat['prefetch_mib']:g} MiB"], textposition="top center",
                                 hovertemplate="gain saturates at %{x:g} MiB (within 1 % of the best depth)"
                                 "<br>step %{y:.4f} ms<extra></extra>"), row=1, col=1)
    for cause, label in c.CAUSE_LABELS.items():
        col = f"{cause}_s"
        if col in ok and (ok[col] > 0).any():
            fig.add_trace(go.Bar(x=ok["prefetch_mib"], y=ok[col] * 1e3, name=label, marker_color=CAUSE_COLORS[cause],
                                 hovertemplate="prefetch %{x:g} MiB<br>" + label + ": %{y:.4f} ms<extra></extra>"),
                          row=2, col=1)
    xaxis = dict(type="log", title="prefetch depth (MiB of weight ring per core, log)") if log_x else dict(
        title="prefetch depth (MiB of weight ring per core)")
    fig.update_layout(barmode="stack", height=560, legend=dict(orientation="h", y=-0.14))
    fig.update_xaxes(**xaxis, row=2, col=1)
    fig.update_yaxes(title_text="step time (ms)", row=1, col=1)
    top = int(ok["expert_slots"].max())
    fig.update_yaxes(title_text="expert slots", secondary_y=True, row=1, col=1, showgrid=False,
                     range=[0, top * 1.15 + 0.5], tick0=0, dtick=max(1, math.ceil(top / 5)))
    fig.update_yaxes(title_text="time by cause (ms)", row=2, col=1)
    return fixed_margins(fig, left=80, right=80, bottom=60)


def bend_explanation(rows: list[dict], sat: dict | None, current: float, hw) -> str | None:
    """Why the step time rises past the best depth: the cause that grows and its mechanism."""
    ok = [r for r in rows if "step_s" in r]
    if not ok or sat is None:
        return None
    best = min(ok, key=lambda r: r["step_s"])
    worse = [r for r in ok if r["prefetch_mib"] > best["prefetch_mib"] and r["step_s"] > best["step_s"] * 1.01]
    if not worse:
        return None
    w = max(worse, key=lambda r: r["step_s"])
    grow = {k: w.get(f"{k}_s", 0.0) - best.get(f"{k}_s", 0.0) for k in c.CAUSE_LABELS}
    cause = max(grow, key=grow.get)
    sharing = ("shares its bandwidth equally among all outstanding copies" if hw.dma_sharing == "shared"
               else "serves copies in the order they were issued")
    why = {"expert_fetch": (f"the ring takes the {hw.onchip_kind} the expert buffers need: {best['expert_slots']} "
                            f"expert slots at {best['prefetch_mib']:g} MiB, {w['expert_slots']} at "
                            f"{w['prefetch_mib']:g} MiB; the expert copies after routing share the DMA engine with the "
                            "ring, so how many are in flight changes when they land"),
           "weight_streaming": (f"a ring of {w['banks']} tiles issues weights for layers far ahead; the DMA engine "
                                f"{sharing} (dma_sharing = {hw.dma_sharing}), so the tile needed next, and each "
                                "layer's expert and KV copies, wait behind tiles for later layers")}
    text = why.get(cause, f"{c.CAUSE_LABELS[cause]} grows")
    return (f"Deeper than {best['prefetch_mib']:g} MiB the step gets slower: at {w['prefetch_mib']:g} MiB it is "
            f"{(w['step_s'] - best['step_s']) * 1e3:+.3f} ms, mostly {c.CAUSE_LABELS[cause]} "
            f"({grow[cause] * 1e3:+.3f} ms): {text}.")


@st.fragment
def prefetch_section(x: dict, stale: str | None) -> None:
    st.subheader("Step time vs prefetch depth")
    if x["engine"] != "megakernel":
        st.info("The prefetch depth is a megakernel setting (a multi-kernel engine cannot prefetch across "
                "kernel boundaries): select the megakernel engine to sweep it.")
        return
    m_ref, h_ref, key, vmem = refs(x)
    hw = c.resolve_hw(h_ref, vmem)
    with maybe_stale(stale, "wi_pf"), st.spinner("Sweeping the prefetch depth..."):
        rows, sat, current = sweep_rows(m_ref, h_ref, key, vmem)
        ok = [r for r in rows if "step_s" in r]
        c.init(wi_pf_logx=False)
        far = current > 64 * hw.dma_tile_bytes / c.MiB  # beyond the tile multiples: only a log axis shows both
        log_x = st.toggle("Log depth axis", key="wi_pf_logx", disabled=far) or far
        if ok:
            st.plotly_chart(sweep_figure(m_ref, h_ref, key, vmem, log_x), key="wi_prefetch_chart")
        bad = [r for r in rows if "error" in r]
        b = fit.onchip_budget(m_ref, h_ref, key, vmem)
        if sat:
            st.caption(f"The gain saturates at **{sat['prefetch_mib']:g} MiB** (smallest depth within 1 % of the "
                       f"best step time swept). Green diamond: the current depth ({current:g} MiB). Hover a point "
                       "for its ring banks and expert slots; the bars below split each depth's step by cause.")
        why = bend_explanation(rows, sat, current, hw)
        if why:
            st.info(why)
        if bad and b:
            deepest = max((r["prefetch_mib"] for r in ok), default=None)
            st.caption(f"{len(bad)} depth(s) do not fit in {hw.onchip_kind} {b['onchip_mib']:g} MiB beside "
                       f"{b['slots'] if dict(key)['expert_slots'] else 'one'} {b['expert_mib']:.2f} MiB expert "
                       "buffer(s): "
                       + ", ".join(f"{r['prefetch_mib']:g}" for r in bad) + " MiB"
                       + (f" (deepest that fits: {deepest:g} MiB)." if deepest else "."))
        if not ok and b:
            n = dict(key)["expert_slots"] or 1
            st.warning(f"No prefetch depth fits: the smallest ring (one {b['tile_mib']:g} MiB tile) and {n} "
                       f"{b['expert_mib']:.2f} MiB expert buffer(s) need {b['tile_mib'] + n * b['expert_mib']:.2f} MiB "
                       f"of {hw.onchip_kind}; this core has {b['onchip_mib']:g} MiB.")
        df = pd.DataFrame(rows)
        c.downloads(df, "whatif_prefetch_sweep", "wi_pf_dl", {"saturation": sat, "model": x["model"],
                                                               "hardware": x["hw"], "current_mib": current})
        c.show_command(c.cli_sweep(x["model"], x["hw"], key, [r["prefetch_mib"] for r in rows], vmem))


# ----- roofline -----------------------------------------------------------------------------------

@st.cache_resource(show_spinner=False, max_entries=32)
def roofline_figure(m_ref, h_ref, key, vmem) -> tuple[go.Figure, pd.DataFrame]:
    r = c.predict_cached(m_ref, h_ref, key, vmem, record=True)
    hw = c.resolve_hw(h_ref, vmem)
    df = pd.DataFrame(r["layers"])
    df["bytes"] = df[["static_bytes", "routed_bytes", "kv_bytes", "act_bytes"]].sum(axis=1)
    df["intensity_flops_per_byte"] = df["flops"] / df["bytes"].where(df["bytes"] > 0)
    df["achieved_flops_per_s"] = df["flops"] / df["time_s"].where(df["time_s"] > 0)
    bw, peaks = hw.core_hbm_bandwidth_bytes_per_s, hw.core_flops_per_s
    pts = df[df["intensity_flops_per_byte"].notna() & df["achieved_flops_per_s"].gt(0)]
    lo = max(1e-3, float(pts["intensity_flops_per_byte"].min()) / 4) if not pts.empty else 0.01
    hi = max(float(pts["intensity_flops_per_byte"].max()) * 4 if not pts.empty else 1e3, max(peaks.values()) / bw * 4)
    fig = go.Figure()
    roof_dash = ("dot", "dash", "dashdot", "longdash")
    for i, (dt, peak) in enumerate(sorted(peaks.items(), key=lambda kv: kv[1])):
        xs = np.array(sorted({lo, min(max(peak / bw, lo), hi), hi}))  # straight in log-log: the ridge and the ends
        fig.add_trace(go.Scatter(x=xs, y=np.minimum(peak, bw * xs) / 1e12, mode="lines", name=f"roof ({dt})",
                                 line=dict(dash=roof_dash[i % 4], color="#555555", width=1.5),
                                 hovertemplate=f"{dt} peak {peak / 1e12:,.0f} TFLOP/s, HBM {bw / 1e12:.2f} TB/s"
                                 "<br>%{x:.3g} FLOP/byte: %{y:.3g} TFLOP/s<extra></extra>"))
    for i, (kind, g) in enumerate(pts.groupby("kind")):
        fig.add_trace(go.Scatter(x=g["intensity_flops_per_byte"], y=g["achieved_flops_per_s"] / 1e12, mode="markers",
                                 name=f"{kind} layers", marker=dict(color=KIND_COLORS[i % len(KIND_COLORS)], size=8),
                                 customdata=np.column_stack([g["layer"], g["time_s"] * 1e6, g["flops"] / 1e9,
                                                             g["bytes"] / c.MiB]),
                                 hovertemplate="layer %{customdata[0]}<br>%{x:.3g} FLOP/byte<br>%{y:.3g} TFLOP/s"
                                 "<br>time %{customdata[1]:.2f} us<br>%{customdata[2]:.3g} GFLOP, "
                                 "%{customdata[3]:.3g} MiB<extra>" + kind + "</extra>"))
    tot_f, tot_b = df["flops"].sum(), r["bytes_per_device"]
    if tot_b > 0 and r["step_s"] > 0:
        fig.add_trace(go.Scatter(x=[tot_f / tot_b], y=[tot_f / r["step_s"] / 1e12], mode="markers", name="whole step",
                                 marker=dict(size=14, symbol="star", color="black"),
                                 hovertemplate="whole step<br>%{x:.3g} FLOP/byte<br>%{y:.3g} TFLOP/s<extra></extra>"))
    decades = dict(type="log", dtick=1, tickformat="~g")  # labels at 0.1, 1, 10, ... only
    fig.update_layout(xaxis=dict(title="arithmetic intensity (FLOP per HBM byte)", **decades),
                      yaxis=dict(title="achieved TFLOP/s per device", **decades),
                      height=440)
    return fixed_margins(fig, left=90, right=20, bottom=60), df


@st.fragment
def roofline_section(x: dict, stale: str | None) -> None:
    st.subheader("Roofline (per device, per layer)")
    with maybe_stale(stale, "wi_roof"):
        fig, df = roofline_figure(*refs(x))
        st.plotly_chart(fig, key="wi_roofline")
        st.caption("A layer's point is its FLOPs and HBM bytes over its time in the step. With the megakernel a "
                   "layer can sit above the HBM roof: part of its weights streamed in during earlier layers "
                   "(prefetch across layer boundaries). Far below the roofs: the layer waits on collectives or "
                   "launches.")
        cols = ["layer", "kind", "time_s", "compute_s", "stall_s", "collective_s", "overhead_s", "flops",
                "static_bytes", "routed_bytes", "kv_bytes", "act_bytes", "intensity_flops_per_byte",
                "achieved_flops_per_s"]
        with st.expander("Per-layer table"):
            st.dataframe(df[cols], hide_index=True, key="wi_layers_table")
        c.downloads(df[cols], "whatif_layers", "wi_layers_dl", {"model": x["model"], "hardware": x["hw"]})
