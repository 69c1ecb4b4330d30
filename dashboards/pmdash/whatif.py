"""What-if view: tune prefetch depth, expert slots, VMEM, batch, context, engine (with a GPU serving
engine's kernels and the KV cache format), steps per call, speculative decoding.

Inputs are strict text fields; a bad one keeps the outputs of the last valid inputs, greyed out.
The headline (predicted tokens/s beside a measurement only when one matches every setting) sits
above five lazy tabs, one picture and one question each: where the step goes, which ring and
expert slots to pick, what the prefetch depth does, when each op runs, how close to the roofs.
Only the open tab runs and is drawn, so an input change redraws the headline and one chart.
A configuration the model refuses shows its on-chip budget in MiB and the nearest ones that run,
and the ring x slots map and the prefetch sweep (what fits) stay live.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from perfmodel.search.batch import evaluate

from . import charts
from . import common as c
from . import fit, measured
from .charts import color, fixed_margins
from .inputs import current_or_last, maybe_stale, number_field

KIND_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
ENGINES = ("megakernel", "multikernel")
VMEM_FIELDS = ("prefetch_bytes", "expert_slots", "onchip_bytes")
FIELD_KEYS = {"devices": "wi_devices", "tp": "wi_tp", "ep": "wi_ep", "batch": "wi_batch", "context": "wi_context",
              "prefetch_mib": "wi_prefetch", "expert_slots": "wi_slots", "steps_per_call": "wi_steps"}
TABS = ("Step breakdown", "Ring x expert slots", "Prefetch depth", "Timeline", "Roofline")
HEAT_METRICS = {"tokens/s": ("tokens_per_s", "Viridis"), "step time (ms)": ("step_ms", "Viridis_r")}  # column, colours


# ----- inputs -------------------------------------------------------------------------------------

def inputs() -> tuple[dict | None, list[str]]:
    models, hws = c.model_options(), c.hardware_options()
    tpu = c.CANONICAL["tpu-v7"]
    c.init(wi_model="kimi-k3", wi_hw="tpu-v7", wi_engine=tpu["engine"], wi_batch="1", wi_devices=str(tpu["devices"]),
           wi_tp=str(tpu["tp"]), wi_ep=str(tpu["ep"]), wi_context="4096", wi_steps=str(tpu["steps_per_call"]),
           wi_prefetch="", wi_slots="", wi_vmem="", wi_spec=False, wi_draft="7", wi_tab=TABS[0])
    errs: list[str] = []
    r1 = st.columns(4)
    model = r1[0].selectbox("Model", models, key="wi_model")
    hw = r1[1].selectbox("Hardware", hws, key="wi_hw")
    engine = r1[2].radio("Engine", ENGINES, horizontal=True, key="wi_engine")
    batch = number_field(r1[3], "Batch (sequences)", "wi_batch", errors=errs)
    r2 = st.columns(5)
    devices = number_field(r2[0], "Devices", "wi_devices", errors=errs)
    tp = number_field(r2[1], "TP", "wi_tp", errors=errs)
    ep = number_field(r2[2], "EP groups", "wi_ep", errors=errs)
    context = number_field(r2[3], "Context (tokens in cache)", "wi_context", lo=0, hi=10_000_000, errors=errs)
    steps = number_field(r2[4], "Steps per device call", "wi_steps", lo=1, hi=4096, errors=errs,
                         help="Decode steps one device call runs; its per-call cost is shared by them "
                              "(Deployment.steps_per_call; the published TPU runs: 64, with spec decode 24).")
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
        draft = acc = None
        if spec:  # its settings only when it is on (the page stays short)
            a, b = st.columns(2)
            draft = number_field(a, "Draft rows", "wi_draft", lo=1, hi=64, errors=errs)
            top = float(draft or c.SPEC_DRAFT_ROWS) + 1
            if "wi_acc" in st.session_state and st.session_state["wi_acc"] > top:
                st.session_state["wi_acc"] = top
            acc = b.slider("Acceptance length", 1.0, top, min(c.SPEC_ACCEPTANCE, top), step=0.5, key="wi_acc",
                           help="Tokens accepted per verification step (tau).")
    serving, kv = c.kernel_choices(*st.columns(2), hw, engine, "wi")
    if errs:
        return None, errs
    key = c.dep_key(devices, tp, ep, engine, batch=batch, context=context, prefetch_mib=prefetch,
                    expert_slots=slots, draft_rows=draft if spec else 0, acceptance_length=acc if spec else None,
                    steps_per_call=steps, serving_engine=serving, kv_cache=kv)
    return dict(model=model, hw=hw, key=key, vmem=vmem, engine=engine), []


def refs(x: dict) -> tuple:
    return c.model_ref(x["model"]), c.hardware_ref(x["hw"]), x["key"], x["vmem"]


@c.callback
def apply(key: tuple, vmem: float | None) -> None:
    """Button callback: put a suggested configuration into the fields."""
    for k, v in dict(key).items():
        if k in FIELD_KEYS:
            st.session_state[FIELD_KEYS[k]] = "" if v is None else f"{v:g}"
    st.session_state["wi_vmem"] = "" if vmem is None else f"{vmem:g}"


@c.callback
def apply_measured(row: dict) -> None:
    """Button callback: the settings of a measurement (those it leaves out: the defaults)."""
    val = lambda k, d: d if measured._value(row, k) is None else measured._value(row, k)
    devices = int(val("devices", int(st.session_state["wi_devices"] or 1)))
    for k, v in (("devices", devices), ("tp", int(val("tp", devices))), ("ep", int(val("ep", devices))),
                 ("batch", int(row["batch"])), ("context", int(val("context", 4096))),
                 ("steps_per_call", int(val("steps_per_call", 1)))):
        st.session_state[FIELD_KEYS[k]] = str(v)
    st.session_state["wi_engine"] = row["engine"]
    st.session_state["wi_serving"] = row.get("serving_engine") or c.GENERIC
    st.session_state["wi_kv"] = row.get("kv_cache") or c.MODEL_KV
    for k, field in (("prefetch_mib", "wi_prefetch"), ("expert_slots", "wi_slots"), ("vmem_mib", "wi_vmem")):
        st.session_state[field] = "" if measured._value(row, k) is None else f"{measured._value(row, k):g}"
    draft = int(val("draft_rows", 0))
    st.session_state["wi_spec"] = draft > 0
    if draft:
        st.session_state["wi_draft"] = str(draft)
        st.session_state["wi_acc"] = float(val("acceptance_length", c.SPEC_ACCEPTANCE))


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
            r = c.predict_cached(*refs(x))
        if "error" in r:
            infeasible(x, r)
            reason = "this configuration cannot run"
    good, stale = current_or_last("wi", x if reason is None else None, reason)
    if good is None:
        st.info("No valid configuration yet: fix the inputs above.")
        return
    rg = c.predict_cached(*refs(good))
    rep = headline(good, rg, stale)
    # the ring x slots map and the prefetch sweep stay live for an on-chip budget error: they show what fits
    live = x if x is not None and r.get("field") in VMEM_FIELDS else good
    sections = {TABS[0]: lambda: breakdown_section(good, stale), TABS[1]: lambda: heat_section(live, stale if live is good else None),
                TABS[2]: lambda: prefetch_section(live, stale if live is good else None),
                TABS[3]: lambda: timeline_section(good, stale), TABS[4]: lambda: roofline_section(good, stale)}
    for tab, name in zip(st.tabs(TABS, key="wi_tab", on_change="rerun"), TABS):
        if tab.open:
            with tab:
                sections[name]()
    headline_files(good, rg, rep, stale)


def deployment_settings(x: dict) -> tuple[dict, dict | None]:
    """The deployment's settings as measurements state them (ring, slots, VMEM as resolved; megakernel
    only) and the values the model's KV cache and the on-chip settings resolve to by default."""
    m_ref, h_ref, key, vmem = refs(x)
    mine, defaults = measured.settings(x["model"], x["hw"], key, c.load_model_ref(m_ref).formats["kv_cache"].name)
    if dict(key)["engine"] != "megakernel":
        return mine, defaults
    b = fit.onchip_budget(m_ref, h_ref, key, vmem)
    b0 = fit.onchip_budget(m_ref, h_ref, c.with_key(key, prefetch_mib=None, expert_slots=None), None)
    if not (b and b0):
        return mine, defaults
    resolved = lambda bb: {"prefetch_mib": bb["ring_mib"], "expert_slots": bb["slots"], "vmem_mib": bb["onchip_mib"]}
    return mine | resolved(b), defaults | resolved(b0)


