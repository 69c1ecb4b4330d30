"""Profiler traces of decode steps: parse any XSpace (capture lives in `perfmodel_jax.capture`).

Capture (`perfmodel_jax.capture.capture_reference`, CLI `perfmodel capture`): runs `perfmodel_kernels.reference.decode_step` (one
compiled XLA program) and `decode_step_op_by_op` (one jitted call per phase) under
`jax.profiler.trace`, each step inside a `StepTraceAnnotation("decode_step")` (a prefill run of
`perfmodel_kernels.prefill.prefill_step`: "prefill_step"), in a subprocess
whose XLA_FLAGS dump the optimised HLO of every compiled module (that is where the `op_name`
metadata, i.e. the named scopes, lives). Layout of the output directory:
    OUT/hlo_<model>_<time>/module_NNNN.<name>.<backend>_after_optimizations.txt
        (NNNN = the trace's program_id; one directory per capture process, as ids restart)
    OUT/<model>_b<B>_c<C>_<mode>/capture.json                (what ran, host wall times)
    OUT/<model>_b<B>_c<C>_<mode>/plugins/profile/*/*.xplane.pb

Parse (`parse_trace`): reads `.xplane.pb` with `jax.profiler.ProfileData` and attributes each op
event to a scope `embed`, `layer_XX/<phase>` or `head`, from, in order:
1. the event's own name, when it is a named-scope marker (in-kernel trace markers of a TPU
   kernel: `layer_03/attention` and the like; the megakernel's layer loop is traced once, so its
   markers carry no number, `layer/attention`, `layer/ffn`: in each step, in time order, the
   k-th top-level `layer/attention` marker begins layer k and the loop markers after it belong
   to that layer, `number_loop_layers`);
2. a `tf_op` / `name_scope` / `name` stat carrying the op_name (TPU / GPU device planes);
3. the `hlo_op` + `program_id` stats looked up in the dumped HLO's op_name metadata (CPU thunks);
4. on a GPU, the instruction or kernel looked up there (`ModuleScopes.device`): XLA runs most
   kernels from command buffers (CUDA graphs), whose launches carry the buffer's `hlo_op`; a
   kernel is named after its fusion; one that several layers share (a deduplicated fusion, a loop
   body cloned per layer) takes the scope of the op before it on its stream, or the next one in
   program order (`resolve_shared`).
An accelerator's trace (op events on a `/device:` plane) counts only those: its host planes hold
the launches.
Steps are the `decode_step` annotations (host), or the events of a `Steps` line (device planes).
Time inside a step is split by a sweep over the op intervals: each instant goes in equal shares
to the scopes of the ops running then; idle gaps (dispatch, launch) go to the scope of the next
op. So the per-layer times of a step sum to the step's window. On a GPU the gaps are the device
waiting on the host (Python dispatch, a loop's condition copied back each trip): they are kept
apart as idle time, and a layer's time is its kernels' alone. Layers are numbered as in
`perfmodel.step.predict`: 0 embedding, 1..n, n + 1 head.
"""
from __future__ import annotations

import bisect
import contextlib
import gzip
import os
import re
import statistics
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from perfmodel.util import schema
from perfmodel.util.checks import COUNT, STR, ListOf, Num
from perfmodel.util.errors import SpecError
from perfmodel.util.files import check_path, read_text

STEP_NAME = "decode_step"
PREFILL_STEP_NAME = "prefill_step"  # the annotation of one traced prefill (perfmodel_jax.capture, mode prefill)
STEP_NAMES = (STEP_NAME, PREFILL_STEP_NAME)
SCOPE_RE = re.compile(r"(?:^|/)(embed|head|layer_(\d+)/(attention|ffn|moe))(?=/|$)")
MARKER_RE = re.compile(r"(embed|head|layer(_\d+)?/(attention|ffn|moe))(/[\w.\-]+)*")
KERNEL_MARKERS = "XLA TraceMe"   # a TPU device plane's line of in-kernel named-scope markers
LOOP_RE = re.compile(r"(?:^|/)layer/(attention|ffn|moe)(?=/|$)")
HLO_SUFFIX = "_after_optimizations.txt"  # module_NNNN.<name>.cpu_after_... (CPU), .sm_9.0_gpu_after_... (GPU)
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ")
_COMP_RE = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")
_CALLS_RE = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_OPERAND_RE = re.compile(r"%([\w.\-]+)")
_OPNAME_RE = re.compile(r'op_name="([^"]*)"')


# ----- scopes ---------------------------------------------------------------------------------

