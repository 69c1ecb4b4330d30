"""Measured points: the published table, host results, user uploads; and which of them is the
reference for a deployment.

Each source carries a plain-language name (its `origin`): "Inferact, 16x TPU v7, published",
"this machine, host validation", "your upload: FILE". A measurement is the reference for a
deployment only when every setting matches (`differences` is empty); a setting a row leaves out
takes perfmodel's default (tp and ep = devices, context 4096, no speculative decoding, one step per
device call, the generic multi-kernel engine, the model's KV cache format, the default ring, expert
slots and on-chip buffer), except the model and the device count, which a row may leave open.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import streamlit as st

from perfmodel.fit.measurements import seed_measurements
from perfmodel.util.errors import SpecError

from .common import GENERIC, HOST_HW, REPO, UPLOAD_PREFIX, read_csv_bytes, shown_path

HOST_VALIDATION_CSV = REPO / "experiments" / "results" / "host_validation.csv"
GPU_VALIDATION_CSV = REPO / "experiments" / "results" / "gpu_validation.csv"
COLUMNS = ["source", "model", "hardware", "engine", "devices", "tp", "ep", "batch", "context", "draft_rows",
           "acceptance_length", "steps_per_call", "serving_engine", "kv_cache", "prefetch_mib", "expert_slots",
           "vmem_mib", "tokens_per_s", "origin", "role"]
HELD_OUT = "held-out"  # a published point's role: nothing the dashboard predicts with was fitted to it
# optional columns of a measurements file, with their types
OPTIONAL = {"devices": int, "tp": int, "ep": int, "context": int, "draft_rows": int, "acceptance_length": float,
            "steps_per_call": int, "prefetch_mib": float, "expert_slots": int, "vmem_mib": float}
TEXT_OPTIONAL = ("serving_engine", "kv_cache")  # optional text columns (empty: the default)
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
    df["role"] = HELD_OUT  # the presets hold no value fitted to a decode step
    df["model"] = SEED_MODEL
    for col in TEXT_OPTIONAL:  # "" in the table: the default
        df[col] = df[col].replace("", None)
    for col in ("context", "prefetch_mib", "expert_slots", "vmem_mib"):  # not published: the defaults
        df[col] = None
    return df[COLUMNS]


def normalise(df: pd.DataFrame, origin: str) -> pd.DataFrame:
    """Check and complete a measurements table; a missing column or a bad value raises SpecError."""
    df = df.rename(columns=str.strip)
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise SpecError("measurements file", origin,
                        f"missing column(s) {', '.join(missing)}; need {', '.join(REQUIRED)} "
                        f"(optional: model, {', '.join(OPTIONAL)}, {', '.join(TEXT_OPTIONAL)}, source)")
    if df.empty:
        raise SpecError("measurements file", origin, "has no rows")
    out = pd.DataFrame({"hardware": df["hardware"].astype(str).str.strip(),
                        "engine": df["engine"].astype(str).str.strip()})
    for col, kind in (("batch", int), ("tokens_per_s", float), *OPTIONAL.items()):
        if col not in df.columns:
            out[col] = 0 if col == "draft_rows" else None
            continue
        vals = pd.to_numeric(df[col], errors="coerce")
        bad = vals.isna() & df[col].notna() if col in OPTIONAL else vals.isna()
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
    for col in TEXT_OPTIONAL:
        text = df[col].astype(str).str.strip() if col in df.columns else None
        out[col] = None if text is None else text.where(df[col].notna() & (text != ""), None)
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


# the settings a measurement is matched on, as the page names them
SETTINGS = {"model": "model", "hardware": "hardware", "engine": "engine", "devices": "devices", "tp": "TP",
            "ep": "EP", "batch": "batch", "context": "context", "draft_rows": "draft rows",
            "acceptance_length": "acceptance length", "steps_per_call": "steps per call",
            "serving_engine": "serving engine", "kv_cache": "KV cache", "prefetch_mib": "prefetch depth", "expert_slots": "expert slots", "vmem_mib": "VMEM"}
OPEN = ("model", "devices")  # a row that leaves these out matches any value
DEFAULTS = {"context": 4096, "draft_rows": 0, "acceptance_length": None, "steps_per_call": 1,
            "serving_engine": GENERIC}


def settings(model: str, hardware: str, key: tuple, model_kv: str) -> tuple[dict, dict]:
    """A deployment (a pmdash.common.dep_key) as measurements state it (SETTINGS keys but the on-chip
    ones), and the defaults a row's missing KV cache format resolves to (`model_kv`, the model's)."""
    k = dict(key)
    mine = {"model": model, "hardware": hardware, **{f: k[f] for f in (
        "engine", "devices", "tp", "ep", "batch", "context", "draft_rows", "acceptance_length", "steps_per_call")},
        "serving_engine": k["serving_engine"] or GENERIC, "kv_cache": k["kv_cache"] or model_kv}
    return mine, {"kv_cache": model_kv}


def _value(row: dict, key: str):
    v = row.get(key)
    return None if v is None or (isinstance(v, float) and pd.isna(v)) else v


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a)), abs(float(b)))
    return a == b


def differences(row: dict, mine: dict, defaults: dict | None = None) -> list[tuple[str, object, object]]:
    """(setting, yours, the measurement's) for each setting of `mine` the measured row differs in.

    `mine` holds the deployment's settings (SETTINGS keys; the KV cache format by name; prefetch_mib /
    expert_slots / vmem_mib as resolved, megakernel only); `defaults` the values the deployment's
    model and chip resolve the rest to by default (kv_cache, the on-chip settings), which a row that
    leaves them out was measured at."""
    out = []
    for key, label in SETTINGS.items():
        if key not in mine:
            continue
        theirs = _value(row, key)
        if theirs is None:
            if key in OPEN:
                continue
            if key in ("tp", "ep"):
                theirs = _value(row, "devices") or mine.get("devices")
            elif key in DEFAULTS:
                theirs = DEFAULTS[key]
            else:
                theirs = (defaults or {}).get(key)
        if not _same(mine[key], theirs):
            out.append((label, mine[key], theirs))
    return out


def fmt_setting(v) -> str:
    return "default" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def differs_text(diffs: list[tuple[str, object, object]]) -> str:
    """'EP (yours 16, measured 8), context (yours 8192, measured 4096)'."""
    return ", ".join(f"{label} (yours {fmt_setting(a)}, measured {fmt_setting(b)})" for label, a, b in diffs)


def all_points() -> pd.DataFrame:
    host, _ = host_points()
    return pd.concat([published_table()] + ([host] if host is not None else []), ignore_index=True)


def reference(points: pd.DataFrame, mine: dict, defaults: dict | None = None,
              ignore: tuple[str, ...] = ()) -> tuple[list[dict], dict | None, list]:
    """The measured rows that match `mine` in every setting but those in `ignore`, and when none
    does, the nearest row of the same model and hardware with its differences (fewest differing
    settings, then the closest batch)."""
    if points is None or points.empty:
        return [], None, []
    mine_cmp = {k: v for k, v in mine.items() if k not in ignore}
    rows = points.to_dict("records")
    exact = [r for r in rows if not differences(r, mine_cmp, defaults)]
    if exact:
        return exact, None, []
    near = [r for r in rows if r["hardware"] == mine.get("hardware")
            and (_value(r, "model") is None or r["model"] == mine.get("model"))]
    if not near:
        return [], None, []
    scored = [(len(d := differences(r, mine_cmp, defaults)),
               abs(float(r["batch"]) - float(mine.get("batch", r["batch"]))), i, r, d) for i, r in enumerate(near)]
    _, _, _, best, diffs = min(scored, key=lambda t: t[:3])
    return [], best, diffs
