"""The component layer: every time term is a named mechanism with its own parameters.

Each function below is one mechanism. Its parameters live in the hardware file's
`[components]` table (with a `[sources]` entry each) and are fitted only to that mechanism's
own micro-benchmarks by `perfmodel calibrate --microbench FILE` (perfmodel/fit/microbench.py); the
docstring names those micro-benchmarks (ids in perfmodel/data/microbench/*.json).

TPU (one TensorCore = one device; a chip has `cores_per_chip` of them):
- `dma_stream_time`: HBM -> VMEM copies on the core's DMA engine;
- `matmul_time`: the MXU's weight push (flat for few rows) and the per-dot issue cost;
- `remote_copy_time`: a remote VMEM copy to the sibling core or to a core on another chip;
- `collective_time`: one collective as phases of remote copies and a semaphore round, per
  algorithm (`rs_ag`, `hierarchical`, `one_shot`, `direct`), the fastest picked per payload as a
  kernel would;
- `device_call_time`: host dispatch of one device call (a jitted program);
- `xla_dot_time`, `xla_expert_time`: XLA's dots and its loop over the distinct routed experts,
  as the multi-kernel engine prices XLA on a TPU.
GPU: `kernel_launch_time` (CUDA-graph node), `kernel_stream_time` (achieved bandwidth of a decode
GEMV / grouped GEMM kernel), `gpu_all_reduce_time` (by ranks and payload).
Host CPU: `host_dot_time` (XLA:CPU decode-shaped dots by rows), `host_expert_time` (the
reference's loop over the distinct experts), `host_convert_time` (bf16 -> f32 widening of a
cache), `host_program_time` (a compiled program's call and fixed cost per thunk),
`host_argmax_time` (the greedy sampler's value-and-index reduce) and `host_absorbed_kv_b_time`
(the absorbed MLA's re-laid-out kv_b), fitted to hostbench's figures.
"""
from __future__ import annotations

from dataclasses import dataclass

from perfmodel.util.errors import SpecError

TILE_WEIGHTS = 256 * 256          # one MXU weight tile (TPU v7: 256 x 256)
# the operands a TPU MXU takes and the push rate each runs at: int8 weights are pushed at the bf16
# rate, fp8 and int4 at the fp8 rate; no fp4 (musespark README s.5, s.12; jax tpu_info.py)
PUSH_DTYPE = {"bf16": "bf16", "f32": "bf16", "int8": "bf16", "fp8": "fp8", "int4": "fp8"}
ALGORITHMS = {"all_reduce": ("rs_ag", "hierarchical", "one_shot"), "all_gather": ("direct", "hierarchical"),
              "barrier": ("barrier",)}


def param(c: dict, name: str) -> float:
    if name not in c:
        raise SpecError(f"components.{name}", None, "missing in the hardware file: run perfmodel "
                        "calibrate --microbench FILE --hardware NAME --out FILE")
    return c[name]


# ---- TPU ---------------------------------------------------------------------------------

def dma_stream_time(c: dict, nbytes: float, descriptors: int = 1, cold: bool = True) -> float:
    """HBM -> VMEM stream of `nbytes` in `descriptors` copies served back to back by one DMA
    engine: first-byte latency (when the engine starts cold) + a fixed cost per descriptor +
    bytes at the achieved bandwidth. Several outstanding copies share that bandwidth
    (round-robin) or queue (FIFO): perfmodel.engine.megakernel.
    Micro-benchmarks: ms-stream-bf16, ms-stream-int8-dma-only, ms-stream-lmhead-*,
    ms-expert-int4-per-expert (warm: a per-expert slope); they do not determine the latency,
    which is fitted to the Muse Spark phase profile (experiments/phase_split.py)."""
    return ((param(c, "dma_latency_s") if cold else 0.0) + descriptors * param(c, "dma_descriptor_s")
            + nbytes / param(c, "dma_bandwidth_bytes_per_s"))