def scope_of(text: str) -> tuple[str, int | None, str] | None:
    """(scope, layer or None for embed/head, phase) of the first named scope in `text`."""
    m = SCOPE_RE.search(text or "")
    if not m:
        return None
    if m.group(2):
        return m.group(1), int(m.group(2)), m.group(3)
    return m.group(1), None, m.group(1)


def loop_scope(text: str) -> str | None:
    """`layer/<phase>` of a layer-loop marker (no layer number), else None."""
    m = LOOP_RE.search(text or "")
    return f"layer/{m.group(1)}" if m else None


def number_loop_layers(ops: list["OpEvent"], windows: list[tuple[int, float, float]]) -> None:
    """Give the layer-loop markers of each step window their layer: in time order, a
    `layer/attention` marker that starts after the previous one ended begins the next layer
    (a nested one does not), and every loop marker belongs to the layer begun last (layer 1
    before any). Rewrites their scopes to `layer_XX/<phase>` in place."""
    loop = sorted((o for o in ops if o.scope and o.scope.startswith("layer/")),
                  key=lambda o: (o.start_ns, -o.end_ns))
    for _, t0, t1 in windows:
        layer, attention_end = 0, float("-inf")
        for o in loop:
            if not t0 <= o.start_ns < t1:
                continue
            phase = o.scope.split("/", 1)[1]
            if phase == "attention" and o.start_ns >= attention_end:
                layer, attention_end = layer + 1, o.end_ns
            o.scope = f"layer_{max(layer, 1):02d}/{phase}"


def _instructions(hlo_text: str):
    """(computation, whether it is the entry, instruction name, its line) of each instruction."""
    comp, entry = "", False
    for line in hlo_text.splitlines():
        m = _INSTR_RE.match(line)
        if m:
            yield comp, entry, m.group(1), line
            continue
        c = _COMP_RE.match(line)
        if c:
            comp, entry = c.group(1), line.lstrip().startswith("ENTRY")


def hlo_scopes(hlo_text: str) -> dict[str, str]:
    """Instruction name -> named scope, from one module's HLO text.

    An instruction without a scope in its own op_name (XLA drops the metadata of some rewritten
    dots and of fusions) takes, in order, the most common scope of the computations it calls,
    of its operands, or of its users."""
    return _scopes_of(_instructions(hlo_text))


def _scopes_of(instructions) -> dict[str, str]:
    """hlo_scopes of a module's parsed instructions (`_instructions`)."""
    own: dict[str, str | None] = {}
    calls: dict[str, list[str]] = {}
    operands: dict[str, list[str]] = {}
    users: dict[str, list[str]] = defaultdict(list)
    comp_members: dict[str, list[str]] = defaultdict(list)
    for comp, _, name, line in instructions:
        op = _OPNAME_RE.search(line)
        s = scope_of(op.group(1)) if op else None
        own[name] = s[0] if s else None
        calls[name] = _CALLS_RE.findall(line)
        body = line.split("=", 1)[1].split("metadata=")[0]
        operands[name] = [o for o in _OPERAND_RE.findall(body) if o != name]
        for o in operands[name]:
            users[o].append(name)
        comp_members[comp].append(name)

    def vote(scopes) -> str | None:
        votes: dict[str, int] = defaultdict(int)
        for x in scopes:
            if x:
                votes[x] += 1
        return max(votes, key=votes.get) if votes else None

    comp_memo: dict[str, str | None] = {}

    def of_comp(c: str) -> str | None:
        """A computation's scope, its callees' first (an explicit stack: call chains of any depth;
        a computation in progress reads as None, which breaks a cycle)."""
        stack = [(c, False)]
        while stack:
            x, ready = stack.pop()
            if ready:
                comp_memo[x] = vote(own.get(n) or vote(comp_memo.get(k) for k in calls.get(n, []))
                                    for n in comp_members.get(x, []))
            elif x not in comp_memo:
                comp_memo[x] = None
                stack.append((x, True))
                stack.extend((k, False) for n in comp_members.get(x, []) if not own.get(n)
                             for k in calls.get(n, []) if k not in comp_memo)
        return comp_memo[c]

    out = {n: own[n] or vote(of_comp(c) for c in calls[n]) for n in own}
    for links in (operands, users):  # propagate along the dataflow, a few hops
        for _ in range(4):
            missing = [n for n in out if not out[n]]
            if not missing:
                break
            for n in missing:
                out[n] = vote(out.get(o) for o in links.get(n, []))
    return {n: s for n, s in out.items() if s}