def headline(x: dict, r: dict, stale: str | None) -> dict | None:
    """The predicted numbers, and the measurement beside them when one matches every setting (else the
    nearest one and what differs); returns that measurement."""
    mine, defaults = deployment_settings(x)
    exact, near, diffs = measured.reference(measured.all_points(), mine, defaults)
    rep = exact[0] if exact else None
    with maybe_stale(stale, "wi_head"):
        m = st.columns(6)
        m[0].metric("tokens/s (predicted)", f"{r['tokens_per_s']:,.0f}")
        if rep is not None:
            err = r["tokens_per_s"] / rep["tokens_per_s"] - 1
            m[1].metric("measured tokens/s", f"{rep['tokens_per_s']:,.0f}", delta=f"{err:+.1%} predicted",
                        delta_color="off", help=f"{rep['origin']} ({rep['source']}): every setting matches.")
        else:
            m[1].metric("measured tokens/s", "none", help="No published or host measurement matches every setting "
                        "of this deployment.")
        m[2].metric("step time", f"{r['step_s'] * 1e3:.3f} ms")
        m[3].metric("bound", r["bound"])
        m[4].metric("HBM floor", f"{r['hbm_floor_s'] * 1e3:.3f} ms")
        m[5].metric("HBM utilisation", f"{r['hbm_utilisation']:.0%}")
        if rep is not None:
            st.caption(f"Measured: {rep['tokens_per_s']:,.0f} tokens/s, {rep['origin']} ({rep['source']}); "
                       f"the prediction is {err:+.1%} off.")
        elif near is not None:
            a, b = st.columns([5, 1])
            a.caption(f"Nearest measurement: {near['tokens_per_s']:,.0f} tokens/s at batch {int(near['batch'])}, "
                      f"{near['origin']} ({near['source']}); yours differs in {measured.differs_text(diffs)}. "
                      "Not a reference for these settings.")
            b.button("Use its settings", key="wi_meas_btn", on_click=apply_measured, args=(near,))
    return rep


