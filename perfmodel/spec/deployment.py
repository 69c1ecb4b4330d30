"""How a model is served: devices, parallel layout, engine, batch, context, speculative decoding."""
from __future__ import annotations

from dataclasses import dataclass

from perfmodel.spec.arch import ModelSpec
from perfmodel.spec.hardware import Hardware
from perfmodel.util.checks import MAX_SKEW
from perfmodel.util.errors import SpecError, positive_int, require

MAX_STREAM_TILES = 2**22  # ring tiles the megakernel simulator walks per step (memory and time)

ENGINES = ("megakernel", "multikernel")
MOE_COMM = ("all_reduce", "all_to_all")


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
    """One way to serve a model (module docstring); each field's comment says what it sets."""
    devices: int                  # JAX devices (TPU v7: 2 per chip) or GPUs
    tp: int                       # tensor parallel degree of attention / dense / shared weights
    engine: str = "megakernel"
    ep: int | None = None         # expert-parallel groups (None: expert_groups' default)
    batch: int = 1                # sequences decoded together
    context: int = 4096           # tokens already in each sequence's cache
    prefetch_bytes: float | None = None  # megakernel ring depth in bytes (None: as VMEM allows)
    expert_slots: int | None = None      # megakernel expert buffers (None: top_k)
    spec: SpecDecode | None = None
    routing_skew: float | None = None    # None: the model preset's [moe] routing_skew
    routing_correlation: float | None = None  # 0 independent rows .. 1 identical; None: the preset's
    steps_per_call: int = 1       # decode steps one device call runs (its per-call costs are shared)
    serving_engine: str | None = None    # GPU multi-kernel engine: vllm, sglang or trtllm (None: generic)
    pp: int = 1                   # pipeline stages (layers split evenly; micro-batches of batch / pp)
    moe_comm: str = "all_reduce"  # experts' tokens: all_reduce (replicated / gathered) or all_to_all

    @property
    def expert_groups(self) -> int:
        """`ep`, by default the serving engine's own (vLLM, SGLang and TensorRT-LLM split every
        expert over the tp ranks unless told otherwise: docs/sources.md), else one group per device
        (all-to-all dispatch puts whole experts on every device)."""
        return self.ep or (1 if self.serving_engine and self.moe_comm != "all_to_all" else self.devices)

    @property
    def dp(self) -> int:
        """Attention data-parallel replicas (per pipeline stage); each decodes ceil(batch / dp)
        sequences (ceil(batch / (dp x pp)) per micro-batch with pipeline stages)."""
        return self.devices // (self.tp * self.pp)

    @property
    def rows_per_seq(self) -> int:
        return self.spec.rows if self.spec else 1


