"""Fit each component's parameters to its own micro-benchmarks (`perfmodel calibrate`).

A micro-benchmark file (perfmodel/data/microbench/*.json) lists entries, each one mechanism
with the inputs needed to predict it, the measured value and its public source. Parameters are
grouped by mechanism (GROUPS; an entry's `fits` field overrides, for a composed stream whose
time the MXU sets); a group is fitted (least squares on log error) only on the
entries of its own mechanisms, the other groups held at their current values, in the order
below, twice (the stream benchmarks compose the DMA and MXU groups). A file's `fit` table may
name the parameters a group fits on its platform (a subset, or one of the group's OPTIONAL ones
that its entries determine). Entries marked `not_modelled` are printed with the reason and never
fitted. A few hardware fields are not fitted but taken as measured from a mechanism's entries
(MEASURED: the multi-kernel engine's per-op cost on a TPU is the time of one small XLA op in a
chain of them), their source naming the entries and the file.

CLI: `perfmodel calibrate --microbench FILE [--hardware NAME] [--out FILE] [--json]`.
"""
from __future__ import annotations

import dataclasses
import math
from datetime import date
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from perfmodel.cost import components as cm
from perfmodel.graph.ops import kda_flops
from perfmodel.spec.hardware import Hardware
from perfmodel.spec.recipe import TOP_K
from perfmodel.util import schema
from perfmodel.util.checks import BOOL, STR, ListOf, Num, OneOf, Req, check_tree
from perfmodel.util.errors import SpecError, in_file, require
from perfmodel.util.files import check_path

DATA_DIR = Path(__file__).parents[1] / "data" / "microbench"
TARGET = 0.10  # the bound a fitted entry's residual is judged against, unless its file sets `target`
UNITS = {"us_per_layer": 1e-6, "us_per_step": 1e-6, "us_per_expert": 1e-6, "us_per_copy": 1e-6,
         "us_per_collective": 1e-6, "us_per_dot": 1e-6, "us_per_tile": 1e-6, "us_per_call": 1e-6,
         "us_per_kernel": 1e-6, "us_per_op": 1e-6, "us_per_trip": 1e-6, "us_per_attention": 1e-6,
         "ms_per_dot": 1e-3, "GB_per_s": 1e9, "fraction_of_hbm_bandwidth": 1.0, "s": 1.0}