@dataclass(frozen=True)
class ModuleScopes:
    """The named scopes of one compiled module. `ops`: per instruction, from its own metadata
    (`hlo_scopes`). `device`: what a GPU event names, an instruction (its `hlo_op`) or a kernel,
    to its candidate scopes. Instructions with one `deduplicated_name` share one kernel, named
    after any of them ('.' as '_'), so the kernel has all their scopes; an instruction inside a
    called computation (a loop body) takes the scopes of the top-level instructions that call it,
    since XLA clones a loop body per layer with the first layer's metadata."""
    ops: dict[str, str]
    device: dict[str, frozenset[str]]
    order: dict[str, int]   # each scope's place in the program: its first top-level instruction


_DEDUP_RE = re.compile(r'deduplicated_name="([^"]*)"')
_LOOP_OP_RE = re.compile(r"^%[\w.\-]+ = .* (while|conditional)\(")


def module_scopes(hlo_text: str) -> ModuleScopes:
    instructions = list(_instructions(hlo_text))
    ops = _scopes_of(instructions)
    comp_of: dict[str, str] = {}
    callers: dict[str, list[str]] = defaultdict(list)   # computation -> calling instructions
    kernel_of: dict[str, str] = {}
    entry = None
    for comp, is_entry, name, line in instructions:
        entry = comp if is_entry else entry
        comp_of[name] = comp
        for k in _CALLS_RE.findall(line.split("metadata=")[0]):
            callers[k].append(name)
        d = _DEDUP_RE.search(line)
        kernel_of[name] = d.group(1) if d else name
    memo: dict[str, frozenset[str]] = {}

    def top(c: str) -> frozenset[str]:
        """The top-level (entry) instructions that call computation `c`, through any depth."""
        if c not in memo:
            memo[c] = frozenset()  # a cycle guard
            memo[c] = frozenset(x for i in callers.get(c, [])
                                for x in ([i] if comp_of[i] == entry else top(comp_of[i])))
        return memo[c]

    device: dict[str, set[str]] = defaultdict(set)
    group: dict[str, set[str]] = defaultdict(set)  # a shared kernel -> the scopes of its users
    order: dict[str, int] = {}
    for name, c in comp_of.items():
        if c == entry and name in ops:
            order.setdefault(ops[name], len(order))
        scopes = {ops[i] for i in top(c) if i in ops} if c != entry else set()
        scopes = scopes or ({ops[name]} if name in ops else set())
        device[name] |= scopes
        group[kernel_of[name]] |= scopes
    for name, shared in kernel_of.items():  # the kernel takes any of its users' names
        for k in {name, shared}:
            device[k.replace(".", "_")] |= group[shared]
    return ModuleScopes(ops, {k: frozenset(v) for k, v in device.items() if v}, order)


def load_hlo_dir(hlo_dir: Path) -> dict[int, ModuleScopes]:
    """program_id -> its scopes, for every dumped module in `hlo_dir`."""
    out = {}
    for f in Path(hlo_dir).glob(f"module_*{HLO_SUFFIX}"):
        pid = f.name.split(".")[0].split("_")[1]
        if pid.isdigit():
            out[int(pid)] = module_scopes(read_text(f, "HLO dump"))
    return out


# ----- reading an XSpace ----------------------------------------------------------------------

def find_xplane(path: str | Path) -> Path:
    """The `.xplane.pb` file at `path` (a file, or the newest one under a directory)."""
    p = check_path("--trace", path)
    if p.is_file():
        return p
    if not p.exists():
        raise SpecError("--trace", str(p), "no such file or directory")
    try:
        found = sorted((f for f in p.rglob("*.xplane.pb") if f.is_file()), key=lambda f: f.stat().st_mtime)
    except OSError as e:
        raise SpecError("--trace", str(p), f"cannot read the directory: {e.strerror or e}") from None
    if not found:
        raise SpecError("--trace", str(p), "no .xplane.pb file under this directory")
    return found[-1]