def mxu_push_s(c: dict, dtype: str) -> float:
    """Time to push one 256 x 256 weight tile of `dtype` into the MXU (int8 at the bf16 rate,
    fp8 and 4-bit formats at the fp8 rate). Micro-benchmarks: ms-mxu-push-bf16, ms-mxu-push-fp8."""
    if dtype not in PUSH_DTYPE:
        raise SpecError("dtype", dtype, f"the MXU takes {', '.join(PUSH_DTYPE)} (Format.feed picks one)")
    return param(c, f"mxu_push_{PUSH_DTYPE[dtype]}_s")


def matmul_time(c: dict, weights: float, dtype: str, lhs_rows: int, dots: int = 1) -> float:
    """Weight-stationary matmul of `weights` weights (in 256 x 256 tiles) against `lhs_rows` rows:
    per tile max(weight push, rows x row time) -- flat in the rows until the LHS stream is the
    longer -- plus a fixed issue cost per dot. Micro-benchmarks: ms-nvfp4-gateup-slice-v2-b*,
    ms-stream-int8(-narrowdots) (composed with the DMA stream)."""
    per_tile = max(mxu_push_s(c, dtype), lhs_rows * param(c, "mxu_row_s"))
    return weights / TILE_WEIGHTS * per_tile + dots * param(c, "mxu_dot_issue_s")


def dequant_matmul_time(c: dict, weights: float, lhs_rows: int, matrices: int = 1) -> float:
    """`matrices` 4-bit weight matrices of `weights` weights in all, each dequantised to bf16 on the
    vector unit and then pushed at the bf16 rate (Inferact's NVFP4 path from batch 8,
    musespark/fp4.py `fp4_dequant_dot`): the bf16 matmul, one dot issued per matrix (the dots of
    its later K chunks issue behind the dequantisation of the next), plus `vpu_dequant_s` a matrix
    (the vector unit's work the first dot waits for). Micro-benchmarks: ms-nvfp4-dequant-gateup,
    ms-nvfp4-dequant-down."""
    return matmul_time(c, weights, "bf16", lhs_rows, matrices) + matrices * param(c, "vpu_dequant_s")


# what a kernel's vector unit decodes a weight from, scales applied, into the bf16 operand a chip
# without the format's matrix dtype is fed (perfmodel_kernels.quant: e2m1 codes as f32 bits, e2m1
# codes with a power-of-two scale as bf16 bits two a 32-bit word, int4 by sign-extending shifts,
# int8 / fp8 widened)
DECODE_KINDS = ("e2m1", "e2m1_words", "int4", "int8")


def vpu_decode_time(c: dict, weights: float, kind: str) -> float:
    """`weights` weights decoded on the vector unit from `kind` codes into a bf16 operand (the
    kernel's work before its dots): `vpu_decode_<kind>_s` a weight; 0 on a chip whose preset
    has not measured it. Micro-benchmarks: v5e-expert-column-* (the dot it feeds priced by
    `matmul_time`)."""
    if kind not in DECODE_KINDS:
        raise SpecError("decode", kind, f"one of {', '.join(DECODE_KINDS)}")
    return weights * c.get(f"vpu_decode_{kind}_s", 0.0)


def decode_pass_time(c: dict, passes: float, kind: str) -> float:
    """`passes` passes of a kernel's routed-expert column loop decoding `kind` codes (each decodes a
    group of column blocks into VMEM and runs their dots): `expert_pass_<kind>_s` a pass, what a
    pass costs beyond its tiles' decode and push (its loop trip, the aligned load of its scale
    chunk, its dots drained before the next pass); 0 on a chip whose preset has not measured it.
    Micro-benchmarks: v5e-expert-loop-* (the kernel's loop over one matrix)."""
    if kind not in DECODE_KINDS:
        raise SpecError("decode", kind, f"one of {', '.join(DECODE_KINDS)}")
    return passes * c.get(f"expert_pass_{kind}_s", 0.0)


def remote_copy_time(c: dict, nbytes: float, path: str, links: int = 1) -> float:
    """One remote VMEM copy (issue to semaphore) to the sibling core of the chip or to a core on
    another chip over `links` links in parallel: latency + bytes / bandwidth.
    Micro-benchmarks: ms-copy-sibling-*, ms-copy-crosschip-*, ms-bw-crosschip-3links."""
    if path == "sibling":
        return param(c, "sibling_latency_s") + nbytes / param(c, "sibling_bandwidth_bytes_per_s")
    return param(c, "cross_chip_latency_s") + nbytes / (links * param(c, "link_bandwidth_bytes_per_s"))


