"""Component micro-benchmarks on one TPU chip (written for the TPU v5e), one mechanism each, in the
micro-benchmark file format that `perfmodel calibrate --microbench FILE` reads:

    python experiments/tpu_microbench.py [--out experiments/results/tpu_v5e_microbench.json]
    python experiments/tpu_microbench.py --dry-run --out /tmp/mb.json    # no TPU needed

Sections, in the order they run (`--only` picks some), the function of each (named after its
mechanism) and the `mechanism` of its entries:
- dispatch, `host_dispatch`: a trivial jitted call (`x + 1` on one [8, 128] f32 tile), called and
  waited on, median of many calls (`components.host_dispatch_s`);
- dispatch_args, `host_dispatch_args` (not fitted): a pallas_call of 1, 8, 32 or 128 arguments
  (one f32 tile read, the rest HBM arrays it never reads), its first input donated and aliased
  to its output or not, called and waited on: what the host's dispatch costs per argument;
- dma, `dma_ring`: HBM -> VMEM copies of bf16 [rows, 128] and [rows, 256] blocks, 64 KiB .. 16 MiB,
  1, 2, 4 or 8 kept in flight (a ring of VMEM slots; a copy issued as the oldest is waited for),
  time per copy (`components.dma_stream_time`: bandwidth, per-descriptor cost, first-byte latency);
- ring_dot, `ring_dot`: the ring as the megakernel uses it: bf16 [rows, 128] banks (1 .. 8 MiB),
  8 in flight, each waited for, consumed by one dot of 8 rows and refilled: time per bank, what a
  bank costs beyond its bytes (no term of the model yet);
- latency, `dma_latency` (entries `dma_ring`): the same ring with one copy in flight and tiny
  copies (4 .. 32 KiB), each issued, then waited for: its first-byte latency, descriptor and bytes;
- mxu, `mxu_matmul` (entries `matmul`, `matmul_int8_lhs`): x[m, k] @ w[k, n] inside a kernel, m in
  {8, 16, 64, 256}, k, n in 128 .. 2048: bf16 weights; int8 weights widened to bf16 in the kernel
  (what int8 weights cost beside bf16 activations); int8 x int8 -> int32 (the v5e MXU's int8
  rate). Two weight matrices are used in turn, so no dot finds its weights already in the MXU.
  The v5e has no fp8 MXU (JAX's tpu_info: fp8_ops_per_second = 0): nothing is measured in fp8;
- mxu_static (entries `matmul`, not fitted): the bf16 dots again at 8 and 64 rows, each weight
  matrix named by a static index, two dots a trip: a probe of the mxu entries' method;
- ring_work, `ring_work` (not fitted): the ring when a bank's use outlasts its copy (each bank
  widened to f32 512 rows at a time, 1 or 4 multiply-adds, a dot of 8 rows), streamed and, as
  its twin, resident with no copy in flight: what streaming costs a compute-bound ring;
- ring_reader, `ring_reader` (not fitted): the kernel's own ring and reader (`ring.PartReader`) on
  the static parts of one K3 TP32-core MoE layer (KDA attention, router, latent projections,
  shared expert; 136 MiB), 8 rows, at rings of 8 x 32768, 16 x 16384, 32 x 8192 (64 MiB ahead),
  8 x 16384 and 8 x 8192 rows: time per layer, what a bank costs the reader;
- vpu, `vpu_elementwise`: one elementwise pass (a multiply, or exp) over an f32 [rows, lanes]
  array held in VMEM, 8 .. 256 rows x 128 .. 4096 lanes;
- loop, `loop_trip` (entries `loop_trip`, `dma_issue_wait`): one trip of an in-kernel `fori_loop`
  whose body increments an SMEM scalar; what starting a tiny copy and waiting for one issued 16
  trips earlier (its data long arrived) adds to a trip that has 64 dependent vector multiply-adds;
- queue, `dma_queue`: a small copy (4 KiB, or one 16-row tile of a 7168-wide bf16 embedding) issued
  before or after k = 1 .. 16 copies of 2 MiB ring banks, all in flight at once: how much later
  than alone the small copy arrives (the wait a step's first embedding rows, or an attention
  phase's cache window, sees behind the ring's banks);
- mla_core, `mla_core` (entries `attention_core_tiles`): the megakernel's own MLA decode core
  (`perfmodel_kernels.megakernel._sequence_attention`: one sequence's absorbed latent queries over
  its cached tokens, cache tiles of 256 rows copied three in flight, an online softmax) by cached
  tokens (256 .. 2048) and query rows (2 .. 16), latent rank 512: time per sequence (fits
  `attention_core_s` and `attention_tile_s`);
- attn_parts, `attn_parts` (entries `kda_core`, `mla_absorb`): the megakernel's attention between its
  projections at the widths of the K3 TP32-core and TP8-core slices, batches 1 and 8: the KDA
  block's recurrence (`reference.kda_block` with the projections' outputs given: gates, short
  conv, delta rule, norm, output gate; state in VMEM; fits `vpu_flops_per_s`) and the MLA layer's
  two absorption einsums with kv_b (bhn,rhn->bhr, bhr,rhv->bhv; and the latter as one dot a head);
- expert_loop, `expert_kernel_columns`: the kernel's own column path
  (`megakernel.expert_columns`: its `fori_loop` over whole scale chunks, decode passes into
  alternate halves of the decode buffer, one dot a column block) on each matrix of one routed
  expert at the K3 TP32-core and TP8-core widths, per format, 8 rows: time per tile, beside
  `expert_column` (whose chunks are a static loop); fits `expert_pass_<decode>_s` (bf16, which
  decodes nothing, kept as data);
- expert_slots, `expert_kernel_slots` (not fitted): the same column path over every matrix of a whole
  expert at the K3 widths (int4, MXFP4, int8), the next expert's copy in flight into the other of
  two slots (as the kernel's expert slots), and as its twin the same experts resident with no
  copy in flight: time per tile, what the expert stream costs the decode beside it;
- embed, `embed_pick`: the megakernel's pick of each sequence's embedding row out of the bf16 tile it
  copied it in (`megakernel.pick_rows`) at the same slices, batches 1, 8 and 16 (fits `embed_pick_s`);
- xla, `xla_ops` (entries `xla_op`, `xla_loop_trip`, `xla_dot`, `xla_attention`): a chain of small
  dependent XLA ops (tanh(x[8, 128] @ w[128, 128]), one fusion each) in an XLA while loop, bodies
  of 1 and 32 ops: the time per op (its launch gap and its tiny work) and the loop's own trip;
  XLA's bf16 dot x[m, k] @ w[k, n] (m 1 .. 64, k, n 1024 .. 8192) in a chain through 16 distinct
  weights per loop trip, alternately [k, n] and [n, k]; XLA's decode attention over a bf16 cache,
  one query row per head (8 KV heads of 4 query heads each, head dim 128) against T cached rows,
  softmax included; the loop's trip subtracted from both.
- xla_expert, `xla_expert_loop`: the XLA reference's own routed-expert loop (`reference.expert_loop`)
  alone, by rows (1 .. 64) and expert shape (Kimi K3's latent 3584, width 768 and 3072): time per
  trip (one expert); at two row counts one call is also traced and its ops listed by time;
- xla_cache, `xla_cache_update`: the reference's MLA cache update (`reference.latent_write`) by
  cache size (batch 1 .. 64 x 2048 tokens x 576), beyond reading the cache: a check of where XLA
  places the cache's copies (`components.xla_cache_copy_time`);
- xla_copy, `xla_copy`: XLA copying a bf16 [B, 2048, 576] array whole (a roll by one token) in a
  loop, by B: the copy rate that term needs (fits `xla_copy_bandwidth_bytes_per_s`).

Timing. A jitted call costs about half a millisecond of host time on a TPU VM, so no figure is one
call's wall clock: every kernel and XLA program takes its repetition count as an argument (an SMEM
scalar or a device scalar: one compile serves every count), the count is raised until a call takes
`target_s` more than a call of the smallest count, and the time per repetition is the
least-squares slope over counts n, 2n and 3n (the median of `repeats` calls each), so the dispatch,
the kernel's prologue and its epilogue drop out. Each entry's `notes` give the counts, the
intercept and the fit's largest residual.

Output: entries in the layout of perfmodel/data/microbench/tpu7x.json (id, mechanism, inputs,
value, unit, scope, source, notes; `not_modelled` with the reason where no component of the model
takes the mechanism), its `source` naming the command, the chip (JAX's device_kind), the JAX and
libtpu versions and the date. The file is rewritten after every entry, so a run cut short
keeps what it measured; `--budget-s` stops starting new measurements past that many seconds.
With `--dry-run` (no TPU) the same code runs at tiny sizes, the Pallas kernels in interpret mode on
the CPU: a check of the pipeline (a test runs it), its timings are not a TPU's.
On the lent TPU v5e every section has run (experiments/results/tpu_v5e/: the whole first run
under `--budget-s 240`; queue alone 9.8 s, xla_cache 33.2 s, mla_core 13.1 s).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "experiments" / "results" / "tpu_v5e_microbench.json"
BF16, F32, I8, I32 = jnp.bfloat16, jnp.float32, jnp.int8, jnp.int32
KIB, MIB = 1024, 1024 * 1024
# JAX device_kind -> the hardware preset the entries are for
PLATFORMS = {"TPU v5 lite": "tpu-v5e", "TPU v5e": "tpu-v5e", "TPU v6 lite": "tpu-v6e", "TPU v5": "tpu-v5p",
             "TPU v5p": "tpu-v5p", "TPU7x": "tpu-v7"}
SECTIONS = ("dispatch", "dispatch_args", "dma", "ring_dot", "latency", "mxu", "mxu_static", "ring_work", "ring_reader", "vpu", "loop",
            "queue", "expert", "expert_loop", "expert_slots", "mla_core", "attn_parts", "embed", "xla", "xla_expert", "xla_cache",
            "xla_copy")  # run in this order


@dataclass(frozen=True)
class Sizes:
    """Every shape the run measures, and how long a timed call should be."""
    dma_kib: dict            # lanes -> copy sizes (KiB) of the ring at that width
    in_flight: tuple         # copies kept in flight
    ring_dot_rows: tuple     # ring_dot: bank rows of the bf16 [rows, 128] banks a dot consumes
    ring_dot_depth: int      # ring_dot: banks in flight (the kernel's ring depth)
    ring_vmem_bytes: int     # a ring's slots at most this much VMEM (in_flight x copy)
    ring_source_bytes: int   # the HBM a ring reads, cycled through (blocks of the copy size)
    latency_rows: tuple      # tiny copies: rows of a bf16 [rows, 128] block, one in flight
    mxu_rows: tuple          # m of x[m, k] @ w[k, n]
    mxu_shapes: tuple        # (k, n), bf16 weights
    mxu_int8_shapes: tuple   # (k, n), int8 weights widened to bf16 (every m of mxu_rows)
    mxu_int8_lhs: tuple      # (m, k, n), int8 x int8 -> int32
    mxu_static_rows: tuple   # mxu_static: m of the same dots, weights by a static index
    ring_work_chunk: int     # ring_work: rows of a bank each step of its use reads
    ring_work_fmas: tuple    # ring_work: multiply-adds per element of a bank's use
    reader_slice: str        # ring_reader: the kernel slice whose MoE layer's static parts are streamed
    expert_loop_slices: tuple  # expert_loop: the slices whose routed experts' matrices are run
    reader_rings: tuple      # ring_reader: (depth, bank rows) of the rings
    vpu_shapes: tuple        # (rows, lanes) of the f32 array
    vpu_ops: tuple
    issue_lag: int           # dma_issue_wait: a copy is waited for this many trips after its start
    issue_chain: int         # dma_issue_wait: dependent vector multiply-adds in each trip
    queue_big_rows: int      # dma_queue: rows of the bf16 [rows, 128] copies in flight beside the small one
    queue_ahead: tuple       # dma_queue: how many such copies
    queue_small: tuple       # dma_queue: (rows, lanes) of the small bf16 copy
    queue_work_s: float      # dma_queue: vector work after the small copy's wait, at least this long
    mla_tokens: tuple        # mla_core: cached tokens of the sequence
    mla_rows: tuple          # mla_core: query rows (heads x draft rows) of the sequence
    mla_rank: tuple          # mla_core: (latent rank, rope dims, cache block rows)
    attn_slices: tuple       # attn_parts: kernel slices (perfmodel_kernels.specs) whose KDA and MLA widths are timed
    attn_batches: tuple      # attn_parts: sequences of the step (padded to whole 8-row tiles)
    xla_rows: tuple          # m of XLA's dots
    xla_shapes: tuple        # (k, n) of XLA's dots
    xla_weights_per_trip: int
    attention_heads: tuple   # (KV heads, query heads per KV head, head dim)
    attention_tokens: tuple  # T cached rows
    op_chain: tuple          # small ops per loop trip (two lengths: the slope between them is an op)
    expert_shapes: tuple     # (latent, width) of the XLA expert loop's experts (gate|up [latent, 2 width])
    expert_rows: tuple       # rows (batch) of the XLA expert loop
    expert_count: int        # experts stacked (the loop cycles through them)
    expert_traced: tuple     # rows whose loop is also traced op by op (first shape)
    cache_batches: tuple     # sequences of the XLA cache update's bf16 [B, tokens, 576] cache
    cache_tokens: int
    cache_traced: tuple      # batches whose update is also traced op by op
    dispatch_calls: int
    target_s: float          # a timed call lasts at least this much longer than the smallest one
    repeats: int             # calls per count (the median is used)
    vmem_limit_bytes: int


FULL = Sizes(
    dma_kib={128: (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384), 256: (256, 1024, 4096, 16384)},
    in_flight=(1, 2, 4, 8), ring_dot_rows=(4096, 8192, 16384, 32768), ring_dot_depth=8,
    ring_vmem_bytes=64 * MIB, ring_source_bytes=64 * MIB,
    latency_rows=(16, 32, 64, 128),
    mxu_rows=(8, 16, 64, 256),
    mxu_shapes=((128, 128), (256, 256), (512, 512), (1024, 1024), (2048, 2048), (512, 2048), (2048, 512)),
    mxu_int8_shapes=((256, 256), (1024, 1024), (2048, 2048)),
    mxu_int8_lhs=((8, 1024, 1024), (8, 2048, 2048), (256, 1024, 1024), (256, 2048, 2048)),
    mxu_static_rows=(8, 64), ring_work_chunk=512, ring_work_fmas=(1, 4), reader_slice="k3-tp32-core",
    expert_loop_slices=("k3-tp32-core", "k3-tp8-core"),
    reader_rings=((8, 32768), (16, 16384), (32, 8192), (8, 16384), (8, 8192)),
    vpu_shapes=((8, 128), (8, 1024), (64, 1024), (256, 1024), (256, 4096)), vpu_ops=("mul", "exp"),
    issue_lag=16, issue_chain=64,
    queue_big_rows=8192, queue_ahead=(1, 2, 4, 8, 16), queue_small=((16, 128), (16, 7168)), queue_work_s=80e-6,
    mla_tokens=(256, 1024, 2048), mla_rows=(2, 8, 16), mla_rank=(512, 64, 256),
    attn_slices=("k3-tp32-core", "k3-tp8-core"), attn_batches=(1, 8),
    xla_rows=(1, 8, 16, 32, 64),
    xla_shapes=((1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192), (2048, 8192)),
    xla_weights_per_trip=16,
    attention_heads=(8, 4, 128), attention_tokens=(1024, 4096, 16384, 65536),
    op_chain=(1, 32), expert_shapes=((3584, 768), (3584, 3072)), expert_rows=(1, 8, 16, 32, 64),
    expert_count=8, expert_traced=(8, 64), cache_batches=(1, 8, 16, 32, 64), cache_tokens=2048,
    cache_traced=(8, 64), dispatch_calls=500, target_s=3e-3, repeats=7, vmem_limit_bytes=100 * MIB)

MINI = Sizes(  # the same code at tiny sizes: Pallas interpret mode on a CPU (--dry-run)
    dma_kib={128: (8, 16), 256: (16,)}, in_flight=(1, 2), ring_dot_rows=(32, 64), ring_dot_depth=2,
    ring_vmem_bytes=64 * KIB,
    ring_source_bytes=64 * KIB, latency_rows=(16,),
    mxu_rows=(8,), mxu_shapes=((128, 128),), mxu_int8_shapes=((128, 128),), mxu_int8_lhs=((32, 128, 128),),
    mxu_static_rows=(8,), ring_work_chunk=16, ring_work_fmas=(1,), reader_slice="kimi-k3-mini",
    expert_loop_slices=("kimi-k3-mini",),
    reader_rings=((2, 256), (4, 128)),
    vpu_shapes=((8, 128),), vpu_ops=("mul", "exp"), issue_lag=2, issue_chain=2,
    queue_big_rows=64, queue_ahead=(2,), queue_small=((16, 128),), queue_work_s=1e-6,
    mla_tokens=(64,), mla_rows=(2,), mla_rank=(128, 64, 16),
    attn_slices=("kimi-k3-mini",), attn_batches=(1,),
    xla_rows=(1,), xla_shapes=((128, 256),), xla_weights_per_trip=2,
    attention_heads=(2, 2, 128), attention_tokens=(64,),
    op_chain=(1, 4), expert_shapes=((256, 128),), expert_rows=(1,), expert_count=2, expert_traced=(1,),
    cache_batches=(2,), cache_tokens=64, cache_traced=(2,), dispatch_calls=20, target_s=0.02, repeats=1, vmem_limit_bytes=100 * MIB)


# ---- timing -----------------------------------------------------------------------------------

@dataclass
class Slope:
    """Seconds per repetition (least squares over counts), with what the fit saw."""
    per_rep_s: float
    intercept_s: float
    counts: tuple
    medians_s: tuple
    residual: float  # largest |fit - median| over the slope's span between the counts

    def notes(self, per: str = "repetitions") -> str:
        return (f"slope over {', '.join(map(str, self.counts))} {per} per call (median of the calls at "
                f"each): intercept {self.intercept_s * 1e6:.1f} us, largest residual "
                f"{100 * self.residual:.1f} % of the span")


def wall(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def call_times(run, n: int) -> tuple[float, str]:
    """`run` (a call waited on) 5 times to warm, then n times: (the median s, its 10th / 90th
    percentiles as a note)."""
    for _ in range(5):
        run()
    times = [wall(run) for _ in range(n)]
    q = statistics.quantiles(times, n=10)
    return statistics.median(times), f"10th / 90th percentile {q[0] * 1e6:.1f} / {q[-1] * 1e6:.1f} us"


class Clock:
    """Times `run(n)` (n repetitions in one call, waited on) and returns the slope per repetition."""

    def __init__(self, sizes: Sizes):
        self.target_s, self.repeats = sizes.target_s, sizes.repeats

    def slope(self, run, n0: int = 1, n_max: int = 1 << 24) -> Slope:
        run(n0)  # compile and warm up
        base = min(wall(lambda: run(n0)) for _ in range(3))
        n = n0
        while n < n_max:
            extra = wall(lambda: run(n)) - base
            if extra >= self.target_s:
                break
            # below a tenth of the target the rate is noise: x4; above, jump toward the target
            grow = 4.0 if extra < 0.1 * self.target_s else min(64.0, max(2.0, 1.3 * self.target_s / extra))
            n = min(n_max, max(n + 1, int(n * grow)))
        for _ in range(3):  # the counts' span must itself last the target (not one noisy call's)
            sl = self.fit((n, 2 * n, 3 * n), run)
            if sl.medians_s[-1] - sl.medians_s[0] >= self.target_s or 2 * n > n_max:
                break
            n *= 2
        return sl

    def fit(self, counts: tuple, run) -> Slope:
        """The least-squares line through the median call time at each count."""
        times = {c: [] for c in counts}
        for _ in range(self.repeats):
            for c in counts:  # interleaved, so drift touches every count alike
                times[c].append(wall(lambda: run(c)))
        med = [statistics.median(times[c]) for c in counts]
        k, b = np.polyfit(np.array(counts, float), np.array(med), 1)
        span = max(abs(k) * (counts[-1] - counts[0]), 1e-12)
        resid = max(abs(k * c + b - m) for c, m in zip(counts, med)) / span
        return Slope(float(k), float(b), counts, tuple(med), float(resid))


# ---- Pallas kernels ---------------------------------------------------------------------------

SMEM_SPEC = pl.BlockSpec(memory_space=pltpu.SMEM)
VMEM_SPEC = pl.BlockSpec(memory_space=pltpu.VMEM)
HBM_SPEC = pl.BlockSpec(memory_space=pl.ANY)


def pallas(kernel, out_shape, in_specs, out_specs, scratch, sizes: Sizes, interpret: bool, aliases=None):
    """A pallas_call without a grid; interpret: Pallas TPU interpret mode (on a CPU); aliases:
    its input_output_aliases."""
    return pl.pallas_call(
        kernel, out_shape=out_shape, in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch,
        input_output_aliases=aliases or {},
        compiler_params=None if interpret else pltpu.CompilerParams(vmem_limit_bytes=sizes.vmem_limit_bytes),
        interpret=pltpu.InterpretParams() if interpret else False)


def ring_copy(src_hbm, slots, sems, blocks: int, i):
    """Copy i of a ring: block i mod blocks of the source into slot i mod (slots)."""
    s = i % slots.shape[0]
    return pltpu.make_async_copy(src_hbm.at[i % blocks], slots.at[s], sems.at[s])


def ring_trips(n, in_flight: int, copy, use, carry):
    """n copies (n >= in_flight), in_flight of them outstanding: the first in_flight issued at once,
    then trip i waits for copy i, uses it (`use(i, carry)`) and issues copy i + in_flight into its
    slot. Returns the last carry."""
    for j in range(in_flight):
        copy(j).start()

    def trip(i, carry):
        copy(i).wait()
        carry = use(i, carry)

        @pl.when(i + in_flight < n)
        def _():
            copy(i + in_flight).start()
        return carry

    return lax.fori_loop(0, n, trip, carry)


def dma_ring_kernel(in_flight: int, blocks: int, n_ref, src_hbm, o_ref, slots, sems):
    """The copies alone: each used as soon as it has landed."""
    # n_ref: [1] i32 SMEM (copies); src_hbm: [blocks, rows, lanes] bf16 HBM; o_ref: [16, lanes]
    # slots: [in_flight, rows, lanes] bf16 VMEM; sems: DMA [in_flight]
    ring_trips(n_ref[0], in_flight, lambda i: ring_copy(src_hbm, slots, sems, blocks, i), lambda i, c: c, 0)
    o_ref[...] = slots[0, :16, :]


def dma_ring_call(rows: int, lanes: int, in_flight: int, blocks: int, sizes: Sizes, interpret: bool):
    return pallas(lambda *r: dma_ring_kernel(in_flight, blocks, *r),
                  jax.ShapeDtypeStruct((16, lanes), BF16), [SMEM_SPEC, HBM_SPEC], VMEM_SPEC,
                  [pltpu.VMEM((in_flight, rows, lanes), BF16), pltpu.SemaphoreType.DMA((in_flight,))],
                  sizes, interpret)


def ring_dot_kernel(in_flight: int, blocks: int, n_ref, x_ref, src_hbm, o_ref, slots, sems):
    """The megakernel's use of a bank between its wait and its refill: a dot of the rows x[8, rows]
    against it (ring.PartReader's block)."""
    # n_ref: [1] i32 SMEM; x_ref: [8, rows] bf16 VMEM; src_hbm: [blocks, rows, 128] bf16 HBM;
    # o_ref: [8, 128] f32; slots: [in_flight, rows, 128] bf16 VMEM; sems: DMA [in_flight]
    def use(i, acc):
        return acc + jnp.dot(x_ref[...], slots[i % in_flight], preferred_element_type=F32)
    o_ref[...] = ring_trips(n_ref[0], in_flight, lambda i: ring_copy(src_hbm, slots, sems, blocks, i), use,
                            jnp.zeros(o_ref.shape, F32))


def ring_dot_call(rows: int, in_flight: int, blocks: int, sizes: Sizes, interpret: bool):
    return pallas(lambda *r: ring_dot_kernel(in_flight, blocks, *r),
                  jax.ShapeDtypeStruct((8, 128), F32), [SMEM_SPEC, VMEM_SPEC, HBM_SPEC], VMEM_SPEC,
                  [pltpu.VMEM((in_flight, rows, 128), BF16), pltpu.SemaphoreType.DMA((in_flight,))],
                  sizes, interpret)


def matmul_kernel(widen: bool, acc_dtype, n_ref, x_ref, w_ref, o_ref):
    """n dots x @ w, the two weight matrices in turn (int8 weights widened first where `widen`)."""
    # n_ref: [1] i32 SMEM; x_ref: [m, k]; w_ref: [2, k, n]; o_ref: [m, n] f32 or i32
    def trip(i, carry):
        w = w_ref[i % 2]
        if widen:
            w = w.astype(x_ref.dtype)
        o_ref[...] = jnp.dot(x_ref[...], w, preferred_element_type=acc_dtype)
        return carry

    lax.fori_loop(0, n_ref[0], trip, 0)


def matmul_call(m: int, k: int, n: int, x_dtype, w_dtype, sizes: Sizes, interpret: bool):
    acc = I32 if x_dtype == I8 else F32
    return pallas(lambda *r: matmul_kernel(w_dtype != x_dtype, acc, *r), jax.ShapeDtypeStruct((m, n), acc),
                  [SMEM_SPEC, VMEM_SPEC, VMEM_SPEC], VMEM_SPEC, [], sizes, interpret)


def matmul_static_kernel(n_ref, x_ref, w_ref, o_ref):
    """n trips of two dots x @ w[0] then x @ w[1], each weight matrix named by a static index (the
    `mxu` entries index it by the trip's parity, a dynamic load)."""
    def trip(i, carry):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[0], preferred_element_type=F32)
        o_ref[...] += jnp.dot(x_ref[...], w_ref[1], preferred_element_type=F32)
        return carry

    lax.fori_loop(0, n_ref[0], trip, 0)


