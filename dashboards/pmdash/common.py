"""Shared pieces of the dashboard: cached loading and prediction, CLI commands, downloads, errors.

Everything expensive is cached on plain, hashable inputs (names, file text, numbers), so a widget
change only recomputes what that widget feeds. Predictions are cached as plain dicts (numbers,
lists) so that a cache hit costs an unpickle of a few kB, not a model rebuild.
"""
from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import re
import shlex
import tempfile
import threading
import tomllib
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from perfmodel.cli.dashboard import TRACE_ROOT_ENV  # set by `perfmodel dashboard --trace-root DIR`
from perfmodel.engine import megakernel_sim
from perfmodel.fit.measurements import seed_measurements
from perfmodel.spec import arch, hardware, hf, loaders
from perfmodel.spec.deployment import Deployment, SpecDecode
from perfmodel.spec.engines import serving_engines
from perfmodel.spec.formats import FORMATS, get_format
from perfmodel.step.predict import predict
from perfmodel.util.csvsafe import csv_text, neutral
from perfmodel.util.errors import SpecError

from . import warm

megakernel_sim.compile_loops()  # an interactive app predicts often: compiled loops (cached by numba)
# compiled (or loaded from numba's disk cache) while the server starts; a page waits for it with a message
LOOPS = threading.Thread(target=warm.warm, name="perfmodel-loops", daemon=True)
LOOPS.start()

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "experiments" / "results"
MiB = 2**20
BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
SPEC_DRAFT_ROWS, SPEC_ACCEPTANCE = 7, 6.0



GENERIC = "generic"  # the multi-kernel engine without a serving engine's kernel inventory
MODEL_KV = "model's"  # the KV cache format of the model's preset


def canonical() -> dict[str, dict]:
    """The published table's deployments per platform (Inferact, tpu-megakernels report, Sept 2026):
    layout, engine, serving engine, KV cache format and the decode steps per device call of the runs
    without and with spec decode."""
    out: dict[str, dict] = {}
    for m in seed_measurements():
        d = out.setdefault(m.hardware, dict(hardware=m.hardware, engine=m.engine, devices=m.devices, tp=m.tp,
                                            ep=m.ep, serving_engine=m.serving_engine or GENERIC,
                                            kv_cache=m.kv_cache or MODEL_KV, steps_per_call=1,
                                            spec_steps_per_call=1))
        d["spec_steps_per_call" if m.spec_decode else "steps_per_call"] = m.steps_per_call
    return out


CANONICAL = canonical()

# Widget keys start with their view's prefix. Kept across view switches: all but those Streamlit cannot
# set from state (uploaders, buttons, downloads, selectable charts: by their key's ending or word) and
# widgets whose options depend on other inputs (key prefixes).
VIEW_PREFIXES = ("cmp_", "wi_", "ex_", "val_", "mh_", "ds_", "sv_")
NOT_SETTABLE_WORDS = ("_upload", "_dl", "_btn", "_pick", "_near_", "_menu", "_forced")
NOT_SETTABLE_ENDINGS = ("_csv", "_json")
NOT_SETTABLE_PREFIXES = ("wi_layers", "wi_acc", "ex_acc", "val_run", "val_path_run", "val_upload_run")


def settable(key: str) -> bool:
    return not (any(w in key for w in NOT_SETTABLE_WORDS) or key.endswith(NOT_SETTABLE_ENDINGS)
                or key.startswith(NOT_SETTABLE_PREFIXES))


def keep_inputs() -> None:
    """Streamlit forgets the state of widgets that a run does not draw: keep each view's inputs when
    another view is shown (re-assigning a widget's value marks it as user state)."""
    for key in [k for k in st.session_state if isinstance(k, str) and k.startswith(VIEW_PREFIXES)]:
        if settable(key):
            st.session_state[key] = st.session_state[key]


def init(**defaults) -> None:
    """Widget defaults go into the session state once (widgets are then created without a
    default), so a value kept across view switches never conflicts with a default."""
    for key, value in defaults.items():
        if key not in st.session_state:
            st.session_state[key] = value

# Step-time causes in stacking order, with the labels the page shows.
CAUSE_LABELS = {
    "weight_streaming": "weight streaming (exposed DMA stall)",
    "expert_fetch": "expert fetch (exposed DMA stall)",
    "collective": "collectives",
    "launch": "launch / per-op overhead",
    "fill_drain": "pipeline fill / drain",
    "compute": "compute",
    "draft": "drafter",
}