# group -> (its parameters, the mechanisms whose micro-benchmarks fit them)
GROUPS = {
    # dma_latency_s is not here: the stream entries are timed whole calls of 16 layers or
    # differences of calls, so a copy's first-byte latency barely enters them (it is fitted, with
    # dma_concurrent_copies, to the phase profile: experiments/phase_split.py); a file whose
    # entries determine it (a ring kept one copy in flight) adds it by its `fit` table (OPTIONAL)
    "dma": (("dma_bandwidth_bytes_per_s", "dma_descriptor_s"),
            ("weight_stream", "expert_stream", "dma_ring", "dma_queue", "ring_dot")),
    "mxu": (("mxu_push_bf16_s", "mxu_push_fp8_s", "mxu_row_s", "mxu_dot_issue_s"),
            ("mxu_push", "matmul")),
    "vpu_dequant": (("vpu_dequant_s",), ("dequant_matmul",)),
    "vpu_decode": (tuple(f"vpu_decode_{k}_s" for k in cm.DECODE_KINDS), ("expert_column",)),
    "expert_pass": (tuple(f"expert_pass_{k}_s" for k in cm.DECODE_KINDS), ("expert_kernel_columns",)),
    "remote_copy": (("sibling_latency_s", "sibling_bandwidth_bytes_per_s", "cross_chip_latency_s",
                     "link_bandwidth_bytes_per_s"), ("remote_copy", "link_bandwidth")),
    "collective": (("collective_call_s", "collective_phase_s", "collective_copy_issue_s",
                    "chip_bandwidth_bytes_per_s"), ("collective",)),
    "vpu": (("topk_round_s", "attention_core_s"), ("topk", "attention_core", "attention_core_tiles", "kda_core")),
    "xla_glue": (("xla_embedding_s",), ("xla_glue",)),
    "host": (("host_dispatch_s",), ("host_dispatch",)),
    "gpu_launch": (("kernel_launch_s",), ("kernel_launch",)),
    "gpu_graph_overlap": (("graph_kernel_overlap_s",), ("pdl_kernel_pair",)),
    "gpu_all_reduce": (("allreduce_base_s", "allreduce_per_peer_s", "allreduce_bytes_per_s"),
                       ("gpu_all_reduce",)),
    "gpu_kernel": (("kernel_bandwidth_efficiency",), ("engine_bandwidth_fraction",)),
    "host_dot": (("dot_gemv_bandwidth_bytes_per_s", "dot_gemm_bandwidth_bytes_per_s", "dot_gemm_row_s_per_byte",
                  "dot_fixed_s"),
                 ("host_dot",)),
    "xla_dot": (("xla_dot_fixed_s", "xla_dot_bandwidth_bytes_per_s"), ("xla_dot",)),
    "xla_copy": (("xla_copy_bandwidth_bytes_per_s",), ("xla_copy",)),
    "embed": (("embed_pick_s",), ("embed_pick",)),
    "xla_expert": (("xla_expert_trip_s", "xla_expert_bandwidth_bytes_per_s", "xla_expert_row_s_per_byte"),
                   ("xla_expert_loop",)),
    "host_expert": (("host_expert_fixed_s", "host_expert_bandwidth_bytes_per_s", "host_expert_row_s_per_byte"),
                    ("host_expert_loop",)),
    "host_convert": (("host_convert_values_per_s", "host_convert_reused_values_per_s"), ("host_convert",)),
    "host_program": (("host_call_s", "host_thunk_s"), ("host_program",)),
    "host_pages": (("host_fill_bytes_per_s", "host_page_fault_s"), ("host_temp_pages",)),
    "host_stack_copy": (("host_stack_copy_bytes_per_s",), ("host_stack_copy",)),
    "host_argmax": (("host_argmax_values_per_s",), ("host_argmax",)),
    "host_absorb": (("host_absorb_fixed_s", "host_absorb_bytes_per_s"), ("host_absorbed_kv_b",)),
}
# hardware fields set to what a mechanism's entries measure (their median), not fitted: the per-op
# cost of XLA's ops (perfmodel.engine.terms.launch_s), from a chain of small dependent XLA ops
# (experiments/tpu_microbench.py, xla_ops)
MEASURED = {"xla_op": "launch_overhead_s"}
# parameters a file's `fit` table may add to a group where its entries determine them: a ring of
# copies kept one in flight exposes the first-byte latency, an attention core timed by cached
# tokens its cost per cache tile, a KDA core by heads and batch the vector unit's rate
# (experiments/tpu_microbench.py)
OPTIONAL = {"dma": ("dma_latency_s",), "vpu": ("attention_tile_s", "vpu_flops_per_s")}


