"""The megakernel's routed-expert column path (`megakernel.expert_columns`) alone on one packed
expert at the K3 slices' widths, against numpy: x @ the dequantised weights, per format.

Each format's error is printed as the largest |kernel - numpy| over the largest |numpy|, with
the column blocks where it exceeds 1 %. On the TPU v5e (2026-12-07) it found why the K3 slices'
int4 checks missed their bound (tokens differ, 0.06 of the logits' spread): int4 was 2 % off on
every column block with the weights packed on the chip, exact with them packed on the CPU
(`--pack-on-cpu`). The kernel was right: XLA on the chip had taken the codes from the f32 group
scale where the code asked for its bf16 rounding (`quant.quantize_jax` now rounds with
reduce_precision), so codes and stored scales disagreed. int8, mxfp4 and bf16 were exact either
way (experiments/results/tpu_v5e/calls_2026-12-07_w.log).

With the fix TP8-core int4 passed its check and TP32-core int4 did not (0.43); `--slice-weights`
unpacks every int4 expert of a slice as packed on the chip for the kernel and compares it with
the reference's dequantised expert: all equal on the v5e (calls_2026-12-07_d4.log), so the
miss was not the weights (it was one step's near-tied routing, docs/tpu.md).

    python experiments/tpu_decode_probe.py [--out FILE.json]    # on a TPU (seconds)
    python experiments/tpu_decode_probe.py --interpret           # interpret mode, on a CPU
    python experiments/tpu_decode_probe.py --slice-weights --slices k3-tp32-core   # a minute
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tpu_microbench  # noqa: E402
from perfmodel_kernels import chip, layout, quant  # noqa: E402
from perfmodel_kernels.specs import SLICES, slice_spec  # noqa: E402

V5E = chip.chip("v5e")   # the chip whose feed (bf16) and tile the probe lays the expert out for
T, BP = V5E.mxu, 8       # the tile, the input rows
FORMATS = ("int4", "int8", "mxfp4", "bf16")


def matrices(slice_name: str) -> list[tuple[int, int]]:
    """(d_in, d_out) of one routed expert's matrices on the slice, in the kernel's order."""
    return [(mm.d_in, mm.d_out) for mm in layout.expert_matmuls(slice_spec(slice_name))]


def columns_call(lay, m: int, turn: int, interpret: bool):
    """A kernel that runs expert_columns on matrix m of the expert in slot 0 until the given turn
    (`tpu_microbench.expert_loop_kernel`, one trip a turn) and returns its column blocks."""
    c = lay.shapes[m][1]
    separate = lay.rows[1] > 0
    scratch = [pltpu.VMEM((max(lay.decoded_rows(), 8), T), jnp.bfloat16),
               pltpu.VMEM((c, BP, T), jnp.float32)]
    call = tpu_microbench.pallas(
        lambda *refs: tpu_microbench.expert_loop_kernel(lay, m, separate, *refs),
        jax.ShapeDtypeStruct((c, BP, T), jnp.float32),
        [tpu_microbench.SMEM_SPEC] + [tpu_microbench.VMEM_SPEC] * (3 if separate else 2),
        tpu_microbench.VMEM_SPEC, scratch, tpu_microbench.FULL, interpret)
    return lambda *args: call(jnp.full((1,), turn + 1, jnp.int32), *args)


def probe(fmt: str, slice_name: str, interpret: bool, pack_on_cpu: bool = False,
          seed: int = 0) -> list[dict]:
    """Each matrix of one random expert at the slice's widths, packed and dequantised by
    `quant` (on the default device, or the CPU), through expert_columns at turns 0 and 1."""
    rng = np.random.default_rng(seed)
    mats = matrices(slice_name)
    lay = quant.expert_layout(fmt, T, mats, fp8=V5E.fp8)
    ws = [rng.standard_normal((i, o)).astype(np.float32) * 0.02 for i, o in mats]
    with jax.default_device(jax.devices("cpu")[0] if pack_on_cpu else None):
        codes, scales, _ = quant.pack_experts(lay, [jnp.asarray(w)[None] for w in ws])
        deqs = [w if fmt == "bf16" else quant.round_trip(w, fmt, T) for w in ws]
    codes, scales = jax.device_put((codes, scales), jax.devices()[0])
    out = []
    for m, ((d_in, d_out), w) in enumerate(zip(mats, ws)):
        r, c = lay.shapes[m]
        x = (rng.standard_normal((BP, r * T)) * (np.arange(r * T) < d_in)).astype(np.float32)
        xb = jnp.asarray(x, jnp.bfloat16)
        w_bf16 = np.asarray(jnp.asarray(deqs[m], jnp.bfloat16), np.float32)
        want = np.asarray(xb, np.float32)[:, :d_in] @ w_bf16
        for turn in (0, 1):
            args = (codes, scales, xb) if scales is not None else (codes, xb)
            ys = np.asarray(columns_call(lay, m, turn, interpret)(*args))
            got = np.concatenate(list(ys), axis=1)[:, :d_out]
            err = np.abs(got - want)
            col_err = np.pad(err, ((0, 0), (0, c * T - d_out))).reshape(BP, c, T).max(axis=(0, 2))
            bad = [int(j) for j in np.nonzero(col_err > 1e-2 * np.abs(want).max())[0]]
            rec = {"format": fmt, "slice": slice_name, "matrix": m, "tiles": [r, c],
                   "column_group": lay.column_group(m), "chunk": lay.fmt.chunk, "turn": turn,
                   "error": float(err.max() / np.abs(want).max()), "bad_columns": bad[:16],
                   "n_bad_columns": len(bad)}
            print(f"{fmt:6s} {slice_name} matrix {m} ({r} x {c} tiles, {lay.column_group(m)} "
                  f"column(s) a pass, chunk {lay.fmt.chunk}) turn {turn}: error "
                  f"{rec['error']:.2e}, {len(bad)} of {c} column blocks off"
                  + (f": {bad[:16]}" if bad else ""), flush=True)
            out.append(rec)
    return out


def unpacked_int4(lay, codes, scales, m: int, d_in: int, d_out: int) -> np.ndarray:
    """Matrix m of int4 experts as the kernel stores them (codes [E, rows, T] int8, two a byte;
    bf16 scales [E, scale rows, T]) -> the weights [E, d_in, d_out] f32 they stand for (code x
    its group's scale, as `quant.scaled_operand` forms them before the bf16 rounding)."""
    f, (r, c), t = lay.fmt, lay.shapes[m], lay.fmt.t
    e, g = codes.shape[0], f.scale_rows
    rows = np.asarray(codes[:, lay.first_tile(m) * f.code_rows:(lay.first_tile(m) + r * c) * f.code_rows])
    n = rows.astype(np.int32).reshape(e, c, r, t // 2, t)
    vals = np.concatenate([(n << 28) >> 28, n >> 4], axis=3)       # [E, c, r, T, T]
    first = lay.scale_first_row(m)
    sc = np.asarray(jnp.asarray(scales[:, first:first + c * r * g], jnp.float32)).reshape(e, c, r, g, 1, t)
    w = (vals.reshape(e, c, r, g, t // g, t) * sc).reshape(e, c, r * t, t)
    return w.transpose(0, 2, 1, 3).reshape(e, r * t, c * t)[:, :d_in, :d_out]


def slice_weights(slice_name: str, fmt: str = "int4") -> list[dict]:
    """The whole slice's routed experts as the K3 check builds them on the default device (seed
    0): packed for the kernel (`layout.pack_weights`) and unpacked here, against the reference's
    dequantised experts (`quant.dequantized_experts`), per MoE layer and matrix: the largest
    difference over the largest weight, and the experts whose difference exceeds 1 % of it."""
    import tpu_megakernel
    from perfmodel_kernels import reference
    if fmt != "int4":
        raise ValueError(f"--slice-weights: format {fmt!r} not unpacked here; int4 only")
    spec = slice_spec(slice_name, fmt)
    cfg = tpu_megakernel.kernel_cfg(spec, 1, interpret=False)   # the check's ring and tile
    w = reference.init_weights(spec, 0)
    packed = layout.pack_weights(w, cfg)
    lay = layout.expert_layout(spec, cfg)
    mms = layout.expert_matmuls(spec)
    out, mo = [], 0
    for li, (layer, lw) in enumerate(zip(spec.layers, w["layers"])):
        if layer.ffn != "moe":
            continue
        for m, mm in enumerate(mms):
            ref = np.asarray(jnp.asarray(quant.dequantized_experts(lw[mm.name], fmt, cfg.tile), jnp.float32))
            got = unpacked_int4(lay, packed.experts[mo], packed.expert_scales[mo], m, mm.d_in, mm.d_out)
            got = np.asarray(jnp.asarray(got, jnp.bfloat16), np.float32)
            err = np.abs(got - ref).max(axis=(1, 2))
            top = float(np.abs(ref).max())
            bad = [int(e) for e in np.nonzero(err > 1e-2 * top)[0]]
            rec = {"slice": slice_name, "format": fmt, "layer": li, "matrix": m, "name": mm.name,
                   "error": float(err.max() / top), "bad_experts": bad[:16], "n_bad_experts": len(bad),
                   "experts": int(err.shape[0])}
            print(f"{slice_name} {fmt} layer {li} {mm.name}: error {rec['error']:.2e}, {len(bad)} of "
                  f"{err.shape[0]} experts off" + (f": {bad[:16]}" if bad else ""), flush=True)
            out.append(rec)
        mo += 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU)")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"of {', '.join(FORMATS)}")
    ap.add_argument("--slices", default="k3-tp32-core,k3-tp8-core",
                    help=f"MoE slices of {', '.join(SLICES)}")
    ap.add_argument("--pack-on-cpu", action="store_true",
                    help="quantise, pack and dequantise on the CPU (the kernel runs on the TPU)")
    ap.add_argument("--slice-weights", action="store_true",
                    help="instead: each slice's whole int4 experts packed for the kernel against the "
                         "reference's dequantised ones (no kernel runs)")
    ap.add_argument("--out", help="write the records here as JSON")
    a = ap.parse_args(argv)
    slices, fmts = a.slices.split(","), a.formats.split(",")
    moe = [s for s in SLICES if "moe" in SLICES[s]]
    for s in slices:
        if s not in moe:
            ap.error(f"--slices: {s!r} is not a MoE slice; known: {', '.join(moe)}")
    for f in fmts:
        if f not in FORMATS:
            ap.error(f"--formats: unknown format {f!r}; known: {', '.join(FORMATS)}")
    if a.slice_weights:
        recs = [r for s in slices for r in slice_weights(s)]
    else:
        recs = [r for s in slices for f in fmts for r in probe(f, s, a.interpret, a.pack_on_cpu)]
    if a.out:
        Path(a.out).write_text(json.dumps({"device": jax.devices()[0].device_kind,
                                           "jax": jax.__version__, "pack_on_cpu": a.pack_on_cpu,
                                           "records": recs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