def headline_files(x: dict, r: dict, rep: dict | None, stale: str | None) -> None:
    """The headline's numbers as files and the command that prints them (under the tabs: the picture first)."""
    k = dict(x["key"])
    summary = {kk: r[kk] for kk in ("tokens_per_s", "step_s", "bound", "hbm_floor_s", "compute_floor_s",
                                    "hbm_utilisation", "bytes_per_device")}
    summary.update({f"{kk}_s": v for kk, v in r["breakdown_s"].items()})
    if rep is not None:
        summary.update(measured_tokens_per_s=rep["tokens_per_s"], measured_source=rep["origin"])
    with maybe_stale(stale, "wi_files"):
        st.markdown("**The headline numbers**")
        c.downloads(pd.DataFrame([summary]), "whatif_prediction", "wi_pred_dl",
                    {"model": x["model"], "hardware": x["hw"], "vmem_mib": x["vmem"], "inputs": k})
        c.show_command(c.cli_predict(x["model"], x["hw"], x["key"], [k["batch"]], x["vmem"]))


# ----- breakdown ----------------------------------------------------------------------------------

@st.cache_resource(show_spinner=False, max_entries=64)
def breakdown_figure(m_ref, h_ref, key, vmem, engine) -> tuple[go.Figure, pd.DataFrame, dict, dict]:
    r = c.predict_cached(m_ref, h_ref, key, vmem)  # the headline's prediction, not another run
    other = "multikernel" if engine == "megakernel" else "megakernel"
    ro = c.predict_cached(m_ref, h_ref, c.with_key(key, engine=other, serving_engine=None), vmem)  # its generic self
    bars = {engine + " (selected)": r}
    if "error" not in ro:
        bars[other] = ro
    rows = [{"engine": label, "cause": cause, "label": c.CAUSE_LABELS.get(cause, cause), "time_ms": s * 1e3,
             "share_of_step": s / res["step_s"] if res["step_s"] else 0.0}
            for label, res in bars.items() for cause, s in res["breakdown_s"].items()]
    df = pd.DataFrame(rows)
    fig = go.Figure()
    causes = list(dict.fromkeys(list(c.CAUSE_LABELS) + list(df["cause"])))  # a new cause is drawn too
    for i, cause in enumerate(causes):
        g = df[df["cause"] == cause]
        if g.empty or not (g["time_ms"] > 0).any():
            continue
        label = c.CAUSE_LABELS.get(cause, cause)
        fig.add_trace(go.Bar(x=g["engine"], y=g["time_ms"], name=label, marker_color=color(cause, i),
                             customdata=g["share_of_step"],
                             hovertemplate="%{x}<br>" + label + ": %{y:.4f} ms (%{customdata:.1%} of the step)"
                             "<extra></extra>"))
    fig.update_layout(barmode="stack", yaxis_title="time per decode step (ms)", height=380,
                      legend=dict(orientation="h", y=-0.15))
    return fixed_margins(fig, left=80, right=20, bottom=40), df, r, ro