def matmul_static_call(m: int, k: int, n: int, sizes: Sizes, interpret: bool):
    return pallas(matmul_static_kernel, jax.ShapeDtypeStruct((m, n), F32),
                  [SMEM_SPEC, VMEM_SPEC, VMEM_SPEC], VMEM_SPEC, [], sizes, interpret)


def ring_work_kernel(in_flight: int, blocks: int, chunk: int, fmas: int, streamed: bool, n_ref, x_ref, src_hbm,
                     o_ref, slots, sems):
    """A bank's use that outlasts its copy: the bank read `chunk` rows at a time, each chunk widened to
    f32, put through `fmas` dependent multiply-adds on the vector unit and fed to one dot of 8 rows.
    streamed: the ring refills each bank as it is used (ring_trips); else the banks copied once
    stay resident and the same uses run with no copy in flight."""
    # n_ref: [1] i32 SMEM (banks); x_ref: [rows // chunk, 8, chunk] bf16; src_hbm: [blocks, rows, 128]
    # bf16 HBM; o_ref: [8, 128] f32; slots: [in_flight, rows, 128] bf16 VMEM; sems: DMA [in_flight]
    parts = slots.shape[1] // chunk

    def use(i, acc):
        def part(j, acc):
            w = slots[i % in_flight, pl.ds(pl.multiple_of(j * chunk, chunk), chunk), :].astype(F32)
            for _ in range(fmas):
                w = w * 0.5 + 0.25
            return acc + jnp.dot(x_ref[j], w.astype(BF16), preferred_element_type=F32)
        return lax.fori_loop(0, parts, part, acc)

    copy = lambda i: ring_copy(src_hbm, slots, sems, blocks, i)  # noqa: E731
    acc = jnp.zeros(o_ref.shape, F32)
    if streamed:
        o_ref[...] = ring_trips(n_ref[0], in_flight, copy, use, acc)
        return
    for j in range(in_flight):
        copy(j).start()
        copy(j).wait()
    o_ref[...] = lax.fori_loop(0, n_ref[0], use, acc)