# ----- inputs: presets and uploaded files ------------------------------------------------------

def uploads(kind: str) -> dict[str, tuple[str, str]]:
    """Session store of uploaded specs: display name -> (file suffix, text)."""
    return st.session_state.setdefault(f"uploaded_{kind}", {})


def model_options() -> list[str]:
    return arch.list_presets() + list(uploads("model"))


HOST_HW_FILE = REPO / "experiments" / "results" / "host-cpu.toml"
HOST_HW = "host-cpu (hostbench)"  # this machine, measured by `perfmodel hostbench`


def local_hardware() -> dict[str, Path]:
    """Hardware files of this checkout offered beside the presets (when they exist)."""
    return {HOST_HW: HOST_HW_FILE} if HOST_HW_FILE.exists() else {}


def hardware_options() -> list[str]:
    return hardware.list_presets() + list(local_hardware()) + list(uploads("hardware"))


def model_ref(name: str) -> tuple:
    """A hashable reference: a preset name, or an uploaded file's (name, suffix, text)."""
    up = uploads("model").get(name)
    return (name, None, None) if up is None else (name, *up)


@st.cache_data(show_spinner=False, max_entries=8)
def file_text(path: str, mtime: float) -> str:
    return Path(path).read_text()


def hardware_ref(name: str) -> tuple:
    local = local_hardware().get(name)
    if local is not None:  # keyed on the text, so a re-measured file is picked up
        return (name, ".toml", file_text(str(local), local.stat().st_mtime))
    up = uploads("hardware").get(name)
    return (name, None, None) if up is None else (name, *up)


@st.cache_resource(show_spinner=False, max_entries=64)
def load_model_ref(ref: tuple):
    name, suffix, text = ref
    if text is None:
        return loaders.load_model(name)
    return parse_model_text(text, suffix, name)


@st.cache_resource(show_spinner=False, max_entries=64)
def load_hardware_ref(ref: tuple):
    name, suffix, text = ref
    if text is None:
        return hardware.load_hardware(name)
    return parse_hardware_text(text, name)


def parse_model_text(text: str, suffix: str, name: str | None = None):
    """A model from an uploaded Hugging Face config.json (suffix .json) or a preset-style .toml."""
    if suffix not in (".json", ".toml"):
        raise SpecError("model file", name or suffix, "expected a Hugging Face config.json or a model .toml")
    if suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise SpecError("model file", name, f"not valid TOML: {e}") from None
        return _guard(lambda: arch.from_dict(data), "model file", name)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(text)
        spec = _guard(lambda: hf.from_hf_config(path), "model file", name)
    if name and spec.name in ("", Path(tmp).name):
        spec = dataclasses.replace(spec, name=name)
    return spec


def parse_hardware_text(text: str, filename: str | None = None):
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError("hardware file", filename, f"not valid TOML: {e}") from None
    return _guard(lambda: hardware.from_dict(data), "hardware file", data.get("name", filename))


def _guard(fn, field, value):
    """Run a parser; malformed content that slips past its checks becomes a SpecError."""
    try:
        return fn()
    except SpecError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise SpecError(field, value, f"malformed content ({type(e).__name__}: {e})") from None


UPLOAD_PREFIX = "your upload: "


