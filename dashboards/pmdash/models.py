"""Models & hardware view: the presets with their sources; load a config.json or a hardware file.

The tables are static (markdown tables: pmdash.common.static_table), a few dozen rows each."""
from __future__ import annotations

import dataclasses

import pandas as pd
import streamlit as st

from perfmodel.spec import arch, hardware, loaders
from perfmodel.util.errors import SpecError

from . import common as c


def count(n: float) -> str:
    """A parameter count with its unit: 1.24 B, 150 M, 12 k."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f}"


def size(nbytes: float) -> str:
    """Bytes in GB (>= 1 GB) or MiB."""
    v, unit = (nbytes / 1e9, "GB") if nbytes >= 1e9 else (nbytes / c.MiB, "MiB")
    return f"{v:,.0f} {unit}" if v >= 100 else f"{v:.3g} {unit}"


def rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e12:.3g} TB/s" if bytes_per_s >= 1e12 else f"{bytes_per_s / 1e9:.3g} GB/s"


def seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def model_row(name: str, m) -> dict:
    fam = m.params_by_family()
    return {"model": name, "layers": len(m.layers), "hidden": m.hidden,
            "attention": ", ".join(f"{k} x{m.count(attention=k)}" for k in ("kda", "mla", "gqa")
                                   if m.count(attention=k)),
            "experts (top-k)": f"{m.moe.experts} (top-{m.moe.top_k})" if m.moe else "-",
            "parameters": count(m.total_params), "routed-expert parameters": count(fam.get("routed_expert", 0)),
            "weights": size(m.weight_bytes()), "routed format": m.formats["routed_expert"].name,
            "sources": "; ".join(f"{k}: {v}" for k, v in m.sources.items())}


def hardware_row(name: str, h) -> dict:
    return {"hardware": name, "kind": h.kind, "cores per chip": h.cores_per_chip,
            "bf16 per chip": f"{h.peak_flops_per_s['bf16'] / 1e12:,.0f} TFLOP/s",
            "fp8 per chip": (f"{h.peak_flops_per_s['fp8'] / 1e12:,.0f} TFLOP/s" if "fp8" in h.peak_flops_per_s
                             else "-"),
            "HBM per chip": size(h.hbm_bytes), "HBM bandwidth": rate(h.hbm_bandwidth_bytes_per_s),
            "on-chip per core": f"{size(h.onchip_bytes)} {h.onchip_kind}",
            "link per direction": rate(h.link_bandwidth_bytes_per_s), "link latency": seconds(h.link_latency_s),
            "launch overhead": seconds(h.launch_overhead_s),
            "efficiency": ", ".join(f"{k}={v:g}" for k, v in dataclasses.asdict(h.efficiency).items())}


def field_value(name: str, v) -> str:
    """A hardware field with its unit."""
    if isinstance(v, dict):
        return ", ".join(f"{k} {x / 1e12:,.0f} TFLOP/s" for k, x in v.items())
    if isinstance(v, bool) or isinstance(v, str):
        return str(v)
    if name.endswith("_bytes_per_s"):
        return rate(v)
    if name.endswith("_bytes"):
        return size(v)
    if name.endswith("_s"):
        return seconds(v)
    return f"{v:.6g}" if isinstance(v, float) else str(v)


@st.cache_data(show_spinner=False)
def preset_tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Static: the bundled presets (cached for the process)."""
    ms = pd.DataFrame([model_row(n, loaders.load_model(n)) for n in arch.list_presets()])
    hs = pd.DataFrame([hardware_row(n, hardware.load_hardware(n)) for n in hardware.list_presets()])
    return ms, hs


def hardware_fields(h) -> pd.DataFrame:
    rows = []
    for f in dataclasses.fields(h):
        if f.name in ("sources", "name"):
            continue
        v = getattr(h, f.name)
        if f.name == "efficiency":
            for k, ev in dataclasses.asdict(v).items():
                rows.append({"field": f"efficiency.{k}", "value": f"{ev:g}",
                             "source": h.sources.get(f"efficiency.{k}", h.sources.get("efficiency", ""))})
            continue
        rows.append({"field": f.name, "value": field_value(f.name, v), "source": h.sources.get(f.name, "")})
    return pd.DataFrame(rows)