# what each mechanism's entries must give as inputs (a fit reads every one of them)
_BYTES = Num(0, 2**50, lo_open=True)
_N = Num(1, 2**31, integer=True)
_DTYPE = OneOf("bf16", "fp8", "int8", "int4", "fp4", "f32")
INPUTS = {
    "weight_stream": {"bytes": Req(_BYTES), "bank_bytes": Req(_BYTES), "dtype": Req(_DTYPE), "rows": Req(_N),
                      "dots_per_layer": Num(0, 2**31, integer=True), "dots_per_bank": Num(0, 2**31, integer=True),
                      "layers_per_call": _N, "difference_of_calls": (BOOL,)},
    "expert_stream": {"bytes": Req(_BYTES), "descriptors": Req(_N)},
    "dma_ring": {"bytes": Req(_BYTES), "in_flight": Req(_N), "lanes": _N, "dtype": _DTYPE},
    "dma_queue": {"bytes": Req(_BYTES), "big_bytes": Req(_BYTES), "ahead": Req(_N), "order": Req(OneOf("small last"))},
    "mxu_push": {"dtype": Req(_DTYPE)},
    "matmul": {"k": Req(_N), "n": Req(_N), "k_chunk": Req(_N), "lhs_rows_per_chunk": Req(_N), "dtype": Req(_DTYPE),
               "rows": _N},
    "expert_column": {"format": Req((STR,)), "decode": Req(OneOf("", *cm.DECODE_KINDS)), "feed": Req(OneOf("bf16")),
                      "tile": Req(_N), "rows": Req(_N), "row_tiles": Req(_N)},
    "expert_kernel_columns": {"format": Req((STR,)), "decode": Req(OneOf("", *cm.DECODE_KINDS)), "tile": Req(_N),
                              "rows": Req(_N), "row_tiles": Req(_N), "column_blocks": Req(_N),
                              "column_group": Req(_N), "slice": (STR,), "matrix": Num(0, 2**31, integer=True), "chunk": _N},
    "dequant_matmul": {"k": Req(_N), "n": Req(_N), "k_chunk": Req(_N), "lhs_rows_per_chunk": Req(_N),
                       "dtype": Req(_DTYPE), "rows": _N},
    "remote_copy": {"bytes": Req(_BYTES), "path": Req(OneOf("sibling", "cross_chip"))},
    "link_bandwidth": {"links": Req(_N)},
    "collective": {"kind": Req(OneOf(*cm.ALGORITHMS)), "payload_bytes": Req(_BYTES), "devices": Req(_N),
                   "cores_per_chip": Req(_N), "algorithm": Req((STR,)), "shard": (STR,)},
    "topk": {"algorithm": Req(OneOf(*TOP_K)), "k": Req(_N), "experts": _N},
    "attention_core": {"sequences": Req(_N), "kind": (STR,), "q_heads_per_core": _N, "kv_heads_per_core": _N,
                       "head_dim": _N},
    "attention_core_tiles": {"tiles": Req(_N), "kind": (STR,), "tokens": _N, "rows": _N, "rank": _N, "rope": _N,
                             "cache_block": _N},
    "kda_core": {"batch": Req(_N), "heads": Req(_N), "head_dim": Req(_N), "conv_width": Req(_N), "slice": (STR,),
                 "rows": _N},
    "xla_glue": {}, "host_dispatch": {}, "kernel_launch": {},
    "pdl_kernel_pair": {"without_pdl_us": Req(Num(0, lo_open=True)), "with_pdl_us": Req(Num(0, lo_open=True))},
    "gpu_all_reduce": {"bytes": Req(_BYTES), "ranks": Req(_N)},
    "host_dot": {"bytes": Req(_BYTES), "rows": Req(_N)},
    "host_convert": {"values": Req(_N), "allocated_bytes": Req(Num(0, 2**50))},
    "host_program": {"thunks": Req(_N)},
    "host_temp_pages": {"bytes": Req(_BYTES)}, "host_stack_copy": {"bytes": Req(_BYTES)},
    "host_absorbed_kv_b": {"bytes": Req(_BYTES)}, "host_argmax": {"values": Req(_N)},
    "host_expert_loop": {"bytes": Req(_BYTES), "rows": Req(_N), "experts": Req(_N)},
    "xla_dot": {"bytes": Req(_BYTES), "m": _N, "k": _N, "n": _N, "dtype": _DTYPE},
    "xla_copy": {"bytes": Req(_BYTES), "batch": _N, "tokens": _N, "width": _N},
    "embed_pick": {"values": Req(_N), "rows": _N, "tile_rows": _N, "hidden": _N, "batch": _N, "slice": (STR,)},
    "ring_dot": {"bytes": Req(_BYTES), "in_flight": Req(_N), "bank_rows": Req(_N), "lanes": Req(_N),
                 "rows": Req(_N)},
    "xla_expert_loop": {"bytes": Req(_BYTES), "rows": Req(_N), "latent": _N, "width": _N, "experts": _N},
    "engine_bandwidth_fraction": {"model": Req((STR,)), "devices": Req(_N), "batch": Req(_N)},
}
ENTRY = {"id": Req((STR,)), "mechanism": Req((STR,)), "inputs": Req({"*": None}), "value": Req(Num(0, lo_open=True)),
         "unit": Req(OneOf(*UNITS)), "source": Req((STR,)), "scope": (STR,), "platform": (STR,),
         "not_modelled": (STR,), "notes": (STR,), "fits": OneOf(*GROUPS)}