def register_upload(kind: str, filename: str, data: bytes) -> str:
    """Parse an uploaded model / hardware file; on success keep it for the other views under a name
    of its own ("your upload: FILE (model name)"; a different file of the same name gets " #2")."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{kind} file", filename, "not a text file (UTF-8 JSON or TOML expected)") from None
    suffix = Path(filename).suffix.lower()
    if kind == "model":
        inner = parse_model_text(text, suffix, Path(filename).stem).name
    else:
        if suffix != ".toml":
            raise SpecError("hardware file", filename, "expected a hardware .toml (see perfmodel/presets/hardware)")
        inner = parse_hardware_text(text, filename).name
    base = UPLOAD_PREFIX + filename + ("" if inner == Path(filename).stem else f" ({inner})")
    store, name, n = uploads(kind), base, 1
    while name in store and store[name] != (suffix, text):
        n += 1
        name = f"{base} #{n}"
    store[name] = (suffix, text)
    return name


# ----- deployments and cached predictions -----------------------------------------------------

def serving_engine_allowed(hw: str, engine: str, prefix: str) -> bool:
    """Whether a serving engine can be chosen (a GPU's multi-kernel engine); where not, its select
    (key PREFIX_serving) is put at generic."""
    gpu_mk = engine == "multikernel" and load_hardware_ref(hardware_ref(hw)).kind == "gpu"
    if not gpu_mk:
        st.session_state[f"{prefix}_serving"] = GENERIC
    return gpu_mk


def kernel_menu(prefix: str, hw: str, engine: str, more: str = ""):
    """A popover (its widgets mounted only when it is opened) for the serving engine and KV cache selects
    (kernel_choices) and any others (`more`: their values for the label), labelled with their values."""
    serving_engine_allowed(hw, engine, prefix)
    label = f"{st.session_state[f'{prefix}_serving']} engine, KV {st.session_state[f'{prefix}_kv']}{more}"
    return st.popover(label, key=f"{prefix}_kernels_menu")


def kernel_choices(col_engine, col_kv, hw: str, engine: str, prefix: str) -> tuple[str | None, str | None]:
    """The serving engine and KV cache format selects (keys PREFIX_serving, PREFIX_kv): (serving engine or
    None for the generic engine, KV format or None for the model's). A serving engine is a GPU
    multi-kernel engine: on other hardware or engines the select is off, at generic."""
    gpu_mk = serving_engine_allowed(hw, engine, prefix)
    serving = col_engine.selectbox("Serving engine", (GENERIC, *serving_engines()), key=f"{prefix}_serving",
                                   disabled=not gpu_mk, help="GPU multi-kernel only: replay this engine's measured "
                                   "kernels (`--serving-engine`); generic: perfmodel's multi-kernel engine.")
    kv = col_kv.selectbox("KV cache", (MODEL_KV, *FORMATS), key=f"{prefix}_kv",
                          help="The KV cache's storage format (`--kv-cache`, e.g. fp8-kv as vLLM's "
                               "--kv-cache-dtype fp8); model's: the model preset's.")
    return None if serving == GENERIC else serving, None if kv == MODEL_KV else kv


def dep_key(devices: int, tp: int, ep: int | None, engine: str, batch: int = 1, context: int = 4096,
            prefetch_mib: float | None = None, expert_slots: int | None = None,
            draft_rows: int = 0, acceptance_length: float | None = None, steps_per_call: int = 1,
            serving_engine: str | None = None, kv_cache: str | None = None) -> tuple:
    """Deployment inputs as a hashable tuple (the cache key); serving_engine None: the generic
    multi-kernel engine; kv_cache None: the model's KV cache format."""
    return (("devices", int(devices)), ("tp", int(tp)), ("ep", None if ep is None else int(ep)),
            ("engine", engine), ("batch", int(batch)), ("context", int(context)),
            ("prefetch_mib", None if prefetch_mib is None else float(prefetch_mib)),
            ("expert_slots", None if expert_slots is None else int(expert_slots)),
            ("draft_rows", int(draft_rows)),
            ("acceptance_length", None if acceptance_length is None else float(acceptance_length)),
            ("steps_per_call", int(steps_per_call)), ("serving_engine", serving_engine), ("kv_cache", kv_cache))


def with_key(key: tuple, **changes) -> tuple:
    d = dict(key)
    d.update(changes)
    return dep_key(**d)


def make_deployment(key: tuple) -> Deployment:
    k = dict(key)
    spec = SpecDecode(k["draft_rows"], acceptance_length=k["acceptance_length"]) if k["draft_rows"] else None
    pf = k["prefetch_mib"]
    return Deployment(devices=k["devices"], tp=k["tp"], engine=k["engine"], ep=k["ep"], batch=k["batch"],
                      context=k["context"], prefetch_bytes=None if pf is None else pf * MiB,
                      expert_slots=k["expert_slots"], spec=spec, steps_per_call=k["steps_per_call"],
                      serving_engine=k["serving_engine"])


def model_for(m_ref: tuple, key: tuple):
    """The model with the deployment's KV cache format (as `--kv-cache`)."""
    return _with_kv(m_ref, dict(key)["kv_cache"])


@st.cache_resource(show_spinner=False, max_entries=64)
def _with_kv(m_ref: tuple, kv_cache: str | None):
    model = load_model_ref(m_ref)
    if kv_cache is None:
        return model
    return dataclasses.replace(model, formats={**model.formats, "kv_cache": get_format(kv_cache, "KV cache")})


def fmt_mib(x: float) -> str:
    return f"{x:,.0f} MiB" if x >= 1000 else f"{x:.3g} MiB"


_FIELD_BYTES = re.compile(r"(\w+_bytes)=(\d+(?:\.\d+)?(?:e[+-]?\d+)?)")
_BYTES = re.compile(r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?) B\b")


_NONE_FITS = re.compile(r"; at most 0 MiB fits")


def readable(msg: str) -> str:
    """A model message with byte counts in MiB ("67108864 B" -> "64 MiB"); "at most 0 MiB fits" (a buffer smaller
    than one ring tile) said as it is."""
    msg = _FIELD_BYTES.sub(lambda m: f"{m[1].removesuffix('_bytes')}={fmt_mib(float(m[2]) / MiB)}", msg)
    msg = _BYTES.sub(lambda m: fmt_mib(float(m[1]) / MiB), msg)
    return _NONE_FITS.sub("; not even one tile fits (the buffer is smaller than one ring tile)", msg)


def cause_of(msg: str) -> str:
    """What an error is about, without the numbers that differ from batch to batch."""
    return re.sub(r"[\d.,]+", "#", msg)


def errors_by_cause(items: list[tuple[str, int | None, str]]) -> None:
    """One error box per place and cause: items are (where, batch or None, message); a box lists the
    batches it applies to."""
    groups: dict[tuple, list] = {}
    for where, batch, msg in items:
        groups.setdefault((where, cause_of(msg)), []).append((batch, msg))
    for (where, _), group in groups.items():
        batches = [b for b, _ in group if b is not None]
        st.error(f"{where}: {group[0][1]}" + (f" (batch {', '.join(map(str, batches))})" if batches else ""))


def resolve_hw(hw_ref: tuple, onchip_mib: float | None):
    hw = load_hardware_ref(hw_ref)
    if onchip_mib is not None:
        if not onchip_mib > 0:
            raise SpecError("onchip_bytes", onchip_mib * MiB, "must be > 0")
        hw = hw.replace(onchip_bytes=float(onchip_mib) * MiB)
    return hw


def predict_cached(m_ref: tuple, hw_ref: tuple, key: tuple, onchip_mib: float | None = None,
                   record: bool = False) -> dict:
    """One prediction as a plain dict, or {"error": message} for an input the model refuses; with
    `record`, also the simulated step's events (a smaller cache: they are about 0.5 MB a step)."""
    return (_recorded if record else _summary)(m_ref, hw_ref, key, onchip_mib)


@st.cache_data(show_spinner=False, max_entries=4096)
def _summary(m_ref: tuple, hw_ref: tuple, key: tuple, onchip_mib: float | None) -> dict:
    return _prediction(m_ref, hw_ref, key, onchip_mib, record=False)


@st.cache_data(show_spinner=False, max_entries=64)
def _recorded(m_ref: tuple, hw_ref: tuple, key: tuple, onchip_mib: float | None) -> dict:
    return _prediction(m_ref, hw_ref, key, onchip_mib, record=True)


def _prediction(m_ref: tuple, hw_ref: tuple, key: tuple, onchip_mib: float | None, record: bool) -> dict:
    try:
        model, hw = model_for(m_ref, key), resolve_hw(hw_ref, onchip_mib)
        p = predict(model, hw, make_deployment(key), record=record)
    except SpecError as e:
        return {"error": readable(str(e)), "field": e.field}
    out = {"tokens_per_s": p.tokens_per_s, "step_s": p.step_s, "bound": p.bound,
           "hbm_floor_s": p.hbm_floor_s, "compute_floor_s": p.compute_floor_s,
           "hbm_utilisation": p.hbm_utilisation, "bytes_per_device": p.bytes_per_device,
           "breakdown_s": dict(p.breakdown_s),
           "layers": [dataclasses.asdict(r) for r in p.layers]}
    if record:  # numpy columns: a cache hit unpickles a few arrays, not thousands of tuples
        ev = p.timeline.events
        out["events"] = {"lane": np.array([e[0] for e in ev], dtype=str),
                         "name": np.array([e[1] for e in ev], dtype=str),
                         "layer": np.array([e[2] for e in ev], dtype=np.int64),
                         "t0_s": np.array([e[3] for e in ev], dtype=float),
                         "t1_s": np.array([e[4] for e in ev], dtype=float)}
    return out


@st.cache_resource(show_spinner=False, max_entries=8)
def chrome_trace_json(m_ref: tuple, hw_ref: tuple, key: tuple, onchip_mib: float | None) -> str:
    """The simulated step as Perfetto / Chrome trace JSON (built only when downloaded)."""
    from perfmodel.step.timeline import chrome_trace
    model, hw = model_for(m_ref, key), resolve_hw(hw_ref, onchip_mib)
    return json.dumps(chrome_trace(predict(model, hw, make_deployment(key), record=True)))


def prefetch_sweep(m_ref: tuple, hw_ref: tuple, key: tuple, onchip_mib: float | None,
                   depths_mib: tuple[float, ...]) -> tuple[list[dict], dict | None, list[str]]:
    """Step time per prefetch depth, the saturation point (perfmodel.search.sweep.saturation) and the causes
    of the step (the prediction's breakdown: each row's time of cause C is its column C_s; the causes are
    named by the breakdown, not guessed from the columns' units).

    Each depth is one cached prediction (the points `perfmodel sweep --vary prefetch_mib=...` gives), so
    asking for another depth runs the model once, not once per depth."""
    from perfmodel.search.sweep import saturation
    rows, causes = [], {}
    for depth in depths_mib:
        r = predict_cached(m_ref, hw_ref, with_key(key, prefetch_mib=depth), onchip_mib)
        if "error" in r:
            rows.append({"prefetch_mib": depth, "error": r["error"]})
            continue
        causes.update(dict.fromkeys(r["breakdown_s"]))
        rows.append({"prefetch_mib": depth, "step_s": r["step_s"], "tokens_per_s": r["tokens_per_s"],
                     "bound": r["bound"], **{f"{c}_s": v for c, v in r["breakdown_s"].items()}})
    sat = saturation(rows, axis="prefetch_mib")
    return rows, None if sat is None else {"prefetch_mib": sat["prefetch_mib"], "step_s": sat["step_s"]}, list(causes)


# ----- CLI commands shown next to the numbers ---------------------------------------------------

def _cli_name(kind: str, name: str) -> str:
    if kind == "hardware" and name in local_hardware():
        return shown_path(local_hardware()[name])
    if name.startswith(UPLOAD_PREFIX):
        return "<path to your config.json or .toml>" if kind == "model" else "<path to your hardware .toml>"
    return name


def cli_args(model: str, hw: str, key: tuple, onchip_mib: float | None = None) -> list[str]:
    """The deployment and hardware flags of every perfmodel command shown on the page."""
    k = dict(key)
    args = ["--model", _cli_name("model", model), "--hardware", _cli_name("hardware", hw),
            "--devices", str(k["devices"]), "--tp", str(k["tp"])]
    if k["ep"] is not None:
        args += ["--ep", str(k["ep"])]
    args += ["--engine", k["engine"]]
    if k["serving_engine"] is not None:
        args += ["--serving-engine", k["serving_engine"]]
    if k["kv_cache"] is not None:
        args += ["--kv-cache", k["kv_cache"]]
    if k["context"] != 4096:
        args += ["--context", str(k["context"])]
    if k["prefetch_mib"] is not None:
        args += ["--prefetch-mib", f"{k['prefetch_mib']:g}"]
    if k["expert_slots"] is not None:
        args += ["--expert-slots", str(k["expert_slots"])]
    if k["draft_rows"]:
        args += ["--draft-rows", str(k["draft_rows"]), "--acceptance-length", f"{k['acceptance_length']:g}"]
    if k["steps_per_call"] != 1:
        args += ["--steps-per-call", str(k["steps_per_call"])]
    if onchip_mib is not None:
        args += ["--vmem-mib", f"{onchip_mib:g}"]
    return args


def cli_predict(model: str, hw: str, key: tuple, batches, onchip_mib: float | None = None) -> str:
    return shlex.join(["perfmodel", "predict"] + cli_args(model, hw, key, onchip_mib) +
                      ["--batch", ",".join(map(str, batches)), "--json"])


def cli_trace(model: str, hw: str, key: tuple, onchip_mib: float | None = None) -> str:
    return shlex.join(["perfmodel", "trace"] + cli_args(model, hw, key, onchip_mib) +
                      ["--batch", str(dict(key)["batch"]), "--out", "step.trace.json"])


def cli_sweep(model: str, hw: str, key: tuple, depths_mib, onchip_mib: float | None = None,
              slots: tuple[int, ...] | None = None) -> str:
    k = dict(key)
    args = ["perfmodel", "sweep"] + cli_args(model, hw, with_key(key, prefetch_mib=None), onchip_mib)
    args += ["--vary", "prefetch_mib=" + ",".join(f"{x:g}" for x in depths_mib)]
    if slots:
        args += ["--vary", "expert_slots=" + ",".join(map(str, slots))]
    if k["batch"] != 1:  # sweep takes the batch as an axis
        args += ["--vary", f"batch={k['batch']}"]
    return shlex.join(args + ["--json"])


# ----- output helpers ---------------------------------------------------------------------------

def download_menu(key: str, label: str = "Download CSV / JSON"):
    """A button that opens the downloads beside it (a popover: the browser mounts what it holds only when
    it is opened, so a page load does not draw every download button)."""
    return st.popover(label, icon=":material/download:", key=f"{key}_menu")


def downloads(df: pd.DataFrame, stem: str, key: str, extra_json: dict | None = None) -> None:
    """CSV and JSON download buttons for a table (JSON carries the rows plus any context), in a download menu."""
    with download_menu(key):
        # the files are built when clicked (callables), so a re-render does not serialise every table; a click
        # does not rerun the page (a rerun would drop the file another button is still fetching)
        st.download_button("Download CSV", lambda: csv_download(df), file_name=f"{stem}.csv", mime="text/csv",
                           key=f"{key}_csv", on_click="ignore")
        st.download_button("Download JSON", lambda: table_json(df, extra_json), file_name=f"{stem}.json",
                           mime="application/json", key=f"{key}_json", on_click="ignore")


def table_json(df: pd.DataFrame, extra: dict | None = None) -> str:
    return json.dumps({**(extra or {}), "rows": json.loads(df.to_json(orient="records"))}, indent=1, default=str)


MARKDOWN_SPECIAL = re.compile(r"([\\`*_$~<>\[\]|])")


def static_table(df: pd.DataFrame, formats: dict[str, str] | None = None) -> None:
    """A small static table as one markdown (GFM) table: an st.table cost a page load here about 0.8 s of
    browser CPU, an st.dataframe about as much. `formats`: column -> format spec; missing values are empty."""
    def cell(col, v) -> str:
        if v is None or (isinstance(v, float) and not np.isfinite(v)):
            return ""
        text = format(v, formats[col]) if formats and col in formats else str(v)
        return MARKDOWN_SPECIAL.sub(r"\\\1", text.replace("\n", " "))
    lines = ["| " + " | ".join(cell(None, col) for col in df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(col, v) for col, v in zip(df.columns, row)) + " |"
              for row in df.itertuples(index=False)]
    st.markdown("\n".join(lines))


def numbered_sources(texts, what: bool = True) -> tuple[list[str], list[str]]:
    """Long source texts as short references: "[n] what" per text (what: the text before its first colon, at
    most 40 characters; with what=False only "[n]") and the distinct texts, numbered from 1 in that order. A
    table then stays a line a row, its sources one click away (sources_expander)."""
    distinct = list(dict.fromkeys(t for t in texts if t))
    def ref(t: str) -> str:
        head = t.split(":")[0].strip()
        return f"[{distinct.index(t) + 1}]" + ("" if not what else " " + (head if len(head) <= 40 else head[:39] + "…"))
    return [ref(t) if t else "" for t in texts], distinct


def sources_expander(key: str, sources: list[str], title: str = "Sources") -> None:
    """The numbered sources of a table, drawn when opened."""
    box = st.expander(f"{title} ({len(sources)})", key=key, on_change="rerun")
    if box.open:
        with box:
            st.markdown("\n".join(f"{i}. " + MARKDOWN_SPECIAL.sub(r"\\\1", s) for i, s in enumerate(sources, 1)))


def figures_line(figures: list[tuple[str, str]]) -> None:
    """A view's headline figures as one markdown line, "label: **value** · ..." (one element: a row of
    st.metric cost a page load about 0.03 CPU-s per figure)."""
    st.markdown(" · ".join(f"{label}: **{value}**" for label, value in figures))


def show_command(cmd: str, caption: str = "Reproduce with the CLI:") -> None:
    """The command beside a number, as inline code in markdown (selectable, wrapped): st.code's highlighter
    bundle would cost each page load about 0.3 s of browser CPU. One element: the caption in small type above."""
    st.markdown(f":small[{caption}]  \n{code_span(cmd)}")


def code_span(text: str) -> str:
    """Text as one markdown code span (fenced with more backticks than it holds)."""
    fence = "`" * (max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence} {text} {fence}" if "`" in text else f"`{text}`"


def shown_path(path: Path) -> str:
    """A path as the page shows it: relative to the repository when inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def read_csv_bytes(data: bytes, name: str = "upload") -> pd.DataFrame:
    """An uploaded CSV, bounded in size and rows before it is parsed (perfmodel.util.csvsafe)."""
    return pd.read_csv(io.StringIO(csv_text(data, name)))


def csv_download(df: pd.DataFrame) -> str:
    """A table as CSV for download, formula-like text cells neutralised."""
    return df.map(neutral).to_csv(index=False)


def wait_for_loops() -> None:
    """Before the first prediction of a fresh server: the compiled loops, with a message saying so."""
    if LOOPS.is_alive():
        note = st.info("Preparing the simulator's compiled loops (numba): loaded from the disk cache in about a "
                       "second, built in about a minute on the first start after an install (`make setup` "
                       "builds them beforehand).", icon=":material/hourglass_top:")
        with st.spinner("Preparing the compiled loops..."):
            LOOPS.join()
        note.empty()


def trace_roots() -> list[Path]:
    """The directories a typed path may name: the project's results and the trace root(s) the app was
    opened on (`perfmodel dashboard --trace-root DIR`, or PERFMODEL_TRACE_ROOT; default ./traces of the
    repository, where `perfmodel capture --out traces` writes)."""
    env = os.environ.get(TRACE_ROOT_ENV, "")
    given = [Path(x).expanduser() for x in env.split(os.pathsep) if x.strip()]
    return [r.resolve() for r in [RESULTS_DIR, *(given or [REPO / "traces"])]]


def roots_text() -> str:
    """The directories a typed path may name, as a user of the page knows them: by what they are and, inside
    the project, by their path in it; never the server's absolute paths."""
    roots = trace_roots()
    inside = [shown_path(r) for r in roots if not Path(shown_path(r)).is_absolute()]
    outside = len(roots) - len(inside)
    return ", ".join(inside + ([f"{outside} trace folder{'s' if outside > 1 else ''} chosen when the dashboard "
                                "was started"] if outside else []))


def confined_path(text: str, field: str = "trace path") -> Path:
    """A typed path, resolved (links followed) and refused unless it lies inside trace_roots().
    A relative path is taken from the repository, else from each root. Messages name the typed text and the
    directories by roots_text (a browser's user sees neither the server's absolute paths nor its flags)."""
    p = Path(text).expanduser()
    roots = trace_roots()
    if not p.is_absolute():
        p = next((base / p for base in (REPO, *roots) if (base / p).exists()), REPO / p)
    try:
        real = p.resolve()
    except (OSError, RuntimeError):
        raise SpecError(field, text, "cannot be resolved (a link loop or an unreadable directory)") from None
    if not any(real == r or r in real.parents for r in roots):
        raise SpecError(field, text, f"is outside the directories this dashboard was opened on ({roots_text()}); "
                        "whoever starts the dashboard chooses the trace folders it may read")
    return real


def callback(fn):
    """A widget callback that never shows a traceback: what it raises is shown as one line on the page."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- the page must never show a traceback
            st.session_state["_callback_error"] = f"{type(e).__name__}: {e}"
    return run


def guarded(render) -> None:
    """Run a view; bad input shows its message, anything unexpected a one-line error, never a traceback."""
    if msg := st.session_state.pop("_callback_error", None):
        st.error(f"Unexpected error in the last action ({msg}). Please report it with the inputs below.")
    try:
        render()
    except SpecError as e:
        st.error(f"Invalid input: {e}")
    except Exception as e:  # noqa: BLE001 -- the page must never show a traceback
        st.error(f"Unexpected error ({type(e).__name__}): {e}. Please report it with the inputs above.")
