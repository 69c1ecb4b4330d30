"""A decode step's DMA plan as data: every copy a kernel's DMA engine makes, in issue order.

The Pallas megakernel (`perfmodel_kernels.plan`) emits its real plan in this form, one `Copy` per DMA
descriptor, and the schedule simulator (`perfmodel.engine.megakernel`) runs on it, so the model
and the kernel agree copy by copy.

Fields beyond the copy itself (all with defaults, so a plan of HBM copies needs none of them):
- `padding`: how many of `bytes` are zeros the kernel's layout added (tile or bank padding,
  filler scale rows), which an analytic model of the weights does not count;
- `peer` and `collective`: a remote copy of an in-kernel collective to mesh device `peer`
  (the position on the kernel's tensor-parallel axis), `collective` naming the collective and
  its algorithm, e.g. "all_reduce one_shot" or "all_gather"; `peer` is -1 for HBM <-> on-chip
  copies. A consumer that models collectives by itself must leave remote copies out.

A plan file (`save_plan` / `load_plan`, the input of `perfmodel predict --kernel-plan`) is one
JSON object: {"format": "perfmodel-dma-plan", "version": 1, "model", "deployment", "kernel",
"source", "columns", "copies"} where `copies` are rows in the order of `columns` (the Copy
fields), `deployment` the layout the plan is of and `kernel` the kernel's settings (KERNEL_FIELDS;
docs/json-schema.md "Kernel plan file").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from perfmodel.util import limits, schema
from perfmodel.util.errors import in_file, require

FORMAT, VERSION = "perfmodel-dma-plan", 1
DEPLOYMENT_FIELDS = {"devices": int, "tp": int, "ep": int, "batch": int, "context": int, "draft_rows": int,
                     "steps_per_call": int}
# the kernel's settings the engine replays beside its copies (each optional):
#   bank_bytes, depth (ring banks), expert_slots; wire ("bf16" / "f32": what its reductions send);
#   all_reduce (its all-reduce algorithm at these rows: rs_ag, hierarchical, one_shot);
#   collective_rows (rows a collective's payload is padded to); expert_feed (the dtype its routed
#   experts' dots are fed: bf16 = dequantised, fp8, int4, ...) and expert_scale_rows (LHS rows per
#   batch row of that feed); expert_decode (what the vector unit decodes each routed weight from
#   before that feed, scales applied: e2m1, e2m1_words, int4 or int8; absent: none) and
#   expert_decode_passes (the passes of that decode over one expert); embedding_pick_values
#   (what its embed phase selects through: Megakernel.embedding_pick_values); shared_expert (where
#   a MoE layer's shared expert runs: Megakernel.shared_expert)
KERNEL_FIELDS = {"bank_bytes": int, "depth": int, "expert_slots": int, "wire": str, "all_reduce": str,
                 "collective_rows": int, "expert_feed": str, "expert_scale_rows": int,
                 "expert_decode": str, "expert_decode_passes": int, "cache_block": int, "matmul_dots": dict, "embedding_pick_values": int,
                 "shared_expert": str}


@dataclass(frozen=True)
class Copy:
    """One copy of a kernel's plan: where it is issued, what it moves and how."""
    order: int       # issue position within the step (0-based)
    layer: int       # 1-based layer; 0 = embedding, n_layers + 1 = final norm / lm_head
    family: str      # a weight family of perfmodel.spec.arch (e.g. "attention"), "kv_cache" /
    #                  "state", or "activation" (a remote copy)
    name: str        # what is copied, e.g. "attention[bank 3]" or "expert 2 -> slot 0"
    bytes: int
    routed: bool = False  # data dependent: issued only after this layer's router has run
    ring: bool = False    # a static weight bank streamed through the ring of on-chip banks
    padding: int = 0      # of `bytes`, zeros added by the kernel's layout
    peer: int = -1        # a remote copy to this mesh device (-1: HBM <-> on-chip)
    collective: str = ""  # the collective (and algorithm) a remote copy belongs to

    @property
    def writes_back(self) -> bool:
        """On-chip state written back to HBM: the kernel names those copies "... (write back)"
        (a KDA state) or "... (write) ..." (an MLA cache's new rows)."""
        return "(write" in self.name


COLUMNS = tuple(f.name for f in fields(Copy))


@dataclass(frozen=True)
class KernelPlan:
    """A kernel's plan of one step on one device of a deployment, with the kernel's settings."""
    model: str                # preset name or model file the kernel runs
    deployment: dict          # DEPLOYMENT_FIELDS
    kernel: dict              # KERNEL_FIELDS
    copies: tuple[Copy, ...]
    source: str = ""          # the command that wrote it

    @property
    def hbm_copies(self) -> list[Copy]:
        """The HBM <-> on-chip copies (remote copies left out), renumbered in order."""
        return [dataclasses.replace(c, order=k) for k, c in enumerate(c for c in self.copies if c.peer < 0)]

    @property
    def remote_copies(self) -> list[Copy]:
        return [c for c in self.copies if c.peer >= 0]


def bytes_by_layer_family(plan: list[Copy]) -> dict[tuple[int, str], int]:
    out: dict[tuple[int, str], int] = {}
    for c in plan:
        out[(c.layer, c.family)] = out.get((c.layer, c.family), 0) + c.bytes
    return out