@contextlib.contextmanager
def _native_stderr_silenced():
    """Send file descriptor 2 to /dev/null: the protobuf parser logs each malformed string of a
    corrupt trace there, and the CLI reports one line instead."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def load_xspace(path: Path):
    """`jax.profiler.ProfileData` of one `.xplane.pb` (or its gzip, as the repository keeps them),
    with a clear error for bad files."""
    from jax.profiler import ProfileData
    try:
        data = Path(path).read_bytes()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
    except (OSError, EOFError) as e:
        raise SpecError("trace", str(path), getattr(e, "strerror", None) or str(e) or type(e).__name__) from None
    if not data:
        raise SpecError("trace", str(path), "empty file (no XSpace protobuf)")
    try:
        with _native_stderr_silenced():
            pd = ProfileData.from_serialized_xspace(data)
    except Exception as e:  # the binding raises its own status error types
        raise SpecError("trace", str(path), f"not a readable XSpace protobuf (corrupt or "
                        f"truncated): {str(e).splitlines()[0][:200]}") from None
    if not list(pd.planes):
        raise SpecError("trace", str(path), "XSpace holds no planes (foreign or truncated file)")
    return pd


@dataclass
class OpEvent:
    start_ns: float
    end_ns: float
    scope: str | None      # None: unattributed
    plane: str
    line: str = ""
    candidates: tuple[str, ...] = ()  # a shared GPU kernel's scopes in program order (`resolve_shared`)
    order: dict[str, int] | None = None  # its program's scope order (ModuleScopes.order)


def _op_scope(name: str, stats: dict, table: ModuleScopes | None,
              on_device: bool) -> tuple[str | None, tuple[str, ...]]:
    """(scope, candidate scopes in program order) of an XLA op event: its `tf_op` / `name_scope`
    / `name` stat (the op_name, on TPU and some GPU events), else its `hlo_op` instruction in the
    dumped HLO (CPU thunks), else, on a GPU, the instruction or kernel it names there
    (`ModuleScopes.device`: kernels a command buffer launches carry the buffer's `hlo_op`)."""
    for key in ("tf_op", "name_scope", "name"):
        s = scope_of(str(stats.get(key, "")))
        if s:
            return s[0], ()
    if table is None:
        return None, ()
    if not on_device:
        return table.ops.get(str(stats.get("hlo_op"))), ()
    found = table.device.get(str(stats.get("hlo_op"))) or table.device.get(name, frozenset())
    if len(found) == 1:
        return next(iter(found)), ()
    return None, tuple(sorted(found, key=lambda x: (table.order.get(x, len(table.order)), x)))


def _layer(scope: str) -> int:
    s = scope_of(scope)
    return -1 if s[0] == "embed" else 10**9 if s[0] == "head" else s[1]


def resolve_shared(ops: list[OpEvent]) -> None:
    """Place each launch of a kernel that several scopes share (XLA deduplicates identical fusions
    and clones a loop body per layer) by program order: the scope of the op before it on its
    stream if that is a candidate, else the first candidate after that scope in the program (after
    its layer, when the op before is of another program), else the first (a new step). In place."""
    by_line: dict[tuple[str, str], list[OpEvent]] = defaultdict(list)
    for o in ops:
        by_line[(o.plane, o.line)].append(o)
    for seq in by_line.values():
        seq.sort(key=lambda o: o.start_ns)
        before = None
        for o in seq:
            if o.candidates:
                if before in o.candidates:
                    o.scope = before
                else:
                    later = ([c for c in o.candidates if o.order.get(c, -1) > o.order[before]]
                             if before in o.order else
                             [c for c in o.candidates if _layer(c) >= _layer(before)] if before else [])
                    o.scope = (later or o.candidates)[0]
            before = o.scope or before


def _events(pd, hlo: dict[int, ModuleScopes]):
    """(op events, step windows [(step, start_ns, end_ns)]) of every plane; when a device plane
    holds op events (an accelerator's trace), the host planes' op events are launches, not the
    ops, and are left out."""
    ops, steps = [], []
    for plane in pd.planes:
        if plane.name.startswith("/host:metadata"):
            continue
        on_device = plane.name.startswith("/device:")
        for line in plane.lines:
            is_steps_line = line.name == "Steps"
            for ev in line.events:
                name = ev.name
                stats = {k: v for k, v in ev.stats}
                if is_steps_line or name in STEP_NAMES:
                    steps.append((_int(stats.get("step_num"), int(name) if name.isdigit() else len(steps)),
                                  ev.start_ns, ev.end_ns))
                    continue
                if name.startswith("end: "):
                    continue
                # a named-scope marker: exactly a scope on host planes; on device planes the
                # runtime may prefix it (program or kernel name)
                is_marker = MARKER_RE.fullmatch(name) or (
                    on_device and "hlo_op" not in stats
                    and (SCOPE_RE.search(name) or LOOP_RE.search(name)))
                marker = is_marker and (loop_scope(name) or scope_of(name)[0])
                if marker:
                    ops.append(OpEvent(ev.start_ns, ev.end_ns, marker, plane.name, line.name))
                elif any(k in stats for k in ("tf_op", "name_scope")) or (
                        "hlo_op" in stats and "program_id" in stats):
                    table = hlo.get(_int(stats.get("program_id"), None))
                    scope, shared = _op_scope(name, stats, table, on_device)
                    ops.append(OpEvent(ev.start_ns, ev.end_ns, scope, plane.name, line.name, shared,
                                       table.order if table else None))
                elif on_device and line.name == "XLA Ops" and name.startswith("%") and len(hlo) == 1:
                    # an op named by its HLO text and nothing else (the v5e's libtpu): its
                    # instruction in the one module given; a loop's own event spans its body's
                    # ops, which are events of their own, so it is left out
                    if _LOOP_OP_RE.search(name):
                        continue
                    table = next(iter(hlo.values()))
                    ops.append(OpEvent(ev.start_ns, ev.end_ns, table.ops.get(_op_name(name)), plane.name,
                                       line.name))
    if any(o.plane.startswith("/device:") for o in ops):
        ops = [o for o in ops if o.plane.startswith("/device:")]
    resolve_shared(ops)
    return ops, sorted(steps)


def _int(v, default):
    """An event stat as an integer (a malformed one: `default`)."""
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
        return default


# ----- per-step attribution ---------------------------------------------------------------------

@dataclass
class Step:
    index: int
    window_s: float                 # the step annotation's duration
    busy_s: float                   # time with at least one op running
    unattributed_s: float           # busy time of ops without a scope
    scope_s: dict[str, float]       # per scope, gaps included (with unattributed and idle: the window)
    scope_ops: dict[str, int] = field(default_factory=dict)  # op events per scope
    idle_s: float = 0.0             # gaps kept apart (a GPU's), not given to the next op


def attribute(ops: list[OpEvent], t0: float, t1: float, index: int, gaps_to_next: bool = True) -> Step:
    """Split the window [t0, t1] (ns) over the scopes of the ops that ran in it (module doc).
    `gaps_to_next=False` (a GPU's kernels): a gap is the device waiting on the host, kept apart
    as `idle_s`, and each scope gets its kernels' time alone."""
    inside = [o for o in ops if t0 <= o.start_ns < t1]
    edges = []
    for o in inside:
        edges.append((o.start_ns, 1, o.scope))
        edges.append((min(o.end_ns, t1), -1, o.scope))
    edges.sort(key=lambda e: (e[0], -e[1]))
    active: dict[str | None, int] = defaultdict(int)
    share: dict[str | None, float] = defaultdict(float)
    pending_gap, busy, last = 0.0, 0.0, t0
    for t, kind, scope in edges:
        dt = t - last
        if dt > 0:
            live = [s for s, c in active.items() if c > 0]
            if len(live) > 1 and None in live:  # an enclosing or concurrent unscoped event
                live.remove(None)
            if live:
                busy += dt
                for s in live:
                    share[s] += dt / len(live)
            else:
                pending_gap += dt
        if kind > 0 and pending_gap and gaps_to_next and not any(c > 0 for c in active.values()):
            share[scope] += pending_gap  # idle before an op: that op's dispatch / launch
            pending_gap = 0.0
        active[scope] += kind
        last = t
    tail = pending_gap + max(0.0, t1 - last)
    idle = 0.0
    if not gaps_to_next:
        idle, tail = tail, 0.0
    if inside and tail:
        share[max(inside, key=lambda o: o.end_ns).scope] += tail
    unattr = share.pop(None, 0.0)
    counts: dict[str, int] = defaultdict(int)
    for o in inside:
        counts[o.scope] += 1
    return Step(index, (t1 - t0) * 1e-9, busy * 1e-9, unattr * 1e-9,
                {k: v * 1e-9 for k, v in share.items()}, dict(counts), idle * 1e-9)


# ----- a whole trace --------------------------------------------------------------------------

@dataclass(frozen=True)
class Spread:
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, xs: list[float]) -> "Spread":
        return cls(statistics.median(xs), min(xs), max(xs)) if xs else cls(0.0, 0.0, 0.0)

    def json(self) -> dict:
        return {"median": self.median, "min": self.min, "max": self.max}


