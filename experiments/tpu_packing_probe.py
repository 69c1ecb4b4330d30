"""Which rows share a 32-bit word when a Pallas TPU kernel bitcasts packed dtypes, on the chip
it runs on (`pltpu.bitcast` along the second-minor dimension).

Interpret mode defines the bitcast as consecutive rows packed little-endian: word row a of an
int32 view of int8 holds rows 4a..4a+3 (row 4a in the low byte), of bf16 rows 2a and 2a+1. A
kernel that builds bf16 weights as integer words on the vector unit (MXFP4 decoded two weights a
word) relies on that pairing; on a TPU v5e such a kernel matched the reference in interpret mode
and not on the chip (experiments/results/tpu_v5e/calls_2026-12-06g_w.log). This probe sends rows
numbered by their index through each bitcast on the chip and prints the pairing it finds. On the
lent TPU v5e (JAX 0.10.2, libtpu 0.0.42.1) it is the one interpret mode defines, in all three
cases (experiments/results/tpu_v5e/packing_probe_2026-12-06.json): the pairing is not the fault.

    python experiments/tpu_packing_probe.py [--out FILE.json]     # on a TPU (seconds)
    python experiments/tpu_packing_probe.py --interpret            # interpret mode, on a CPU
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

VMEM = pl.BlockSpec(memory_space=pltpu.VMEM)


def bitcast_call(shape, src, dst, interpret: bool):
    """A kernel that returns its input [shape] src bitcast to dst."""
    rows = shape[0] * jnp.dtype(src).itemsize // jnp.dtype(dst).itemsize

    def kernel(x_ref, o_ref):
        o_ref[...] = pltpu.bitcast(x_ref[...], dst)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((rows, shape[1]), dst),
                          in_specs=[VMEM], out_specs=VMEM,
                          interpret=pltpu.InterpretParams() if interpret else False)


def pairing(n_in: int, src, dst, interpret: bool) -> list[list[int]]:
    """Per word row of the wider view (or per row pair of the narrower one): the input rows it
    holds, lowest bits first, read from lane 0 (every lane holds the same row number)."""
    lanes = 128
    if jnp.dtype(src).itemsize < jnp.dtype(dst).itemsize:     # narrow rows into words
        x = np.repeat(np.arange(n_in)[:, None], lanes, 1).astype(src)
        words = np.asarray(bitcast_call(x.shape, src, dst, interpret)(jnp.asarray(x)))
        per = jnp.dtype(dst).itemsize // jnp.dtype(src).itemsize
        parts = words[:, :1].view(src).reshape(-1, per) if per > 1 else words[:, :1]
        return [[int(v) for v in row] for row in parts.astype(np.float64)]
    # words into narrow rows: word row a carries its number in each part (part k: a * per + k)
    per = jnp.dtype(src).itemsize // jnp.dtype(dst).itemsize
    tags = np.arange(n_in * per).reshape(n_in, per).astype(dst)          # the parts' values
    x = np.repeat(tags.view(src), lanes, 1)                                # [n_in, lanes] words
    rows = np.asarray(bitcast_call(x.shape, src, dst, interpret)(jnp.asarray(x)))[:, 0]
    return [[int(rows[r]) for r in range(a * per, (a + 1) * per)] for a in range(n_in)]


CASES = [("int8 rows into int32 words", 64, np.int8, np.int32),
         ("bf16 rows into int32 words", 32, jnp.bfloat16, np.int32),
         ("int32 words into bf16 rows", 16, np.int32, jnp.bfloat16)]


def interpret_semantics(n_in: int, src, dst) -> list[list[int]]:
    """What interpret mode defines: consecutive rows, lowest bits first."""
    a, b = jnp.dtype(src).itemsize, jnp.dtype(dst).itemsize
    per = b // a if a < b else a // b
    n = n_in // per if a < b else n_in
    return [list(range(w * per, (w + 1) * per)) for w in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (no TPU)")
    ap.add_argument("--out", help="write the pairings as JSON")
    a = ap.parse_args(argv)
    if not a.interpret and jax.devices()[0].platform != "tpu":
        print("tpu_packing_probe: no TPU attached; run with --interpret for interpret mode's "
              "semantics", file=sys.stderr)
        return 2
    where = "interpret mode" if a.interpret else jax.devices()[0].device_kind
    out = {"device": where, "jax": jax.__version__, "cases": []}
    for name, n, src, dst in CASES:
        got = pairing(n, src, dst, a.interpret)
        same = got == interpret_semantics(n, src, dst)
        out["cases"].append({"case": name, "pairing": got, "as_interpret_mode": same})
        print(f"{where}: {name}: the first words hold {got[:4]}; as interpret mode defines: "
              f"{'yes' if same else 'NO'}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
