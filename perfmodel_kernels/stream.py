"""The static weight stream: every matmul but the routed experts (and the lm_head), packed in
the order the kernel consumes it into one HBM array [rows, T] bf16 (T = `KernelConfig.tile`
lanes), which the kernel streams through a ring of VMEM banks of `bank_rows` rows, one DMA per
bank.

A layer is cut into parts, one per weight family in the order of its matmuls (attention;
dense_ffn; or router, latent_projection, shared_expert; lm_head for the head); a part starts on
a bank boundary and its last bank holds only what is left (a shorter copy). Layers of one kind share a part layout, so the layer loop
finds a part's first bank in the layer table and everything inside it at static offsets.

Inside a part, the matmuls that read the same input (`FUSED`) form one group whose columns are
concatenated: [d_in, C]. A group is cut into items:
- blocks of T columns, stored as [d_in, T] (d_in rounded up to 16 rows, the bf16 sublane tile);
- the last C mod T columns (the tail, r wide) stored transposed: ceil(d_in / T) chunks of
  [ceil16(r), T] (chunk c holds input rows c*T..c*T+T-1 of the r columns). A narrow projection
  (KDA's decay_a and beta at TP32: 7 columns) costs at most 15 zero rows per chunk instead of
  T - r zero columns.
Placement: items follow one another; a block that starts on a 128-row boundary may straddle a
bank boundary (the kernel splits its input range there, at a multiple of 128 lanes of the
input); any other item that would straddle is moved to the next bank, the rows skipped being
zeros (`Part.bank_padding_bytes` counts them; the kernel-plan figure in perfmodel_kernels/README.md gives the share).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from perfmodel.spec.arch import Layer, Matmul, ModelSpec
from perfmodel.util.errors import require

from . import chip

SPLIT = 128          # a block's input range may be split only at multiples of this

# matmuls of one part that read the same input and are computed as one, in column order
FUSED = {
    "kda": (("q_proj", "k_proj", "v_proj", "gate_proj", "decay_a", "beta_proj"),),
    "mla": (("q_a", "kv_a", "gate_proj"),),
}


ROW_TILE = chip.tile_rows(np.dtype(ml_dtypes.bfloat16))   # 16: every item and bank starts on one


def pad16(n: int) -> int:
    """n rounded up to whole bf16 tiles (`ROW_TILE` rows)."""
    return chip.round_rows(n, np.dtype(ml_dtypes.bfloat16))


@dataclass(frozen=True)
class Group:
    """Matmuls computed as one: x [bp, d_in] @ [d_in, sum(widths)]."""
    names: tuple[str, ...]
    widths: tuple[int, ...]
    d_in: int
    family: str

    @property
    def d_out(self) -> int:
        return sum(self.widths)

    def column(self, name: str) -> int:
        """First column of member `name` in the group's output."""
        k = self.names.index(name)
        return sum(self.widths[:k])

    def blocks(self, t: int) -> int:
        return self.d_out // t

    def tail(self, t: int) -> int:
        """Width of the transposed tail (0: none)."""
        return self.d_out % t

    def chunks(self, t: int) -> int:
        return math.ceil(self.d_in / t) if self.tail(t) else 0


@dataclass(frozen=True)
class Item:
    """One block (kind "block", column block `index`) or tail chunk (kind "tail", input chunk
    `index`) of group `group`, at rows [row, row + rows) of its part."""
    group: int
    kind: str
    index: int
    row: int
    rows: int


@dataclass(frozen=True)
class Part:
    """One family's matmuls of a layer kind, laid out in banks of `bank_rows` rows."""
    key: tuple[str, str]          # (layer kind: "kda", "mla", "dense", "moe" or "head", family)
    groups: tuple[Group, ...]
    items: tuple[Item, ...]
    rows: int
    bank_rows: int
    tile: int

    @property
    def family(self) -> str:
        return self.key[1]

    @property
    def banks(self) -> int:
        return max(1, math.ceil(self.rows / self.bank_rows))

    def bank_sizes(self) -> list[int]:
        """Rows each bank's copy moves (the last one: what is left)."""
        b = self.bank_rows
        return [min(b, self.rows - j * b) for j in range(self.banks)]

    def group_of(self, name: str) -> int:
        return next(k for k, g in enumerate(self.groups) if name in g.names)

    @functools.cached_property
    def real_per_row(self) -> np.ndarray:
        """Weight values (not zeros) in each of the part's rows (int, [rows])."""
        t, out = self.tile, np.zeros(self.rows, np.int64)
        for it in self.items:
            g = self.groups[it.group]
            if it.kind == "block":
                out[it.row:it.row + g.d_in] = t
            else:
                inputs = min(t, g.d_in - it.index * t)
                out[it.row:it.row + g.tail(t)] = inputs
        return out

    def bank_padding_bytes(self) -> list[int]:
        """Zero bytes (bf16) in each bank's copy."""
        b, real, t = self.bank_rows, self.real_per_row, self.tile
        return [int(2 * (n * t - real[j * b:j * b + n].sum()))
                for j, n in enumerate(self.bank_sizes())]


def layer_parts(spec: ModelSpec, layer: Layer | None) -> list[tuple[str, str]]:
    """Part keys of a layer (None: the head), in stream order."""
    if layer is None:
        return [("head", "lm_head")]
    fams = []
    for mm in spec.layer_matmuls(layer):
        if mm.family != "routed_expert" and mm.family not in fams:
            fams.append(mm.family)
    return [(layer.attention if f == "attention" else layer.ffn, f) for f in fams]