def validate(model: ModelSpec, hw: Hardware, d: Deployment) -> None:
    """Refuse layouts that cannot run, naming the field and value."""
    positive_int("devices", d.devices), positive_int("tp", d.tp), positive_int("batch", d.batch)
    positive_int("steps_per_call", d.steps_per_call)
    require(isinstance(d.context, int) and d.context >= 0, "context", d.context, "must be an integer >= 0")
    require(d.engine in ENGINES, "engine", d.engine, f"must be one of {ENGINES}")
    positive_int("pp", d.pp)
    require(d.devices % (d.tp * d.pp) == 0, "tp", d.tp, f"tp x pp ({d.tp} x {d.pp}) must divide devices ({d.devices})")
    require(d.pp <= len(model.layers), "pp", d.pp, f"at most one stage per layer ({len(model.layers)})")
    require(d.moe_comm in MOE_COMM, "moe_comm", d.moe_comm, f"one of {MOE_COMM}")
    if model.moe and model.count(ffn="moe"):
        g = positive_int("ep", d.expert_groups)
        require(d.devices % g == 0, "ep", g, f"must divide devices ({d.devices})")
        require(model.moe.experts % g == 0, "ep", g, f"must divide experts ({model.moe.experts})")
        if d.expert_slots is not None:
            positive_int("expert_slots", d.expert_slots)
            require(d.expert_slots <= model.moe.experts, "expert_slots", d.expert_slots,
                    f"at most the model's {model.moe.experts} experts")
    if d.serving_engine is not None or d.pp > 1 or d.moe_comm != "all_reduce":
        require(hw.kind == "gpu" and d.engine == "multikernel", "serving_engine", d.serving_engine,
                "serving engines, pipeline stages and all-to-all EP model GPU multi-kernel engines: "
                "use a GPU hardware preset and --engine multikernel")
    if d.serving_engine is not None:
        from perfmodel.spec.engines import check_serving_layout
        check_serving_layout(model, hw, d)
    elif hw.kind == "gpu":
        from perfmodel.spec.engines import check_block_splits
        check_block_splits(model, d)
    for label in sorted({l.attention for l in model.layers} - {"none"}):
        a = model.attn(label)
        heads = getattr(a, "heads", None) or a.value_heads
        require(heads % d.tp == 0, "tp", d.tp, f"must divide {label} heads ({heads})")
        groups = getattr(a, "o_groups", 0)  # a grouped output projection splits by whole groups
        require(not groups or groups % d.tp == 0, "tp", d.tp, f"must divide {label} output groups ({groups})")
    if d.prefetch_bytes is not None:
        require(d.prefetch_bytes > 0, "prefetch_bytes", d.prefetch_bytes, "must be > 0")
    if d.routing_skew is not None:
        require(0 <= d.routing_skew <= MAX_SKEW, "routing_skew", d.routing_skew, f"must be in [0, {MAX_SKEW:g}]")
    if d.routing_correlation is not None:
        require(0 <= d.routing_correlation <= 1, "routing_correlation", d.routing_correlation,
                "must be in [0, 1] (0 = independent rows, 1 = identical)")
    # the ring's bank: the model's kernel's own, else the chip's DMA tile (perfmodel.engine.megakernel.bank_bytes)
    bank, field = ((model.megakernel.bank_bytes, "megakernel.bank_bytes") if model.megakernel.bank_bytes
                   else (hw.dma_tile_bytes, "dma_tile_bytes"))
    tiles = model.weight_bytes() / (d.tp * bank)
    if d.engine == "megakernel" and tiles > MAX_STREAM_TILES:  # the simulator's arrays and loop
        raise SpecError(field, bank, f"streams {model.name} in {tiles:.3g} banks per step; the simulator takes at "
                        f"most {MAX_STREAM_TILES}: use banks of at least "
                        f"{model.weight_bytes() / (d.tp * MAX_STREAM_TILES):.0f} B")
    need = resident_bytes_per_device(model, d)
    have = hw.core_hbm_bytes
    if need > have:
        raise SpecError("devices", d.devices,
                        f"model does not fit: needs {need / 1e9:.1f} GB per device (weights + cache), "
                        f"{hw.name} has {have / 1e9:.1f} GB per device")


def resident_bytes_per_device(model: ModelSpec, d: Deployment) -> float:
    """HBM a device holds: its weight shards plus its sequences' caches and states."""
    by_family = model.weight_bytes_by_family()
    sharded = sum(by_family[k] for k in ("attention", "dense_ffn", "shared_expert", "latent_projection", "embedding",
                                         "lm_head")) / d.tp
    routed = by_family["routed_expert"] / d.devices
    router = by_family["router"] * (model.moe.router_copies if model.moe else 1)  # replicated
    seqs = -(-d.batch // d.dp)
    return (sharded + router) / d.pp + routed + seqs * cache_bytes_per_seq(model, d.context + d.rows_per_seq, d.tp) / d.pp


def cache_bytes_per_seq(model: ModelSpec, context: int, tp: int) -> float:
    """One sequence's caches and states on one device, over all layers (`ModelSpec.cache_bytes`)."""
    return sum(n * model.cache_bytes(attention, context, tp) for attention, n in model.attention_counts.items())