@dataclass
class TraceSummary:
    path: str                        # the .xplane.pb
    run_dir: str                     # the run (its capture.json), else the trace's directory
    meta: dict                       # capture.json of the run, if any
    n_layers: int
    steps: list[Step]
    step_s: Spread                   # step window
    layer_s: dict[int, Spread]       # 0 embed, 1..n, n+1 head (gaps included)
    layer_ops: dict[int, float]      # median op events per step, per layer
    phase_s: dict[str, Spread]       # per scope string
    unattributed_share: float        # of busy time, all steps
    host_step_s: Spread | None = None  # untraced wall time per step (capture.json)
    notes: list[str] = field(default_factory=list)
    idle_share: float = 0.0          # of the step windows, all steps: the device idle (a GPU's)
    platform: str = "cpu"            # whose ops were read: "cpu" (host threads), "gpu" or "tpu"
    sub_phase_s: dict[str, Spread] = field(default_factory=dict)  # nested in-kernel markers

    def json(self) -> dict:
        return {"path": self.path, "run_dir": self.run_dir, "meta": self.meta, "n_layers": self.n_layers,
                "steps": len(self.steps), "step_s": self.step_s.json(),
                "host_step_s": self.host_step_s.json() if self.host_step_s else None,
                "unattributed_share": self.unattributed_share, "idle_share": self.idle_share, "platform": self.platform,
                "layers": {str(k): v.json() for k, v in sorted(self.layer_s.items())},
                "layer_ops": {str(k): v for k, v in sorted(self.layer_ops.items())},
                "phases": {k: v.json() for k, v in sorted(self.phase_s.items())},
                "sub_phases": {k: v.json() for k, v in sorted(self.sub_phase_s.items())},
                "notes": self.notes}