@dataclass(frozen=True)
class Phase:
    """One round of a collective: every core issues `copies` remote copies at once, `sibling_bytes`
    to its sibling core and `cross_bytes` to cores on other chips, then a semaphore round."""
    copies: int
    sibling_bytes: float
    cross_bytes: float

    @property
    def dma_bytes(self) -> float:
        """Bytes this core's DMA engine moves in the phase."""
        return self.sibling_bytes + self.cross_bytes


def collective_phases(kind: str, algorithm: str, payload: float, devices: int, cores: int,
                      host_devices: int = 0) -> list[Phase]:
    """The phases of `algorithm` for a collective whose full per-device result is `payload` bytes,
    among `devices` devices on chips of `cores` cores (devices 2r, 2r+1 share chip r), hosts of
    `host_devices` devices each (0: one host holds them all)."""
    k = min(cores, devices)
    chips = devices // k
    if kind == "barrier":  # a signal to every peer, no data
        return [Phase(devices - 1, 0.0, 0.0)]
    if algorithm in ("rs_ag", "direct"):  # every device writes one shard to every peer
        shard = payload / devices
        one = Phase(devices - 1, (k - 1) * shard, (devices - k) * shard)
        return [one, one] if kind == "all_reduce" else [one]
    if algorithm == "one_shot" and kind == "all_reduce":
        # every device writes its whole partial sum to each peer of its host and adds up what it
        # receives; across hosts the host sums go the same way, to the same core of every host
        group = host_devices if 0 < host_devices < devices and devices % host_devices == 0 else devices
        hosts = devices // group
        phases = [Phase(group - 1, (k - 1) * payload, (group - k) * payload),
                  Phase(hosts - 1, 0.0, (hosts - 1) * payload)]
        return [ph for ph in phases if ph.copies]
    if algorithm != "hierarchical":
        raise SpecError("algorithm", algorithm, f"one of {ALGORITHMS[kind]}")
    if kind == "all_reduce":  # sibling reduce-scatter, chips RS + AG on 1/k each, sibling gather
        sib = Phase(k - 1, (k - 1) * payload / k, 0.0)
        cross = Phase(chips - 1, 0.0, (chips - 1) * payload / k / chips)
        phases = [sib, cross, cross, sib]
    else:  # all-gather: own shard to the same core of every other chip (1/k of direct's
        # cross-chip bytes per core), then the chips' shards so gathered to the siblings
        shard = payload / devices
        phases = [Phase(chips - 1, 0.0, (chips - 1) * shard), Phase(k - 1, (k - 1) * chips * shard, 0.0)]
    return [ph for ph in phases if ph.copies]


def phase_time(c: dict, ph: Phase, chips: int, cores: int, scale: float = 1.0) -> float:
    """One phase: a semaphore round + issuing its copies + the slowest of the sibling copy, this
    core's cross-chip bytes over its links (bandwidths of `remote_copy_time`) and the chip's
    (all `cores` sending at once) over `chip_bandwidth_bytes_per_s`. A phase's copies are in
    flight together, so the round, not each copy's latency, is paid. `scale` multiplies the
    latency terms (a whole-step parameter, 1 by default)."""
    links = max(1, min(int(param(c, "links_per_chip")), chips - 1))
    move = max(ph.sibling_bytes / param(c, "sibling_bandwidth_bytes_per_s"),
               ph.cross_bytes / (links * param(c, "link_bandwidth_bytes_per_s")),
               cores * ph.cross_bytes / param(c, "chip_bandwidth_bytes_per_s"))
    return scale * (param(c, "collective_phase_s") + ph.copies * param(c, "collective_copy_issue_s")) + move