def gain_text(mega: dict, multi: dict) -> str:
    """The megakernel's gain over the multi-kernel engine at the same settings, by cause."""
    gain = multi["step_s"] - mega["step_s"]
    causes = set(mega["breakdown_s"]) | set(multi["breakdown_s"])
    by = sorted(((multi["breakdown_s"].get(k, 0.0) - mega["breakdown_s"].get(k, 0.0), k) for k in causes),
                key=lambda t: -abs(t[0]))
    parts = ", ".join(f"{c.CAUSE_LABELS.get(k, k)} {d * 1e3:+.3f} ms" for d, k in by[:3] if abs(d) > 1e-9)
    return (f"Megakernel gain at these settings (multi-kernel step - megakernel step, `perfmodel predict --gain`): "
            f"**{gain * 1e3:+.3f} ms** ({gain / multi['step_s']:+.1%} of the multi-kernel step)"
            + (f"; by cause: {parts}." if parts else "."))


def breakdown_section(x: dict, stale: str | None) -> None:
    with maybe_stale(stale, "wi_bd"):
        with st.spinner("Running the other engine..."):
            fig, df, r, ro = breakdown_figure(*refs(x), x["engine"])
        st.plotly_chart(fig, key="wi_breakdown")
        if "error" not in ro:
            mega, multi = (r, ro) if x["engine"] == "megakernel" else (ro, r)
            st.caption(gain_text(mega, multi))
        else:
            other = "multikernel" if x["engine"] == "megakernel" else "megakernel"
            st.caption(f"{other} at these settings: {ro['error']}")
        c.downloads(df, "whatif_breakdown", "wi_bd_dl", {"inputs": dict(x["key"]), "model": x["model"],
                                                         "hardware": x["hw"], "vmem_mib": x["vmem"]})


# ----- ring depth x expert slots ------------------------------------------------------------------

def depths_for(hw, *extra_mib: float) -> tuple[float, ...]:
    """Ring-tile multiples up to the on-chip buffer, and the depths asked for."""
    tile = hw.dma_tile_bytes / c.MiB
    cap = hw.onchip_bytes / c.MiB
    ks = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 24, 32, 48, 64)
    return tuple(sorted({round(k * tile, 6) for k in ks if k * tile <= cap} | {round(x, 6) for x in extra_mib}))


def slot_counts(top_k: int, *extra: int) -> tuple[int, ...]:
    return tuple(sorted({s for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if s <= top_k} | {top_k, *extra}))


def settings_of(key: tuple, vmem: float | None) -> dict:
    """A deployment key as the settings of perfmodel.search.batch.evaluate."""
    k = dict(key)
    return dict(devices=k["devices"], tp=k["tp"], ep=k["ep"], engine=k["engine"], batch=k["batch"],
                context=k["context"], draft_rows=k["draft_rows"], acceptance_length=k["acceptance_length"],
                draft_cost=0.05, steps_per_call=k["steps_per_call"], prefetch_mib=k["prefetch_mib"],
                expert_slots=k["expert_slots"], vmem_mib=vmem)


