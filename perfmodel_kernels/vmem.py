"""VMEM budget of the megakernel, with TPU tile padding and a margin for the compiler.

Each buffer's bytes are padded to the TPU memory tiling: the last dimension to the lane count
(128) and the second-minor dimension to the dtype's sublane tiling (`TpuInfo.
get_sublane_tiling`: 8 rows for 32-bit, 16 for bf16 (8 on v5e), 32 for 8-bit). The figures
are those of the chip the kernel is built for (`KernelConfig.chip`, `perfmodel_kernels.chip`).
The explicit allocations may use the chip's VMEM minus `MARGIN_BYTES`, the room Mosaic needs
for its own spill slots and internal scratch: Inferact's TPU7x megakernel keeps explicit
allocations at or below 58 MiB of the 64 MiB and measured about 2.7 MiB of compiler spill slots
(docs/sources.md, "The public TPU7x megakernel"); Mosaic gets the whole VMEM as its limit.
Compiled ahead of time for a v5e at a limit 1 MiB over the explicit buffers (libtpu says by how
much Mosaic exceeds it), Mosaic also held about two more KDA states a batch row (the TP8-core
slice: 1.1, 5.2 and 11.6 MiB over at batches 1, 4 and 8, a KDA state being 0.79 MB a
sequence), counted here as the update's intermediates; beyond them up to 4.3 MiB (the dense
slice at batch 1), within the margin. `aot.compile_kernel` compiles at the budget plus the
margin, so every ahead-of-time compile checks that they suffice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp

from perfmodel.spec.arch import ModelSpec
from perfmodel.util.errors import SpecError, require

from . import comm, layout, reference
from .chip import Chip
from .layout import KernelConfig

MARGIN_BYTES = 6 << 20   # 64 - 58 MiB: compiler spill slots (~2.7 MiB measured) and scratch


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int       # padded to the TPU tiling


@dataclass(frozen=True)
class Budget:
    buffers: tuple[Buffer, ...]
    capacity_bytes: int      # the chip's VMEM per core (Mosaic's limit)
    limit_bytes: int         # what the explicit buffers may use (capacity - margin)
    chip: str

    @property
    def total_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers)

    def table(self) -> str:
        lines = [f"VMEM budget on {self.chip}, TPU tile padding included:"]
        for b in self.buffers:
            lines.append(f"  {b.name:<42} {str(b.shape):<24} {b.dtype:<9} {b.bytes:>12,} B")
        lines.append(f"  {'total':<76}{self.total_bytes:>12,} B of {self.limit_bytes:,} B "
                     f"({100 * self.total_bytes / self.limit_bytes:.1f} %; "
                     f"{self.capacity_bytes - self.limit_bytes:,} B kept for the compiler)")
        return "\n".join(lines)


def padded_bytes(shape: tuple[int, ...], dtype, target: Chip) -> int:
    dtype = jnp.dtype(dtype)
    dims = (1,) * max(0, 2 - len(shape)) + tuple(shape)
    sub = target.sublane_tiling(dtype)
    lead = math.prod(dims[:-2])
    return lead * math.ceil(dims[-2] / sub) * sub * math.ceil(dims[-1] / target.lanes) \
        * target.lanes * dtype.itemsize


def buffers(spec: ModelSpec, cfg: KernelConfig) -> list[Buffer]:
    """The kernel's VMEM scratch and blocks, plus its largest compiler-managed values."""
    bp, t, h = cfg.padded_batch, cfg.tile, spec.hidden
    caches = reference.cache_shapes(spec, cfg.batch, cfg.max_context)
    items = [("weight ring (depth x bank)", (cfg.depth, cfg.bank_rows, t), jnp.bfloat16)]
    if spec.moe and spec.count(ffn="moe"):
        lay = layout.expert_layout(spec, cfg)
        items.append(("expert slots", (cfg.expert_slots, lay.rows[0], t), lay.fmt.code_dtype))
        if lay.rows[1]:
            items.append(("expert scale slots", (cfg.expert_slots, lay.rows[1], t),
                          lay.fmt.scale_dtype))
        if lay.decodes:
            items.append(("expert decode buffer", (lay.decoded_rows(), t), jnp.bfloat16))
    rmax, cmax = layout.max_row_col_tiles(spec, cfg)
    items += [("layer vectors (double buffer)", (2, layout.vector_rows(spec), layout.LANES),
               jnp.bfloat16),
              ("embedding tiles", layout.embedding_tiles(spec, cfg), jnp.bfloat16),
              ("input chunks, output blocks", (rmax + cmax, bp, t), jnp.float32),
              ("next tokens (output)", (bp, layout.LANES), jnp.int32),
              ("logits (output)", (bp, spec.vocab // layout.tp_of(spec)), jnp.float32),
              ("logits (value)", (bp, spec.vocab // layout.tp_of(spec)), jnp.float32),
              ("residual + normed input (values)", (2, bp, h), jnp.float32)]
    if "kda_state" in caches:
        items += [("kda state", caches["kda_state"][0][1:], jnp.float32),
                  ("kda state (value)", caches["kda_state"][0][1:], jnp.float32),
                  ("kda state (the update's two intermediates)", (2, *caches["kda_state"][0][1:]),
                   jnp.float32),
                  ("kda conv window", caches["kda_conv"][0][1:], caches["kda_conv"][1])]
    if "mla_latent" in caches:
        m = spec.mla
        d = caches["mla_latent"][0][-1]
        items += [("mla cache tiles (3 buffers)", (3, cfg.cache_block, d), jnp.bfloat16),
                  ("mla cache tile (f32 value)", (cfg.cache_block, d), jnp.float32),
                  ("mla new rows' windows", (cfg.batch, layout.cache_window(cfg), d),
                   jnp.bfloat16),
                  ("mla kv_b (value)", (m.kv_lora_rank, m.heads * (m.qk_nope_dim + m.v_head_dim)),
                   jnp.bfloat16)]
    if spec.moe:
        items.append(("used-expert mask", (1, spec.moe.experts), jnp.int32))
    tp = layout.tp_of(spec)
    if tp > 1:
        for (kind, dtype), (send, recv) in comm.buffer_shapes(
                spec, cfg, comm.collective_widths(spec, cfg), tp).items():
            items += [(f"send buffer ({comm.KINDS[kind]}, {dtype})", send, dtype),
                      (f"receive buffers ({comm.KINDS[kind]}, {dtype})", recv, dtype)]
    return [Buffer(n, tuple(s), jnp.dtype(d).name, padded_bytes(s, d, cfg.target))
            for n, s, d in items]


def check_vmem(spec: ModelSpec, cfg: KernelConfig, capacity_bytes: int | None = None,
               margin_bytes: int = MARGIN_BYTES) -> Budget:
    """The budget, or SpecError naming the largest buffers and the excess when the buffers do not
    fit in `capacity_bytes` (default: the VMEM of the config's chip) minus `margin_bytes`; the
    tile must be a multiple of the chip's MXU width."""
    layout.check_kernel_spec(spec, cfg)
    target = cfg.target
    cap = target.vmem_bytes if capacity_bytes is None else capacity_bytes
    require(cfg.tile % target.mxu == 0, "tile", cfg.tile,
            f"must be a multiple of the MXU width of TPU {target.version} ({target.mxu}, jax "
            "tpu_info)")
    limit = cap - margin_bytes
    budget = Budget(tuple(buffers(spec, cfg)), cap, limit, target.describe())
    if budget.total_bytes > limit:
        big = sorted(budget.buffers, key=lambda b: -b.bytes)[:4]
        raise SpecError("vmem", budget.total_bytes,
                        f"the kernel needs {budget.total_bytes:,} B of VMEM but {budget.chip} "
                        f"leaves {limit:,} B ({cap:,} B less {margin_bytes:,} B for the "
                        f"compiler): {budget.total_bytes - limit:,} B too many; largest "
                        "buffers: " + ", ".join(f"{b.name} {b.bytes:,} B" for b in big)
                        + f" (depth={cfg.depth}, bank_rows={cfg.bank_rows}, "
                        f"expert_slots={cfg.expert_slots}, max_context={cfg.max_context})")
    return budget
