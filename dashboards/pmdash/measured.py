"""Measured points for the Compare view: the published table, host results, user uploads.

Each source carries a plain-language name (its `origin`): "Inferact, 16x TPU v7, published",
"this machine, host validation", "your upload: FILE".
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import streamlit as st

from perfmodel.fit.measurements import seed_measurements
from perfmodel.util.errors import SpecError

from .common import HOST_HW, REPO, UPLOAD_PREFIX, read_csv_bytes, shown_path

HOST_VALIDATION_CSV = REPO / "experiments" / "results" / "host_validation.csv"
COLUMNS = ["source", "model", "hardware", "engine", "devices", "batch", "context", "draft_rows",
           "acceptance_length", "tokens_per_s", "origin", "role"]
SEED_MODEL = "kimi-k3"  # the published table is Kimi K3 decode
PUBLISHED_SOURCE = "Inferact, tpu-megakernels report (Sept 2026)"
PUBLISHED_NAMES = {("tpu-v7", "megakernel"): "Inferact, 16x TPU v7, published",
                   ("gb200", "multikernel"): "Inferact, 16x GB200 (vLLM), published"}
HOST_ORIGIN = "this machine, host validation"
REQUIRED = ("hardware", "engine", "batch", "tokens_per_s")


@st.cache_data(show_spinner=False)
def published_table() -> pd.DataFrame:
    ms = seed_measurements()
    df = pd.DataFrame([dataclasses.asdict(m) for m in ms])
    df["origin"] = [PUBLISHED_NAMES.get((m.hardware, m.engine), f"Inferact, {m.hardware}, published") for m in ms]
    df["source"] = PUBLISHED_SOURCE
    df["role"] = [calibration_role(m) for m in ms]
    df["model"] = SEED_MODEL
    df["context"] = None
    return df[COLUMNS]


def calibration_role(m) -> str:
    """fitted (the calibration's training points) or held-out, as `perfmodel reproduce` names them."""
    from perfmodel.fit.seed import role
    return role(m)


def normalise(df: pd.DataFrame, origin: str) -> pd.DataFrame:
    """Check and complete a measurements table; a missing column or a bad value raises SpecError."""
    df = df.rename(columns=str.strip)
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise SpecError("measurements file", origin,
                        f"missing column(s) {', '.join(missing)}; need {', '.join(REQUIRED)} "
                        "(optional: devices, draft_rows, acceptance_length, source)")
    if df.empty:
        raise SpecError("measurements file", origin, "has no rows")
    out = pd.DataFrame({"hardware": df["hardware"].astype(str).str.strip(),
                        "engine": df["engine"].astype(str).str.strip()})
    optional = ("devices", "acceptance_length", "context")
    for col, kind in (("batch", int), ("tokens_per_s", float), ("devices", int), ("draft_rows", int),
                      ("acceptance_length", float), ("context", int)):
        if col not in df.columns:
            out[col] = None if col in optional else 0
            continue
        vals = pd.to_numeric(df[col], errors="coerce")
        bad = vals.isna() & df[col].notna() if col in optional else vals.isna()
        if bad.any():
            i = int(bad.to_numpy().nonzero()[0][0])
            raise SpecError(f"measurements file column {col}", df[col].iloc[i], f"row {i + 1}: not a number")
        out[col] = vals.astype(kind) if not vals.isna().any() else vals
    if (out["batch"] < 1).any() or (out["tokens_per_s"] <= 0).any():
        raise SpecError("measurements file", origin, "batch must be >= 1 and tokens_per_s > 0 in every row")
    bad_engine = ~out["engine"].isin(["megakernel", "multikernel"])
    if bad_engine.any():
        raise SpecError("measurements file column engine", out["engine"][bad_engine].iloc[0],
                        "must be megakernel or multikernel")
    out["model"] = df["model"].astype(str).str.strip() if "model" in df.columns else None
    out["source"] = df["source"].astype(str) if "source" in df.columns else origin
    out["origin"] = origin
    out["role"] = ""
    return out[COLUMNS]


def parse_upload(name: str, data: bytes) -> pd.DataFrame:
    if not name.lower().endswith(".csv"):
        raise SpecError("measurements file", name, "expected a .csv with columns "
                        "hardware, engine, batch, tokens_per_s")
    try:
        df = read_csv_bytes(data, name)
    except (UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise SpecError("measurements file", name, f"not a readable CSV ({type(e).__name__})") from None
    return normalise(df, f"{UPLOAD_PREFIX}{name}")


HOST_STEP_COLUMNS = {"variant", "model", "mode", "batch", "context", "layer", "measured_s"}


def host_points() -> tuple[pd.DataFrame | None, str]:
    """The host points, re-read only when the results file changes."""
    path = HOST_VALIDATION_CSV
    return _host_points(str(path), path.stat().st_mtime if path.exists() else None)


@st.cache_data(show_spinner=False, max_entries=4)
def _host_points(path: str, mtime: float | None) -> tuple[pd.DataFrame | None, str]:
    """Step-level host results from the host validation CSV, as measured tokens/s points.

    experiments/validate_host.py writes one "step" row per run. The points kept are the runs
    with the hardware file as written (variant "file") and op by op (mode "op_by_op": every op
    pays its dispatch, which is what the multikernel engine on the hostbench file predicts);
    tokens/s = batch / measured step time. They belong to the "host-cpu (hostbench)" hardware
    choice, multikernel, 1 device.
    """
    if mtime is None:
        return None, (f"No host validation results yet ({shown_path(HOST_VALIDATION_CSV)} is missing; "
                      "run `python experiments/validate_host.py` to produce it).")
    try:
        df = read_csv_bytes(Path(path).read_bytes())
    except Exception as e:  # noqa: BLE001 -- a broken results file must not break the page
        return None, f"{HOST_VALIDATION_CSV.name} could not be read: {e}"
    if HOST_STEP_COLUMNS <= set(df.columns):
        step = df[(df["layer"].astype(str) == "step") & (df["variant"] == "file") & (df["mode"] == "op_by_op")]
        if step.empty:
            return None, f"{HOST_VALIDATION_CSV.name} has no op-by-op step rows."
        batch = pd.to_numeric(step["batch"], errors="coerce")
        meas = pd.to_numeric(step["measured_s"], errors="coerce")
        pts = pd.DataFrame({"hardware": HOST_HW, "engine": "multikernel", "devices": 1, "batch": batch,
                            "context": step["context"], "model": step["model"],
                            "tokens_per_s": batch / meas, "draft_rows": 0})
        pts = pts[pts["tokens_per_s"].notna() & (pts["tokens_per_s"] > 0)]
        out = normalise(pts, HOST_ORIGIN)
        out["source"] = [f"{HOST_VALIDATION_CSV.name}: op by op, context {c}" for c in out["context"]]
        return out, ""
    if set(REQUIRED) <= set(df.columns):
        try:
            return normalise(df, HOST_ORIGIN), ""
        except SpecError as e:
            return None, f"{Path(path).name}: {e}"
    return None, f"{HOST_VALIDATION_CSV.name} has no step-level rows; its per-layer results are in the Validation view."


def matches(df: pd.DataFrame, model: str, hw: str, engine: str, devices: int, context: int,
            spec_on: bool) -> pd.DataFrame:
    """Measured rows for one platform: same model, hardware, engine, and (where the row gives them)
    device count and context."""
    if df is None or df.empty:
        return df
    m = (df["hardware"] == hw) & (df["engine"] == engine)
    m &= df["model"].isna() | (df["model"] == model)
    m &= df["devices"].isna() | (df["devices"] == devices)
    m &= df["context"].isna() | (df["context"] == context)
    m &= (df["draft_rows"] > 0) == spec_on
    return df[m]


@st.cache_data(show_spinner=False, max_entries=256)
def reported(model: str, hw: str, engine: str, devices: int, context: int, batch: int,
             draft_rows: int, acceptance_length: float | None) -> dict | None:
    """The published or host-measured tokens/s for exactly this deployment, if one exists."""
    host, _ = host_points()
    points = pd.concat([published_table()] + ([host] if host is not None else []), ignore_index=True)
    sel = matches(points, model, hw, engine, devices, context, draft_rows > 0)
    sel = sel[sel["batch"] == batch]
    if draft_rows:
        sel = sel[(sel["draft_rows"] == draft_rows) & (sel["acceptance_length"] == acceptance_length)]
    return None if sel.empty else sel.iloc[0].to_dict()
