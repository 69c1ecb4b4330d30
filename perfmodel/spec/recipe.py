"""A model's own megakernel: the choices its kernel makes that the op graph and the engine follow.

A model file's `[megakernel]` table (docs/models.md). Every field has the default of a generic
megakernel, so a model without the table is modelled as before; a kernel that is known (Inferact's
Muse Spark kernel, the public Kimi K3 kernel) says what it does, each choice with a source in the
model file's `[sources]`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from perfmodel.util.errors import positive_int, require

MAX_ROWS = 4096
MAX_VECTORS = 256  # per-layer vector copies a kernel may list
EXPERT_REDUCE_ROWS = ("tokens", "pairs")
POST_EXPERT_PROJECTIONS = ("row_sharded", "output_sharded")
WIRES = {"bf16": 2, "f32": 4}
TOP_K = ("rank", "iterative_argmax")
EMBEDDINGS = ("kernel", "xla")
SAMPLINGS = ("kernel", "xla")
SHARED_EXPERT = ("with_copies", "last")
ALL_REDUCE = ("rs_ag", "hierarchical", "one_shot")  # perfmodel.cost.components.ALGORITHMS["all_reduce"]
EXPERT_ROWS = ("routed", "batch")


@dataclass(frozen=True)
class Megakernel:
    """A model's own megakernel: the `[megakernel]` table, each field a choice of its kernel
    (defaults: a generic megakernel's)."""
    # rows per step at which the kernel has shard-based collectives; at any other row count its
    # all-reduces are one-shot. None: the fastest algorithm per payload at every row count
    shard_collective_rows: tuple[int, ...] | None = None
    # the kernel's all-reduce algorithm at every row count (rs_ag, hierarchical, one_shot); "": as
    # shard_collective_rows says, else the fastest per payload
    all_reduce: str = ""
    # a collective's payload holds at least this many rows (activations kept as whole sublane
    # tiles: 8 rows), so a batch of 1 sends 8 rows
    collective_rows: int = 1
    # rows of the routed experts' reduction: "tokens" (combined per token first) or "pairs" (one
    # row per (token, expert) pair, batch x top_k)
    expert_reduce_rows: str = "tokens"
    # the latent MoE's post-expert projection: "row_sharded" (partial sums all-reduced) or
    # "output_sharded" (each device computes a slice of the hidden state, then all-gathers it)
    post_expert_projection: str = "row_sharded"
    collective_wire: str = "bf16"       # dtype of the values the collectives send
    kv_prefetch: bool = True            # KV / state copies issued at layer start (else at the attention)
    top_k: str = "rank"                 # routing: all ranks in one pass, or one argmax per pick
    embedding: str = "kernel"           # the embedding lookup in the kernel or in XLA glue around it
    # the greedy token: picked in the kernel (each rank's masked max / argmax over its vocabulary
    # shard, one all-gather of the pairs) or by XLA ops after it, from the logits the kernel wrote
    sampling: str = "kernel"
    bank_bytes: int = 0                 # ring bank (DMA tile) size; 0: the chip's dma_tile_bytes
    ring_banks: int = 0                 # banks the ring keeps in flight; 0: half the on-chip buffer
    expert_slots: int = 0               # expert buffers; 0: as many as fit (at most top_k)
    # at this many rows per step or fewer, the ring refills that a MoE layer's gemvs before its
    # routed experts (router, latent down-projection) issue for a later layer's tiles are held back
    # and issued after the experts' last dots, so the expert copies meet no next-layer weights on
    # the DMA engine (Muse Spark's kernel: decode_megakernel.py defer=next, flush=last); 0: never
    defer_refills_rows: int = 0
    # the LHS rows of each routed expert's dots: "routed" (the rows routed to it) or "batch" (every
    # row of the step, each row's result kept by mask, while the step fits the MXU's row tile)
    expert_rows: str = "routed"
    # tokens of the tiles the attention moves each sequence's GQA KV cache in: it reads the tiles
    # holding the cached tokens (one copy per tile for K and one for V) and writes the last back as it
    # starts, waited for before the layer's next collective (Muse Spark's kernel: 256-token tiles,
    # attention.py; the write-back waited for after the o projection, decode_megakernel.py
    # wait_cache_writes); other caches: a recurrent state written back whole. 0: the cached tokens
    # read as one copy, no write-back wait inside the layer
    kv_tile_tokens: int = 0
    # tokens of the cache tiles a GQA or MLA core walks, each paying components.attention_core_time's
    # tile term (perfmodel_kernels' MLA core: its plan's cache_block); 0: kv_tile_tokens
    attention_tile_tokens: int = 0
    # the MXU dots a kernel issues for each streamed (non-routed) matmul, as ("<layer kind>/<matmul>",
    # dots) pairs (layer kind: its attention or FFN kind, or "head"): perfmodel_kernels issues one a
    # lane-tile block of a fused group's outputs and one a tile-wide input chunk of a narrower
    # remainder, counted on its first member (its plan's `matmul_dots`); each pays
    # components.matmul_time's issue cost. A matmul not named: one dot (and one per ring bank beyond
    # its first: Muse Spark's stream.py)
    matmul_dots: tuple[tuple[str, int], ...] = ()
    # bytes of each small per-layer vector (norm weights, residual gates, router bias) the kernel
    # copies from HBM one DMA apiece, issued as a layer starts, for the next layer (Muse Spark's
    # kernel: decode_megakernel.py prefetch_vectors, layout.py VECTOR_FAMILIES); waited for at that
    # layer's start, by when they have landed. Empty: none copied inside the step
    layer_vector_bytes: tuple[int, ...] = ()
    # values the kernel's embed phase selects through once its embedding rows arrive: perfmodel_kernels
    # copies each sequence's row in its bf16 tile and picks it out with one select a tile row over
    # [padded rows, hidden] f32 (its plan's setting, `megakernel.pick_rows`; components.embed_pick_time);
    # 0: no pick
    embedding_pick_values: int = 0
    # the expert-parallel groups the kernel runs with, a command's --ep when it names none and they
    # divide its devices (Muse Spark's kernel splits every expert over its tp ranks: 1; Kimi K3's
    # owns them in 8 groups); 0: one group per device
    expert_groups: int = 0
    # where a MoE layer's shared expert runs: "with_copies", after the router and the latent
    # down-projection while the routed experts' copies land (Inferact's kernels); "last", after the
    # routed experts and the latent up-projection (perfmodel_kernels' `megakernel.moe`)
    shared_expert: str = "with_copies"

    @property
    def wire_bytes(self) -> int:
        return WIRES[self.collective_wire]


def from_table(table) -> Megakernel:
    """The `[megakernel]` table of a model file, every field checked."""
    require(isinstance(table, dict), "megakernel", table, "must be a table")
    known = [f.name for f in fields(Megakernel)]
    for k in table:
        require(k in known, f"megakernel.{k}", table[k], f"unknown field; known: {', '.join(known)}")
    out = dict(table)
    rows = table.get("shard_collective_rows")
    if rows is not None:
        require(isinstance(rows, list) and len(rows) <= MAX_ROWS, "megakernel.shard_collective_rows", rows,
                "must be a list of row counts")
        for r in rows:
            positive_int("megakernel.shard_collective_rows", r)
            require(r <= MAX_ROWS, "megakernel.shard_collective_rows", r, f"must be <= {MAX_ROWS}")
        out["shard_collective_rows"] = tuple(sorted(set(rows)))
    dots = table.get("matmul_dots")
    if dots is not None:
        require(isinstance(dots, (list, tuple)) and len(dots) <= MAX_VECTORS * 16, "megakernel.matmul_dots", dots,
                "must be a list of [\"<layer kind>/<matmul>\", dots] pairs")
        for pair in dots:
            require(isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)
                    and isinstance(pair[1], int) and not isinstance(pair[1], bool) and 0 <= pair[1] <= 1 << 20,
                    "megakernel.matmul_dots", pair, "must be a [\"<layer kind>/<matmul>\", dots] pair, dots in 0..1048576")
        out["matmul_dots"] = tuple(sorted((p[0], p[1]) for p in dots))
    vectors = table.get("layer_vector_bytes")
    if vectors is not None:
        require(isinstance(vectors, list) and len(vectors) <= MAX_VECTORS, "megakernel.layer_vector_bytes", vectors,
                f"must be a list of at most {MAX_VECTORS} byte counts")
        for b in vectors:
            require(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 1 << 30,
                    "megakernel.layer_vector_bytes", b, "must be an integer in 1..1073741824")
        out["layer_vector_bytes"] = tuple(vectors)
    for k, choices in (("all_reduce", ALL_REDUCE), ("expert_rows", EXPERT_ROWS),
                       ("expert_reduce_rows", EXPERT_REDUCE_ROWS), ("post_expert_projection", POST_EXPERT_PROJECTIONS),
                       ("collective_wire", tuple(WIRES)), ("top_k", TOP_K), ("embedding", EMBEDDINGS),
                       ("sampling", SAMPLINGS), ("shared_expert", SHARED_EXPERT)):
        if k in table:
            require(table[k] in choices, f"megakernel.{k}", table[k], f"must be one of {', '.join(choices)}")
    if "kv_prefetch" in table:
        require(isinstance(table["kv_prefetch"], bool), "megakernel.kv_prefetch", table["kv_prefetch"],
                "must be true or false")
    for k, lo, hi in (("collective_rows", 1, MAX_ROWS), ("bank_bytes", 1, 1 << 34), ("ring_banks", 0, 1 << 20),
                      ("expert_slots", 0, 1 << 16), ("defer_refills_rows", 0, MAX_ROWS),
                      ("kv_tile_tokens", 0, 1 << 24), ("attention_tile_tokens", 0, 1 << 24),
                      ("expert_groups", 0, 1 << 20), ("embedding_pick_values", 0, 1 << 40)):
        if k in table:
            v = table[k]
            require(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi, f"megakernel.{k}", v,
                    f"must be an integer in {lo}..{hi}" + (" (left out: the chip's dma_tile_bytes)" if k == "bank_bytes"
                                                           else ""))
    return Megakernel(**out)


def to_table(m: Megakernel) -> dict:
    """The fields that differ from the defaults (the inverse of from_table)."""
    out = {}
    for f in fields(Megakernel):
        v = getattr(m, f.name)
        if v != f.default:
            out[f.name] = [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
    return out