FILE = {"entries": Req(ListOf(ENTRY, 1)), "platform": (STR,), "what": (STR,), "source": (STR,),
        "context": {"*": None}, "fit": {"*": {"*": ListOf((STR,), 1)}}, "target": Num(0, 1, lo_open=True)}


def load(path: str | Path) -> dict:
    """A micro-benchmark file (a path, or a file name in perfmodel/data/microbench), checked: the
    schema above, each entry's inputs those its mechanism needs, ids unique, and every entry
    either fitted by a group or marked `not_modelled`."""
    p = check_path("--microbench", path)
    if not p.exists() and (DATA_DIR / p).exists():
        p = DATA_DIR / p
    data = schema.load(p, FILE, "--microbench", fmt="json")
    with in_file(p):
        seen = set()
        for i, e in enumerate(data["entries"]):
            where = f"entries[{i}]"
            require(e["id"] not in seen, f"{where}.id", e["id"], "used by an earlier entry")
            seen.add(e["id"])
            if e["mechanism"] in INPUTS:  # predicted for the residual table even when not fitted
                check_tree(e["inputs"], INPUTS[e["mechanism"]], f"{where}.inputs", 1)
            if e.get("not_modelled") is not None:
                continue
            require(e["mechanism"] in INPUTS, f"{where}.mechanism", e["mechanism"],
                    f"no component models it; one of {', '.join(INPUTS)}, or mark the entry not_modelled")
            require(group_of(e) is not None, f"{where}.mechanism", e["mechanism"],
                    "no group fits it: give `fits` or mark the entry not_modelled")
        for platform, groups in data.get("fit", {}).items():
            for g, names in groups.items():
                require(g in GROUPS, f"fit.{platform}.{g}", g, f"unknown group; known: {', '.join(GROUPS)}")
                known = GROUPS[g][0] + OPTIONAL.get(g, ())
                for n in names:
                    require(n in known, f"fit.{platform}.{g}", n, f"not a parameter of the group; "
                            f"known: {', '.join(known)}")
    return data


def group_of(e: dict) -> str | None:
    """The group an entry calibrates: its `fits` field (a composed stream that is MXU-bound), or
    the group of its mechanism."""
    return e.get("fits") or next((g for g, (_, mechs) in GROUPS.items() if e["mechanism"] in mechs), None)


def weight_stream_time(c: dict, i: dict) -> float:
    """A ring of banks streamed by the DMA engine (FIFO, deep enough to stay DMA-bound), each
    bank consumed by matmuls of `rows` rows as soon as it lands and the previous one is done.
    As the entry was timed: by default one cold stream of `bytes`; with `layers_per_call` N, one
    device call streaming N such layers back to back, its dispatch and first-byte latency
    included, divided by N; with `difference_of_calls`, the bytes streamed after others in the
    same call, timed as the difference of two calls (neither dispatch nor latency in it)."""
    banks = math.ceil(i["bytes"] / i["bank_bytes"])
    per_bank = cm.dma_stream_time(c, i["bank_bytes"], 1, cold=False)
    dots = i.get("dots_per_layer", i.get("dots_per_bank", 0) * banks) / banks
    weights = i["bank_bytes"] / (1 if i["dtype"] == "int8" else 2)
    work = cm.matmul_time(c, weights, i["dtype"], i["rows"], dots) if dots else 0.0
    layers = i.get("layers_per_call", 1)
    warm = i.get("difference_of_calls", False)
    t = 0.0 if warm else cm.param(c, "dma_latency_s")
    done = 0.0
    for b in range(banks * layers):
        done = max(t + (b + 1) * per_bank, done) + work
    if "layers_per_call" in i:
        done += cm.device_call_time(c)
    return done / layers