def plan_json(p: KernelPlan) -> dict:
    """The plan file's object (plain JSON types)."""
    return {"format": FORMAT, "version": VERSION, "model": p.model, "deployment": dict(p.deployment),
            "kernel": dict(p.kernel), "source": p.source, "columns": list(COLUMNS),
            "copies": [[getattr(c, k) for k in COLUMNS] for c in p.copies]}


def save_plan(path, p: KernelPlan) -> None:
    """Write a plan file whole (perfmodel.util.files.write_atomic)."""
    import json
    from perfmodel.util.files import write_atomic
    write_atomic(path, json.dumps(plan_json(p), separators=(",", ":")) + "\n")


# the most an integer field of a plan's deployment or kernel may hold (the CLI's own bounds)
FIELD_MAX = {"context": 2**30, "bank_bytes": 2**34, "depth": 2**20, "expert_slots": 2**16}
COUNT_MAX = 2**20


def _typed(where: str, table, spec: dict, required: tuple[str, ...] = ()) -> dict:
    require(isinstance(table, dict), where, table, "must be an object")
    for k, v in table.items():
        require(k in spec, f"{where}.{k}", v, f"unknown field; known: {', '.join(spec)}")
        kind, hi = spec[k], FIELD_MAX.get(k, COUNT_MAX)
        if kind is dict:   # names -> counts (matmul_dots)
            require(isinstance(v, dict) and len(v) <= 4096, f"{where}.{k}", v, "must be an object of names -> counts")
            for name, n in v.items():
                require(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= hi, f"{where}.{k}.{name}", n,
                        f"must be an integer in 0..{hi}")
            continue
        ok = isinstance(v, str) if kind is str else isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= hi
        require(ok, f"{where}.{k}", v, "must be a string" if kind is str else f"must be an integer in 0..{hi}")
    for k in required:
        require(k in table, f"{where}.{k}", None, "required field is missing")
    return dict(table)


PLAN_KEYS = ("format", "version", "model", "deployment", "kernel", "columns", "copies", "source")


def plan_from_json(data, where: str = "plan") -> KernelPlan:
    """A KernelPlan from a plan file's object, every field checked."""
    require(isinstance(data, dict), where, type(data).__name__, "a plan file is one JSON object")
    require(data.get("format") == FORMAT, f"{where}.format", data.get("format"), f"must be {FORMAT!r}")
    require(data.get("version") == VERSION, f"{where}.version", data.get("version"), f"must be {VERSION}")
    model = data.get("model")
    require(isinstance(model, str) and model, f"{where}.model", model, "must name a model (preset or file)")
    dep = _typed(f"{where}.deployment", data.get("deployment"), DEPLOYMENT_FIELDS, ("devices", "tp", "batch"))
    kernel = _typed(f"{where}.kernel", data.get("kernel", {}), KERNEL_FIELDS)
    cols = data.get("columns")
    require(isinstance(cols, list) and all(isinstance(c, str) for c in cols), f"{where}.columns", cols,
            "must list the Copy fields of each row")
    unknown = [c for c in cols if c not in COLUMNS]
    require(not unknown, f"{where}.columns", unknown, f"unknown Copy fields; known: {', '.join(COLUMNS)}")
    for c in ("order", "layer", "family", "name", "bytes"):
        require(c in cols, f"{where}.columns", cols, f"needs {c!r}")
    rows = data.get("copies")
    require(isinstance(rows, list), f"{where}.copies", type(rows).__name__, "must be a list of rows")
    limits.refuse(f"{where}.copies", f"{len(rows)} rows", "copies in the plan", len(rows), limits.MAX_PLAN_COPIES,
                  "copies")
    types = {f.name: f.type for f in fields(Copy)}
    check = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool), "str": lambda v: isinstance(v, str),
             "bool": lambda v: isinstance(v, bool)}
    copies = []
    for i, r in enumerate(rows):
        require(isinstance(r, list) and len(r) == len(cols), f"{where}.copies[{i}]", r,
                f"must be a row of {len(cols)} values ({', '.join(cols)})")
        row = dict(zip(cols, r))
        for k, v in row.items():
            require(check[types[k]](v), f"{where}.copies[{i}].{k}", v, f"must be a {types[k]}")
        require(row["bytes"] >= 0 and row.get("padding", 0) >= 0 and row.get("padding", 0) <= row["bytes"],
                f"{where}.copies[{i}].bytes", row["bytes"], "must be >= its padding >= 0")
        require(row["order"] == i, f"{where}.copies[{i}].order", row["order"], "copies are listed in issue order")
        require(0 <= row["layer"] <= 1 << 20, f"{where}.copies[{i}].layer", row["layer"],
                "must be a layer number >= 0 (0 = embedding)")
        copies.append(Copy(**row))
    src = data.get("source", "")
    require(isinstance(src, str), f"{where}.source", src, "must be a string")
    return KernelPlan(model, dep, kernel, tuple(copies), src)


def load_plan(path) -> KernelPlan:
    """A plan file (plan_json's object), or SpecError naming the field and value."""
    data = schema.load(path, dict.fromkeys(PLAN_KEYS), "--kernel-plan", fmt="json")
    with in_file(path):
        return plan_from_json(data)