def ring_work_call(rows: int, in_flight: int, blocks: int, chunk: int, fmas: int, streamed: bool, sizes: Sizes,
                   interpret: bool):
    return pallas(lambda *r: ring_work_kernel(in_flight, blocks, chunk, fmas, streamed, *r),
                  jax.ShapeDtypeStruct((8, 128), F32), [SMEM_SPEC, VMEM_SPEC, HBM_SPEC], VMEM_SPEC,
                  [pltpu.VMEM((in_flight, rows, 128), BF16), pltpu.SemaphoreType.DMA((in_flight,))],
                  sizes, interpret)


class CyclicRing:
    """The kernel's weight ring (`perfmodel_kernels.ring.Ring`) over one layer's static parts read
    again and again: bank g is the layer's bank g mod its banks, in slot g mod depth, `total`
    (traced) banks in all. The kernel's `PartReader` consumes it as in the kernel."""

    def __init__(self, ring, total):
        self.ring, self.total = ring, total
        self.depth, self.s, self.dma, self.banks = ring.depth, ring.s, ring.dma, ring.banks

    def slot(self, g):
        return self.ring.slot(g)

    def bank(self, g, rows: int):
        from perfmodel_kernels.dma import Copies
        from perfmodel_kernels.stream import ROW_TILE
        r = self.ring
        row0 = pl.multiple_of(r.row0[lax.rem(g, r.n)], ROW_TILE)
        return Copies(f"bank {g}", (r.hbm.at[pl.ds(row0, rows)], r.banks.at[self.slot(g), pl.ds(0, rows)],
                                    r.sems.at[self.slot(g)]))

    def start(self):
        for g in range(self.depth):
            self.bank(g, self.s.banks[g % self.ring.n].rows).start()

    def issue(self, g):
        j = lax.rem(g, self.ring.n)
        for k, rows in enumerate(self.s.sizes):
            pl.when(jnp.logical_and(g < self.total, self.ring.cls[j] == k))(
                lambda rows=rows: self.bank(g, rows).start())


def reader_layer(spec, bank_rows: int):
    """(the static parts of the first MoE layer of `spec` in stream order, their stream of banks)."""
    from perfmodel_kernels import stream as st
    layer = next(x for x in spec.layers if x.ffn == "moe")
    parts = [st.part(spec, key, 128, bank_rows) for key in st.layer_parts(spec, layer)]
    banks, first, row0 = [], {}, 0
    for p in parts:
        first[p.key] = len(banks)
        for j, n in enumerate(p.bank_sizes()):
            banks.append(st.Bank(layer.index, p.family, j, row0, n, 0))
            row0 += n
    return parts, st.Stream(tuple(banks), first, tuple(sorted({b.rows for b in banks}, reverse=True)), row0)


def ring_reader_kernel(depth: int, parts, stream, n_ref, row0_ref, cls_ref, x_ref, hbm, o_ref, banks, sems, xs, ys):
    """n layers' static parts through the kernel's ring and reader: each group's dots of x against
    its banks, the banks waited for and refilled as the kernel does."""
    from perfmodel_kernels.dma import Dma
    from perfmodel_kernels.ring import PartReader, Ring
    nb = len(stream.banks)
    ring = CyclicRing(Ring(depth, stream, hbm, banks, sems, row0_ref, cls_ref, Dma(None)), n_ref[0] * nb)
    ring.start()

    def layer(i, acc):
        for p in parts:
            r = PartReader(ring, p, i * nb + stream.first_bank[p.key], xs, ys)
            for k, g in enumerate(p.groups):
                acc = acc + jnp.sum(r.matmul(k, x_ref[:, :g.d_in]), axis=1, keepdims=True)
            r.finish()
        return acc
    o_ref[...] = lax.fori_loop(0, n_ref[0], layer, jnp.zeros(o_ref.shape, F32))


def ring_reader_call(depth: int, bank_rows: int, parts, stream, sizes: Sizes, interpret: bool):
    most = max(max(g.blocks(128), g.chunks(128)) for p in parts for g in p.groups)
    return pallas(lambda *r: ring_reader_kernel(depth, parts, stream, *r),
                  jax.ShapeDtypeStruct((8, 128), F32), [SMEM_SPEC, SMEM_SPEC, SMEM_SPEC, VMEM_SPEC, HBM_SPEC],
                  VMEM_SPEC, [pltpu.VMEM((depth, bank_rows, 128), BF16), pltpu.SemaphoreType.DMA((depth,)),
                              pltpu.VMEM((most, 8, 128), F32), pltpu.VMEM((most, 8, 128), F32)],
                  sizes, interpret)


def vpu_kernel(op: str, n_ref, x_ref, o_ref):
    """n elementwise passes over the array in VMEM, each reading the last one's result."""
    # n_ref: [1] i32 SMEM; x_ref, o_ref: [rows, lanes] f32 VMEM
    o_ref[...] = x_ref[...]

    def trip(i, carry):
        v = o_ref[...]
        o_ref[...] = jnp.exp(-v) if op == "exp" else v * 0.999
        return carry

    lax.fori_loop(0, n_ref[0], trip, 0)


def vpu_call(rows: int, lanes: int, op: str, sizes: Sizes, interpret: bool):
    return pallas(lambda *r: vpu_kernel(op, *r), jax.ShapeDtypeStruct((rows, lanes), F32),
                  [SMEM_SPEC, VMEM_SPEC], VMEM_SPEC, [], sizes, interpret)


def loop_trip_kernel(n_ref, o_ref, count):
    """n trips of a fori_loop whose body increments an SMEM scalar (a side effect nothing removes)."""
    # n_ref: [1] i32 SMEM; o_ref: [1] i32 SMEM; count: [1] i32 SMEM scratch
    count[0] = 0

    def trip(i, carry):
        count[0] = count[0] + 1
        return carry

    lax.fori_loop(0, n_ref[0], trip, 0)
    o_ref[0] = count[0]


def loop_trip_call(sizes: Sizes, interpret: bool):
    return pallas(loop_trip_kernel, jax.ShapeDtypeStruct((1,), I32), [SMEM_SPEC], SMEM_SPEC,
                  [pltpu.SMEM((1,), I32)], sizes, interpret)


def issue_wait_kernel(lag: int, chain: int, with_copy: bool, n_ref, src_hbm, x_ref, o_ref, slots, sems):
    """n trips (n >= lag) of `chain` dependent multiply-adds on one vector tile; with_copy: each trip
    also waits for the copy started `lag` trips before (long arrived) and starts one of 4 KiB."""
    # n_ref: [1] i32 SMEM; src_hbm: [lag, 16, 128] bf16 HBM; x_ref, o_ref: [8, 128] f32 VMEM
    # slots: [lag, 16, 128] bf16 VMEM; sems: DMA [lag]
    n = n_ref[0]

    def trip(i, x):
        for _ in range(chain):
            x = x * 0.5 + 0.25
        if with_copy:
            @pl.when(i >= lag)
            def _():
                ring_copy(src_hbm, slots, sems, lag, i - lag).wait()
            ring_copy(src_hbm, slots, sems, lag, i).start()
        return x

    x = lax.fori_loop(0, n, trip, x_ref[...])
    if with_copy:
        for j in range(lag):
            ring_copy(src_hbm, slots, sems, lag, n - lag + j).wait()
    o_ref[...] = x


def issue_wait_call(lag: int, chain: int, with_copy: bool, sizes: Sizes, interpret: bool):
    return pallas(lambda *r: issue_wait_kernel(lag, chain, with_copy, *r), jax.ShapeDtypeStruct((8, 128), F32),
                  [SMEM_SPEC, HBM_SPEC, VMEM_SPEC], VMEM_SPEC,
                  [pltpu.VMEM((lag, 16, 128), BF16), pltpu.SemaphoreType.DMA((lag,))], sizes, interpret)


def dma_queue_kernel(ahead: int, small_first: bool, trips: int, n_ref, big_hbm, small_hbm, x_ref, o_ref,
                     bigs, small, sems):
    """n repetitions of: `ahead` big copies and one small copy started (the small first or last),
    the small one waited for, `trips` x 8 dependent vector multiply-adds on a tile that reads it,
    then the big ones waited for. With the work longer than the big copies, a repetition lasts the
    small copy's arrival plus the work."""
    # n_ref: [1] i32 SMEM; big_hbm: [ahead, R, 128] bf16 HBM; small_hbm: [r, l] bf16 HBM;
    # x_ref, o_ref: [8, 128] f32 VMEM; bigs: [ahead, R, 128] bf16 VMEM; small: [r, l] bf16 VMEM; sems: DMA [ahead + 1]
    big = [pltpu.make_async_copy(big_hbm.at[j], bigs.at[j], sems.at[j]) for j in range(ahead)]
    one = pltpu.make_async_copy(small_hbm, small, sems.at[ahead])

    def rep(i, x):
        for cp in ([one] + big if small_first else big + [one]):
            cp.start()
        one.wait()
        x = x + small[:8, :128].astype(F32)

        def work(j, x):
            for _ in range(8):
                x = x * 0.5 + 0.25
            return x
        x = lax.fori_loop(0, trips, work, x)
        for cp in big:
            cp.wait()
        return x

    o_ref[...] = lax.fori_loop(0, n_ref[0], rep, x_ref[...])


def dma_queue_call(ahead: int, small_first: bool, trips: int, big_rows: int, small_shape: tuple, sizes: Sizes,
                   interpret: bool):
    return pallas(lambda *r: dma_queue_kernel(ahead, small_first, trips, *r), jax.ShapeDtypeStruct((8, 128), F32),
                  [SMEM_SPEC, HBM_SPEC, HBM_SPEC, VMEM_SPEC], VMEM_SPEC,
                  [pltpu.VMEM((max(ahead, 1), big_rows, 128), BF16), pltpu.VMEM(small_shape, BF16),
                   pltpu.SemaphoreType.DMA((ahead + 1,))], sizes, interpret)


def mla_core_kernel(r: int, cb: int, n_ref, pos_ref, cache_hbm, ql_ref, qr_ref, blk_ref, o_ref, blocks, sems):
    """n repetitions of the megakernel's MLA core for one sequence (`_sequence_attention`, its cache
    tiles copied from HBM three in flight by `LatentCache`), each repetition's queries scaled by
    the last one's output so none is hoisted."""
    # n_ref, pos_ref: [1] i32 SMEM; cache_hbm: [1, 1, T, r + rope] bf16 HBM; ql_ref [hr, r], qr_ref
    # [hr, rope], blk_ref [1, r + rope] f32 VMEM; o_ref [hr, r] f32; blocks: [3, cb, r + rope] bf16 VMEM
    from types import SimpleNamespace
    from perfmodel_kernels.megakernel import LatentCache, _sequence_attention
    hr = ql_ref.shape[0]
    ctx = SimpleNamespace(spec=SimpleNamespace(mla=SimpleNamespace(kv_lora_rank=r)),
                          cfg=SimpleNamespace(cache_block=cb, max_context=cache_hbm.shape[2]),
                          mla=SimpleNamespace(cache=cache_hbm, blocks=blocks, sem=sems), pos=pos_ref)
    cache = LatentCache(ctx, 0)
    causal = jnp.ones((hr, 1), bool)
    scale = (r + qr_ref.shape[1]) ** -0.5

    def rep(i, acc):
        cache.start_first(0)
        ql = ql_ref[...] * (1.0 + 1e-6 * acc[:, :1])
        return _sequence_attention(ctx, cache, 0, ql, qr_ref[...], blk_ref[...], causal, scale)

    o_ref[...] = lax.fori_loop(0, n_ref[0], rep, jnp.zeros((hr, r), F32))


def mla_core_call(hr: int, tokens: int, r: int, rope: int, cb: int, sizes: Sizes, interpret: bool):
    return pallas(lambda *refs: mla_core_kernel(r, cb, *refs), jax.ShapeDtypeStruct((hr, r), F32),
                  [SMEM_SPEC, SMEM_SPEC, HBM_SPEC, VMEM_SPEC, VMEM_SPEC, VMEM_SPEC], VMEM_SPEC,
                  [pltpu.VMEM((3, cb, r + rope), BF16), pltpu.SemaphoreType.DMA((3,))], sizes, interpret)


def kda_core_kernel(spec, rows: int, n_ref, q_ref, k_ref, v_ref, dec_ref, beta_ref, gate_ref, a_log_ref, dt_ref,
                    norm_ref, conv_ref, state_in, window_in, o_ref, state, window):
    """n repetitions of the megakernel's KDA attention between its projections (`reference.kda_block`
    with the projections' outputs given: gates, short conv, delta rule, norm and output gate), its
    state and window in VMEM as the kernel holds them; each repetition's inputs scaled by the last
    one's output so none is hoisted."""
    from perfmodel_kernels import reference as ref
    state[...], window[...] = state_in[...], window_in[...]
    v = {"A_log": a_log_ref[...], "dt_bias": dt_ref[...], "o_norm": norm_ref[...], "conv": conv_ref[...]}
    b = state.shape[0]
    accepted = jnp.full((b, 1), rows, jnp.int32)

    def rep(i, acc):
        s = 1.0 + 1e-6 * acc[:, :1]
        proj = {"q_proj": q_ref, "k_proj": k_ref, "v_proj": v_ref, "decay_b": dec_ref, "beta_proj": beta_ref,
                "gate_proj": gate_ref}

        def matmul(name, x):
            if name in ("decay_a", "o_proj"):  # decay_b gives the pair's output; o_proj's input is the result
                return x
            return proj[name][...] * s
        out, st, win = ref.kda_block(spec, matmul, v, lambda: (state[...], window[...]), acc, accepted, rows)
        state[...] = st
        window[...] = win.astype(window.dtype)
        return out

    o_ref[...] = lax.fori_loop(0, n_ref[0], rep, jnp.zeros(o_ref.shape, F32))