@st.cache_data(show_spinner=False, max_entries=32)
def heat_grid(m_ref, h_ref, key, vmem) -> dict:
    """Step time and tokens/s for every ring depth x expert slot count (one batched simulation per op
    graph: perfmodel.search.batch.evaluate), with the current, default and best cells."""
    model, chip, hw = c.model_for(m_ref, key), c.load_hardware_ref(h_ref), c.resolve_hw(h_ref, vmem)
    k = dict(key)
    top_k = model.moe.top_k if model.moe else 1
    cur = fit.onchip_budget(m_ref, h_ref, key, vmem)
    dflt = fit.onchip_budget(m_ref, h_ref, c.with_key(key, prefetch_mib=None, expert_slots=None), vmem)
    half = hw.onchip_bytes / 2 / c.MiB
    cur_depth, cur_slots = k["prefetch_mib"] or half, k["expert_slots"] or (cur or dflt or {}).get("slots", top_k)
    def_slots = (dflt or {}).get("slots", top_k)
    depths, slots = depths_for(hw, cur_depth, half), slot_counts(top_k, cur_slots, def_slots)
    base = settings_of(key, vmem)
    rows = evaluate(model, chip, [dict(base, prefetch_mib=d, expert_slots=s) for s in slots for d in depths])
    step = np.array([r["step_s"] if r["status"] == "ok" else np.nan for r in rows], float).reshape(len(slots), -1)
    tps = np.array([r["tokens_per_s"] if r["status"] == "ok" else np.nan for r in rows], float).reshape(len(slots), -1)
    why = next((r["reason"] for r in rows if r["status"] != "ok" and r["constraint"] != "vmem"), None)
    best = np.unravel_index(np.nanargmin(step), step.shape) if np.isfinite(step).any() else None
    at = lambda d, s: (slots.index(s), depths.index(round(d, 6)))
    return {"depths": depths, "slots": slots, "step_s": step, "tokens_per_s": tps, "other_error": why,
            "current": at(cur_depth, cur_slots), "default": at(half, def_slots),
            "best": None if best is None else (int(best[0]), int(best[1]))}


@st.cache_resource(show_spinner=False, max_entries=32)
def heat_figure(m_ref, h_ref, key, vmem, metric: str) -> go.Figure:
    g = heat_grid(m_ref, h_ref, key, vmem)
    col, scale = HEAT_METRICS[metric]
    z = g["step_s"] * 1e3 if col == "step_ms" else g["tokens_per_s"]
    xs, ys = [f"{d:g}" for d in g["depths"]], [str(s) for s in g["slots"]]
    fig = go.Figure(go.Heatmap(z=z, x=xs, y=ys, colorscale=scale, colorbar=dict(title=metric), hoverinfo="skip"))
    # the on-chip boundary: right of the line the ring and the expert buffers do not fit
    path = []
    for i in range(len(ys)):
        ok = np.flatnonzero(np.isfinite(g["step_s"][i]))
        edge = (ok.max() if len(ok) else -1) + 0.5
        path += [(edge, i - 0.5), (edge, i + 0.5)]
    fig.add_trace(go.Scatter(x=[p[0] for p in path], y=[p[1] for p in path], mode="lines", name="on-chip limit",
                             line=dict(color="#d62728", width=3), hoverinfo="skip", xaxis="x2", yaxis="y2"))
    marks = [("default", g["default"], "circle-open", "#ffffff"), ("current", g["current"], "diamond", "#ffffff"),
             ("best", g["best"], "star", "#d62728")]
    for name, cell, symbol, colr in marks:
        if cell is None:
            continue
        fig.add_trace(go.Scatter(x=[xs[cell[1]]], y=[ys[cell[0]]], mode="markers+text", name=name, text=[name],
                                 textposition="top center", textfont=dict(color="black"),
                                 marker=dict(symbol=symbol, size=16, color=colr, line=dict(width=2, color="black")),
                                 hoverinfo="skip"))
    # clickable cells: an invisible marker on each cell that fits (a click puts its ring and slots in the fields)
    ii, jj = np.nonzero(np.isfinite(g["step_s"]))
    fig.add_trace(go.Scatter(x=[xs[j] for j in jj], y=[ys[i] for i in ii], mode="markers", name="cells",
                             marker=dict(size=24, symbol="square", opacity=0), showlegend=False, customdata=z[ii, jj],
                             hovertemplate="ring %{x} MiB, %{y} expert slots<br>" + metric +
                             ": %{customdata:.4g}<br>click to use them<extra></extra>"))
    n = len(xs)
    fig.update_layout(height=420, legend=dict(orientation="h", y=-0.2),
                      xaxis=dict(title="prefetch depth (MiB of weight ring per core)", type="category"),
                      yaxis=dict(title="expert slots", type="category"),
                      xaxis2=dict(overlaying="x", range=[-0.5, n - 0.5], visible=False),
                      yaxis2=dict(overlaying="y", range=[-0.5, len(ys) - 0.5], visible=False))
    return fixed_margins(fig, left=70, right=20, bottom=90)


