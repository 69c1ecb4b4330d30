"""How a model is served: devices, parallel layout, engine, batch, context, speculative decoding."""
from __future__ import annotations

from dataclasses import dataclass

from .arch import ModelSpec
from .errors import SpecError, positive_int, require
from .hardware import Hardware

ENGINES = ("megakernel", "multikernel")


@dataclass(frozen=True)
class SpecDecode:
    """Speculative decoding: `draft_rows` drafted tokens verified per step with one anchor row.

    Give the acceptance either as a per-token probability (`acceptance_prob`) or directly as the
    acceptance length tau (`acceptance_length`: tokens per step, bonus token included).
    `draft_cost_fraction` is the drafter's time as a fraction of the verification step.
    """
    draft_rows: int
    acceptance_prob: float | None = None
    acceptance_length: float | None = None
    draft_cost_fraction: float = 0.05

    def __post_init__(self):
        positive_int("spec.draft_rows", self.draft_rows)
        require((self.acceptance_prob is None) != (self.acceptance_length is None), "spec.acceptance",
                (self.acceptance_prob, self.acceptance_length), "give exactly one of prob or length")
        if self.acceptance_prob is not None:
            require(0 <= self.acceptance_prob < 1, "spec.acceptance_prob", self.acceptance_prob,
                    "must be in [0, 1)")
        if self.acceptance_length is not None:
            require(1 <= self.acceptance_length <= self.draft_rows + 1, "spec.acceptance_length",
                    self.acceptance_length, f"must be in [1, draft_rows + 1 = {self.draft_rows + 1}]")
        require(self.draft_cost_fraction >= 0, "spec.draft_cost_fraction", self.draft_cost_fraction,
                "must be >= 0")

    @property
    def rows(self) -> int:
        return self.draft_rows + 1

    @property
    def tokens_per_step(self) -> float:
        """Expected accepted tokens per verification step: (1 - a^(g+1)) / (1 - a), or tau."""
        if self.acceptance_length is not None:
            return self.acceptance_length
        a, g = self.acceptance_prob, self.draft_rows
        return (1 - a ** (g + 1)) / (1 - a)


@dataclass(frozen=True)
class Deployment:
    devices: int                  # JAX devices (TPU v7: 2 per chip) or GPUs
    tp: int                       # tensor parallel degree of attention / dense / shared weights
    engine: str = "megakernel"
    ep: int | None = None         # expert-parallel groups (None: one group per device)
    batch: int = 1                # sequences decoded together
    context: int = 4096           # tokens already in each sequence's cache
    prefetch_bytes: float | None = None  # megakernel ring depth in bytes (None: as VMEM allows)
    expert_slots: int | None = None      # megakernel expert buffers (None: top_k)
    spec: SpecDecode | None = None
    routing_skew: float | None = None    # None: the model preset's [moe] routing_skew

    @property
    def expert_groups(self) -> int:
        return self.ep or self.devices

    @property
    def dp(self) -> int:
        """Attention data-parallel replicas; each decodes ceil(batch / dp) sequences."""
        return self.devices // self.tp

    @property
    def rows_per_seq(self) -> int:
        return self.spec.rows if self.spec else 1


def validate(model: ModelSpec, hw: Hardware, d: Deployment) -> None:
    """Refuse layouts that cannot run, naming the field and value."""
    positive_int("devices", d.devices), positive_int("tp", d.tp), positive_int("batch", d.batch)
    require(isinstance(d.context, int) and d.context >= 0, "context", d.context, "must be an integer >= 0")
    require(d.engine in ENGINES, "engine", d.engine, f"must be one of {ENGINES}")
    require(d.devices % d.tp == 0, "tp", d.tp, f"must divide devices ({d.devices})")
    for kind in ("kda", "mla", "gqa"):
        sub = getattr(model, kind)
        if sub is not None and model.count(attention=kind):
            require(sub.heads % d.tp == 0, "tp", d.tp, f"must divide {kind} heads ({sub.heads})")
    if model.moe and model.count(ffn="moe"):
        g = positive_int("ep", d.expert_groups)
        require(d.devices % g == 0, "ep", g, f"must divide devices ({d.devices})")
        require(model.moe.experts % g == 0, "ep", g, f"must divide experts ({model.moe.experts})")
        if d.expert_slots is not None:
            positive_int("expert_slots", d.expert_slots)
    if d.prefetch_bytes is not None:
        require(d.prefetch_bytes > 0, "prefetch_bytes", d.prefetch_bytes, "must be > 0")
    if d.routing_skew is not None:
        require(d.routing_skew >= 0, "routing_skew", d.routing_skew, "must be >= 0")
    need = resident_bytes_per_device(model, d)
    have = hw.core_hbm_bytes
    if need > have:
        raise SpecError("devices", d.devices,
                        f"model does not fit: needs {need / 1e9:.1f} GB per device (weights + cache), "
                        f"{hw.name} has {have / 1e9:.1f} GB per device")


def resident_bytes_per_device(model: ModelSpec, d: Deployment) -> float:
    """HBM a device holds: its weight shards plus its sequences' caches and states."""
    fam = model.params_by_family()
    f = model.formats
    sharded = sum(fam[k] * f[k].bytes_per_value for k in ("attention", "dense_ffn", "shared_expert",
                                                           "embedding", "lm_head")) / d.tp
    routed = fam["routed_expert"] * f["routed_expert"].bytes_per_value / d.devices
    router = fam["router"] * f["router"].bytes_per_value  # replicated
    seqs = -(-d.batch // d.dp)
    return sharded + routed + router + seqs * cache_bytes_per_seq(model, d.context + d.rows_per_seq, d.tp)


def cache_bytes_per_seq(model: ModelSpec, context: int, tp: int) -> float:
    """One sequence's KV cache (MLA latents are replicated across TP ranks) and KDA state."""
    total = 0.0
    kv, st = model.formats["kv_cache"].bytes_per_value, model.formats["state"].bytes_per_value
    if model.mla:
        total += model.count(attention="mla") * context * (model.mla.kv_lora_rank + model.mla.qk_rope_dim) * kv
    if model.gqa:
        g = model.gqa
        span = min(context, g.window) if g.window else context
        total += model.count(attention="gqa") * span * 2 * -(-g.kv_heads // tp) * g.head_dim * kv
    if model.kda:
        a = model.kda
        per_layer = a.heads // tp * (a.head_dim * a.head_dim * st + 3 * a.head_dim * (a.conv_width - 1) * kv)
        total += model.count(attention="kda") * per_layer
    return total
