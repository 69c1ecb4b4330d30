"""Validation view: per-layer predicted vs measured (bundled host results, uploaded traces), MAPE."""
from __future__ import annotations

import importlib
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from perfmodel.errors import SpecError

from . import common as c
from .measured import HOST_VALIDATION_CSV

WORST = 5


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def per_layer_table(df: pd.DataFrame) -> pd.DataFrame:
    """Normalise a per-layer comparison to layer, kind, predicted_s, measured_s, error.

    Accepts the columns the host validation writes: a layer column, and predicted / measured
    times in seconds (`*_s`) or microseconds (`*_us`).
    """
    cols = {c_.lower(): c_ for c_ in df.columns}
    layer = next((cols[k] for k in ("layer", "layer_index", "layer_id") if k in cols), None)
    if layer is None:
        raise SpecError("per-layer table", list(df.columns), "needs a 'layer' column")

    def pick(word: str) -> tuple[str, float]:
        for suffix, scale in (("_s", 1.0), ("_us", 1e-6), ("_ms", 1e-3)):
            for k, orig in cols.items():
                if word in k and k.endswith(suffix) and "error" not in k:
                    return orig, scale
        raise SpecError("per-layer table", list(df.columns),
                        f"needs a {word} time column (e.g. {word}_s or {word}_us)")

    pc, ps = pick("predicted")
    mc, ms = pick("measured")
    out = pd.DataFrame({"layer": df[layer]})
    kind = next((cols[k] for k in ("kind", "layer_kind") if k in cols), None)
    out["kind"] = df[kind].astype(str) if kind else ""
    for extra in ("platform", "hardware", "run", "engine", "batch"):
        if extra in cols:
            out[extra] = df[cols[extra]]
    out["predicted_us"] = pd.to_numeric(df[pc], errors="coerce") * ps * 1e6
    out["measured_us"] = pd.to_numeric(df[mc], errors="coerce") * ms * 1e6
    out = out[out["measured_us"].notna() & out["predicted_us"].notna()]
    out["error"] = np.where(out["measured_us"] > 0, out["predicted_us"] / out["measured_us"] - 1, np.nan)
    out["abs_error"] = out["error"].abs()
    return out.reset_index(drop=True)


def show_comparison(df: pd.DataFrame, title: str, key: str, command: str | None) -> None:
    if df.empty:
        st.warning(f"{title}: no layer has both a predicted and a measured time.")
        return
    mape = float(df["abs_error"].mean())
    step_err = df["predicted_us"].sum() / df["measured_us"].sum() - 1 if df["measured_us"].sum() else float("nan")
    m = st.columns(3)
    m[0].metric("MAPE over layers", f"{mape:.1%}")
    m[1].metric("step (sum of layers) error", f"{step_err:+.1%}")
    m[2].metric("layers", f"{len(df)}")
    worst = set(df.nlargest(WORST, "abs_error").index)
    color = np.where(df.index.isin(worst), "#d62728", "#1f77b4")
    lim = [max(1e-3, float(min(df["predicted_us"].min(), df["measured_us"].min())) * 0.8),
           float(max(df["predicted_us"].max(), df["measured_us"].max())) * 1.25]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=lim, y=lim, mode="lines", line=dict(dash="dot", color="grey"), name="exact",
                             hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=df["measured_us"], y=df["predicted_us"], mode="markers", name="layers",
                             marker=dict(color=color, size=9),
                             customdata=df[["layer", "kind", "error"]].to_numpy(),
                             hovertemplate="layer %{customdata[0]} (%{customdata[1]})<br>measured %{x:.2f} us"
                             "<br>predicted %{y:.2f} us<br>error %{customdata[2]:+.1%}<extra></extra>"))
    fig.update_layout(xaxis=dict(type="log", title="measured time per layer (us)"),
                      yaxis=dict(type="log", title="predicted time per layer (us)"), height=420,
                      margin=dict(t=30), showlegend=False)
    st.plotly_chart(fig, key=f"{key}_chart")
    st.caption(f"Red: the {min(WORST, len(df))} layers with the largest absolute error.")
    st.dataframe(df.style.format({"predicted_us": "{:.2f}", "measured_us": "{:.2f}", "error": "{:+.1%}",
                                  "abs_error": "{:.1%}"}).apply(
        lambda r: ["background-color: #f8d7da" if r.name in worst else "" for _ in r], axis=1),
        hide_index=True, key=f"{key}_table")
    c.downloads(df, f"validation_{key}", f"{key}_dl", {"title": title, "mape": mape})
    if command:
        c.show_command(command)


