"""Measured points for the Compare view: the bundled seed table, host results, user uploads."""
from __future__ import annotations

import dataclasses
import pandas as pd

from perfmodel.errors import SpecError
from perfmodel.measurements import seed_measurements

from .common import REPO, read_csv_bytes, shown_path

HOST_VALIDATION_CSV = REPO / "experiments" / "results" / "host_validation.csv"
COLUMNS = ["source", "hardware", "engine", "devices", "batch", "draft_rows", "acceptance_length",
           "tokens_per_s", "origin", "role"]
REQUIRED = ("hardware", "engine", "batch", "tokens_per_s")


def seed_table() -> pd.DataFrame:
    ms = seed_measurements()
    df = pd.DataFrame([dataclasses.asdict(m) for m in ms])
    df["origin"] = "seed table (perfmodel/data/seed_measurements.csv)"
    df["role"] = [calibration_role(m) for m in ms]
    return df[COLUMNS]


def calibration_role(m) -> str:
    """fitted (the calibration's training points) or held-out, as `perfmodel reproduce` names them."""
    try:
        from perfmodel.calibrate import role
    except ImportError:
        return ""
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
    for col, kind in (("batch", int), ("tokens_per_s", float), ("devices", int), ("draft_rows", int),
                      ("acceptance_length", float)):
        if col not in df.columns:
            out[col] = None if col in ("devices", "acceptance_length") else 0
            continue
        vals = pd.to_numeric(df[col], errors="coerce")
        bad = vals.isna() & df[col].notna() if col in ("devices", "acceptance_length") else vals.isna()
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
    out["source"] = df["source"].astype(str) if "source" in df.columns else origin
    out["origin"] = origin
    out["role"] = ""
    return out[COLUMNS]


def parse_upload(name: str, data: bytes) -> pd.DataFrame:
    if not name.lower().endswith(".csv"):
        raise SpecError("measurements file", name, "expected a .csv with columns "
                        "hardware, engine, batch, tokens_per_s")
    try:
        df = read_csv_bytes(data)
    except (UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise SpecError("measurements file", name, f"not a readable CSV ({type(e).__name__})") from None
    return normalise(df, f"uploaded {name}")


def host_points() -> tuple[pd.DataFrame | None, str]:
    """Step-level host results, if the host validation CSV exists and carries tokens/s."""
    if not HOST_VALIDATION_CSV.exists():
        return None, (f"No host validation results yet ({shown_path(HOST_VALIDATION_CSV)} is missing; "
                      "run the host validation experiment to produce it).")
    try:
        df = read_csv_bytes(HOST_VALIDATION_CSV.read_bytes())
    except Exception as e:  # noqa: BLE001 -- a broken results file must not break the page
        return None, f"{HOST_VALIDATION_CSV.name} could not be read: {e}"
    if not set(REQUIRED) <= set(df.columns):
        return None, (f"{HOST_VALIDATION_CSV.name} holds per-layer host results (no step-level tokens/s "
                      "columns); they are shown in the Validation view.")
    try:
        return normalise(df, "host validation"), ""
    except SpecError as e:
        return None, f"{HOST_VALIDATION_CSV.name}: {e}"


def matches(df: pd.DataFrame, hw: str, engine: str, devices: int, spec_on: bool) -> pd.DataFrame:
    """Measured rows for one platform: same hardware, engine and (when given) device count."""
    if df is None or df.empty:
        return df
    m = (df["hardware"] == hw) & (df["engine"] == engine)
    m &= df["devices"].isna() | (df["devices"] == devices)
    m &= (df["draft_rows"] > 0) == spec_on
    return df[m]