CAPTURE_FILE = {"model": (STR,), "batch": (COUNT,), "context": Num(0, 2**30, integer=True), "mode": (STR,),
                "steps": (COUNT,), "host_step_s": ListOf(Num(0), 1), "hlo_dir": (STR,), "weights_dtype": (STR,),
                "machine": (STR,), "jax": (STR,), "command": (STR,), "load_average_1min": Num(0),
                "date": (STR,),
                # a prefill run (mode prefill): its prompt length and the structure counted in its
                # compiled program (perfmodel_jax.capture.prefill_structure: name -> count or bytes)
                "prompt": Num(0, 2**30, integer=True), "structure": {"*": Num(0)}}


def capture_meta(path: Path) -> dict:
    """A run's capture.json (what ran, host wall times), checked."""
    return schema.load(path, CAPTURE_FILE, "capture.json", fmt="json")


def layer_index(scope: str, n_layers: int) -> int:
    s = scope_of(scope)
    return 0 if s[0] == "embed" else n_layers + 1 if s[0] == "head" else s[1]


def parse_trace(path: str | Path, hlo_dir: str | Path | None = None, n_layers: int | None = None,
                skip_first: int = 0) -> TraceSummary:
    """Per-step, per-layer and per-scope times of one trace (a run directory or `.xplane.pb`).

    `hlo_dir` defaults to the capture's (capture.json) or `hlo/` beside or above the trace;
    `n_layers` to the capture's model's, else the largest layer index seen; `skip_first` drops warm-up steps."""
    xp = find_xplane(path)
    run_dir = Path(path) if Path(path).is_dir() else xp.parent
    meta_file = next((d / "capture.json" for d in [run_dir, *run_dir.parents][:5]
                      if (d / "capture.json").exists()), None)
    meta = capture_meta(meta_file) if meta_file else {}
    if hlo_dir is None:
        cands = ([meta_file.parent / check_path("hlo_dir", meta["hlo_dir"])] if meta.get("hlo_dir") else []) + \
            [d / "hlo" for d in [run_dir, *run_dir.parents][:5]]
        hlo_dir = next((c for c in cands if c.is_dir()), None)
    hlo = load_hlo_dir(Path(hlo_dir)) if hlo_dir else {}
    pd = load_xspace(xp)
    with warnings.catch_warnings():  # the binding's stat types warn on iteration
        warnings.simplefilter("ignore", DeprecationWarning)
        ops, windows = _events(pd, hlo)
    if not ops:
        raise SpecError("trace", str(xp), "no XLA op or named-scope events: a foreign trace, "
                        "or one recorded without a decode step")
    notes = []
    if not windows:
        lo, hi = min(o.start_ns for o in ops), max(o.end_ns for o in ops)
        windows = [(0, lo, hi)]
        notes.append("no step markers: the whole trace is taken as one step")
    kernel = [o for o in ops if o.line == KERNEL_MARKERS and o.plane.startswith("/device:")]
    outside: list[float] = []
    if kernel:   # a TPU kernel's in-kernel markers: a step is their span, they alone count
        device_ops = [(ev.start_ns, ev.end_ns) for plane in pd.planes if plane.name.startswith("/device:")
                      for line in plane.lines if line.name == "XLA Ops" for ev in line.events]
        runs = _program_runs(pd, kernel)
        if runs:
            windows = runs
            notes.append("steps: the device's program runs that hold the kernel's markers (the "
                         "host's step markers are on another clock)")
        outside = [_outside_kernel(device_ops, kernel, t0, t1) for _, t0, t1 in windows]
        windows = [(i, min(o.start_ns for o in k), max(o.end_ns for o in k))
                   for i, t0, t1 in windows
                   if (k := [o for o in kernel if t0 <= o.start_ns < t1])]
        ops = kernel
        notes.append("in-kernel markers: each step is the span of the kernel's markers; device "
                     f"ops outside it (layout copies, the loop's bookkeeping) "
                     f"{statistics.median(outside) * 1e6:.1f} us a step are left out")
    number_loop_layers(ops, windows)
    platform = next((p for p in ("gpu", "tpu") if any(o.plane.startswith(f"/device:{p.upper()}") for o in ops)),
                    "cpu")
    gpu = platform == "gpu"
    steps = [attribute(ops, t0, t1, i, gaps_to_next=not gpu) for i, t0, t1 in windows][skip_first:]
    steps = [s for s in steps if s.busy_s > 0]
    if not steps:
        raise SpecError("trace", str(xp), "no op events inside any step marker")
    n = n_layers
    if n is None and meta.get("model"):
        from perfmodel.spec.loaders import load_model
        n = len(load_model(meta["model"]).layers)
    if n is None:
        n = max((scope_of(k)[1] or 0 for s in steps for k in s.scope_s), default=0)
    if not hlo and any(o.scope is None and o.plane.startswith("/host") for o in ops):
        notes.append("no HLO dump found: CPU op events cannot be attributed")
    per_layer: dict[int, list[float]] = defaultdict(list)
    per_scope: dict[str, list[float]] = defaultdict(list)
    ops_count: dict[int, list[int]] = defaultdict(list)
    for s in steps:
        layer_sum: dict[int, float] = defaultdict(float)
        layer_n: dict[int, int] = defaultdict(int)
        for k, v in s.scope_s.items():
            layer_sum[layer_index(k, n)] += v
        for k, c in s.scope_ops.items():
            if k is not None:
                layer_n[layer_index(k, n)] += c
        for k in set(layer_sum) | set(per_layer):
            per_layer[k].append(layer_sum.get(k, 0.0))
            ops_count[k].append(layer_n.get(k, 0))
        for k, v in s.scope_s.items():
            per_scope[k].append(v)
    busy = sum(s.busy_s for s in steps)
    host = meta.get("host_step_s")
    subs = _sub_phases(pd, ops, windows[skip_first:]) if kernel else {}
    return TraceSummary(str(xp), str(meta_file.parent if meta_file else run_dir), meta, n, steps,
                        Spread.of([s.window_s for s in steps]),
                        {k: Spread.of(v) for k, v in per_layer.items()},
                        {k: statistics.median(v) for k, v in ops_count.items()},
                        {k: Spread.of(v) for k, v in per_scope.items()},
                        sum(s.unattributed_s for s in steps) / busy if busy else 1.0,
                        Spread.of(host) if host else None, notes,
                        sum(s.idle_s for s in steps) / sum(s.window_s for s in steps), platform,
                        {k: Spread.of(v) for k, v in subs.items()})