def mla_absorb_kernel(spec, which: str, n_ref, kv_b_ref, x_ref, o_ref):
    """n repetitions of one of the megakernel's MLA absorption einsums on the kv_b matrix as the ring
    hands it over (bf16 [rank, heads x (nope + v)], split by `reference.split_kv_b`): "absorb" the
    queries into the latent (bhn,rhn->bhr) or "expand" the latent values (bhr,rhv->bhv); and
    "expand_heads", the same product as one 2-D dot a head on kv_b's columns, as the kernel now
    computes it (`megakernel.expand_latent`)."""
    from perfmodel_kernels import reference as ref
    from perfmodel_kernels.megakernel import expand_latent
    m = spec.mla

    def rep(i, acc):
        x = x_ref[...] * (1.0 + 1e-6 * acc[:1, :1, :1])
        if which == "expand_heads":
            return expand_latent(spec, x, kv_b_ref[...])
        w_uk, w_uv = ref.split_kv_b(spec, kv_b_ref[...])
        y = jnp.einsum("bhn,rhn->bhr", x, w_uk) if which == "absorb" else jnp.einsum("bhr,rhv->bhv", x, w_uv)
        return y[..., :m.qk_nope_dim] if which == "absorb" else y
    o_ref[...] = lax.fori_loop(0, n_ref[0], rep, jnp.zeros(o_ref.shape, F32))


def embed_pick_kernel(batch: int, n_ref, tok_ref, tiles_ref, o_ref):
    """n repetitions of the megakernel's embed phase after its rows arrive: each sequence's row
    picked out of its copied 16-row tile (`megakernel.pick_rows`, selects over [Bp, H] f32)."""
    from perfmodel_kernels.megakernel import pick_rows
    o_ref[...] = lax.fori_loop(0, n_ref[0], lambda i, acc: acc + pick_rows(tok_ref, tiles_ref, batch),
                               jnp.zeros(o_ref.shape, F32))


# ---- XLA programs -----------------------------------------------------------------------------

def dot_chain(trips, x, ws):
    """`trips` loop trips, each a chain of dots through the weights `ws` (x[m, k] -> [m, n] -> ...)."""
    def trip(_, x):
        for w in ws:
            x = jnp.dot(x, w)
        return x
    return lax.fori_loop(0, trips, trip, x)


def small_op_chain(length: int):
    def run(trips, x, w):
        """`trips` loop trips of `length` dependent small ops, tanh(x[8, 128] @ w[128, 128]) each."""
        def trip(_, x):
            for _ in range(length):
                x = jnp.tanh(jnp.dot(x, w))
            return x
        return lax.fori_loop(0, trips, trip, x)
    return run


def decode_attention(q, k, v):
    """One query row per head against the cache: q [H, G, D], k and v [H, T, D] -> [H, G, D] f32."""
    s = jnp.einsum("hgd,htd->hgt", q, k, preferred_element_type=F32) * q.shape[-1] ** -0.5
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return jnp.einsum("hgt,htd->hgd", p, v, preferred_element_type=F32)


def attention_chain(trips, q, k, v):
    """`trips` attentions, each query nudged by the last one's output (so none can be skipped)."""
    def trip(_, q):
        return (q.astype(F32) + 1e-3 * decode_attention(q, k, v)).astype(q.dtype)
    return lax.fori_loop(0, trips, trip, q)


# ---- the run ----------------------------------------------------------------------------------

class Bench:
    """The run's state: sizes, clock, deadline, the entries so far and the output file."""

    def __init__(self, sizes: Sizes, interpret: bool, out: Path, platform: str, source: str,
                 context: dict, budget_s: float):
        self.sizes, self.interpret, self.out, self.platform = sizes, interpret, out, platform
        self.source, self.context = source, context
        self.clock = Clock(sizes)
        self.deadline = time.monotonic() + budget_s
        self.entries: list[dict] = []
        self.skipped: list[str] = []
        self.prefix = platform.removeprefix("tpu-")
        self._counts: dict[tuple, jax.Array] = {}

    def count(self, n: int, shape: tuple = (1,)) -> jax.Array:
        """n as an int32 device array of `shape` ([1]: a kernel's SMEM input; (): an XLA loop's trip
        count), cached: no transfer inside a timed call."""
        if (n, shape) not in self._counts:
            self._counts[n, shape] = jnp.full(shape, n, I32)
        return self._counts[n, shape]

    def case(self, what: str, fn, *args):
        """fn(*args), one measurement: not started past the deadline; an error is recorded as a skip
        and the run goes on (in the dry run, which CI runs, it is raised)."""
        if time.monotonic() >= self.deadline:
            self.skip(what, "the --budget-s deadline passed")
            return
        try:
            fn(*args)
        except Exception as e:
            if self.interpret:
                raise
            self.skip(what, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:400]}")

    def skip(self, what: str, why: str):
        self.skipped.append(f"{what}: {why}")
        print(f"  skipped {what}: {why}", flush=True)

    def kernel_slope(self, call, args, n0: int = 1) -> Slope:
        """The slope per repetition of a pallas_call whose first input is the repetition count."""
        f = jax.jit(call)
        return self.clock.slope(lambda n: jax.block_until_ready(f(self.count(n), *args)), n0)

    def program_slope(self, fn, args, n0: int = 1, n_max: int = 1 << 24) -> Slope:
        """The slope per loop trip of a jitted fn(trips, *args) (trips a device scalar)."""
        f = jax.jit(fn)
        return self.clock.slope(lambda n: jax.block_until_ready(f(self.count(n, ()), *args)), n0, n_max)

    def add(self, ident: str, mechanism: str, inputs: dict, value: float, unit: str, scope: str,
            notes: str = "", not_modelled: str = ""):
        """One entry (printed as it comes); a value that is not positive is a failed measurement."""
        ident = f"{self.prefix}-{ident}"
        if not (value > 0 and math.isfinite(value)):
            self.skip(ident, f"measured {value!r} {unit}: not a positive time ({notes})")
            return
        e = {"id": ident, "mechanism": mechanism, "inputs": inputs, "value": float(f"{value:.6g}"), "unit": unit,
             "scope": scope, "source": self.source}
        if notes:
            e["notes"] = notes
        if not_modelled:
            e["not_modelled"] = not_modelled
        self.entries.append(e)
        print(f"{ident}: {e['value']:.4g} {unit} ({scope})", flush=True)
        self.write()

    def write(self):
        """The file as measured so far (rewritten whole after every entry and mechanism)."""
        from perfmodel.util.files import write_atomic
        doc = {"what": f"{self.context['device']} component micro-benchmarks (one mechanism each), with the "
                       "inputs the component model needs to predict each one.",
               "platform": self.platform, "source": self.source,
               "target": 0.05,  # each fitted entry's |residual| at most this (perfmodel calibrate)
               "context": {**self.context, "skipped": list(self.skipped)},
               "fit": {self.platform: {
                   # the ring determines the first-byte latency beside the bandwidth and the descriptor
                   "dma": ["dma_bandwidth_bytes_per_s", "dma_descriptor_s", "dma_latency_s"],
                   # no fp8 MXU: its push is not measured
                   "mxu": ["mxu_push_bf16_s", "mxu_row_s", "mxu_dot_issue_s"],
                   # the MLA core by cached tokens: a latency a sequence and one a cache tile; the KDA core
                   # by heads and batch: the vector unit's rate (no top-k here)
                   "vpu": ["attention_core_s", "attention_tile_s", "vpu_flops_per_s"],
                   # the kernel's column loop runs the word decode for MXFP4, not the f32 one
                   "expert_pass": ["expert_pass_int4_s", "expert_pass_int8_s", "expert_pass_e2m1_words_s"]}},
               "entries": self.entries}
        if self.entries:
            write_atomic(self.out, json.dumps(doc, indent=1) + "\n", parents=True)


def host_dispatch(b: Bench):
    """Host dispatch of a trivial jitted call (x + 1 on one [8, 128] f32 tile), called and waited on:
    the median over calls. The same calls issued back to back without waiting are in the notes."""
    f = jax.jit(lambda x: x + 1)
    x = jnp.zeros((8, 128), F32)
    n = b.sizes.dispatch_calls
    median, spread = call_times(lambda: f(x).block_until_ready(), n)
    t0 = time.perf_counter()
    ys = [f(x) for _ in range(n)]
    jax.block_until_ready(ys)
    queued = (time.perf_counter() - t0) / n
    b.add("host-dispatch", "host_dispatch", {}, median * 1e6, "us_per_call",
          f"a jitted x + 1 on an [8, 128] f32 tile, called and waited on, median of {n} calls",
          f"{spread}; {queued * 1e6:.1f} us a call when {n} calls are issued before waiting")


def dispatch_args(b: Bench):
    """Host dispatch of a pallas_call against its argument count: a kernel that copies its first
    f32 [8, 128] input to its output and takes N - 1 more HBM arrays it never reads, jitted, called
    and waited on (median of calls); and the same with its first input donated and aliased to its
    output, each call fed the last one's output (as the megakernel's cache). The megakernel's
    one-step calls took 1.1-1.5 ms of host time where `host_dispatch` takes 0.55 ms."""
    n_calls = b.sizes.dispatch_calls

    def kernel(x_ref, *refs):
        refs[-1][...] = x_ref[...] + 1.0

    def one(what, n_args, donated):
        call = pallas(kernel, jax.ShapeDtypeStruct((8, 128), F32), [VMEM_SPEC] + [HBM_SPEC] * (n_args - 1),
                      VMEM_SPEC, [], b.sizes, b.interpret, aliases={0: 0} if donated else None)
        f = jax.jit(call, donate_argnums=(0,) if donated else ())
        rest = [jnp.zeros((8, 128), F32) + i for i in range(n_args - 1)]
        state = [jnp.zeros((8, 128), F32)]

        def run():
            y = f(state[0], *rest)
            y.block_until_ready()
            if donated:
                state[0] = y
        median, spread = call_times(run, n_calls)
        b.add(what, "host_dispatch_args", {"arguments": n_args, "donated": donated}, median * 1e6, "us_per_call",
              f"a pallas_call of {n_args} argument(s) (one [8, 128] f32 tile read, the rest untouched HBM"
              + (", the first donated and aliased to the output)" if donated else ")")
              + f", called and waited on, median of {n_calls} calls", spread,
              not_modelled="a probe of the host's dispatch against the argument count, beside host_dispatch")

    for n_args in (1, 8, 32, 128):
        for donated in (False, True):
            what = f"dispatch-args-{n_args}" + ("-donated" if donated else "")
            b.case(what, one, what, n_args, donated)


