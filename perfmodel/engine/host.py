"""The host (XLA:CPU) engine's terms: how the pure-JAX reference runs on this machine's CPU,
from the hostbench components (perfmodel.cost.components host_*), used by the multi-kernel
engine when the hardware file is a host file.
"""
from __future__ import annotations

import math

import numpy as np

from perfmodel.cost import components as cm
from perfmodel.engine.terms import op_weights
from perfmodel.graph.ops import OpGraph
from perfmodel.spec.hardware import Hardware


def host_terms(g: OpGraph, hw: Hardware, t_mem: np.ndarray, bw: float,
               weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | float]:
    """The host (XLA:CPU) engine's terms from the hostbench components: the memory-side time of
    each op (`t_mem`, bytes over `bw`, with the dots and the expert loop by rows, the latent
    cache's widening, fresh pages of each program's temporaries, XLA's copies of the cache stacks,
    kv_b's re-layout and argmax in their place) and each op's share of the program's call and
    thunks. Returns (t_mem, program cost per op)."""
    c, w = hw.components, op_weights(g) if weights is None else weights
    host_launch = 0.0
    experts = max(1.0, math.ceil(g.distinct_experts))
    for j in np.flatnonzero((w > 0) & (g.flops > 0)):
        if g.routed_bytes[j] > 0 and "host_expert_fixed_s" in c:  # its loop over the experts
            t_mem[j] = cm.host_expert_time(c, g.routed_bytes[j], g.tokens, experts)
        else:  # dots: achieved bandwidth by rows
            t_mem[j] = cm.host_dot_time(c, g.static_bytes[j] + g.routed_bytes[j], g.flops[j] / (2 * w[j]))
        t_mem[j] += (g.kv_bytes[j] + g.act_bytes[j]) / bw
    if "host_convert_values_per_s" in c:  # it widens the whole bf16 latent cache to f32 each step,
        # into the program's temporary buffer (whose fresh pages are charged below, once)
        for j in (j for j, name in enumerate(g.name) if name == "mla_attention" and g.kv_bytes[j] > 0):
            t_mem[j] += cm.host_convert_time(c, g.kv_bytes[j] / 2, 0.0) + g.kv_bytes[j] / bw
    first_attn: dict[int, int] = {}  # each layer's first attention op
    for j, (l, p) in enumerate(zip(g.layer.tolist(), g.phase)):
        if p == "attention":
            first_attn.setdefault(l, j)
    kind = {l: g.layer_kind[l].split("+")[0] for l in first_attn}
    op_by_op = hw.launch_overhead_s > 0  # else one program per step (launch_overhead_s = 0)
    if "host_page_fault_s" in c:  # a program's temporaries, host_temp_per_cache_byte[_<phase>] x
        # its caches (counted in the reference's compiled programs by hostbench), are new pages every
        # call above the mmap threshold, faulted in as first written: at its first layer's attention;
        # op by op each attention phase is a program of its own
        step = cm.param(c, "host_temp_per_cache_byte")
        temps = ({l: c.get(f"host_temp_per_cache_byte_attention_{kind[l]}", step) * g.cache_bytes.get(l, 0.0)
                  for l in first_attn} if op_by_op
                 else {min(first_attn): step * sum(g.cache_bytes.values())} if first_attn else {})
        for l, temp in temps.items():
            t_mem[first_attn[l]] += cm.host_fresh_pages_time(c, temp)
    if "host_stack_copy_bytes_per_s" in c:  # XLA copies whole cache stacks and layer slots around
        # their per-layer updates (bytes counted in the compiled programs by hostbench): in one program,
        # host_stack_copies_<kind> x its kind's caches per layer of that kind; op by op, each
        # attention phase host_stack_copies_attention_<kind> x all caches
        stack: dict[str, float] = {}
        for l in first_attn:
            stack[kind[l]] = stack.get(kind[l], 0.0) + g.cache_bytes.get(l, 0.0)
        for l, j in first_attn.items():
            copied = (c.get(f"host_stack_copies_attention_{kind[l]}", 0.0) * sum(stack.values()) if op_by_op
                      else c.get(f"host_stack_copies_{kind[l]}", 0.0) * stack[kind[l]])
            t_mem[j] += cm.host_stack_copy_time(c, copied)
    for l, j in first_attn.items():  # loops of known trip count inside an attention phase (a prefill's
        # recurrence token by token): their bodies' bytes in all iterations (host_loop_bytes_attention_<kind>,
        # counted in the compiled program by perfmodel_jax.capture) at the stream bandwidth
        t_mem[j] += c.get(f"host_loop_bytes_attention_{kind[l]}", 0.0) / bw
    if "host_absorb_bytes_per_s" in c:  # the absorbed MLA re-lays out kv_b before its einsums
        kv_b = np.array([name == "kv_b" for name in g.name]) & (g.static_bytes > 0)
        t_mem = np.where(kv_b, cm.host_absorbed_kv_b_time(c, g.static_bytes) + g.act_bytes / bw, t_mem)
    if "host_argmax_values_per_s" in c:  # greedy sampling: a scalar reduce over f32 logits
        argmax = np.array([name == "argmax" for name in g.name])
        t_mem = np.where(argmax, cm.host_argmax_time(c, g.act_bytes / 4), t_mem)
    if "host_thunk_s" in c:  # one program call per step; each layer phase's XLA:CPU thunks
        # (components.host_thunks_<phase>[_<attention kind>], counted in the reference's compiled
        # HLO by hostbench) shared evenly by its ops; one per op where the file has no count
        phase = ["ffn" if p == "dense" else p for p in g.phase]  # the dense FFN's norm
        keys = [f"host_thunks_{p}_{g.layer_kind[l].split('+')[0]}" if p == "attention" else f"host_thunks_{p}"
                for l, p in zip(g.layer.tolist(), phase)]
        _, group, size = np.unique([f"{l}/{p}" for l, p in zip(g.layer.tolist(), phase)],
                                   return_inverse=True, return_counts=True)
        ops = size[group]
        thunks = np.array([c.get(k, n) for k, n in zip(keys, ops.tolist())], float) / ops
        host_launch = cm.host_program_time(c, thunks, calls=np.arange(len(g)) == 0)
    return t_mem, host_launch