def bundled() -> None:
    st.subheader("Bundled host validation")
    if not HOST_VALIDATION_CSV.exists():
        st.info(f"No host validation results yet: {c.shown_path(HOST_VALIDATION_CSV)} is missing. "
                "Produce them with `perfmodel validate` on this machine (host CPU traces of the pure-JAX "
                "reference step); this view then shows them.")
        return
    try:
        raw = c.read_csv_bytes(HOST_VALIDATION_CSV.read_bytes())
        df = per_layer_table(raw)
    except SpecError as e:
        st.error(f"{HOST_VALIDATION_CSV.name} has an unexpected layout: {e}")
        return
    except Exception as e:  # noqa: BLE001
        st.error(f"{HOST_VALIDATION_CSV.name} could not be read ({type(e).__name__}: {e}).")
        return
    groups = [g for g in ("platform", "hardware", "run") if g in df.columns]
    if groups and df[groups[0]].nunique() > 1:
        choice = st.selectbox("Run", sorted(df[groups[0]].astype(str).unique()), key="val_run")
        df = df[df[groups[0]].astype(str) == choice].reset_index(drop=True)
    show_comparison(df, "host validation", "val_host", "perfmodel validate --json")


def compare_trace(path: Path) -> pd.DataFrame:
    """Parse a trace dir / .xplane.pb with perfmodel.traces and compare per layer with the model."""
    validate = _module("perfmodel.validate")
    traces = _module("perfmodel.traces")
    for mod, fname in ((validate, "compare_trace"), (validate, "validate_trace"), (traces, "compare")):
        fn = getattr(mod, fname, None) if mod else None
        if fn is not None:
            result = fn(path)
            rows = result if isinstance(result, pd.DataFrame) else pd.DataFrame(
                result.get("layers", result) if isinstance(result, dict) else result)
            return per_layer_table(rows)
    raise SpecError("trace", str(path), "trace parsing is not available in this checkout yet "
                    "(perfmodel.traces / perfmodel.validate has no trace comparison function)")


def check_trace_upload(files) -> None:
    names = [f.name for f in files]
    if not any(n.endswith(".xplane.pb") or n.endswith(".pb") or n.endswith(".json.gz") or n.endswith(".json")
               for n in names):
        raise SpecError("trace upload", ", ".join(names[:3]),
                        "not a profiler trace: expected a .xplane.pb file or a jax.profiler trace directory")


def uploaded() -> None:
    st.subheader("Your trace")
    st.caption("A `.xplane.pb` file, or a `jax.profiler` trace directory (upload the directory or give its path "
               "on this machine). Layers are attributed from the named scopes the reference step and the "
               "megakernel carry.")
    files = st.file_uploader("Trace file(s)", accept_multiple_files=True, key="val_upload")
    path_text = st.text_input("...or a trace path on this machine", key="val_path",
                              placeholder="e.g. /tmp/trace or run.xplane.pb")
    if files:
        check_trace_upload(files)
        with tempfile.TemporaryDirectory() as tmp:
            for f in files:
                dest = Path(tmp) / Path(f.name).name
                dest.write_bytes(f.getvalue())
            target = Path(tmp) if len(files) > 1 else Path(tmp) / Path(files[0].name).name
            df = compare_trace(target)
        show_comparison(df, "uploaded trace", "val_upload", None)
    elif path_text:
        p = Path(path_text).expanduser()
        if not p.exists():
            raise SpecError("trace path", path_text, "does not exist")
        if p.is_file() and not p.name.endswith(".pb"):
            raise SpecError("trace path", path_text, "expected a .xplane.pb file or a trace directory")
        df = compare_trace(p)
        show_comparison(df, "trace", "val_path", f"perfmodel validate --trace {path_text} --json")


def render() -> None:
    st.header("Validation: per-layer predicted vs measured")
    bundled()
    try:
        uploaded()
    except SpecError as e:
        st.error(f"Cannot use this trace: {e}")
