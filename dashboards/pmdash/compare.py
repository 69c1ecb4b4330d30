"""Compare view: two platforms' predicted tokens/s across batch sizes, with measured points and errors."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from perfmodel.errors import SpecError

from . import common as c
from . import measured

SPEC_MODES = ("off", "on", "both")


def platform_inputs(col, tag: str, default: dict) -> dict:
    hw_opts = c.hardware_options()
    c.init(**{f"cmp_{tag}_{k}": default[v] for k, v in (("hw", "hardware"), ("engine", "engine"),
                                                          ("devices", "devices"), ("tp", "tp"), ("ep", "ep"))})
    with col:
        st.markdown(f"**Platform {tag}**")
        hw = st.selectbox("Hardware", hw_opts, key=f"cmp_{tag}_hw")
        engine = st.radio("Engine", ("megakernel", "multikernel"), horizontal=True, key=f"cmp_{tag}_engine")
        a, b, e = st.columns(3)
        devices = a.number_input("Devices", 1, 4096, key=f"cmp_{tag}_devices")
        tp = b.number_input("TP", 1, 4096, key=f"cmp_{tag}_tp")
        ep = e.number_input("EP groups", 1, 4096, key=f"cmp_{tag}_ep")
    label = f"{hw} {engine} ({devices} dev, tp {tp}, ep {ep})"
    return dict(hw=hw, engine=engine, devices=int(devices), tp=int(tp), ep=int(ep), label=label)


def predicted_rows(model: str, plat: dict, batches, spec_on: bool, context: int) -> tuple[list[dict], list]:
    rows, errors = [], []
    for b in batches:
        key = c.dep_key(plat["devices"], plat["tp"], plat["ep"], plat["engine"], batch=b, context=context,
                        draft_rows=c.SPEC_DRAFT_ROWS if spec_on else 0,
                        acceptance_length=c.SPEC_ACCEPTANCE if spec_on else None)
        r = c.predict_cached(c.model_ref(model), c.hardware_ref(plat["hw"]), key)
        if "error" in r:
            errors.append((b, r["error"]))
            continue
        bd = r["breakdown_s"]
        rows.append({"platform": plat["label"], "hardware": plat["hw"], "engine": plat["engine"],
                     "spec_decode": spec_on, "batch": b, "predicted_tokens_per_s": r["tokens_per_s"],
                     "step_ms": r["step_s"] * 1e3, "bound": r["bound"],
                     "hbm_utilisation": r["hbm_utilisation"],
                     "exposed_stall_ms": (bd["weight_streaming"] + bd["expert_fetch"]) * 1e3,
                     "collective_ms": bd["collective"] * 1e3})
    return rows, errors


def error_rows(model: str, plat: dict, points: pd.DataFrame, spec_on: bool, context: int) -> list[dict]:
    rows = []
    sel = measured.matches(points, model, plat["hw"], plat["engine"], plat["devices"], context, spec_on)
    if sel is None:
        return rows
    for _, m in sel.iterrows():
        draft = int(m["draft_rows"] or 0)
        acc = m["acceptance_length"] if draft else None
        if draft and (acc is None or pd.isna(acc)):
            continue
        key = c.dep_key(plat["devices"], plat["tp"], plat["ep"], plat["engine"], batch=int(m["batch"]),
                        context=context, draft_rows=draft, acceptance_length=acc)
        r = c.predict_cached(c.model_ref(model), c.hardware_ref(plat["hw"]), key)
        pred = r.get("tokens_per_s")
        rows.append({"platform": plat["label"], "spec_decode": spec_on, "batch": int(m["batch"]),
                     "measured_tokens_per_s": float(m["tokens_per_s"]),
                     "predicted_tokens_per_s": pred,
                     "error": (pred / m["tokens_per_s"] - 1) if pred else None,
                     "role": m["role"], "source": m["source"], "origin": m["origin"]})
    return rows


def render() -> None:
    st.header("Compare platforms: predicted vs measured tokens/s")
    st.caption("Kimi K3 decode by default: TPU v7 Pallas megakernel (32 devices = 16 chips, tp 32, ep 8) vs "
               "GB200 vLLM multi-kernel (16 GPUs, tp 16, ep 16), the seed table's layouts (docs/sources.md s.1).")
    c.init(cmp_model="kimi-k3", cmp_batches=list(c.DEFAULT_BATCHES), cmp_context=4096, cmp_spec="off")
    model = st.selectbox("Model", c.model_options(), key="cmp_model")
    ca, cb = st.columns(2)
    pa = platform_inputs(ca, "A", c.CANONICAL["tpu-v7"])
    pb = platform_inputs(cb, "B", c.CANONICAL["gb200"])
    c1, c3, c2 = st.columns([3, 1, 2])
    batches = c1.multiselect("Batch sizes", list(range(1, 65)), key="cmp_batches")
    context = int(c3.number_input("Context (tokens)", 0, 4_000_000, step=1024, key="cmp_context"))
    spec_mode = c2.radio(f"Speculative decoding ({c.SPEC_DRAFT_ROWS} draft rows, acceptance length "
                         f"{c.SPEC_ACCEPTANCE:g})", SPEC_MODES, horizontal=True, key="cmp_spec")
    batches = sorted(batches)
    if not batches:
        st.warning("Pick at least one batch size.")
        return

    points = [measured.seed_table()]
    host, host_note = measured.host_points()
    if host is not None:
        points.append(host)
    with st.expander("Load your own measurements (CSV)"):
        st.caption("Columns: hardware, engine, batch, tokens_per_s; optional model, devices, context, draft_rows, "
                   "acceptance_length, source. Lines starting with # are ignored.")
        up = st.file_uploader("Measurements CSV", type=None, key="cmp_upload")
        if up is not None:
            try:
                user = measured.parse_upload(up.name, up.getvalue())
                points.append(user)
                st.success(f"Loaded {len(user)} measured point(s) from {up.name}.")
            except SpecError as e:
                st.error(f"Could not use {up.name}: {e}")
    if host_note:
        st.info(host_note)
    allpoints = pd.concat(points, ignore_index=True)

    spec_states = {"off": [False], "on": [True], "both": [False, True]}[spec_mode]
    pred, errs, perr = [], [], {}
    for plat in (pa, pb):
        for s in spec_states:
            rows, e = predicted_rows(model, plat, batches, s, context)
            pred += rows
            for b, msg in e:
                perr.setdefault(f"{plat['label']}{' (spec decode)' if s else ''}: {msg}", []).append(b)
            errs += error_rows(model, plat, allpoints, s, context)
    for msg, bs in perr.items():
        st.error(f"{msg} (batch {', '.join(map(str, bs))})")
    pdf, edf = pd.DataFrame(pred), pd.DataFrame(errs)

    fig = go.Figure()
    colors = {pa["label"]: "#1f77b4", pb["label"]: "#d62728"}
    if pa["label"] == pb["label"]:
        colors[pb["label"]] = "#1f77b4"
    if not pdf.empty:
        for (label, spec), g in pdf.groupby(["platform", "spec_decode"], sort=False):
            name = f"{label} predicted" + (" + spec decode" if spec else "")
            fig.add_trace(go.Scatter(
                x=g["batch"], y=g["predicted_tokens_per_s"], mode="lines+markers", name=name,
                line=dict(color=colors.get(label), dash="dash" if spec else "solid"),
                customdata=g[["step_ms", "bound", "hbm_utilisation"]].to_numpy(),
                hovertemplate=("batch %{x}<br>predicted %{y:.0f} tokens/s<br>step %{customdata[0]:.3f} ms"
                               "<br>bound: %{customdata[1]}<br>HBM utilisation %{customdata[2]:.0%}"
                               f"<extra>{name}</extra>")))
    if not edf.empty:
        for (label, spec, origin), g in edf.groupby(["platform", "spec_decode", "origin"], sort=False):
            name = f"{label} measured" + (" + spec decode" if spec else "") + f" ({origin.split(' (')[0]})"
            fig.add_trace(go.Scatter(
                x=g["batch"], y=g["measured_tokens_per_s"], mode="markers", name=name,
                marker=dict(color=colors.get(label), size=11, symbol="diamond-open" if spec else "x",
                            line=dict(width=2)),
                customdata=g[["predicted_tokens_per_s", "error", "source"]].to_numpy(),
                hovertemplate=("batch %{x}<br>measured %{y:.0f} tokens/s<br>predicted %{customdata[0]:.0f} "
                               "tokens/s<br>error %{customdata[1]:+.1%}<br>%{customdata[2]}"
                               f"<extra>{name}</extra>")))
    fig.update_layout(xaxis=dict(title="batch (sequences)", type="log", tickvals=batches),
                      yaxis=dict(title="aggregate decode tokens/s"), height=480,
                      legend=dict(orientation="h", y=-0.2), margin=dict(t=30))
    st.plotly_chart(fig, key="cmp_chart")

    st.subheader("Measured points: per-point error")
    if edf.empty:
        st.info("No measured points for these platforms (the seed table covers Kimi K3 on tpu-v7 megakernel "
                "with 32 devices and gb200 multikernel with 16; the host results cover the kimi-k3-host-* models "
                f"on '{c.HOST_HW}', multikernel, 1 device, at their contexts; load your own CSV above).")
    else:
        show = edf.copy()
        mape = show["error"].abs().mean()
        st.metric("Mean absolute error over the points shown", f"{mape:.1%}")
        if (show["role"] == "fitted").any():
            st.caption("role: the calibration (`perfmodel reproduce`) fits its efficiency parameters on the "
                       "'fitted' seed points only; 'held-out' points were not used to fit anything.")
        st.dataframe(show.style.format({"measured_tokens_per_s": "{:.0f}", "predicted_tokens_per_s": "{:.0f}",
                                        "error": "{:+.1%}"}), key="cmp_errors", hide_index=True)
        c.downloads(edf, "compare_errors", "cmp_err_dl", {"model": model, "mean_abs_error": mape})
    st.subheader("Predicted curves")
    st.dataframe(pdf, hide_index=True, key="cmp_pred")
    c.downloads(pdf, "compare_predicted", "cmp_pred_dl", {"model": model})
    for plat in (pa, pb):
        for s in spec_states:
            key = c.dep_key(plat["devices"], plat["tp"], plat["ep"], plat["engine"], context=context,
                            draft_rows=c.SPEC_DRAFT_ROWS if s else 0,
                            acceptance_length=c.SPEC_ACCEPTANCE if s else None)
            c.show_command(c.cli_predict(model, plat["hw"], key, batches))
