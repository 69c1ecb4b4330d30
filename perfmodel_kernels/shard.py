"""Tensor and expert parallelism of the megakernel: per-device shapes and weight shards.

On a mesh of `tp` devices (both TensorCores of a chip are devices), device d holds:
- attention: heads d*H/tp .. (q/k/v, decay_b, beta, gates, q_b, kv_b: column shards; o_proj:
  row shard, its partial output all-reduced), and a column shard of the low-rank projections
  q_a, kv_a, decay_a (outputs all-gathered before their norms);
- dense FFN and shared experts: column shards of gate|up (gate and up of the same columns),
  row shards of down (partial output all-reduced);
- MoE: the router replicated; latent_down column shard (all-gathered); routed experts owned by
  `groups` expert-parallel groups of tp/groups devices each, expert e by group e // (E/groups),
  each expert's width split over its group's devices; the routed partial sums are
  reduce-scattered over the latent dimension, latent_up is a row shard;
- embedding: a column shard of the hidden dimension (rows gathered, then all-gathered);
  lm_head: a vocabulary shard (local argmax, then an all-gather of (max, index) pairs).
`DeviceSpec` is the ModelSpec of one device's shapes, so the layout, plan and VMEM code apply
unchanged; bytes per device equal the analytic model's params / tp (router: replicated).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from perfmodel.spec.arch import ModelSpec
from perfmodel.util.errors import positive_int, require

from . import reference

GATHERED = ("q_a", "kv_a", "decay_a", "latent_down")   # column shards all-gathered
ROW_SHARDED = ("o_proj", "down", "shared_down", "latent_up", "expert_down")
GATE_UP = ("gate_up", "shared_gate_up", "expert_gate_up")


@dataclasses.dataclass(frozen=True)
class DeviceSpec(ModelSpec):
    """One device's shapes (heads, widths already local); `tp` devices, `groups` EP groups."""
    tp: int = 1
    groups: int = 1

    @property
    def expert_tp(self) -> int:
        return self.tp // self.groups

    @property
    def local_experts(self) -> int:
        return self.moe.experts // self.groups

    def _shard(self, mms):
        out = []
        for mm in mms:
            if mm.name in GATHERED:
                mm = dataclasses.replace(mm, d_out=mm.d_out // self.tp)
            elif mm.name == "latent_up":
                mm = dataclasses.replace(mm, d_in=mm.d_in // self.tp)
            out.append(mm)
        return out

    def attention_matmuls(self, kind):
        return self._shard(super().attention_matmuls(kind))

    def ffn_matmuls(self, ffn):
        return self._shard(super().ffn_matmuls(ffn))


def device_spec(spec: ModelSpec, tp: int, ep: int | None = None) -> DeviceSpec:
    """The per-device spec for `tp` devices and `ep` expert groups (default: one per device)."""
    positive_int("tp", tp)
    groups = ep or tp
    positive_int("ep", groups)
    require(tp % groups == 0, "ep", groups, f"must divide tp ({tp})")
    rep = {}
    for kind in ("kda", "mla"):
        sub = getattr(spec, kind)
        if sub is not None and spec.count(attention=kind):
            require(sub.heads % tp == 0, "tp", tp, f"must divide {kind} heads ({sub.heads})")
            rep[kind] = dataclasses.replace(sub, heads=sub.heads // tp)
    dims = [("hidden", spec.hidden), ("vocab", spec.vocab)]
    if spec.count(ffn="dense"):
        dims.append(("dense_width", spec.dense_width))
    if spec.mla and spec.count(attention="mla"):
        dims += [("mla.q_lora_rank", spec.mla.q_lora_rank),
                 ("mla.kv_lora_rank + qk_rope_dim", spec.mla.kv_lora_rank + spec.mla.qk_rope_dim)]
    if spec.kda and spec.count(attention="kda"):
        dims.append(("kda.decay_gate_rank", spec.kda.decay_gate_rank))
    if spec.moe and spec.count(ffn="moe"):
        m = spec.moe
        require(m.experts % groups == 0, "ep", groups, f"must divide experts ({m.experts})")
        dims += [("moe.shared_width", m.shared_width), ("moe.latent_dim", m.latent_dim)]
        require(m.expert_width % (tp // groups) == 0, "tp", tp,
                f"tp/ep ({tp // groups}) must divide moe.expert_width ({m.expert_width})")
        rep["moe"] = dataclasses.replace(m, shared_width=m.shared_width // tp,
                                         expert_width=m.expert_width // (tp // groups))
    for name, n in dims:
        require(n % tp == 0, "tp", tp, f"must divide {name} ({n})")
    if spec.count(ffn="dense"):
        rep["dense_width"] = spec.dense_width // tp
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(ModelSpec)}
    return DeviceSpec(**(fields | rep), tp=tp, groups=groups)


def _cols(w, d, n):
    c = w.shape[-1] // n
    return w[..., d * c:(d + 1) * c]


def _rows(w, d, n):
    r = w.shape[-2] // n
    return w[..., d * r:(d + 1) * r, :]


def _gate_up(w, d, n):
    half = w.shape[-1] // 2
    return np.concatenate([_cols(w[..., :half], d, n), _cols(w[..., half:], d, n)], axis=-1)


def shard_weights(weights: reference.Weights, dspec: DeviceSpec, d: int) -> reference.Weights:
    """Device d's weights (reference layout, DeviceSpec shapes) from the full model's."""
    spec, tp = weights.spec, dspec.tp
    np_ = lambda a: np.asarray(a)
    layers = []
    for layer, lw in zip(spec.layers, weights["layers"]):
        out = {}
        for name, w in lw.items():
            w = np_(w)
            if name == "router" or name in ("attn_norm", "ffn_norm", "o_norm", "q_norm",
                                            "kv_norm", "router_bias"):
                out[name] = w
            elif name.startswith("expert_"):
                g, k, n_loc = d // dspec.expert_tp, d % dspec.expert_tp, dspec.local_experts
                w = w[g * n_loc:(g + 1) * n_loc]
                out[name] = _gate_up(w, k, dspec.expert_tp) if name in GATE_UP else \
                    _rows(w, k, dspec.expert_tp)
            elif name in GATE_UP:
                out[name] = _gate_up(w, d, tp)
            elif name in ROW_SHARDED:
                out[name] = _rows(w, d, tp)
            elif name == "conv":  # q|k|v channels: each part sharded by heads
                out[name] = np.concatenate([_cols(p, d, tp) for p in np.split(w, 3, axis=-1)],
                                           axis=-1)
            else:  # column shards (heads, or the gathered low-rank outputs); A_log, dt_bias
                out[name] = _cols(w, d, tp)
        layers.append(out)
    params = {"embed": _cols(np_(weights["embed"]), d, tp), "layers": layers,
              "final_norm": np_(weights["final_norm"]),
              "lm_head": _cols(np_(weights["lm_head"]), d, tp)}
    return reference.Weights(params, reference.StaticSpec(dspec))