def _matmuls(spec: ModelSpec, key: tuple[str, str]) -> list[Matmul]:
    kind, family = key
    if kind == "head":
        return [lm_head_matmul(spec)]
    mms = spec.attention_matmuls(kind) if family == "attention" else spec.ffn_matmuls(kind)
    return [mm for mm in mms if mm.family == family]


def lm_head_matmul(spec: ModelSpec) -> Matmul:
    """The lm_head (a vocabulary shard on each of tp devices)."""
    return Matmul("lm_head", "lm_head", spec.hidden, spec.vocab // getattr(spec, "tp", 1))


def groups_of(spec: ModelSpec, key: tuple[str, str]) -> list[Group]:
    """A part's groups in consumption order (the position of each group's first member in the
    spec's matmul order)."""
    mms = _matmuls(spec, key)
    by = {mm.name: mm for mm in mms}
    out, seen = [], set()
    for mm in mms:
        if mm.name in seen:
            continue
        fused = next((f for f in FUSED.get(key[0], ()) if mm.name in f), (mm.name,))
        names = tuple(n for n in fused if n in by)
        require(len({by[n].d_in for n in names}) == 1, "stream.FUSED", names,
                "fused matmuls must read the same input")
        seen.update(names)
        out.append(Group(names, tuple(by[n].d_out for n in names), mm.d_in, mm.family))
    return out


def place(key: tuple[str, str], groups: list[Group], tile: int, bank_rows: int) -> Part:
    """Lay groups out in banks of `bank_rows` rows (module docstring: blocks, tails, placement)."""
    require(bank_rows % SPLIT == 0 and bank_rows >= tile, "bank_rows", bank_rows,
            f"must be a multiple of {SPLIT} and at least the tile ({tile})")
    items, row = [], 0

    def at(rows: int, may_straddle: bool) -> int:
        nonlocal row
        end = (row // bank_rows + 1) * bank_rows
        if row + rows <= end:
            start = row
        elif may_straddle and -(-row // SPLIT) * SPLIT <= end:
            start = -(-row // SPLIT) * SPLIT   # start on a split boundary, then straddle
        else:
            start = end
        row = start + rows
        return start

    for k, g in enumerate(groups):
        for j in range(g.blocks(tile)):
            items.append(Item(k, "block", j, at(pad16(g.d_in), True), pad16(g.d_in)))
        n16 = pad16(g.tail(tile))
        for c in range(g.chunks(tile)):
            items.append(Item(k, "tail", c, at(n16, False), n16))
    return Part(key, tuple(groups), tuple(items), row, bank_rows, tile)


@functools.lru_cache(maxsize=256)
def _part(spec_key, key: tuple[str, str], tile: int, bank_rows: int) -> Part:
    return place(key, groups_of(spec_key.spec, key), tile, bank_rows)


def part(spec: ModelSpec, key: tuple[str, str], tile: int, bank_rows: int) -> Part:
    from .reference import StaticSpec
    return _part(StaticSpec(spec), key, tile, bank_rows)


@dataclass(frozen=True)
class Bank:
    """One ring copy: global bank g holds rows [row0, row0 + rows) of the stream."""
    layer: int            # 1-based; n_layers + 1 for the head
    family: str
    index: int            # bank index within its part
    row0: int
    rows: int
    padding_bytes: int


@dataclass(frozen=True)
class Stream:
    """The whole static stream: banks in order, each layer's parts with their first bank."""
    banks: tuple[Bank, ...]
    first_bank: dict          # (layer, family) -> global index of the part's first bank
    sizes: tuple[int, ...]    # distinct copy sizes in rows (size class k = sizes[k])
    rows: int


@functools.lru_cache(maxsize=64)
def _stream(spec_key, tile: int, bank_rows: int) -> Stream:
    spec = spec_key.spec
    banks, first, row0 = [], {}, 0
    for layer in (*spec.layers, None):
        index = len(spec.layers) + 1 if layer is None else layer.index
        for key in layer_parts(spec, layer):
            p = part(spec, key, tile, bank_rows)
            first[(index, key[1])] = len(banks)
            for j, (n, pad) in enumerate(zip(p.bank_sizes(), p.bank_padding_bytes())):
                banks.append(Bank(index, key[1], j, row0, n, pad))
                row0 += n
    sizes = tuple(sorted({b.rows for b in banks}, reverse=True))
    return Stream(tuple(banks), first, sizes, row0)


def stream(spec: ModelSpec, tile: int, bank_rows: int) -> Stream:
    from .reference import StaticSpec
    return _stream(StaticSpec(spec), tile, bank_rows)


def pack_part(p: Part, weights: dict[str, np.ndarray]) -> np.ndarray:
    """A part's slab [rows, T] bf16 from its matmuls' weights {name: [d_in, d_out]}."""
    t = p.tile
    slab = np.zeros((p.rows, t), np.float32)
    fused = [np.concatenate([np.asarray(weights[n], np.float32) for n in g.names], axis=1)
             for g in p.groups]
    for it in p.items:
        w, g = fused[it.group], p.groups[it.group]
        if it.kind == "block":
            slab[it.row:it.row + g.d_in] = w[:, it.index * t:(it.index + 1) * t]
        else:
            tail = w[it.index * t:(it.index + 1) * t, g.blocks(t) * t:]   # [<=T inputs, r]
            slab[it.row:it.row + tail.shape[1], :tail.shape[0]] = tail.T
    return slab


def bank_tables(s: Stream) -> tuple[np.ndarray, np.ndarray]:
    """(first stream row, size class) of every bank, int32 [n_banks] each (SMEM inputs)."""
    return (np.array([b.row0 for b in s.banks], np.int32),
            np.array([s.sizes.index(b.rows) for b in s.banks], np.int32))