def _program_runs(pd, kernel: list[OpEvent]) -> list[tuple[int, float, float]]:
    """(step, start ns, end ns) of each run of a device program (the `XLA Modules` lines) that
    holds in-kernel markers, in order; none where a run holds more than one step (more than one
    `embed` marker: a call of several steps). On a TPU VM the device's clock and the host's are
    offset (by 0.1 ms on the lent v5e: a step's first markers fell inside the host's window of
    the step before), so a one-step call's step is cut by the device's own program run."""
    runs = sorted((ev.start_ns, ev.end_ns) for plane in pd.planes if plane.name.startswith("/device:")
                  for line in plane.lines if line.name == "XLA Modules" for ev in line.events)
    starts = sorted(o.start_ns for o in kernel)
    embeds = sorted(o.start_ns for o in kernel if o.scope == "embed")
    count = lambda xs, t0, t1: bisect.bisect_left(xs, t1) - bisect.bisect_left(xs, t0)  # noqa: E731
    held = [(t0, t1) for t0, t1 in runs if count(starts, t0, t1)]
    if any(count(embeds, t0, t1) > 1 for t0, t1 in held):
        return []
    return [(i, t0, t1) for i, (t0, t1) in enumerate(held)]


def _outside_kernel(device_ops: list[tuple[float, float]], kernel: list[OpEvent], t0: float,
                    t1: float) -> float:
    """Seconds of device op events (start, end ns: the `XLA Ops` lines) in the window [t0, t1]
    that end before the kernel's first marker or start after its last."""
    k = [o for o in kernel if t0 <= o.start_ns < t1]
    if not k:
        return 0.0
    a, b = min(o.start_ns for o in k), max(o.end_ns for o in k)
    return sum(e - s for s, e in device_ops if t0 <= s < t1 and (e <= a or s >= b)) * 1e-9


def kernel_markers(pd) -> list[tuple[float, float, str]]:
    """(start ns, end ns, name) of every in-kernel marker on the device planes, in time order."""
    return sorted((ev.start_ns, ev.end_ns, ev.name) for plane in pd.planes if plane.name.startswith("/device:")
                  for line in plane.lines if line.name == KERNEL_MARKERS for ev in line.events)