def ring_blocks(sizes: Sizes, copy_bytes: int) -> int:
    """Blocks of the copy size in the HBM source a ring cycles through (at least 2)."""
    return max(2, sizes.ring_source_bytes // copy_bytes)


def measure_ring(b: Bench, rows: int, lanes: int, in_flight: int) -> Slope:
    copy_bytes = rows * lanes * 2
    blocks = ring_blocks(b.sizes, copy_bytes)
    src = jnp.ones((blocks, rows, lanes), BF16)
    try:
        return b.kernel_slope(dma_ring_call(rows, lanes, in_flight, blocks, b.sizes, b.interpret), (src,),
                              n0=max(in_flight, 2))
    finally:
        src.delete()


def dma_ring(b: Bench):
    """HBM -> VMEM copy stream: time per copy of bf16 [rows, lanes] blocks with 1, 2, 4 or 8 copies
    kept in flight (a ring of VMEM slots; each trip waits for the oldest and issues the next into
    its slot), the slope over the number of copies. The source cycles through `ring_source_bytes`
    of HBM."""
    s = b.sizes

    def one(what, rows, lanes, kib, q):
        sl = measure_ring(b, rows, lanes, q)
        nbytes = rows * lanes * 2
        b.add(what, "dma_ring", {"bytes": nbytes, "in_flight": q, "lanes": lanes, "dtype": "bf16"},
              sl.per_rep_s * 1e6, "us_per_copy",
              f"HBM -> VMEM copies of bf16 [{rows}, {lanes}] ({kib} KiB), {q} kept in flight, per copy "
              f"({nbytes / max(sl.per_rep_s, 1e-15) / 1e9:.0f} GB/s)", sl.notes("copies"))

    for lanes, kibs in s.dma_kib.items():
        for kib in kibs:
            for q in s.in_flight:
                what = f"dma-ring-{lanes}l-{kib}k-q{q}"
                if q * kib * KIB > s.ring_vmem_bytes:
                    b.skip(what, f"{q} slots of {kib} KiB exceed the ring's {s.ring_vmem_bytes // MIB} MiB of VMEM")
                    continue
                b.case(what, one, what, kib * KIB // (lanes * 2), lanes, kib, q)


def ring_dot(b: Bench):
    """The weight ring as the megakernel uses it: time per bank of bf16 [rows, 128] banks, depth of
    them in flight, each waited for, consumed by one dot of 8 rows against it and then refilled,
    by bank rows (the slope over the number of banks). Beside the dma_ring entries of the same
    bytes (the stream alone) they say what a bank costs the kernel beyond its bytes; fitted with
    them (the copy and the dot overlap: the longer of the two)."""
    s, q = b.sizes, b.sizes.ring_dot_depth

    def one(what, rows):
        nbytes = rows * 128 * 2
        blocks = ring_blocks(s, nbytes)
        src, x = jnp.ones((blocks, rows, 128), BF16), jnp.ones((8, rows), BF16)
        try:
            sl = b.kernel_slope(ring_dot_call(rows, q, blocks, s, b.interpret), (x, src), n0=max(q, 2))
        finally:
            src.delete()
        b.add(what, "ring_dot", {"bytes": nbytes, "in_flight": q, "lanes": 128, "rows": 8, "bank_rows": rows},
              sl.per_rep_s * 1e6, "us_per_copy",
              f"a ring bank of bf16 [{rows}, 128] ({nbytes // KIB} KiB), {q} in flight, waited for, one dot "
              "of 8 rows against it, then refilled", sl.notes("banks"))

    for rows in s.ring_dot_rows:
        if q * rows * 128 * 2 > s.ring_vmem_bytes:
            b.skip(f"ring-dot-{rows}", f"{q} banks of {rows} rows exceed the ring's {s.ring_vmem_bytes // MIB} MiB")
            continue
        what = f"ring-dot-{rows}"
        b.case(what, one, what, rows)


def dma_latency(b: Bench):
    """A copy's first-byte latency: tiny bf16 [rows, 128] copies, one at a time (each issued, then
    waited for), the slope over the number of copies: latency + descriptor + bytes per copy, the
    loop's trip included (`loop_trip`)."""
    def one(what, rows):
        sl = measure_ring(b, rows, 128, 1)
        b.add(what, "dma_ring", {"bytes": rows * 256, "in_flight": 1, "lanes": 128, "dtype": "bf16"},
              sl.per_rep_s * 1e6, "us_per_copy",
              f"HBM -> VMEM copy of bf16 [{rows}, 128] ({rows * 256 // KIB} KiB) issued and waited for, one "
              f"at a time, per copy (first-byte latency + descriptor + bytes, a loop trip included)",
              sl.notes("copies"))

    for rows in b.sizes.latency_rows:
        what = f"dma-latency-{rows * 256 // KIB}k"
        b.case(what, one, what, rows)


def mxu_matmul(b: Bench):
    """MXU time of one in-kernel dot x[m, k] @ w[k, n] by shape and dtype: the slope over the number
    of dots, the two weight matrices in VMEM used in turn. bf16 x bf16 -> f32; bf16 x int8 weights
    widened to bf16 in the kernel; int8 x int8 -> int32. No fp8: the v5e has no fp8 MXU."""
    s = b.sizes
    key = jax.random.PRNGKey(0)

    def operand(shape, dtype):
        if dtype == I8:
            return jax.random.randint(key, shape, -8, 8, I32).astype(I8)
        return jax.random.normal(key, shape, F32).astype(BF16)

    def one(what, kind, m, k, n, xd, wd):
        sl = b.kernel_slope(matmul_call(m, k, n, xd, wd, s, b.interpret), (operand((m, k), xd), operand((2, k, n), wd)))
        scope = (f"in-kernel dot [{m}, {k}] @ [{k}, {n}], {kind} "
                 f"({2 * m * k * n / max(sl.per_rep_s, 1e-15) / 1e12:.1f} T op/s), per dot")
        if kind == "int8x8":
            b.add(what, "matmul_int8_lhs", {"m": m, "k": k, "n": n}, sl.per_rep_s * 1e6, "us_per_dot", scope,
                  sl.notes("dots"), not_modelled="int8 activations against int8 weights (the v5e MXU's int8 "
                  "rate) are not a path of the model, which feeds int8 weights at the bf16 rate")
            return
        inputs = {"k": k, "n": n, "k_chunk": k, "lhs_rows_per_chunk": m, "dtype": "bf16" if kind == "bf16" else "int8",
                  "rows": m}
        b.add(what, "matmul", inputs, sl.per_rep_s * 1e6, "us_per_dot", scope, sl.notes("dots"),
              not_modelled="" if kind == "bf16" else "the weights' int8 -> bf16 widening on the vector unit is "
              "not a term of matmul_time, which pushes int8 weights at the bf16 rate")

    cases = [(m, k, n, BF16, BF16) for (k, n) in s.mxu_shapes for m in s.mxu_rows]
    cases += [(m, k, n, BF16, I8) for (k, n) in s.mxu_int8_shapes for m in s.mxu_rows]
    cases += [(m, k, n, I8, I8) for (m, k, n) in s.mxu_int8_lhs]
    for m, k, n, xd, wd in cases:
        kind = {(BF16, BF16): "bf16", (BF16, I8): "int8w", (I8, I8): "int8x8"}[(xd, wd)]
        what = f"mxu-{kind}-m{m}-{k}x{n}"
        b.case(what, one, what, kind, m, k, n, xd, wd)


def mxu_static(b: Bench):
    """The `mxu` dots again, each weight matrix named by a static index (two dots a trip): whether
    the dynamic load of the `mxu` entries' weights costs a dot time of its own, by shape."""
    s = b.sizes
    key = jax.random.PRNGKey(0)

    def one(what, m, k, n):
        x = jax.random.normal(key, (m, k), F32).astype(BF16)
        w = jax.random.normal(key, (2, k, n), F32).astype(BF16)
        sl = b.kernel_slope(matmul_static_call(m, k, n, s, b.interpret), (x, w))
        b.add(what, "matmul", {"k": k, "n": n, "k_chunk": k, "lhs_rows_per_chunk": m, "dtype": "bf16", "rows": m},
              sl.per_rep_s / 2 * 1e6, "us_per_dot",
              f"in-kernel dot [{m}, {k}] @ [{k}, {n}], bf16, the weights by a static index, per dot", sl.notes("trips"),
              not_modelled="a probe of the mxu entries' method (their weights by a dynamic index), not fitted")

    for k, n in s.mxu_shapes:
        for m in s.mxu_static_rows:
            what = f"mxu-static-bf16-m{m}-{k}x{n}"
            b.case(what, one, what, m, k, n)


def ring_work(b: Bench):
    """The weight ring when a bank's use outlasts its copy (the megakernel's f32 decode of its mxfp4
    experts was such a use): bf16 [rows, 128] banks, 8 in flight, each used `chunk` rows at a time
    (widened to f32, `fmas` multiply-adds, one dot of 8 rows), per bank; beside each, the same uses
    of resident banks with no copy in flight. The difference is what streaming a bank costs a
    compute-bound ring beyond its use."""
    s, q, chunk = b.sizes, b.sizes.ring_dot_depth, b.sizes.ring_work_chunk

    def one(what, rows, fmas, streamed):
        nbytes = rows * 128 * 2
        blocks = ring_blocks(s, nbytes) if streamed else q
        src, x = jnp.ones((blocks, rows, 128), BF16), jnp.ones((rows // chunk, 8, chunk), BF16)
        try:
            sl = b.kernel_slope(ring_work_call(rows, q, blocks, chunk, fmas, streamed, s, b.interpret), (x, src),
                                n0=max(q, 2))
        finally:
            src.delete()
        b.add(what, "ring_work", {"bytes": nbytes, "in_flight": q, "bank_rows": rows, "chunk": chunk,
                                  "fmas": fmas, "streamed": streamed},
              sl.per_rep_s * 1e6, "us_per_copy",
              f"a bank of bf16 [{rows}, 128] used {chunk} rows at a time (f32, {fmas} multiply-adds, a dot of "
              f"8 rows), " + (f"{q} in flight, refilled as used" if streamed else "resident, no copy"),
              sl.notes("banks"), not_modelled="a probe of a compute-bound ring: the streamed entry against its "
              "resident twin, no term of the model yet")

    for fmas in s.ring_work_fmas:
        for rows in s.ring_dot_rows:
            for streamed in (True, False):
                what = f"ring-work-f{fmas}-{rows}" + ("" if streamed else "-resident")
                b.case(what, one, what, rows, fmas, streamed)


def ring_reader(b: Bench):
    """The kernel's own ring and reader (`ring.Ring`, `ring.PartReader`) on the static parts of one
    MoE layer of a slice (KDA attention, router, latent projections, shared expert), 8 rows, by
    ring depth and bank rows: time per layer (the slope over layers). Beside the stream alone
    (dma_ring) it says what a bank costs the reader: banks per layer are in the inputs."""
    from perfmodel_kernels.specs import slice_spec
    from perfmodel_kernels.stream import bank_tables
    s = b.sizes
    spec = slice_spec(s.reader_slice, "mxfp4")

    def one(what, depth, rows):
        parts, stream = reader_layer(spec, rows)
        row0, cls = (jnp.asarray(t) for t in bank_tables(stream))
        width = max(g.d_in for p in parts for g in p.groups)
        hbm, x = jnp.ones((stream.rows, 128), BF16), jnp.full((8, width), 0.01, F32)
        try:
            sl = b.kernel_slope(ring_reader_call(depth, rows, parts, stream, s, b.interpret),
                                (row0, cls, x, hbm))
        finally:
            hbm.delete()
        nbytes = stream.rows * 128 * 2
        b.add(what, "ring_reader", {"slice": s.reader_slice, "depth": depth, "bank_rows": rows,
                                    "banks": len(stream.banks), "bytes": nbytes, "rows": 8,
                                    "dots": sum(len(p.items) for p in parts)},
              sl.per_rep_s * 1e6, "us_per_layer",
              f"one MoE layer's static parts of {s.reader_slice} ({nbytes / MIB:.1f} MiB in {len(stream.banks)} "
              f"banks of {rows} rows, {depth} in flight) through the kernel's ring and reader, 8 rows "
              f"({nbytes / max(sl.per_rep_s, 1e-15) / 1e9:.0f} GB/s)", sl.notes("layers"),
              not_modelled="a probe of what a bank costs the kernel's reader, no term of the model yet")

    for depth, rows in s.reader_rings:
        what = f"ring-reader-{depth}x{rows}"
        b.case(what, one, what, depth, rows)


def vpu_elementwise(b: Bench):
    """Vector-unit work per element: one elementwise pass (x * c, or exp(-x)) over an f32 [rows,
    lanes] array held in VMEM, each pass reading the last one's result; the slope over passes."""
    def one(what, rows, lanes, op):
        x = jnp.full((rows, lanes), 0.5, F32)
        sl = b.kernel_slope(vpu_call(rows, lanes, op, b.sizes, b.interpret), (x,))
        values = rows * lanes
        b.add(what, "vpu_elementwise", {"op": op, "rows": rows, "lanes": lanes, "values": values},
              sl.per_rep_s * 1e6, "us_per_op",
              f"one pass of {'exp(-x)' if op == 'exp' else 'x * c'} over f32 [{rows}, {lanes}] in VMEM "
              f"(load, op, store; {values / max(sl.per_rep_s, 1e-15) / 1e9:.1f} G values/s)", sl.notes("passes"),
              not_modelled="no per-element vector-unit term in the model yet (vpu_dequant_s is per "
              "dequantised matrix)")

    for rows, lanes in b.sizes.vpu_shapes:
        for op in b.sizes.vpu_ops:
            what = f"vpu-{op}-f32-{rows}x{lanes}"
            b.case(what, one, what, rows, lanes, op)


def expert_tile_kernel(fmt, n_ref, codes_ref, scales_ref, x_ref, o_ref):
    """n trips of the megakernel's own path for one routed-expert tile (`perfmodel_kernels.quant`): the
    codes as the MXU operand (`mxu_operand`: the vector unit unpacks and decodes 4-bit codes),
    the dot against the group's block-diagonal input with its scales (`group_dot`)."""
    # n_ref: [1] i32 SMEM; codes_ref: [2, code_rows, T]; scales_ref: [2, chunk * G, T] or
    # [2, 8, T] unused; x_ref: [rows, T] f32; o_ref: [rows, T] f32
    from perfmodel_kernels import quant
    o_ref[...] = jnp.zeros(o_ref.shape, F32)

    def trip(i, carry):
        w = quant.mxu_operand(codes_ref[i % 2], fmt)
        sc = quant.tile_scales(scales_ref[i % 2], 0, fmt) if fmt.scale_rows else None
        o_ref[...] += quant.group_dot(x_ref[...], w, sc, fmt)
        return carry

    lax.fori_loop(0, n_ref[0], trip, 0)


def expert_tile(b: Bench):
    """The megakernel's per-tile work on a routed expert, per format, at the chip's feed: codes
    to the MXU operand on the vector unit (4-bit codes unpacked and decoded) and the dot with
    its scales, over tiles held in VMEM (no copies); the slope over tiles."""
    from perfmodel_kernels import chip as chip_mod, quant
    target = chip_mod.chip()
    t, rows = target.mxu, 8

    def one(what, name):
        fmt = quant.tile_format(name, t, fp8=target.fp8)
        codes = jnp.ones((2, fmt.code_rows, t), fmt.code_dtype)
        srows = fmt.chunk * fmt.scale_rows if fmt.scale_rows else 8
        sdt = fmt.scale_dtype if fmt.scale_rows else F32
        scales = jnp.ones((2, srows, t), sdt)
        x = jnp.full((rows, t), 0.5, F32)
        call = pallas(lambda *r: expert_tile_kernel(fmt, *r), jax.ShapeDtypeStruct((rows, t), F32),
                      [SMEM_SPEC, VMEM_SPEC, VMEM_SPEC, VMEM_SPEC], VMEM_SPEC, [], b.sizes,
                      b.interpret)
        sl = b.kernel_slope(call, (codes, scales, x))
        b.add(what, "expert_tile", {"format": name, "feed": quant.feed(fmt), "tile": t,
                                    "rows": rows}, sl.per_rep_s * 1e6, "us_per_tile",
              f"one {t} x {t} routed-expert tile of {name}, fed as {quant.feed(fmt)}, through the "
              f"megakernel's mxu_operand + group_dot against {rows} input rows "
              f"({t * t / max(sl.per_rep_s, 1e-15) / 1e9:.1f} G weights/s)", sl.notes("tiles"),
              not_modelled="the model prices a routed expert's tiles by MXU feed and push only; "
              "this is the kernel's whole per-tile path, decode included")

    for name in ("bf16", "int8", "int4", "mxfp4", "nvfp4"):
        what = f"expert-tile-{name}"
        b.case(what, one, what, name)


def expert_column_kernel(fmt, r, n_ref, codes_ref, scales_ref, x_ref, o_ref, wbuf):
    """n trips of the megakernel's column path for one routed-expert column block of r row
    tiles (`expert_columns`, formats the MXU takes as bf16): the r tiles decoded with their
    scales into a VMEM buffer (`quant.decoded_tile`, scale chunks loaded aligned), then one
    dot of the input [rows, r * T] over them; bf16 codes are the operand as they are."""
    # n_ref: [1] i32 SMEM; codes_ref: [2, r * code_rows, T]; scales_ref: [2, r * G, T] (or
    # [2, 8, T] unused); x_ref: [rows, r * T] bf16; o_ref: [rows, T] f32; wbuf: [r * T, T] bf16
    from perfmodel_kernels import quant
    t, ch, g = fmt.t, fmt.chunk, fmt.scale_rows
    o_ref[...] = jnp.zeros(o_ref.shape, F32)

    def trip(i, carry):
        s = i % 2
        if fmt.name == "bf16":
            w = codes_ref[s]
        else:
            for q in range(r // ch):
                sc = scales_ref[s, q * ch * g:(q + 1) * ch * g]
                for u in range(ch):
                    k = q * ch + u
                    codes = codes_ref[s, k * fmt.code_rows:(k + 1) * fmt.code_rows]
                    wbuf[k * t:(k + 1) * t] = quant.decoded_tile(codes, sc, u, fmt)
            w = wbuf[...]
        o_ref[...] += jnp.dot(x_ref[...], w, preferred_element_type=F32)
        return carry

    lax.fori_loop(0, n_ref[0], trip, 0)


def expert_column(b: Bench):
    """The megakernel's per-column work on a routed expert where the MXU takes the format as
    bf16 (all of them on a v5e): r row tiles decoded with their scales and one long dot; the
    slope over columns, per tile."""
    from perfmodel_kernels import chip as chip_mod, quant
    target = chip_mod.chip()
    t, rows = target.mxu, 8

    def one(what, name, r):
        fmt = quant.tile_format(name, t, fp8=target.fp8)
        codes = jnp.ones((2, r * fmt.code_rows, t), fmt.code_dtype)
        sdt = fmt.scale_dtype if fmt.scale_rows else F32
        scales = jnp.ones((2, r * fmt.scale_rows if fmt.scale_rows else 8, t), sdt)
        x = jnp.full((rows, r * t), 0.5, BF16)
        call = pallas(lambda *refs: expert_column_kernel(fmt, r, *refs),
                      jax.ShapeDtypeStruct((rows, t), F32),
                      [SMEM_SPEC, VMEM_SPEC, VMEM_SPEC, VMEM_SPEC], VMEM_SPEC,
                      [pltpu.VMEM((r * t, t), BF16)], b.sizes, b.interpret)
        sl = b.kernel_slope(call, (codes, scales, x))
        per_tile = sl.per_rep_s / r
        decode = quant.expert_layout(name, t, [(t, t)], fp8=target.fp8).decode_kind
        b.add(what, "expert_column", {"format": name, "decode": decode, "feed": quant.feed(fmt),
                                      "tile": t, "rows": rows, "row_tiles": r}, per_tile * 1e6,
              "us_per_tile",
              f"one {t} x {t} routed-expert tile of {name} in a column block of {r} row tiles, "
              f"fed as {quant.feed(fmt)} through the megakernel's column path (decode with "
              f"scales into VMEM, one dot against {rows} input rows) "
              f"({t * t / max(per_tile, 1e-15) / 1e9:.1f} G weights/s)", sl.notes("columns"))

    for name in ("bf16", "int8", "int4", "mxfp4", "nvfp4"):
        if quant.feed(quant.tile_format(name, t, fp8=target.fp8)) == "bf16":
            for r in (8, 32):
                what = f"expert-column-{name}-{r}"
                b.case(what, one, what, name, r)


def expert_loop_kernel(lay, m: int, separate: bool, n_ref, codes_ref, *refs):
    """n trips of the megakernel's `expert_columns` on matrix m of the expert in slot 0, the trip's
    parity its turn (the decode buffer's halves alternate as between the kernel's experts); the
    last trip's column blocks out (also experiments/tpu_decode_probe.py's kernel)."""
    from types import SimpleNamespace
    from perfmodel_kernels import megakernel
    scales_ref, x_ref, o_ref, dec, ys = refs if separate else (None, *refs)
    ctx = SimpleNamespace(cfg=SimpleNamespace(tile=lay.fmt.t), ys=ys, experts=SimpleNamespace(
        lay=lay, slots=codes_ref, scale_slots=scales_ref, decoded=dec))

    def trip(i, carry):
        megakernel.expert_columns(ctx, m, x_ref[...], 0, i % 2)
        return carry

    lax.fori_loop(0, n_ref[0], trip, 0)
    o_ref[...] = ys[...]


def expert_loop(b: Bench):
    """The kernel's own routed-expert column path, per format the MXU takes as bf16, on each matrix
    of one expert of each slice in `expert_loop_slices` (random weights packed as the kernel's):
    the slope over calls of the whole matrix, per tile."""
    from perfmodel_kernels import chip as chip_mod, layout, quant
    from perfmodel_kernels.specs import slice_spec
    target = chip_mod.chip()
    t, rows = target.mxu, 8

    def one(what, name, sl, m, lay, codes, scales):
        r, c = lay.shapes[m]
        separate = scales is not None
        x = jnp.full((rows, r * t), 0.5, BF16)
        args = (codes, scales, x) if separate else (codes, x)
        scratch = [pltpu.VMEM((max(lay.decoded_rows(), 8), t), BF16), pltpu.VMEM((c, rows, t), F32)]
        call = pallas(lambda *refs: expert_loop_kernel(lay, m, separate, *refs),
                      jax.ShapeDtypeStruct((c, rows, t), F32),
                      [SMEM_SPEC] + [VMEM_SPEC] * len(args), VMEM_SPEC, scratch, b.sizes, b.interpret)
        slope = b.kernel_slope(call, args)
        per_tile = slope.per_rep_s / (r * c)
        b.add(what, "expert_kernel_columns",
              {"format": name, "decode": lay.decode_kind, "slice": sl, "matrix": m, "row_tiles": r,
               "column_blocks": c, "column_group": lay.column_group(m), "chunk": lay.fmt.chunk,
               "tile": t, "rows": rows}, per_tile * 1e6, "us_per_tile",
              f"one {t} x {t} tile of {name} in matrix {m} ({r} x {c} tiles) of a {sl} routed expert "
              f"through the megakernel's own expert_columns ({lay.column_group(m)} column block(s) a "
              f"decode pass, scale chunks of {lay.fmt.chunk} tiles), one dot a column block against "
              f"{rows} input rows", slope.notes("calls"),
              not_modelled="" if lay.decode_kind else
              "bf16 codes are the operand: no decode passes; the column loop's dots are priced by "
              "components.matmul_time (bf16 routed experts are in no v5e kernel run)")

    rng = np.random.default_rng(0)
    for sl in b.sizes.expert_loop_slices:
        mats = [(mm.d_in, mm.d_out) for mm in layout.expert_matmuls(slice_spec(sl))]
        ws = [jnp.asarray(rng.standard_normal((1, i, o)) * 0.02, F32) for i, o in mats]
        for name in ("bf16", "int8", "int4", "mxfp4"):
            lay = quant.expert_layout(name, t, mats, fp8=target.fp8)
            if not (name == "bf16" or lay.decodes):
                continue
            codes, scales, _ = quant.pack_experts(lay, ws)
            for m in range(len(mats)):
                what = f"expert-loop-{name}-{sl}-m{m}"
                b.case(what, one, what, name, sl, m, lay, codes, scales)


def expert_slots_kernel(lay, separate: bool, streamed: bool, sources: int, n_ref, codes_hbm, *refs):
    """n trips of the megakernel's `expert_columns` over every matrix of the expert in slot i mod 2
    (trip i is the i-th expert applied), copied by its `expert_fetch` from [1, sources, rows, T]
    HBM arrays: streamed, the next expert's copy into the other slot is in flight meanwhile (the
    kernel's expert slots); else both slots are copied once and the same trips run with no copy
    in flight."""
    from types import SimpleNamespace
    from perfmodel_kernels import megakernel
    scales_hbm, *refs = refs if separate else (None, *refs)
    *xs, o_ref, slots, scale_slots, sems, dec, ys = refs if separate else (*refs[:-3], None, *refs[-3:])
    ctx = SimpleNamespace(cfg=SimpleNamespace(tile=lay.fmt.t), ys=ys, experts=SimpleNamespace(
        lay=lay, slots=slots, scale_slots=scale_slots, decoded=dec))

    refs_x = SimpleNamespace(hbm=codes_hbm, scales_hbm=scales_hbm, slots=slots, scale_slots=scale_slots,
                             sems=sems)
    copy = lambda i: megakernel.expert_fetch(refs_x, 0, i % sources, i % 2)  # noqa: E731

    def use(i, carry):
        for m, x in enumerate(xs):
            megakernel.expert_columns(ctx, m, x[...], i % 2, i % 2)
        return carry

    if streamed:
        ring_trips(n_ref[0], 2, copy, use, 0)
    else:
        for j in range(2):
            copy(j).start()
            copy(j).wait()
        lax.fori_loop(0, n_ref[0], use, 0)
    o_ref[...] = ys[...]


def expert_slots(b: Bench):
    """The kernel's routed-expert column path on whole experts (every matrix), the next expert's
    copy (codes, and int4's and int8's scales apart) in flight into the other of two slots
    meanwhile, and as its twin the same experts resident with no copy in flight: what the expert
    stream costs the decode beside it (`expert_loop` times one matrix alone)."""
    from perfmodel_kernels import chip as chip_mod, layout, quant
    from perfmodel_kernels.specs import slice_spec
    target = chip_mod.chip()
    t, rows, sources = target.mxu, 8, 4

    def one(what, name, sl, lay, codes, scales, streamed):
        separate = scales is not None
        xs = [jnp.full((rows, r * t), 0.5, BF16) for r, _ in lay.shapes]
        cmax = max(c for _, c in lay.shapes)
        (rc, rs), code_dtype = lay.rows, lay.fmt.code_dtype
        scratch = [pltpu.VMEM((2, rc, t), code_dtype),
                   *([pltpu.VMEM((2, rs, t), lay.fmt.scale_dtype)] if separate else []),
                   pltpu.SemaphoreType.DMA((2,)), pltpu.VMEM((max(lay.decoded_rows(), 8), t), BF16),
                   pltpu.VMEM((cmax, rows, t), F32)]
        args = (codes, scales, *xs) if separate else (codes, *xs)
        call = pallas(lambda *refs: expert_slots_kernel(lay, separate, streamed, sources, *refs),
                      jax.ShapeDtypeStruct((cmax, rows, t), F32),
                      [SMEM_SPEC, HBM_SPEC] + [HBM_SPEC] * separate + [VMEM_SPEC] * len(xs), VMEM_SPEC,
                      scratch, b.sizes, b.interpret)
        slope = b.kernel_slope(call, args, n0=2)
        nbytes = sum(lay.bytes())
        b.add(what, "expert_kernel_slots", {"format": name, "decode": lay.decode_kind, "slice": sl, "tiles": lay.tiles,
                                      "bytes": nbytes, "copies": lay.copies(), "streamed": streamed,
                                      "tile": t, "rows": rows},
              slope.per_rep_s / lay.tiles * 1e6, "us_per_tile",
              f"one {t} x {t} tile of a whole {sl} routed expert in {name} ({lay.tiles} tiles, "
              f"{nbytes / MIB:.1f} MiB in {lay.copies()} copies) through the megakernel's own expert_columns, "
              + ("the next expert's copy in flight into the other slot" if streamed else
                 "resident in one of two slots, no copy in flight"), slope.notes("experts"),
              not_modelled="a probe: the streamed entry against its resident twin and against expert_loop "
              "(one matrix alone); in the whole kernel the routed-expert phases ran longer a tile than the "
              "loop alone (docs/validation.md)")

    rng = np.random.default_rng(0)
    for sl in b.sizes.expert_loop_slices:
        mats = [(mm.d_in, mm.d_out) for mm in layout.expert_matmuls(slice_spec(sl))]
        ws = [jnp.asarray(rng.standard_normal((sources, i, o)) * 0.02, F32) for i, o in mats]
        for name in ("int4", "mxfp4", "int8"):
            lay = quant.expert_layout(name, t, mats, fp8=target.fp8)
            if not lay.decodes:
                continue
            codes, scales, _ = quant.pack_experts(lay, ws)
            codes, scales = codes[None], None if scales is None else scales[None]   # one MoE layer
            for streamed in (True, False):
                what = f"expert-slots-{name}-{sl}" + ("" if streamed else "-resident")
                b.case(what, one, what, name, sl, lay, codes, scales, streamed)
            codes.delete()
            if scales is not None:
                scales.delete()
        del ws


def expert_paths(b: Bench):
    """Both routed-expert paths: tile by tile (fp8 feeds) and by column (bf16 feeds)."""
    expert_tile(b)
    expert_column(b)


def loop_trip(b: Bench):
    """One trip of an in-kernel fori_loop (the body increments an SMEM scalar); then what starting a
    tiny copy and waiting for one long arrived adds to a trip with vector work of its own (the
    difference of two kernels' slopes: with and without the copies)."""
    s = b.sizes

    def trip():
        sl = b.kernel_slope(loop_trip_call(s, b.interpret), ())
        b.add("loop-trip", "loop_trip", {}, sl.per_rep_s * 1e6, "us_per_trip",
              "one trip of an in-kernel fori_loop whose body increments an SMEM scalar", sl.notes("trips"),
              not_modelled="no term of the model: a kernel's loop trips are inside its fitted fixed costs")

    def issue_wait():
        lag, chain = s.issue_lag, s.issue_chain
        src = jnp.ones((lag, 16, 128), BF16)
        x = jnp.full((8, 128), 0.5, F32)
        plain = b.kernel_slope(issue_wait_call(lag, chain, False, s, b.interpret), (src, x), n0=lag)
        both = b.kernel_slope(issue_wait_call(lag, chain, True, s, b.interpret), (src, x), n0=lag)
        b.add("dma-issue-wait", "dma_issue_wait", {"bytes": 16 * 128 * 2, "lag": lag, "chain": chain},
              (both.per_rep_s - plain.per_rep_s) * 1e6, "us_per_copy",
              f"what starting a 4 KiB copy and waiting for one started {lag} trips before (long arrived) adds "
              f"to a loop trip of {chain} dependent vector multiply-adds ({plain.per_rep_s * 1e6:.3f} us alone)",
              f"with copies: {both.notes('trips')}; without: {plain.notes('trips')}",
              not_modelled="no term of the model: the start and the wait of a copy whose data has arrived "
              "are inside the per-descriptor cost the ring fits")

    b.case("loop-trip", trip)
    b.case("dma-issue-wait", issue_wait)


def dma_queue(b: Bench):
    """How much later a small copy arrives when k copies of a 2 MiB ring bank are in flight beside it,
    started just before it or just after it: a repetition starts them all, waits for the small one,
    runs vector work that reads it (at least `queue_work_s`, longer than the big copies take, its
    length set from a first measurement) and waits for the big ones; the figure is the repetition's
    slope minus that of the small copy alone with the same work."""
    b.case("dma-queue", _dma_queue, b)


def _dma_queue(b: Bench):
    s = b.sizes
    rows, trips = s.queue_big_rows, 64
    big_src = jnp.ones((max(s.queue_ahead), rows, 128), BF16)
    x = jnp.full((8, 128), 0.5, F32)
    probe = b.kernel_slope(dma_queue_call(0, True, trips, rows, (16, 128), s, b.interpret),
                           (big_src[:1], jnp.ones((16, 128), BF16), x))
    trips = max(trips, math.ceil(trips * s.queue_work_s / max(probe.per_rep_s, 1e-9)))

    def one(what, r, lanes, k, first, alone):
        src = jnp.ones((r, lanes), BF16)
        sl = b.kernel_slope(dma_queue_call(k, first, trips, rows, (r, lanes), s, b.interpret), (big_src[:max(k, 1)], src, x))
        nbytes, big_bytes = r * lanes * 2, rows * 128 * 2
        later = (sl.per_rep_s - alone.per_rep_s) * 1e6
        if first:   # zero within noise where copies are served in issue order: a signed value, not an entry
            b.context.setdefault("dma_queue_started_first_us", {
                "what": f"how much later a small copy started before {min(s.queue_ahead)}-{max(s.queue_ahead)} "
                        f"copies of {big_bytes // KIB} KiB arrives than alone (the dma_queue entries' other order)",
                "source": b.source, "values": {}})["values"][f"{b.prefix}-{what}"] = round(later, 4)
            print(f"{b.prefix}-{what}: {later:.4g} us later than alone (started first)", flush=True)
            return
        b.add(what, "dma_queue", {"bytes": nbytes, "big_bytes": big_bytes, "ahead": k, "order": "small last"},
              later, "us_per_copy",
              f"how much later a {nbytes // KIB} KiB copy arrives with {k} copies of {big_bytes // KIB} KiB in flight "
              "started before it",
              f"{sl.notes('repetitions')}; alone: {alone.per_rep_s * 1e6:.2f} us a repetition ({trips} x 8 "
              f"vector multiply-adds after the wait)")

    try:
        for r, lanes in s.queue_small:
            alone = b.kernel_slope(dma_queue_call(0, True, trips, rows, (r, lanes), s, b.interpret),
                                   (big_src[:1], jnp.ones((r, lanes), BF16), x))
            for first in (True, False):
                for k in s.queue_ahead:
                    what = f"dma-queue-{r * lanes * 2 // KIB}k-{'first' if first else 'last'}-{k}x{rows * 256 // KIB}k"
                    b.case(what, one, what, r, lanes, k, first, alone)
    finally:
        big_src.delete()


def mla_core(b: Bench):
    """The megakernel's MLA decode core for one sequence, by cached tokens and query rows: the slope
    over repetitions of the kernel's own `_sequence_attention` (its cache in HBM, read tile by tile)."""
    s = b.sizes
    r, rope, cb = s.mla_rank
    key = jax.random.PRNGKey(5)

    def one(what, tokens, hr):
        cache = jax.random.normal(key, (1, 1, tokens, r + rope), F32).astype(BF16)
        ql = jax.random.normal(key, (hr, r), F32)
        qr = jax.random.normal(key, (hr, rope), F32)
        blk = jax.random.normal(key, (1, r + rope), F32)
        pos = jnp.full((1,), tokens, I32)
        sl = b.kernel_slope(mla_core_call(hr, tokens, r, rope, cb, s, b.interpret), (pos, cache, ql, qr, blk))
        tiles = -(-tokens // cb)
        b.add(what, "attention_core_tiles", {"kind": "mla", "tokens": tokens, "rows": hr, "rank": r, "rope": rope,
                                             "cache_block": cb, "tiles": tiles},
              sl.per_rep_s * 1e6, "us_per_attention",
              f"the megakernel's MLA core for one sequence: {hr} query rows over {tokens} cached tokens ({tiles} tiles "
              f"of {cb} rows read from HBM three in flight), latent rank {r} + {rope} rope",
              sl.notes("repetitions"))

    for tokens in s.mla_tokens:
        for hr in s.mla_rows:
            what = f"mla-core-t{tokens}-r{hr}"
            b.case(what, one, what, tokens, hr)


def xla_ops(b: Bench):
    """XLA's own ops, as the multi-kernel engine runs them (each a kernel of its own): the per-op
    gap (a chain of small dependent ops in a while loop, bodies of two lengths), then bf16 dots by
    shape and decode attention over a cache, each per op with the loop's own trip subtracted."""
    s = b.sizes
    key = jax.random.PRNGKey(1)
    loop = {"s": 0.0}  # the while loop's own trip, once measured

    def op_gap():
        x = jax.random.normal(key, (8, 128), F32).astype(BF16)
        w = (jax.random.normal(key, (128, 128), F32) / 16).astype(BF16)
        short, long_ = s.op_chain
        a = b.program_slope(small_op_chain(short), (x, w))
        c = b.program_slope(small_op_chain(long_), (x, w))
        per_op = (c.per_rep_s - a.per_rep_s) / (long_ - short)
        loop_s = a.per_rep_s - short * per_op
        b.add("xla-op-gap", "xla_op", {"ops_per_trip": [short, long_]}, per_op * 1e6, "us_per_op",
              "one small XLA op (tanh(x[8, 128] @ w[128, 128]) bf16, one fusion) in a chain of dependent ops: "
              f"its launch gap and its tiny work; slope between loop bodies of {short} and {long_} ops",
              f"{long_} ops: {c.notes('trips')}; {short}: {a.notes('trips')}",
              not_modelled="the multi-kernel engine's per-op cost is the hardware file's launch_overhead_s (not "
              "a fitted component): set it from this entry")
        b.add("xla-loop-trip", "xla_loop_trip", {}, loop_s * 1e6, "us_per_trip",
              f"one trip of an XLA while loop (its condition and branch), the {short}-op body's ops subtracted",
              not_modelled="no term of the model (a decode step is one program without a loop over steps)")
        loop["s"] = max(loop_s, 0.0)

    def dots(k, n):
        per_trip = s.xla_weights_per_trip
        ws = tuple((jax.random.normal(jax.random.fold_in(key, j), (k, n) if j % 2 == 0 else (n, k), F32)
                    * (k ** -0.5)).astype(BF16) for j in range(per_trip))

        def one(what, m):
            x = jax.random.normal(key, (m, k), F32).astype(BF16)
            sl = b.program_slope(dot_chain, (x, ws))
            t = (sl.per_rep_s - loop["s"]) / per_trip
            nbytes = 2 * k * n
            b.add(what, "xla_dot", {"m": m, "k": k, "n": n, "dtype": "bf16", "bytes": nbytes}, t * 1e6, "us_per_op",
                  f"XLA bf16 dot [{m}, {k}] @ [{k}, {n}] in a chain through {per_trip} distinct weights (half of "
                  f"them [{n}, {k}]), per dot ({nbytes / max(t, 1e-15) / 1e9:.0f} GB/s of weights)",
                  f"{sl.notes('trips')}; the loop's trip ({loop['s'] * 1e6:.2f} us) subtracted, the rest over "
                  f"{per_trip} dots")

        try:
            for m in s.xla_rows:
                what = f"xla-dot-bf16-m{m}-{k}x{n}"
                b.case(what, one, what, m)
        finally:
            for w in ws:
                w.delete()

    def attention(what, tokens):
        heads, group, dim = s.attention_heads
        q = jax.random.normal(key, (heads, group, dim), F32).astype(BF16)
        kc = jax.random.normal(key, (heads, tokens, dim), F32).astype(BF16)
        vc = jax.random.normal(jax.random.fold_in(key, 1), (heads, tokens, dim), F32).astype(BF16)
        try:
            sl = b.program_slope(attention_chain, (q, kc, vc))
        finally:
            kc.delete()
            vc.delete()
        t = sl.per_rep_s - loop["s"]
        nbytes = 2 * heads * tokens * dim * 2
        b.add(what, "xla_attention", {"tokens": tokens, "kv_heads": heads, "q_heads_per_kv": group,
                                      "head_dim": dim, "bytes": nbytes}, t * 1e6, "us_per_attention",
              f"XLA decode attention of one sequence: {heads * group} query heads ({heads} KV heads), head dim "
              f"{dim}, over {tokens} cached bf16 rows (scores, softmax, values, the query's update; "
              f"{nbytes / max(t, 1e-15) / 1e9:.0f} GB/s of cache)",
              f"{sl.notes('trips')}; the loop's trip ({loop['s'] * 1e6:.2f} us) subtracted",
              not_modelled="the multi-kernel engine costs attention from its bytes and FLOPs: a check of that "
              "engine, not a component's data")

    b.case("xla-op-gap", op_gap)
    for k, n in s.xla_shapes:
        b.case(f"xla-dot-{k}x{n}", dots, k, n)
    for tokens in s.attention_tokens:
        what = f"xla-attention-t{tokens}"
        b.case(what, attention, what, tokens)


def traced_ops(b: Bench, fn, args, trips: int) -> str:
    """One call of jitted fn(trips, *args) traced: its device ops by time, printed and in words
    (per trip)."""
    import tempfile
    from perfmodel.validate.traces import op_table
    f = jax.jit(fn)
    n = b.count(trips, ())
    jax.block_until_ready(f(n, *args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready(f(n, *args))
        rows = op_table(d)
    for r in rows:
        print(f"    {r.name:28s} {r.category:18s} x{r.count:<5d} {r.total_s * 1e6:9.1f} us  {r.hlo[:160]}", flush=True)
    return ", ".join(f"{r.name} x{r.count / trips:g} {r.total_s / trips * 1e6:.2f} us" for r in rows)


EXPERT_TRIPS_MAX = 1 << 14  # the expert loop's id list (cycling through the stacked experts)


def xla_expert_loop(b: Bench):
    """The XLA reference's routed-expert loop alone (`reference.expert_loop`, the code the reference
    decode runs): one while-loop trip per expert, swiglu(z @ gate_up[e]) @ down[e] scaled and summed,
    each expert's bf16 weights read in place from the stacked [E, ...] arrays by a dynamic index; per
    trip by rows and expert shape. For a few row counts one call is also traced and its device ops
    listed by time (in the notes): which ops a trip runs, and what each costs."""
    from perfmodel_kernels.reference import expert_loop
    s, key = b.sizes, jax.random.PRNGKey(2)
    ids = jnp.arange(EXPERT_TRIPS_MAX, dtype=I32) % s.expert_count

    def run(trips, z, comb, gu, dn):
        return expert_loop(z, comb, ids, trips, gu, dn)

    def shape(latent, width):
        e = s.expert_count
        gu = (jax.random.normal(key, (e, latent, 2 * width), F32) * latent ** -0.5).astype(BF16)
        dn = (jax.random.normal(key, (e, width, latent), F32) * width ** -0.5).astype(BF16)
        nbytes = 2 * 3 * latent * width
        try:
            for m in s.expert_rows:
                what = f"xla-expert-m{m}-{latent}x{width}"
                b.case(what, one, what, m, latent, width, nbytes, gu, dn)
        finally:
            gu.delete()
            dn.delete()

    def one(what, m, latent, width, nbytes, gu, dn):
        z = jax.random.normal(key, (m, latent), F32)
        comb = jax.nn.softmax(jax.random.normal(key, (m, s.expert_count), F32), axis=-1)
        sl = b.program_slope(run, (z, comb, gu, dn), n_max=EXPERT_TRIPS_MAX)
        t = sl.per_rep_s
        ops = ""
        if m in s.expert_traced and (latent, width) == s.expert_shapes[0]:
            ops = "; traced ops (32 trips, per trip): " + traced_ops(b, run, (z, comb, gu, dn), 32)
        b.add(what, "xla_expert_loop", {"rows": m, "latent": latent, "width": width, "bytes": nbytes,
                                        "experts": s.expert_count}, t * 1e6, "us_per_trip",
              f"one trip of the XLA reference's routed-expert loop: rows {m}, bf16 expert gate|up [{latent}, "
              f"{2 * width}] and down [{width}, {latent}] read by a dynamic index ({nbytes / max(t, 1e-15) / 1e9:.0f} "
              "GB/s of expert weights)", sl.notes("trips") + ops)

    for latent, width in s.expert_shapes:
        b.case(f"xla-expert-{latent}x{width}", shape, latent, width)


def xla_cache_update(b: Bench):
    """What the XLA reference's MLA cache update costs a step (`reference.latent_write`: the cache
    with the block's rows written, for this step's attention, and with the accepted rows written,
    kept for the next; XLA writes at least one into a copy), by cache size: a loop whose trip
    writes one row a sequence into a bf16 [B, T, 576] cache held in a one-layer stack, reads the
    written cache as attention does (a dot of one row a sequence against it, in f32) and puts the
    kept one back in the stack; minus the same loop reading the cache unwritten. At two sizes one
    call is traced and its ops listed (is the cache copied, and where does it live)."""
    from perfmodel_kernels.reference import latent_write
    s, key = b.sizes, jax.random.PRNGKey(3)
    t, width = s.cache_tokens, 576

    def loop(write: bool):
        def run(trips, stack, new, q):
            seq = jnp.arange(stack.shape[1])
            zero, one = jnp.zeros_like(seq), jnp.ones_like(seq)

            def trip(j, carry):
                stack, acc = carry
                cache = stack[0]
                pos = jnp.full_like(seq, j % t)
                block, kept = latent_write(cache, new, seq, zero, pos, one) if write else (cache, cache)
                read = jnp.einsum("bd,btd->bt", q * (j + 1).astype(F32), block.astype(F32))  # not hoistable
                return stack.at[0].set(kept), acc + read[:, 0].sum()
            return lax.fori_loop(0, trips, trip, (stack, jnp.float32(0)))[1]
        return run

    def one(what, batch):
        stack = jax.random.normal(key, (1, batch, t, width), F32).astype(BF16)
        new = jax.random.normal(key, (batch, width), F32)
        q = jax.random.normal(key, (batch, width), F32)
        try:
            both = b.program_slope(loop(True), (stack, new, q))
            read = b.program_slope(loop(False), (stack, new, q))
            ops = ""
            if batch in s.cache_traced:
                ops = "; traced ops (8 trips, per trip): " + traced_ops(b, loop(True), (stack, new, q), 8)
        finally:
            stack.delete()
        nbytes = batch * t * width * 2
        b.add(what, "xla_cache_update", {"batch": batch, "tokens": t, "width": width, "bytes": nbytes},
              (both.per_rep_s - read.per_rep_s) * 1e6, "us_per_trip",
              f"the reference's MLA cache update (two writes of one row a sequence into one bf16 [{batch}, {t}, "
              f"{width}] cache, {nbytes / 2**20:.0f} MiB) beyond reading it ({read.per_rep_s * 1e6:.1f} us alone)",
              f"with the update: {both.notes('trips')}; reading only: {read.notes('trips')}{ops}",
              not_modelled="a check of components.xla_cache_copy_time (the reference's placement of its cache "
              "copies), not its data: this loop is not the reference's program, and it mixes the copy with the update")

    for batch in s.cache_batches:
        what = f"xla-cache-update-b{batch}"
        b.case(what, one, what, batch)


def xla_copy(b: Bench):
    """XLA's rate for copying a cache-sized buffer, by size: a loop whose trip rolls a bf16
    [B, tokens, 576] array by one token (`jnp.roll`: every byte read once and written once into a
    new buffer, in VMEM where XLA places it there, else through HBM); time per trip. The compiled
    loop holds two buffers placed as the reference's two cache copies (both in VMEM while they
    fit, one at 72 MiB, none at 144 MiB, read ahead of time for a v5e), so the buffers XLA copies
    through HBM fit `components.xla_cache_copy_time`'s rate; the others are not charged by it."""
    from perfmodel.cost.components import XLA_LATENT_COPIES
    from perfmodel.spec.hardware import load_hardware
    s, key = b.sizes, jax.random.PRNGKey(5)
    t, width = s.cache_tokens, 576
    onchip = load_hardware(b.platform).onchip_bytes

    def run(trips, x):
        y = lax.fori_loop(0, trips, lambda j, x: jnp.roll(x, 1, axis=1), x)
        return y[:, 0, 0].astype(F32).sum()

    def one(what, batch):
        x = jax.random.normal(key, (batch, t, width), F32).astype(BF16)
        try:
            sl = b.program_slope(run, (x,))
        finally:
            x.delete()
        nbytes = batch * t * width * 2
        b.add(what, "xla_copy", {"batch": batch, "tokens": t, "width": width, "bytes": nbytes},
              sl.per_rep_s * 1e6, "us_per_copy",
              f"XLA copying a bf16 [{batch}, {t}, {width}] array ({nbytes / 2**20:.0f} MiB) whole, a loop trip",
              sl.notes("trips"),
              not_modelled="" if onchip // nbytes < XLA_LATENT_COPIES else
              f"both buffers in VMEM ({onchip // MIB} MiB): no copy through HBM, which is all "
              "components.xla_cache_copy_time charges")

    for batch in s.cache_batches:
        what = f"xla-copy-b{batch}"
        b.case(what, one, what, batch)


def attn_parts(b: Bench):
    """The megakernel's attention between its projections, by slice width and batch: the KDA block's
    recurrence (gates, conv, delta rule, norm, gate; its state in VMEM) and the MLA layer's two
    absorption einsums with the kv_b matrix (the slope over repetitions of the kernel's own code)."""
    from perfmodel_kernels import chip, reference as ref
    from perfmodel_kernels.specs import slice_spec
    s = b.sizes
    key = jax.random.PRNGKey(7)
    rnd = lambda shape, scale=1.0: scale * jax.random.normal(key, shape, F32)  # noqa: E731

    def kda(what, name, batch):
        spec = slice_spec(name)
        a = spec.kda
        n, c = chip.round_rows(batch, F32), a.heads * a.head_dim
        shapes = ref.cache_shapes(spec, batch, 256)
        (st_shape, st_dt), (win_shape, win_dt) = shapes["kda_state"], shapes["kda_conv"]
        args = (rnd((n, c)), rnd((n, c)), rnd((n, c)), rnd((n, c)), rnd((n, a.heads)), rnd((n, c)),
                jnp.zeros((1, a.heads), F32), jnp.zeros((1, a.heads), F32), jnp.ones((1, a.head_dim), F32),
                rnd((a.conv_width, 3 * c), 0.5), jnp.zeros(st_shape[1:], st_dt), jnp.zeros(win_shape[1:], win_dt))
        call = pallas(lambda *refs: kda_core_kernel(spec, 1, *refs), jax.ShapeDtypeStruct((n, c), F32),
                      [SMEM_SPEC] + [VMEM_SPEC] * 12, VMEM_SPEC,
                      [pltpu.VMEM(st_shape[1:], st_dt), pltpu.VMEM(win_shape[1:], win_dt)], s, b.interpret)
        sl = b.kernel_slope(call, args)
        b.add(what, "kda_core", {"slice": name, "batch": batch, "rows": n, "heads": a.heads, "head_dim": a.head_dim,
                                 "conv_width": a.conv_width},
              sl.per_rep_s * 1e6, "us_per_layer",
              f"the megakernel's KDA attention between its projections ({name}: {a.heads} heads of {a.head_dim}, "
              f"batch {batch} in {n} rows; state [{batch}, {a.heads}, {a.head_dim}, {a.head_dim}] f32 in VMEM)",
              sl.notes("repetitions"))

    def mla(what, name, batch, which):
        spec = slice_spec(name)
        m = spec.mla
        n = chip.round_rows(batch, F32)
        kv_b = rnd((m.kv_lora_rank, m.heads * (m.qk_nope_dim + m.v_head_dim)), 0.05).astype(BF16)
        x = rnd((n, m.heads, m.qk_nope_dim if which == "absorb" else m.kv_lora_rank))
        width = m.qk_nope_dim if which == "absorb" else m.v_head_dim
        call = pallas(lambda *refs: mla_absorb_kernel(spec, which, *refs),
                      jax.ShapeDtypeStruct((n, m.heads, width), F32), [SMEM_SPEC, VMEM_SPEC, VMEM_SPEC], VMEM_SPEC,
                      [], s, b.interpret)
        sl = b.kernel_slope(call, (kv_b, x))
        eq = {"absorb": "bhn,rhn->bhr", "expand": "bhr,rhv->bhv", "expand_heads": "bhr,rhv->bhv as a dot a head"}[which]
        b.add(what, "mla_absorb", {"slice": name, "batch": batch, "rows": n, "heads": m.heads,
                                   "rank": m.kv_lora_rank, "einsum": which},
              sl.per_rep_s * 1e6, "us_per_layer",
              f"the megakernel's MLA einsum {eq} ({name}: {m.heads} heads, rank {m.kv_lora_rank}, {n} rows) with "
              "kv_b split as the ring hands it over", sl.notes("repetitions"),
              not_modelled="no term of the model yet: the op graph does not hold the MLA absorption products")

    for name in s.attn_slices:
        for batch in s.attn_batches:
            what = f"kda-core-{name}-b{batch}"
            b.case(what, kda, what, name, batch)
            for which in ("absorb", "expand", "expand_heads"):
                what = f"mla-{which}-{name}-b{batch}"
                b.case(what, mla, what, name, batch, which)


def embed_parts(b: Bench):
    """The megakernel's embed phase beyond its rows' copies, by slice width and batch: picking each
    sequence's row out of its copied bf16 tile of 16 (`megakernel.pick_rows`: a select a tile row
    over [Bp, H] f32), timed as the slope over repetitions of the kernel's own code."""
    from perfmodel_kernels import chip, stream
    from perfmodel_kernels.specs import slice_spec
    s = b.sizes

    def one(what, name, batch):
        h, bp, rows = slice_spec(name).hidden, chip.round_rows(batch, F32), stream.ROW_TILE
        tok = jnp.arange(bp, dtype=jnp.int32) * 7 % rows
        tiles = jax.random.normal(jax.random.PRNGKey(3), (bp, rows, h), F32).astype(BF16)
        call = pallas(lambda *refs: embed_pick_kernel(batch, *refs), jax.ShapeDtypeStruct((bp, h), F32),
                      [SMEM_SPEC, SMEM_SPEC, VMEM_SPEC], VMEM_SPEC, [], s, b.interpret)
        sl = b.kernel_slope(call, (tok, tiles))
        b.add(what, "embed_pick", {"slice": name, "batch": batch, "rows": bp, "tile_rows": rows, "hidden": h,
                                   "values": bp * rows * h},
              sl.per_rep_s * 1e6, "us_per_layer",
              f"the megakernel's pick of each sequence's embedding row out of its bf16 [{rows}, {h}] tile "
              f"({name}, batch {batch} in {bp} rows)", sl.notes("repetitions"))

    for name in s.attn_slices:
        for batch in sorted({*s.attn_batches, 2 * max(s.attn_batches)}):   # 16 rows too at the largest
            what = f"embed-pick-{name}-b{batch}"
            b.case(what, one, what, name, batch)


# section -> (its function, a title to print)
MECHANISMS = {"dispatch": (host_dispatch, "host dispatch of a trivial jitted call"),
              "dispatch_args": (dispatch_args, "host dispatch of a pallas_call by argument count, donated or not"),
              "dma": (dma_ring, "HBM -> VMEM copy ring by copy size and copies in flight"),
              "ring_dot": (ring_dot, "the weight ring with a dot consuming each bank, by bank rows"),
              "latency": (dma_latency, "a tiny copy's first-byte latency (one in flight)"),
              "mxu": (mxu_matmul, "in-kernel dots by shape and dtype"),
              "mxu_static": (mxu_static, "in-kernel bf16 dots, weights by a static index"),
              "ring_work": (ring_work, "the weight ring when a bank's use outlasts its copy"),
              "ring_reader": (ring_reader, "the kernel's ring and reader on a MoE layer's static parts"),
              "vpu": (vpu_elementwise, "vector-unit elementwise passes"),
              "loop": (loop_trip, "an in-kernel loop trip; a copy's start and wait beside vector work"),
              "queue": (dma_queue, "a small copy's arrival behind ring banks in flight"),
              "mla_core": (mla_core, "the megakernel's MLA decode core by cached tokens and query rows"),
              "attn_parts": (attn_parts, "the megakernel's KDA core and MLA absorption einsums by width and batch"),
              "embed": (embed_parts, "the megakernel's pick of embedding rows out of their tiles"),
              "expert": (expert_paths, "the megakernel's routed-expert paths per format"),
              "expert_loop": (expert_loop, "the megakernel's own expert column loop at the K3 widths"),
              "expert_slots": (expert_slots, "whole experts through the kernel's column loop, the next one's copy in flight"),
              "xla": (xla_ops, "XLA's op gap, dots by shape and decode attention"),
              "xla_expert": (xla_expert_loop, "the XLA reference's routed-expert loop by rows and shape"),
              "xla_cache": (xla_cache_update, "the XLA reference's MLA cache update by cache size"),
              "xla_copy": (xla_copy, "XLA's copy of a cache-sized buffer by size")}


def libtpu_version() -> str:
    for name in ("libtpu", "libtpu-nightly"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "not installed"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Component micro-benchmarks on one TPU chip (TPU v5e), written as a "
                                             "micro-benchmark file for perfmodel calibrate --microbench.")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="the micro-benchmark file to write")
    ap.add_argument("--dry-run", "--interpret", dest="dry_run", action="store_true",
                    help="tiny sizes, Pallas interpret mode: checks the pipeline on a CPU (timings are not a TPU's)")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run, in this order: {','.join(SECTIONS)}")
    ap.add_argument("--platform", help="the hardware preset the entries are for (default: from JAX's device_kind)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="start no new measurement after this many seconds (what was measured is kept)")
    a = ap.parse_args(argv)
    only = [x for x in a.only.split(",") if x]
    unknown = [x for x in only if x not in SECTIONS]
    if unknown:
        ap.error(f"--only: unknown {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    dev = jax.devices()[0]
    if not a.dry_run and dev.platform != "tpu":
        print(f"tpu_microbench: needs a TPU (JAX's default device is {dev.device_kind}); --dry-run runs the "
              "same code in interpret mode", file=sys.stderr)
        return 2
    sizes = MINI if a.dry_run else FULL
    platform = a.platform or PLATFORMS.get(dev.device_kind, "dry-run" if a.dry_run else dev.device_kind)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    command = " ".join(["python experiments/tpu_microbench.py", *(sys.argv[1:] if argv is None else argv)])
    software = (f"jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}, libtpu {libtpu_version()}, "
                f"Python {sys.version.split()[0]}")
    where = ("Pallas interpret mode on a CPU, tiny sizes: not TPU timings" if a.dry_run
             else f"one {dev.device_kind} ({jax.device_count()} JAX device(s))")
    source = f"this project: {command} on {where}, {date[:10]} ({software})"
    context = {"device": dev.device_kind, "software": software, "command": command, "date": date,
               "platform_version": getattr(dev.client, "platform_version", ""),
               "timing": f"slope of the wall clock over repetition counts n, 2n, 3n in one call (median of "
                         f"{sizes.repeats} calls each), n raised until a call lasts {sizes.target_s * 1e3:g} ms "
                         "longer than the smallest; no figure is one call's wall clock",
               "sizes": json.loads(json.dumps(dataclasses.asdict(sizes), default=str)),
               "fp8": "TPU v5e has no fp8 MXU (JAX tpu_info: fp8_ops_per_second = 0): no fp8 entries"}
    b = Bench(sizes, a.dry_run, Path(a.out), platform, source, context, a.budget_s)
    print(f"tpu_microbench: {where}; {software}; writing {a.out}", flush=True)
    t0 = time.monotonic()
    for name in only:
        t = time.monotonic()
        fn, title = MECHANISMS[name]
        print(f"== {name}: {title}", flush=True)
        fn(b)
        b.write()
        print(f"== {name}: {time.monotonic() - t:.1f} s", flush=True)
    print(f"tpu_microbench: {len(b.entries)} entries, {len(b.skipped)} skipped, {time.monotonic() - t0:.0f} s; "
          f"wrote {a.out}", flush=True)
    return 0


if __name__ == "__main__":
    if str(ROOT) not in sys.path:  # perfmodel.util.files without an installed package
        sys.path.insert(0, str(ROOT))
    sys.exit(main())