def dma_ring_time(c: dict, nbytes: float, in_flight: int) -> float:
    """Per copy, in steady state, a ring of `in_flight` copies of `nbytes` kept outstanding (the
    next issued as the oldest is waited for): a copy's whole time (first-byte latency, descriptor,
    bytes) shared by the copies in flight, and no less than its descriptor and bytes (the engine
    busy throughout). One in flight: latency + descriptor + bytes, a copy's issue-to-wait time."""
    return max(cm.dma_stream_time(c, nbytes, 1, cold=True) / in_flight,
               cm.dma_stream_time(c, nbytes, 1, cold=False))


def predict_entry(e: dict, hw: Hardware) -> float:
    """The component model's value for one entry, in the entry's unit."""
    c, i, m = hw.components, e["inputs"], e["mechanism"]
    if m == "weight_stream":
        t = weight_stream_time(c, i)
    elif m == "expert_stream":
        t = cm.dma_stream_time(c, i["bytes"], i["descriptors"], cold=False)
    elif m == "dma_ring":
        t = dma_ring_time(c, i["bytes"], i["in_flight"])
    elif m == "ring_dot":   # a bank's copy and one dot against it overlap: the longer of the two
        t = max(dma_ring_time(c, i["bytes"], i["in_flight"]),
                cm.matmul_time(c, i["bank_rows"] * i["lanes"], "bf16", i["rows"], 1))
    elif m == "dma_queue":  # served in issue order: the small copy waits for the bytes ahead of it
        t = i["ahead"] * cm.dma_stream_time(c, i["big_bytes"], 1, cold=False)
    elif m == "mxu_push":
        t = cm.mxu_push_s(c, i["dtype"])
    elif m == "matmul":
        chunks = i["k"] // i["k_chunk"]
        t = cm.matmul_time(c, i["k"] * i["n"], i["dtype"], i["lhs_rows_per_chunk"], chunks)
    elif m == "expert_column":   # per tile: r tiles decoded (not bf16), then one dot over them
        w = i["row_tiles"] * i["tile"] ** 2
        t = (cm.matmul_time(c, w, "bf16", i["rows"], 1)
             + (cm.vpu_decode_time(c, w, i["decode"]) if i["decode"] else 0.0)) / i["row_tiles"]
    elif m == "expert_kernel_columns":   # per tile: the matrix decoded in passes, one dot a column block
        n_t = i["row_tiles"] * i["column_blocks"]
        w = n_t * i["tile"] ** 2
        t = (cm.matmul_time(c, w, "bf16", i["rows"], 1) + cm.vpu_decode_time(c, w, i["decode"])
             + cm.decode_pass_time(c, -(-i["column_blocks"] // i["column_group"]), i["decode"])) / n_t
    elif m == "dequant_matmul":
        t = cm.dequant_matmul_time(c, i["k"] * i["n"], i["lhs_rows_per_chunk"])
    elif m == "remote_copy":
        t = cm.remote_copy_time(c, i["bytes"], i["path"])
    elif m == "link_bandwidth":
        return i["links"] * cm.param(c, "link_bandwidth_bytes_per_s") / UNITS[e["unit"]]
    elif m == "collective":
        t = cm.collective_time(c, i["kind"], i["payload_bytes"], i["devices"], i["cores_per_chip"],
                               i["algorithm"])[0]
    elif m == "topk":
        t = cm.topk_time(c, i["algorithm"], i["k"])
    elif m == "attention_core":
        t = cm.attention_core_time(c, i["sequences"])
    elif m == "attention_core_tiles":  # one sequence over its cached tiles
        t = cm.attention_core_time(c, 1, i["tiles"])
    elif m == "kda_core":  # one token a sequence, every sequence at once
        t = cm.recurrence_time(c, kda_flops(i["batch"], i["heads"], i["head_dim"], i["conv_width"]))
    elif m == "xla_glue":
        t = cm.xla_embedding_time(c)
    elif m == "host_dispatch":
        t = cm.device_call_time(c)
    elif m == "kernel_launch":
        t = cm.kernel_launch_time(c)
    elif m == "pdl_kernel_pair":
        t = cm.graph_overlap_time(c)
    elif m == "gpu_all_reduce":
        t = cm.gpu_all_reduce_time(c, i["bytes"], i["ranks"])
    elif m == "host_dot":
        t = cm.host_dot_time(c, i["bytes"], i["rows"])
    elif m == "host_convert":
        t = cm.host_convert_time(c, i["values"], i["allocated_bytes"])
    elif m == "host_program":
        t = cm.host_program_time(c, i["thunks"])
    elif m == "host_temp_pages":
        t = cm.host_temp_fill_time(c, i["bytes"])
    elif m == "host_stack_copy":
        t = cm.param(c, "host_call_s") + cm.host_stack_copy_time(c, i["bytes"])
    elif m == "host_absorbed_kv_b":
        t = cm.host_absorbed_kv_b_time(c, i["bytes"])
    elif m == "host_argmax":
        t = cm.host_argmax_time(c, i["values"])
    elif m == "host_expert_loop":
        t = cm.host_expert_time(c, i["bytes"], i["rows"], i["experts"]) / i["experts"]
    elif m == "xla_dot":
        t = cm.xla_dot_time(c, i["bytes"])
    elif m == "embed_pick":
        t = cm.embed_pick_time(c, i["values"])
    elif m == "xla_copy":   # a buffer copied as the reference copies its cache (placed alike)
        t = cm.xla_cache_copy_time(c, i["bytes"], hw.onchip_bytes)
    elif m == "xla_expert_loop":  # per trip: bytes are one expert's
        t = cm.xla_expert_time(c, i["bytes"], i["rows"], 1)
    elif m == "engine_bandwidth_fraction":
        return engine_bandwidth_fraction(hw, i)
    else:
        raise SpecError(f"entry {e['id']}.mechanism", m, "no component models it")
    return t / UNITS[e["unit"]]


def engine_bandwidth_fraction(hw: Hardware, i: dict) -> float:
    """HBM floor / step of the multi-kernel engine on `i['model']` (one sequence, one device)."""
    from perfmodel.spec.deployment import Deployment
    from perfmodel.spec.loaders import load_model
    from perfmodel.step.predict import predict
    p = predict(load_model(i["model"]), hw, Deployment(devices=i["devices"], tp=i["devices"],
                                                       engine="multikernel", batch=i["batch"]))
    return p.hbm_utilisation


def modelled(data: dict, platform: str) -> list[dict]:
    return [e for e in data["entries"] if not e.get("not_modelled")
            and e.get("platform", data.get("platform")) == platform]


def upper_bound(hw: Hardware, name: str) -> float:
    """Physical ceilings: a core's DMA cannot outrun its share of HBM; an efficiency is <= 1."""
    if name == "dma_bandwidth_bytes_per_s":
        return hw.core_hbm_bandwidth_bytes_per_s
    return 1.0 if name == "kernel_bandwidth_efficiency" else np.inf


def fit(data: dict, hw: Hardware) -> Hardware:
    """Each group's parameters on its own entries for this platform (log least squares, >= 0)."""
    entries = modelled(data, hw.name)
    fit_override = data.get("fit", {}).get(hw.name, {})
    for _ in range(2):
        for g, (names, _) in GROUPS.items():
            own = [e for e in entries if group_of(e) == g]
            names = [n for n in fit_override.get(g, names)]
            if not own:
                continue
            missing = [n for n in names if n not in hw.components]
            require(not missing, f"components.{missing[0] if missing else ''}", None,
                    f"needs a starting value in the {hw.name} hardware file")
            zero = [n for n in names if not hw.components[n] > 0]
            require(not zero, f"components.{zero[0] if zero else ''}", hw.components.get(zero[0]) if zero else None,
                    f"needs a positive starting value in the {hw.name} hardware file (the fit is in log space)")
            x0 = np.log([hw.components[n] for n in names])
            hi = np.log([upper_bound(hw, n) for n in names])
            x0 = np.minimum(x0, hi - 1e-6)

            def residuals(x, own=own, names=names):
                h = dataclasses.replace(hw, components={**hw.components, **dict(zip(names, np.exp(x)))})
                return [math.log(max(predict_entry(e, h), 1e-30) / e["value"]) for e in own]

            res = least_squares(residuals, x0, bounds=(-np.inf, hi), diff_step=1e-4)
            hw = dataclasses.replace(hw, components={**hw.components,
                                                     **{n: float(v) for n, v in zip(names, np.exp(res.x))}})
    return hw


def target(data: dict) -> float:
    """The |residual| a fitted entry of this file must stay within: its `target`, else TARGET."""
    return data.get("target", TARGET)


def residual_table(data: dict, hw: Hardware) -> list[dict]:
    rows, bound = [], target(data)
    for e in data["entries"]:
        if e.get("platform", data.get("platform")) != hw.name:
            continue
        r = {"id": e["id"], "mechanism": e["mechanism"], "group": group_of(e), "measured": e["value"],
             "unit": e["unit"], "source": e["source"]}
        try:
            p = predict_entry(e, hw)
        except SpecError:
            p = None
        err = None if p is None else p / e["value"] - 1
        r.update(predicted=p, error=err, within_target=None if e.get("not_modelled") else abs(err) <= bound)
        if e.get("not_modelled"):
            r["not_modelled"] = e["not_modelled"]
        rows.append(r)
    return rows


def measured_fields(data: dict, hw: Hardware, source_name: str) -> tuple[dict, dict]:
    """(fields, their sources) of `hw` that this platform's entries measure directly (MEASURED)."""
    fields, sources = {}, {}
    for mech, name in MEASURED.items():
        own = [e for e in data["entries"] if e["mechanism"] == mech
               and e.get("platform", data.get("platform")) == hw.name]
        if not own:
            continue
        fields[name] = float(np.median([e["value"] * UNITS[e["unit"]] for e in own]))
        sources[name] = (f"measured: {', '.join(e['id'] for e in own)} of {source_name} (perfmodel calibrate "
                         f"--microbench {source_name} on {date.today()}: {own[0].get('scope', mech)}"
                         f"{', the median' if len(own) > 1 else ''})")
    return fields, sources


def calibrated(data: dict, hw: Hardware, source_name: str) -> Hardware:
    """`hw` with every fitted group's parameters replaced, the fields its entries measure
    (MEASURED) set, and their provenance."""
    fields, measured = measured_fields(data, hw, source_name)
    new = fit(data, hw).replace(**fields)
    sources = dict(hw.sources) | measured
    rows = residual_table(data, new)
    for g, (names, _) in GROUPS.items():
        ids = [r["id"] for r in rows if r["group"] == g and r["within_target"] is not None]
        if not ids:
            continue
        worst = max(abs(r["error"]) for r in rows if r["id"] in ids)
        for n in data.get("fit", {}).get(hw.name, {}).get(g, names):
            sources[f"components.{n}"] = (f"fitted by perfmodel calibrate --microbench {source_name} on "
                                          f"{date.today()} to {', '.join(ids)} (max |residual| "
                                          f"{100 * worst:.1f} %)")
    return dataclasses.replace(new, sources=sources)
