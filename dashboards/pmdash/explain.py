"""Explain view: a per-layer waterfall of the decode step, and one layer term by term
(`perfmodel explain`: bytes, FLOPs, each latency term with its mechanism and source)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from perfmodel.spec.deployment import Deployment
from perfmodel.step.explain import explain
from perfmodel.step.predict import predict

from . import common as c

PARTS = {"compute_s": "compute", "stall_s": "DMA stall", "collective_s": "collectives",
         "overhead_s": "launch / overhead"}


def render() -> None:
    c.init(ex_model="kimi-k3", ex_hw="tpu-v7", ex_engine="megakernel", ex_batch=1, ex_devices=32, ex_tp=32,
           ex_ep=8)
    st.header("Explain: the step layer by layer, each term with its mechanism")
    r = st.columns(7)
    model = c.load_model_ref(c.model_ref(r[0].selectbox("Model", c.model_options(), key="ex_model")))
    hw = c.load_hardware_ref(c.hardware_ref(r[1].selectbox("Hardware", c.hardware_options(), key="ex_hw")))
    engine = r[2].radio("Engine", ("megakernel", "multikernel"), key="ex_engine")
    batch = r[3].select_slider("Batch", list(c.BATCHES), key="ex_batch")
    devices = r[4].number_input("Devices", 1, 4096, key="ex_devices")
    tp = r[5].number_input("TP", 1, 4096, key="ex_tp")
    ep = r[6].number_input("EP groups", 1, 4096, key="ex_ep")
    d = Deployment(devices=int(devices), tp=int(tp), ep=int(ep), engine=engine, batch=batch)
    p = predict(model, hw, d)
    rows = pd.DataFrame([{"layer": x.layer, "kind": x.kind, "time_us": x.time_s * 1e6,
                          **{label: getattr(x, k) * 1e6 for k, label in PARTS.items()}} for x in p.layers])
    fig = go.Figure(go.Waterfall(x=[f"{l} {k}" for l, k in zip(rows.layer, rows.kind)], y=rows.time_us,
                                 measure=["relative"] * len(rows), connector={"visible": False}))
    fig.update_layout(height=320, margin=dict(t=30, b=10), yaxis_title="cumulative step time (us)",
                      title=f"{p.step_s * 1e3:.3f} ms per step, {p.tokens_per_s:.1f} tokens/s")
    st.plotly_chart(fig, width="stretch")
    layer = st.number_input("Layer to explain (0 = embedding, last = head)", 0, int(rows.layer.max()), 1,
                            key="ex_layer")
    out = explain(model, hw, d, int(layer))
    st.dataframe(pd.DataFrame([{"op": o["op"], "MFLOP": o["flops"] / 1e6, "static KB": o["static_bytes"] / 1e3,
                                "routed KB": o["routed_bytes"] / 1e3, "kv KB": o["kv_bytes"] / 1e3,
                                "time us": (o["end_s"] - o["start_s"]) * 1e6, "waited on": o["waited_on"]}
                               for o in out["ops"]]), hide_index=True, width="stretch")
    st.dataframe(pd.DataFrame([{"op": o["op"], "term": t["term"], "us (alone)": t["seconds"] * 1e6,
                                "mechanism": t["mechanism"], "source": t["source"]}
                               for o in out["ops"] for t in o["terms"]]), hide_index=True,
                 width="stretch")
