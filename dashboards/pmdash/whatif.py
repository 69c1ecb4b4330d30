"""What-if view: tune prefetch depth, expert slots, VMEM, batch, context, engine, acceptance length."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from . import common as c

LANES = ("dma", "compute", "link")
LANE_COLORS = {"dma": "#ff7f0e", "compute": "#1f77b4", "link": "#2ca02c"}
CAUSE_COLORS = {"weight_streaming": "#ff7f0e", "expert_fetch": "#ffbb78", "collective": "#2ca02c",
                "launch": "#9467bd", "fill_drain": "#c5b0d5", "compute": "#1f77b4", "draft": "#8c564b"}
ENGINES = ("megakernel", "multikernel")


def inputs() -> dict:
    models, hws = c.model_options(), c.hardware_options()
    c.init(wi_model="kimi-k3", wi_hw="tpu-v7", wi_engine="megakernel", wi_batch=1, wi_devices=32, wi_tp=32, wi_ep=8,
           wi_context=4096, wi_spec=False, wi_draft=c.SPEC_DRAFT_ROWS)
    st.header("What-if: where the decode step goes")
    r1 = st.columns(4)
    model = r1[0].selectbox("Model", models, key="wi_model")
    hw = r1[1].selectbox("Hardware", hws, key="wi_hw")
    engine = r1[2].radio("Engine", ENGINES, horizontal=True, key="wi_engine")
    batch = r1[3].select_slider("Batch", list(c.BATCHES), key="wi_batch")
    r2 = st.columns(4)
    devices = r2[0].number_input("Devices", 1, 4096, key="wi_devices")
    tp = r2[1].number_input("TP", 1, 4096, key="wi_tp")
    ep = r2[2].number_input("EP groups", 1, 4096, key="wi_ep")
    context = r2[3].number_input("Context (tokens in cache)", 0, 4_000_000, step=1024, key="wi_context")
    r3 = st.columns(4)
    hw_spec = c.load_hardware_ref(c.hardware_ref(hw))
    onchip = hw_spec.onchip_bytes / c.MiB
    prefetch = r3[0].number_input("Prefetch depth (MiB)", min_value=0.5, max_value=1e6, value=None, step=4.0,
                                  placeholder=f"default: half the {hw_spec.onchip_kind}",
                                  help="Megakernel weight ring size (Deployment.prefetch_bytes).",
                                  key="wi_prefetch")
    slots = r3[1].number_input("Expert slots", min_value=1, max_value=4096, value=None, step=1,
                               placeholder="default: as many as fit (<= top-k)",
                               help="Megakernel expert buffers (Deployment.expert_slots).", key="wi_slots")
    vmem = r3[2].number_input(f"{hw_spec.onchip_kind} per core (MiB)", min_value=0.5, max_value=1e6,
                              value=None, step=8.0, placeholder=f"preset: {onchip:g} MiB",
                              help="On-chip buffer per core (Hardware.onchip_bytes).", key="wi_vmem")
    with r3[3]:
        spec = st.toggle("Speculative decoding", key="wi_spec")
        draft = st.number_input("Draft rows", 1, 64, key="wi_draft", disabled=not spec)
        acc = st.slider("Acceptance length (tokens / step)", 1.0, float(draft) + 1, min(c.SPEC_ACCEPTANCE, draft + 1.0),
                        step=0.5, key="wi_acc", disabled=not spec)
    key = c.dep_key(devices, tp, ep, engine, batch=batch, context=context, prefetch_mib=prefetch,
                    expert_slots=slots, draft_rows=draft if spec else 0, acceptance_length=acc if spec else None)
    return dict(model=model, hw=hw, key=key, vmem=vmem, hw_spec=hw_spec, engine=engine)


def render() -> None:
    x = inputs()
    m_ref, h_ref, key, vmem = c.model_ref(x["model"]), c.hardware_ref(x["hw"]), x["key"], x["vmem"]
    r = c.predict_cached(m_ref, h_ref, key, vmem, record=True)
    cmd = c.cli_predict(x["model"], x["hw"], key, [dict(key)["batch"]], vmem)
    if "error" in r:
        st.error(f"This configuration cannot run: {r['error']}")
        c.show_command(cmd)
        return
    hw = x["hw_spec"] if vmem is None else x["hw_spec"].replace(onchip_bytes=vmem * c.MiB)
    m = st.columns(5)
    m[0].metric("tokens/s", f"{r['tokens_per_s']:,.0f}")
    m[1].metric("step time", f"{r['step_s'] * 1e3:.3f} ms")
    m[2].metric("bound", r["bound"])
    m[3].metric("HBM floor", f"{r['hbm_floor_s'] * 1e3:.3f} ms")
    m[4].metric("HBM utilisation", f"{r['hbm_utilisation']:.0%}")
    summary = {k: r[k] for k in ("tokens_per_s", "step_s", "bound", "hbm_floor_s", "compute_floor_s",
                                 "hbm_utilisation", "bytes_per_device")}
    summary.update({f"{k}_s": v for k, v in r["breakdown_s"].items()})
    c.downloads(pd.DataFrame([summary]), "whatif_prediction", "wi_pred_dl",
                {"model": x["model"], "hardware": x["hw"], "vmem_mib": vmem, "inputs": dict(key)})
    c.show_command(cmd)
    breakdown(x, r)
    timeline(x, r)
    prefetch(x, hw)
    roofline(x, r, hw)


def breakdown(x: dict, r: dict) -> None:
    st.subheader("Step-time breakdown")
    other = "multikernel" if x["engine"] == "megakernel" else "megakernel"
    ro = c.predict_cached(c.model_ref(x["model"]), c.hardware_ref(x["hw"]), c.with_key(x["key"], engine=other),
                          x["vmem"])
    bars = {x["engine"] + " (selected)": r}
    if "error" not in ro:
        bars[other] = ro
    rows = []
    for label, res in bars.items():
        for cause, s in res["breakdown_s"].items():
            rows.append({"engine": label, "cause": cause, "label": c.CAUSE_LABELS.get(cause, cause),
                         "time_ms": s * 1e3, "share_of_step": s / res["step_s"] if res["step_s"] else 0.0})
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
                      margin=dict(t=30), legend=dict(orientation="h", y=-0.15))
    st.plotly_chart(fig, key="wi_breakdown")
    if "error" not in ro:
        gain = ro["step_s"] - r["step_s"] if x["engine"] == "megakernel" else r["step_s"] - ro["step_s"]
        st.caption(f"Prefetch gain (multi-kernel step - megakernel step) at these settings: {gain * 1e3:.3f} ms.")
    else:
        st.caption(f"{other} at these settings: {ro['error']}")
    c.downloads(df, "whatif_breakdown", "wi_bd_dl", {"inputs": dict(x["key"]), "model": x["model"],
                                                     "hardware": x["hw"], "vmem_mib": x["vmem"]})


@st.cache_data(show_spinner=False, max_entries=64)
def timeline_lanes(m_ref: tuple, h_ref: tuple, key: tuple, vmem: float | None, lo: int, hi: int) -> dict:
    """Per lane: bar starts and lengths (us) and hover texts for layers lo..hi, as numpy arrays."""
    ev = c.predict_cached(m_ref, h_ref, key, vmem, record=True)["events"]
    sel = (ev["layer"] >= lo) & (ev["layer"] <= hi)
    out = {}
    for lane in LANES:
        m = sel & (ev["lane"] == lane)
        if not m.any():
            continue
        t0, t1 = ev["t0_s"][m] * 1e6, ev["t1_s"][m] * 1e6
        text = np.char.add(np.char.add(ev["name"][m], " (layer "), ev["layer"][m].astype(str))
        out[lane] = {"base": t0, "x": t1 - t0, "text": np.char.add(text, ")"), "layer": ev["layer"][m]}
    return out


def timeline(x: dict, r: dict) -> None:
    st.subheader("Simulated step timeline (DMA / compute / link)")
    layers = [row["layer"] for row in r["layers"]]
    lo, hi = st.select_slider("Layers shown", options=layers, value=(layers[0], layers[-1]), key="wi_layers")
    m_ref, h_ref = c.model_ref(x["model"]), c.hardware_ref(x["hw"])
    lanes = timeline_lanes(m_ref, h_ref, x["key"], x["vmem"], lo, hi)
    fig = go.Figure()
    for lane, d in lanes.items():
        fig.add_trace(go.Bar(y=np.full(len(d["x"]), lane), x=d["x"], base=d["base"], orientation="h", name=lane,
                             marker_color=LANE_COLORS[lane], marker_line_width=0, hovertext=d["text"],
                             hovertemplate="%{hovertext}<br>start %{base:.2f} us<br>duration %{x:.3f} us"
                             "<extra>" + lane + "</extra>"))
    fig.update_layout(barmode="overlay", xaxis_title="time in step (us)", height=280, margin=dict(t=30),
                      yaxis=dict(categoryorder="array", categoryarray=list(reversed(LANES))),
                      showlegend=False)
    st.plotly_chart(fig, key="wi_timeline", config={"scrollZoom": True})
    n = sum(len(d["x"]) for d in lanes.values())
    st.caption(f"{n} events in layers {lo}..{hi}; drag to zoom, double-click to reset.")
    c1, c2 = st.columns(2)
    args = (m_ref, h_ref, x["key"], x["vmem"])
    c1.download_button("Download Perfetto trace (JSON)", lambda: c.chrome_trace_json(*args),
                       file_name="whatif_timeline.trace.json", mime="application/json", key="wi_trace_dl")
    c2.download_button("Download events (CSV)", lambda: events_csv(*args, lo, hi), file_name="whatif_events.csv",
                       mime="text/csv", key="wi_events_dl")
    st.caption("Reproduce with the CLI:")
    st.code(c.cli_trace(x["model"], x["hw"], x["key"], x["vmem"]), language="bash")


def events_csv(m_ref, h_ref, key, vmem, lo, hi) -> str:
    ev = c.predict_cached(m_ref, h_ref, key, vmem, record=True)["events"]
    df = pd.DataFrame(ev)
    return df[(df["layer"] >= lo) & (df["layer"] <= hi)].to_csv(index=False)


def depths_for(hw) -> tuple[float, ...]:
    tile = hw.dma_tile_bytes / c.MiB
    cap = hw.onchip_bytes / c.MiB
    ks = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 24, 32)
    return tuple(sorted({round(k * tile, 6) for k in ks if k * tile <= cap}))


def prefetch(x: dict, hw) -> None:
    st.subheader("Step time vs prefetch depth")
    if x["engine"] != "megakernel":
        st.info("The prefetch depth is a megakernel setting (a multi-kernel engine cannot prefetch across "
                "kernel boundaries): select the megakernel engine to sweep it.")
        return
    depths = depths_for(hw)
    rows, sat = c.prefetch_sweep_cached(c.model_ref(x["model"]), c.hardware_ref(x["hw"]), x["key"], x["vmem"], depths)
    df = pd.DataFrame(rows)
    ok = df[df["step_s"].notna()] if "step_s" in df else df.iloc[0:0]
    fig = go.Figure()
    if not ok.empty:
        fig.add_trace(go.Scatter(x=ok["prefetch_mib"], y=ok["step_s"] * 1e3, mode="lines+markers",
                                 name="step time", customdata=ok["tokens_per_s"],
                                 hovertemplate="prefetch %{x:g} MiB<br>step %{y:.4f} ms<br>%{customdata:,.0f} "
                                 "tokens/s<extra></extra>"))
    if sat:
        fig.add_trace(go.Scatter(x=[sat["prefetch_mib"]], y=[sat["step_s"] * 1e3], mode="markers+text",
                                 name="saturation", marker=dict(size=16, symbol="star", color="#d62728"),
                                 text=[f"saturates at {sat['prefetch_mib']:g} MiB"], textposition="top right",
                                 hovertemplate="gain saturates at %{x:g} MiB (within 1 % of the best depth)"
                                 "<br>step %{y:.4f} ms<extra></extra>"))
        fig.add_vline(x=sat["prefetch_mib"], line_dash="dot", line_color="#d62728")
    fig.update_layout(xaxis_title="prefetch depth (MiB of weight ring per core)", yaxis_title="step time (ms)",
                      height=360, margin=dict(t=30), showlegend=False)
    st.plotly_chart(fig, key="wi_prefetch_chart")
    if sat:
        st.caption(f"The gain saturates at **{sat['prefetch_mib']:g} MiB** (smallest depth within 1 % of the best "
                   f"step time swept).")
    bad = df[df["error"].notna()] if "error" in df else df.iloc[0:0]
    if not bad.empty:
        st.warning("Depths that do not fit: " + "; ".join(f"{r.prefetch_mib:g} MiB: {r.error}"
                                                            for r in bad.itertuples()))
    c.downloads(df, "whatif_prefetch_sweep", "wi_pf_dl", {"saturation": sat, "model": x["model"], "hardware": x["hw"]})
    c.show_command(c.cli_sweep(x["model"], x["hw"], x["key"], depths, x["vmem"]))


def roofline(x: dict, r: dict, hw) -> None:
    st.subheader("Roofline (per device, per layer)")
    df = pd.DataFrame(r["layers"])
    df["bytes"] = df[["static_bytes", "routed_bytes", "kv_bytes", "act_bytes"]].sum(axis=1)
    df["intensity_flops_per_byte"] = df["flops"] / df["bytes"].where(df["bytes"] > 0)
    df["achieved_flops_per_s"] = df["flops"] / df["time_s"].where(df["time_s"] > 0)
    bw = hw.core_hbm_bandwidth_bytes_per_s
    peaks = hw.core_flops_per_s
    pts = df[df["intensity_flops_per_byte"].notna() & df["achieved_flops_per_s"].gt(0)]
    lo = max(1e-3, float(pts["intensity_flops_per_byte"].min()) / 4) if not pts.empty else 0.01
    hi = max(float(pts["intensity_flops_per_byte"].max()) * 4 if not pts.empty else 1e3,
             max(peaks.values()) / bw * 4)
    xs = np.geomspace(lo, hi, 200)
    fig = go.Figure()
    for dt, peak in sorted(peaks.items(), key=lambda kv: kv[1]):
        fig.add_trace(go.Scatter(x=xs, y=np.minimum(peak, bw * xs), mode="lines", name=f"roof ({dt})",
                                 line=dict(dash="dot"),
                                 hovertemplate=f"{dt} peak {peak / 1e12:.0f} TFLOP/s, HBM {bw / 1e9:.0f} GB/s"
                                 "<br>%{x:.3g} FLOP/byte -> %{y:.3g} FLOP/s<extra></extra>"))
    for kind, g in pts.groupby("kind"):
        fig.add_trace(go.Scatter(x=g["intensity_flops_per_byte"], y=g["achieved_flops_per_s"], mode="markers",
                                 name=f"{kind} layers",
                                 customdata=g[["layer", "time_s", "flops", "bytes"]].to_numpy(),
                                 hovertemplate="layer %{customdata[0]}<br>%{x:.3g} FLOP/byte<br>%{y:.3g} FLOP/s"
                                 "<br>time %{customdata[1]:.3e} s<br>%{customdata[2]:.3e} FLOP, "
                                 "%{customdata[3]:.3e} bytes<extra>" + kind + "</extra>"))
    tot_f, tot_b = df["flops"].sum(), r["bytes_per_device"]
    if tot_b > 0 and r["step_s"] > 0:
        fig.add_trace(go.Scatter(x=[tot_f / tot_b], y=[tot_f / r["step_s"]], mode="markers", name="whole step",
                                 marker=dict(size=14, symbol="star", color="black"),
                                 hovertemplate="whole step<br>%{x:.3g} FLOP/byte<br>%{y:.3g} FLOP/s<extra></extra>"))
    fig.update_layout(xaxis=dict(type="log", title="arithmetic intensity (FLOP per HBM byte)"),
                      yaxis=dict(type="log", title="achieved FLOP/s per device"), height=420, margin=dict(t=30))
    st.plotly_chart(fig, key="wi_roofline")
    st.caption("A layer's point is its FLOPs and HBM bytes over its time in the step. With the megakernel a layer "
               "can sit above the HBM roof: part of its weights streamed in during earlier layers (prefetch "
               "across layer boundaries). Far below the roofs: the layer waits on collectives or launches.")
    cols = ["layer", "kind", "time_s", "compute_s", "stall_s", "collective_s", "overhead_s", "flops",
            "static_bytes", "routed_bytes", "kv_bytes", "act_bytes", "intensity_flops_per_byte",
            "achieved_flops_per_s"]
    with st.expander("Per-layer table"):
        st.dataframe(df[cols], hide_index=True, key="wi_layers_table")
    c.downloads(df[cols], "whatif_layers", "wi_layers_dl", {"model": x["model"], "hardware": x["hw"]})