def _sub_phases(pd, ops: list[OpEvent], windows) -> dict[str, list[float]]:
    """Per step, the in-kernel markers nested in a layer's phase that name no phase themselves
    (`router`, `experts`, ...), summed per `<phase scope>/<name>` (seconds): not added to the
    layer sums, which their phase already holds."""
    nested = [(a, b, name) for a, b, name in kernel_markers(pd)
              if not (MARKER_RE.fullmatch(name) or SCOPE_RE.search(name) or LOOP_RE.search(name))]
    out: dict[str, list[float]] = defaultdict(list)
    for _, t0, t1 in windows:
        step: dict[str, float] = defaultdict(float)
        for a, b, name in nested:
            outer = next((o for o in ops if t0 <= a < t1 and o.start_ns <= a and b <= o.end_ns
                          and o.scope), None)
            if outer:
                step[f"{outer.scope}/{name}"] += (b - a) * 1e-9
        for k, v in step.items():
            out[k].append(v)
    return out


@dataclass(frozen=True)
class OpTotal:
    """One XLA op of a device plane's `XLA Ops` lines, summed over a trace."""
    name: str        # the HLO instruction (`fusion.12`)
    category: str    # the event's hlo_category stat ("" where absent)
    count: int
    total_s: float
    hlo: str         # the op's HLO text, truncated


def _op_name(event_name: str) -> str:
    """An XLA op event's instruction: its name, or the name its HLO text assigns (`%fusion.12 = ..`)."""
    return event_name.partition(" = ")[0].lstrip("%")


def _xla_op_events(pd):
    """The op events of every device plane's `XLA Ops` lines."""
    for plane in pd.planes:
        if plane.name.startswith("/device:"):
            for line in plane.lines:
                if line.name == "XLA Ops":
                    yield from line.events


def op_table(path: str | Path, top: int = 12) -> list[OpTotal]:
    """The `top` device ops of a trace by total time (all device planes' `XLA Ops` lines): what an
    XLA program spends its time on, op by op. An event names its op, or (the v5e's libtpu 0.0.42)
    carries the whole HLO text `%fusion.12 = f32[..] fusion(..)` as its name; the text is also in a
    `long_name` stat on other versions."""
    acc: dict[str, list] = {}
    for ev in _xla_op_events(load_xspace(find_xplane(path))):
        stats = {k: v for k, v in ev.stats}
        text = ev.name.partition(" = ")[2]
        a = acc.setdefault(_op_name(ev.name), [str(stats.get("hlo_category", "")), 0, 0.0,
                                               (text or str(stats.get("long_name", "")))[:300]])
        a[1] += 1
        a[2] += (ev.end_ns - ev.start_ns) * 1e-9
    rows = [OpTotal(n, c, k, t, h) for n, (c, k, t, h) in acc.items()]
    return sorted(rows, key=lambda r: -r.total_s)[:top]


def xla_layer_times(path: str | Path, hlo_text: str, n_layers: int) -> tuple[dict[int, float], float, int]:
    """Per layer, the device time a step of an XLA program spends in its ops, from a trace whose
    op events are named by their HLO text alone (the v5e's libtpu) and the program's optimised
    HLO (`hlo_text`, e.g. compiled ahead of time for the chip by the same libtpu: the instruction
    names match). Ops in the entry computation run once a call (a loop over steps' own copies in
    and out) and are summed apart; loop ops are left out (their bodies' ops are events of their
    own); ops without a scope go to no layer. Returns ({layer: seconds a step}, seconds a call
    outside the step loop, steps: the trace's `decode_step` annotations)."""
    pd = load_xspace(find_xplane(path))
    instructions = list(_instructions(hlo_text))
    scopes = _scopes_of(instructions)
    entry = {name for _, is_entry, name, _ in instructions if is_entry}
    steps = sum(1 for plane in pd.planes if not plane.name.startswith("/device:")
                for line in plane.lines for ev in line.events if ev.name == STEP_NAME)
    if not steps:
        raise SpecError("trace", str(path), f"no {STEP_NAME} annotations")
    layers: dict[int, float] = defaultdict(float)
    per_call = 0.0
    for ev in _xla_op_events(pd):
        if _LOOP_OP_RE.search(ev.name):
            continue
        name = _op_name(ev.name)
        dt = (ev.end_ns - ev.start_ns) * 1e-9
        if name in entry:
            per_call += dt
        elif name in scopes:
            layers[layer_index(scopes[name], n_layers)] += dt
    return {k: v / steps for k, v in sorted(layers.items())}, per_call / steps, steps