@c.callback
def pick_cell() -> None:
    """Chart selection callback: the clicked cell's ring depth and slots (its x and y categories) go into
    the fields."""
    pts = [p for p in st.session_state["wi_heat_pick"].selection.points if "x" in p and "y" in p]
    if pts:
        st.session_state["wi_prefetch"], st.session_state["wi_slots"] = f"{float(pts[0]['x']):g}", str(int(pts[0]["y"]))


def heat_section(x: dict, stale: str | None) -> None:
    if x["engine"] != "megakernel":
        st.info("The ring and the expert slots are megakernel settings: select the megakernel engine to map them.")
        return
    m_ref, h_ref, key, vmem = refs(x)
    c.init(wi_heat_z="tokens/s")
    with maybe_stale(stale, "wi_heat"), st.spinner("Simulating every ring depth x expert slot count..."):
        g = heat_grid(m_ref, h_ref, key, vmem)
        if g["best"] is None:
            st.warning("No ring depth and expert slot count fits: " + (g["other_error"] or "see the message above."))
            return
        metric = st.radio("Colour", list(HEAT_METRICS), horizontal=True, key="wi_heat_z")
        st.plotly_chart(heat_figure(m_ref, h_ref, key, vmem, metric), key="wi_heat_pick", on_select=pick_cell,
                        selection_mode="points")
        (bs, bd), (cs, cd) = g["best"], g["current"]
        best_tps, cur_tps = g["tokens_per_s"][bs, bd], g["tokens_per_s"][cs, cd]
        st.caption(f"**Best: a {g['depths'][bd]:g} MiB ring with {g['slots'][bs]} expert slots, {best_tps:,.0f} "
                   f"tokens/s** ({best_tps / cur_tps - 1:+.1%} against the current {g['depths'][cd]:g} MiB / "
                   f"{g['slots'][cs]} slots). Right of the red line the ring and the expert buffers exceed the "
                   "on-chip buffer. Click a cell to use its ring and slots.")
        rows = [{"prefetch_mib": d, "expert_slots": s, "step_s": g["step_s"][i, j], "tokens_per_s": g["tokens_per_s"][i, j]}
                for i, s in enumerate(g["slots"]) for j, d in enumerate(g["depths"])]
        c.downloads(pd.DataFrame(rows), "whatif_ring_slots", "wi_heat_dl", {"model": x["model"], "hardware": x["hw"],
                                                                           "vmem_mib": vmem, "inputs": dict(key)})
        c.show_command(c.cli_sweep(x["model"], x["hw"], c.with_key(key, expert_slots=None), g["depths"], vmem,
                                   slots=g["slots"]))


# ----- timeline -----------------------------------------------------------------------------------