def model_fields(m) -> pd.DataFrame:
    rows = [{"field": "layers", "value": str(len(m.layers))}, {"field": "hidden", "value": str(m.hidden)},
            {"field": "vocab", "value": str(m.vocab)}]
    for sec in ("kda", "mla", "gqa", "moe"):
        obj = getattr(m, sec)
        if obj is not None:
            rows += [{"field": f"{sec}.{k}", "value": str(v)} for k, v in dataclasses.asdict(obj).items()]
    rows.append({"field": "ffn.dense_width", "value": str(m.dense_width)})
    rows += [{"field": f"formats.{k}", "value": f.name} for k, f in m.formats.items()]
    rows += [{"field": f"params.{k}", "value": count(v)} for k, v in m.params_by_family().items()]
    return pd.DataFrame(rows)


OVERVIEW_HIDDEN = {"sources", "efficiency"}  # long texts: in the details (and the downloads), not the overview


def render() -> None:
    st.header("Models and hardware")
    ms, hs = preset_tables()
    st.subheader("Model presets")
    c.static_table(ms.drop(columns=[k for k in OVERVIEW_HIDDEN if k in ms]))
    c.downloads(ms, "model_presets", "mh_models_dl")
    st.subheader("Hardware presets")
    c.static_table(hs.drop(columns=[k for k in OVERVIEW_HIDDEN if k in hs]))
    c.downloads(hs, "hardware_presets", "mh_hw_dl")
    st.caption("Every number's source and the efficiency parameters: in the details of a preset below (and in the "
               "downloads).")
    c.show_command("perfmodel list --json")

    details = st.container()  # filled after the uploads, so new files are choices at once
    st.subheader("Load your own")
    st.caption("A Hugging Face `config.json` (DeepSeek / Kimi / Llama style keys) or a model `.toml` in the "
               "preset schema (perfmodel/presets/models); a hardware `.toml` in the preset schema "
               "(perfmodel/presets/hardware: every number needs a `[sources]` entry). Loaded files become "
               "choices in the Compare and What-if views for this session.")
    a, b = st.columns(2)
    for col, kind, key in ((a, "model", "mh_model_upload"), (b, "hardware", "mh_hw_upload")):
        with col:
            up = st.file_uploader(f"{kind.capitalize()} file", key=key)
            if up is None:
                continue
            try:
                name = c.register_upload(kind, up.name, up.getvalue())
            except SpecError as e:
                st.error(f"Could not load {up.name}: {e}")
                continue
            st.success(f"Loaded {up.name} as '{name}': now selectable in Compare and What-if.")
            if kind == "model":
                c.static_table(pd.DataFrame([model_row(name, c.load_model_ref(c.model_ref(name)))]))
            else:
                c.static_table(hardware_fields(c.load_hardware_ref(c.hardware_ref(name))))

    with details:
        st.subheader("Details and sources")
        left, right = st.columns(2)
        with left:
            c.init(mh_model="kimi-k3", mh_hw_pick="tpu-v7")
            mname = st.selectbox("Model", c.model_options(), key="mh_model")
            m = c.load_model_ref(c.model_ref(mname))
            mf = model_fields(m)
            c.static_table(mf)
            c.downloads(mf, f"model_{m.name}", "mh_model_fields_dl", {"sources": m.sources})
            c.sources_expander("mh_model_sources_exp", [f"{k}: {v}" for k, v in m.sources.items()],
                               f"Sources of {mname}")
        with right:
            hname = st.selectbox("Hardware", c.hardware_options(), key="mh_hw_pick")
            h = c.load_hardware_ref(c.hardware_ref(hname))
            hf = hardware_fields(h)
            refs, sources = c.numbered_sources(list(hf["source"]), what=False)
            c.static_table(hf.assign(source=refs))
            c.downloads(hf, f"hardware_{h.name}", "mh_hw_fields_dl")
            c.sources_expander("mh_hw_sources_exp", sources, f"Sources of {hname}")