def collective_time(c: dict, kind: str, payload: float, devices: int, cores: int,
                    algorithm: str | None = None, scale: float = 1.0) -> tuple[float, str, list[Phase]]:
    """One in-kernel collective (`all_reduce` or `all_gather`): an entry/exit handshake (the peers'
    buffers are free, the result is complete) and its phases of remote copies and semaphore
    rounds; with no `algorithm`, the fastest one for this payload (as the kernel picks from its
    own measurements). Hosts hold `chips_per_host` chips (a topology count; absent: one host).
    Returns (seconds, algorithm, phases).
    Micro-benchmarks: the 14 ms-ar-* / ms-ag-* collectives (8 devices on 4 chips)."""
    if devices <= 1:
        return 0.0, "none", []
    k = min(cores, devices)
    chips = max(1, devices // k)
    host = k * int(c.get("chips_per_host", 0))
    best = None
    for a in [algorithm] if algorithm else ALGORITHMS[kind]:
        phases = collective_phases(kind, a, payload, devices, cores, host)
        t = scale * param(c, "collective_call_s") + sum(phase_time(c, ph, chips, k, scale) for ph in phases)
        if best is None or t < best[0]:
            best = (t, a, phases)
    return best


def embed_pick_time(c: dict, values: float) -> float:
    """A megakernel's pick of each sequence's embedding row out of the tile it copied the row in,
    `values` selected through (perfmodel_kernels: one select a bf16 tile row over [padded rows,
    hidden] f32): `embed_pick_s` a value. Micro-benchmarks: v5e-embed-pick-* (the kernel's own
    `pick_rows`)."""
    return values * param(c, "embed_pick_s")


def topk_time(c: dict, algorithm: str, k: int) -> float:
    """Routing's pick of the top-k expert ids, which the scalar unit must read before it can issue
    their copies: rounds of a dependent cross-lane reduction whose result the scalar unit reads,
    one per pick for an iterative argmax, two for a rank-based top-k (every score's rank in one
    pass, then the k winners read out). Micro-benchmarks: ms-phase-routing-argmax,
    ms-phase-routing-rank."""
    return (k if algorithm == "iterative_argmax" else 2) * param(c, "topk_round_s")


def attention_core_time(c: dict, sequences: float = 1, tiles: float = 0) -> float:
    """The decode attention core of `sequences` sequences in a megakernel, beside its bytes and
    FLOPs: a fixed latency a sequence (its chain of small dependent steps: norms, scores, softmax,
    output gate) and one per cache tile it walks (`tiles` over all sequences: the tile's wait,
    dots and online-softmax update; its bytes are a DMA copy of their own). Micro-benchmarks:
    ms-phase-attention (Muse Spark's GQA, KV prefetched: no tile term) on tpu-v7;
    v5e-mla-core-* (the megakernel's MLA core by cached tokens, its 256-token tiles three in
    flight) on tpu-v5e; a recurrence's core (KDA, GDN, Mamba2) assumed to pay the same latency a
    sequence where recurrence_time does not price it."""
    return sequences * param(c, "attention_core_s") + tiles * param(c, "attention_tile_s")


def recurrence_on_vpu(c: dict) -> bool:
    """Whether the hardware file prices a recurrent core by recurrence_time (it has the vector
    unit's rate); without it the roofline prices the FLOPs and attention_core_time the latency a
    sequence."""
    return "vpu_flops_per_s" in c


def recurrence_time(c: dict, flops: float) -> float:
    """A recurrent core (KDA, GDN, Mamba2: elementwise updates and reductions of its state, every
    sequence at once) in a megakernel: one core latency (`attention_core_s`) and its FLOPs on the
    vector unit at `vpu_flops_per_s`. Micro-benchmarks: v5e-kda-core-* (the megakernel's KDA block
    between its projections, by heads and batch)."""
    return param(c, "attention_core_s") + flops / param(c, "vpu_flops_per_s")


def xla_embedding_time(c: dict) -> float:
    """The XLA ops around a megakernel that leaves the embedding out: the lookup in a
    vocabulary-sharded table and the psum of its rows, once per step. Micro-benchmark:
    ms-xla-embedding-psum."""
    return param(c, "xla_embedding_s")


def xla_sampling_time(c: dict) -> float:
    """The XLA ops after a megakernel that leaves the greedy pick out: each rank's max / argmax over
    its vocabulary shard of the logits and the all-gather of the pairs, once per step. No
    micro-benchmark of its own: assumed to cost what the embedding glue does (ms-xla-embedding-psum),
    the same shape of work (a local op on a vocabulary shard and one small collective between XLA
    ops)."""
    return param(c, "xla_embedding_s")


def device_call_time(c: dict) -> float:
    """Host dispatch of one device call (a jitted program or pallas_call), paid once per call.
    Micro-benchmark: ms-host-dispatch."""
    return param(c, "host_dispatch_s")


# ---- GPU ---------------------------------------------------------------------------------

def kernel_launch_time(c: dict) -> float:
    """Launch of one kernel node of a CUDA graph. Micro-benchmark: h100-cuda-graph-launch."""
    return param(c, "kernel_launch_s")


def graph_overlap_time(c: dict) -> float:
    """Seconds of a kernel that run under the tail of the kernel before it in a CUDA graph launched
    with programmatic dependent launch (its launch and prologue); 0 where the hardware file has no
    such component (nothing measured). Micro-benchmarks: the gb200-pdl-* kernel pairs, each a kernel
    timed back to back with and without PDL."""
    return c.get("graph_kernel_overlap_s", 0.0)


def kernel_stream_time(c: dict, nbytes: float, hbm_bandwidth: float) -> float:
    """Bytes of one decode GEMV / grouped-GEMM kernel at its achieved share of HBM bandwidth.
    Micro-benchmark: h100-vllm-sglang-llama1b-bw (through the multi-kernel engine)."""
    return nbytes / (hbm_bandwidth * param(c, "kernel_bandwidth_efficiency"))


def gpu_all_reduce_time(c: dict, nbytes: float, ranks: int, scale: float = 1.0) -> float:
    """An NVLink all-reduce library call: base + per-peer cost + the bus traffic of each rank,
    2 (ranks - 1) / ranks x bytes, over the achieved bus bandwidth. The GB200 figures are of the
    all-reduce fused with the following RMSNorm, so the engine gives that norm no kernel.
    `scale` multiplies the latency terms. Micro-benchmarks: h100/h200-vllm-graph-ar-*, gb200-mnnvl-ar-*,
    b200-nccl-ar-*."""
    if ranks <= 1:
        return 0.0
    return (scale * (param(c, "allreduce_base_s") + (ranks - 1) * param(c, "allreduce_per_peer_s"))
            + 2 * (ranks - 1) / ranks * nbytes / param(c, "allreduce_bytes_per_s"))


# ---- host CPU (XLA:CPU through JAX) --------------------------------------------------------

def host_dot_time(c: dict, nbytes: float, rows: float) -> float:
    """A decode-shaped dot over `nbytes` of weights beyond the LLC: a fixed cost per dot (splitting
    it over the thread pool and joining) and, for one row, XLA:CPU's matrix-vector path at its own
    bandwidth; two or more rows run the matrix-matrix path, a streaming term plus a cost per row
    and byte. Micro-benchmarks: host-dot-f32-r* (256 MiB weights), host-dot-chain-f32-r* (4 MiB
    weights in one program) (hostbench)."""
    if rows <= 1:
        return param(c, "dot_fixed_s") + nbytes / param(c, "dot_gemv_bandwidth_bytes_per_s")
    return param(c, "dot_fixed_s") + nbytes * (1 / param(c, "dot_gemm_bandwidth_bytes_per_s")
                                               + rows * param(c, "dot_gemm_row_s_per_byte"))


def host_expert_time(c: dict, nbytes: float, rows: float, experts: float) -> float:
    """The routed experts of one MoE layer as the XLA:CPU reference runs them: a loop over the
    `experts` distinct experts (`nbytes` of weights in all), every iteration slicing its expert's
    weights out of the stacked array (a copy) and applying them to all `rows` of the batch: a
    fixed cost per expert (loop step, dynamic index, combine) + the loop's own streaming rate
    and cost per row and byte (its slabs are small and copied first, so the large-dot rates of
    `host_dot_time` do not carry over). Micro-benchmarks: host-expert-loop-f32-r* (hostbench)."""
    return experts * param(c, "host_expert_fixed_s") + nbytes * (
        1 / param(c, "host_expert_bandwidth_bytes_per_s") + rows * param(c, "host_expert_row_s_per_byte"))


def xla_dot_time(c: dict, nbytes: float) -> float:
    """One XLA dot on a TPU among others (the multi-kernel engine's op with weights): its weights
    at XLA's streaming rate plus a fixed cost; no separate first-byte latency or launch gap, as
    XLA starts the copies of a dot's weights into VMEM while the ops before it run (its async
    copy-start / copy-done pairs), and flat in the rows up to 64 (measured). Micro-benchmarks:
    v5e-xla-dot-bf16-m*-* (experiments/tpu_microbench.py, xla: a chain of 16 distinct dots a
    loop trip)."""
    return param(c, "xla_dot_fixed_s") + nbytes / param(c, "xla_dot_bandwidth_bytes_per_s")


def xla_expert_time(c: dict, nbytes: float, rows: float, experts: float) -> float:
    """The routed experts of one MoE layer as the XLA reference runs them on a TPU
    (`reference.expert_loop`): a while loop over the `experts` distinct experts (`nbytes` of bf16
    weights in all), each trip reading its expert's weights in place by a dynamic index and
    applying them to all `rows` of the batch: a fixed cost per trip (the loop's trip, its ops'
    launches, the dynamic index and the combine) + the loop's streaming rate and a cost per row and
    byte. Micro-benchmarks: v5e-xla-expert-m*-* (experiments/tpu_microbench.py, xla_expert)."""
    return experts * param(c, "xla_expert_trip_s") + nbytes * (
        1 / param(c, "xla_expert_bandwidth_bytes_per_s") + rows * param(c, "xla_expert_row_s_per_byte"))


# the copies of an MLA latent cache the reference's update makes a step (`reference.latent_write`:
# the block this step attends over and the cache kept for the next), as XLA compiles it for a
# TPU v5e at batches 1-64 (experiments/xla_reference_hlo.py; the K3 slices, one MLA layer each:
# whether a deeper stack of caches is copied whole per layer is not compiled yet)
XLA_LATENT_COPIES = 2


def xla_cache_copy_time(c: dict, cache_bytes: float, onchip_bytes: float) -> float:
    """XLA's copies of one MLA latent cache (`cache_bytes` allocated) around the reference's update
    of it, a step: XLA_LATENT_COPIES copies, each placed in on-chip memory while it fits
    (`onchip_bytes` // `cache_bytes` of them: in the compiled programs both sit in the v5e's
    128 MiB VMEM at 36 MiB, one at 72 MiB, none at 144 MiB), the rest copied through HBM, every
    byte read and written at XLA's copy rate (`xla_copy_bandwidth_bytes_per_s`, bytes moved: the
    xla_copy micro-benchmarks, a loop rolling a cache-sized buffer whose compiled program places
    its two buffers the same way). On-chip copies are not charged."""
    if cache_bytes <= 0:
        return 0.0
    in_hbm = max(0, XLA_LATENT_COPIES - int(onchip_bytes // cache_bytes))
    return in_hbm * 2 * cache_bytes / param(c, "xla_copy_bandwidth_bytes_per_s")


def host_convert_time(c: dict, values: float, allocated_bytes: float) -> float:
    """Widening `values` cached bf16 values to f32 as XLA:CPU runs it (the reference converts the
    whole MLA latent cache every step before attending), an elementwise fusion into a fresh f32
    buffer. When the program allocates more than the allocator's mmap threshold
    (`host_mmap_threshold_bytes`) per call, its buffers are new pages every call, faulted in as
    they are first written (`host_convert_values_per_s`); below it the allocator reuses warm
    memory (`host_convert_reused_values_per_s`). Micro-benchmarks: host-convert-bf16-f32-*
    (hostbench)."""
    fresh = allocated_bytes > param(c, "host_mmap_threshold_bytes")
    return values / param(c, "host_convert_values_per_s" if fresh else "host_convert_reused_values_per_s")


def host_fresh_pages_time(c: dict, allocated_bytes: float) -> float:
    """First-touch page faults of one program call's temporary buffer of `allocated_bytes`:
    above the allocator's mmap threshold (`host_mmap_threshold_bytes`) it is new pages every
    call, each faulted in (zeroed) as it is first written, `host_page_fault_s` per page of
    `host_page_bytes`; below it the allocator reuses warm memory (no faults).
    Micro-benchmarks: host-temp-pages-* (hostbench)."""
    if allocated_bytes <= param(c, "host_mmap_threshold_bytes"):
        return 0.0
    return -(-allocated_bytes // param(c, "host_page_bytes")) * param(c, "host_page_fault_s")


def host_temp_fill_time(c: dict, nbytes: float) -> float:
    """hostbench's temp-buffer program: one call (`host_call_s`) filling a temporary of `nbytes`
    from an input of the same size (`host_fill_bytes_per_s`, warm pages) plus that buffer's
    fresh pages (`host_fresh_pages_time`). Micro-benchmarks: host-temp-pages-* (hostbench)."""
    return param(c, "host_call_s") + nbytes / param(c, "host_fill_bytes_per_s") + host_fresh_pages_time(c, nbytes)


def host_stack_copy_time(c: dict, nbytes: float) -> float:
    """Copies of stacked caches and of their layer slots (`nbytes` copied) that XLA inserts around
    their per-layer updates: a copy into reused (warm) pages at `host_stack_copy_bytes_per_s`; where the
    destination is a program's fresh temporary its page faults are `host_fresh_pages_time`'s,
    charged once per program. Micro-benchmarks: host-stack-copy-* (hostbench)."""
    return nbytes / param(c, "host_stack_copy_bytes_per_s")


def host_program_time(c: dict, thunks, calls=1):
    """One XLA:CPU program (or its share, `calls` = 0): a fixed cost per call (dispatch, argument
    handling) and per thunk (each kernel the executable runs: fusion, copy, dot, loop), whatever
    the kernel computes. `thunks` is counted in the compiled HLO (a structure, never a timing);
    works on numpy arrays. Micro-benchmarks: host-thunk-chain-t* (hostbench)."""
    return calls * param(c, "host_call_s") + thunks * param(c, "host_thunk_s")


def host_argmax_time(c: dict, values):
    """Greedy sampling's argmax over `values` f32 logits as XLA:CPU runs it: a variadic (value,
    index) reduce, scalar code far below the memory system. Works on numpy arrays.
    Micro-benchmarks: host-argmax-f32-* (hostbench)."""
    return values / param(c, "host_argmax_values_per_s")


def host_absorbed_kv_b_time(c: dict, nbytes: float) -> float:
    """The absorbed MLA's use of its `nbytes` kv_b weight as the XLA:CPU reference runs it: split
    into W_uk and W_uv, each laid out again (a transposing copy, strided reads) and applied by
    an einsum: a fixed cost + bytes at the re-layout's rate. Micro-benchmarks:
    host-absorbed-kv-b-* (hostbench)."""
    return param(c, "host_absorb_fixed_s") + nbytes / param(c, "host_absorb_bytes_per_s")


def matrix_dtypes(hw) -> frozenset[str]:
    """The operand dtypes `hw`'s matrix unit takes (perfmodel.spec.formats.Format.feed): a TPU with
    fitted components those of its push table whose push rate its spec sheet lists in its peak-rate
    table (no fp8 there, no fp8 MXU: fp8 and int4 reach it through their formats' fallback); otherwise
    its peak-rate table's and bf16 / f32; a host CPU every dtype (XLA:CPU widens them; its dots are
    costed by bytes)."""
    if hw.kind == "cpu":
        return frozenset(("f32", "bf16", "fp8", "int8", "int4", "fp4"))
    if is_tpu_model(hw.components):
        return frozenset(d for d, rate in PUSH_DTYPE.items() if rate in hw.peak_flops_per_s)
    return frozenset(hw.peak_flops_per_s) | {"bf16", "f32"}


def is_host_model(c: dict) -> bool:
    return "dot_gemv_bandwidth_bytes_per_s" in c


def is_tpu_model(c: dict) -> bool:
    return "dma_bandwidth_bytes_per_s" in c


def is_gpu_model(c: dict) -> bool:
    return "kernel_launch_s" in c