@st.fragment
def timeline_section(x: dict, stale: str | None) -> None:
    m_ref, h_ref, key, vmem = refs(x)
    r = c.predict_cached(m_ref, h_ref, key, vmem)
    layers = [row["layer"] for row in r["layers"]]
    first = layers[1] if len(layers) > 1 else layers[0]
    with maybe_stale(stale, "wi_tl"):
        lo, hi = st.select_slider(f"Layers shown (op by op up to {charts.EVENT_LAYERS} layers, one bar per layer "
                                  "beyond)", options=layers,
                                  value=(first, layers[min(layers.index(first) + charts.DEFAULT_LAYERS - 1,
                                                           len(layers) - 1)]),
                                  key=f"wi_layers_{len(layers)}")  # another model: a fresh range
        with st.spinner("Drawing the timeline..."):
            fig, n, by_op = charts.gantt(m_ref, h_ref, key, vmem, lo, hi)
        st.plotly_chart(fig, key="wi_timeline", config={"scrollZoom": True})
        unit = "op bars (a weight stream's tile copies merged)" if by_op else \
            "layer spans (one bar per layer and lane; narrow the range for ops)"
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
    causes = list(dict.fromkeys(list(c.CAUSE_LABELS) + [k[:-2] for k in ok.columns if k.endswith("_s")
                                                        and k not in ("step_s",)]))
    for i, cause in enumerate(causes):
        col = f"{cause}_s"
        if col in ok and (ok[col] > 0).any():
            label = c.CAUSE_LABELS.get(cause, cause)
            fig.add_trace(go.Bar(x=ok["prefetch_mib"], y=ok[col] * 1e3, name=label, marker_color=color(cause, i),
                                 hovertemplate="prefetch %{x:g} MiB<br>" + label + ": %{y:.4f} ms<extra></extra>"),
                          row=2, col=1)
    title = "prefetch depth (MiB of weight ring per core" + (", log)" if log_x else ")")
    fig.update_layout(barmode="stack", height=560, legend=dict(orientation="h", y=-0.14))
    fig.update_xaxes(type="log" if log_x else "linear")  # both panels: they share the depth axis
    fig.update_xaxes(title_text=title, row=2, col=1)
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
    k = hw.dma_concurrent_copies
    sharing = ("serves copies in the order they were issued (dma_sharing = fifo)" if hw.dma_sharing != "shared"
               else f"serves at most {k} copies at once, round-robin among them, the rest in the order they were "
                    f"issued (dma_concurrent_copies = {k})" if k
               else "shares its bandwidth equally among all outstanding copies (dma_sharing = shared)")
    why = {"expert_fetch": (f"the ring takes the {hw.onchip_kind} the expert buffers need: {best['expert_slots']} "
                            f"expert slots at {best['prefetch_mib']:g} MiB, {w['expert_slots']} at "
                            f"{w['prefetch_mib']:g} MiB; the expert copies after routing share the DMA engine with the "
                            "ring, so how many are in flight changes when they land"),
           "weight_streaming": (f"a ring of {w['banks']} tiles issues weights for layers far ahead; the DMA engine "
                                f"{sharing}, so the tile needed next, and each layer's expert and KV copies, wait "
                                "behind tiles for later layers"),
           "collective": (f"a ring of {w['banks']} tiles issues weights for layers far ahead; the DMA engine "
                          f"{sharing}, so each collective's remote copies wait behind tiles for later layers")}
    text = why.get(cause, f"{c.CAUSE_LABELS[cause]} grows")
    return (f"Deeper than {best['prefetch_mib']:g} MiB the step gets slower: at {w['prefetch_mib']:g} MiB it is "
            f"{(w['step_s'] - best['step_s']) * 1e3:+.3f} ms, mostly {c.CAUSE_LABELS[cause]} "
            f"({grow[cause] * 1e3:+.3f} ms): {text}.")


@st.fragment
def prefetch_section(x: dict, stale: str | None) -> None:
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
            best = min(ok, key=lambda r: r["step_s"])
            st.caption(f"The gain saturates at **{sat['prefetch_mib']:g} MiB** (smallest depth within 1 % of the "
                       f"best step time swept); the best depth swept is **{best['prefetch_mib']:g} MiB with "
                       f"{best['expert_slots']} expert slots** ({best['tokens_per_s']:,.0f} tokens/s). Green "
                       f"diamond: the current depth ({current:g} MiB). Hover a point for its ring banks and expert "
                       "slots; the bars below split each depth's step by cause.")
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
    r = c.predict_cached(m_ref, h_ref, key, vmem)
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


LAYER_COLUMNS = ["layer", "kind", "time_s", "compute_s", "stall_s", "collective_s", "overhead_s", "flops",
                 "static_bytes", "routed_bytes", "kv_bytes", "act_bytes", "intensity_flops_per_byte",
                 "achieved_flops_per_s"]


@st.fragment
def roofline_section(x: dict, stale: str | None) -> None:
    with maybe_stale(stale, "wi_roof"):
        fig, df = roofline_figure(*refs(x))
        st.plotly_chart(fig, key="wi_roofline")
        st.caption("A layer's point is its FLOPs and HBM bytes over its time in the step. With the megakernel a "
                   "layer can sit above the HBM roof: part of its weights streamed in during earlier layers "
                   "(prefetch across layer boundaries). Far below the roofs: the layer waits on collectives or "
                   "launches.")
        cols = [k for k in LAYER_COLUMNS if k in df] + [k for k in df if k not in LAYER_COLUMNS and k != "bytes"]
        table = st.expander("Per-layer table", key="wi_layers_exp", on_change="rerun")
        if table.open:  # drawn only when opened
            with table:
                st.dataframe(df[cols], hide_index=True, key="wi_layers_table")
        c.downloads(df[cols], "whatif_layers", "wi_layers_dl", {"model": x["model"], "hardware": x["hw"]})
