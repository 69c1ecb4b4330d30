"""The XLA reference's optimised HLO for a TPU, compiled ahead of time (no chip needed):

    python experiments/xla_reference_hlo.py [--slice k3-tp32-core] [--batches 1,8,64] [--chip v5e]

`reference.make_loop()` (the program `tpu_megakernel.py` times and traces) is lowered for one
chip of `--chip` with JAX's ahead-of-time path and compiled by libtpu, at the shapes the chip's
runs use (context 2048), and its HLO after optimisations is written gzipped to
experiments/results/tpu_<chip>/xla_<slice>_b<B>.hlo.txt.gz. The same libtpu as on the chip
(0.0.42.1 with JAX 0.10.2 here: `make test-oldest`'s environment) gives the same instruction
names, so a trace whose ops carry only their HLO text (`--only xla_trace --keep-xla-traces`) can
be read per layer: `perfmodel.validate.traces.xla_layer_times`, in `validate_tpu.py`. The HLO
must be of the traced program: the committed files are the loop's before it kept each step's
picks, and a trace of the loop since then needs the HLO this script writes at its commit.
"""
from __future__ import annotations

import argparse
import gzip
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONTEXT = 2048   # tpu_megakernel.py's MLA cache capacity


def reference_hlo(slice_name: str, batch: int, chip: str) -> str:
    """The optimised HLO text of reference.make_loop() for `slice_name` at `batch` on `chip`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding
    from perfmodel_kernels import aot, reference
    from perfmodel_kernels.specs import slice_spec
    spec = slice_spec(slice_name)
    sharding = SingleDeviceSharding(aot.device(chip))
    shaped = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)  # noqa: E731
    weights = jax.tree_util.tree_map(shaped, jax.eval_shape(lambda: reference.init_weights(spec, 0)))
    cache = jax.tree_util.tree_map(shaped, jax.eval_shape(lambda: reference.init_cache(spec, batch, CONTEXT)))
    rows = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=sharding)
    steps = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)
    lowered = reference.make_loop().trace(weights, cache, rows, rows, steps).lower(lowering_platforms=("tpu",))
    return lowered.compile().as_text()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slice", default="k3-tp32-core")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--chip", default="v5e")
    a = ap.parse_args(argv)
    from perfmodel_kernels import aot
    if not aot.available():
        print("xla_reference_hlo: needs libtpu (pip install 'jax[tpu]'; make test-oldest's environment has it)",
              file=sys.stderr)
        return 2
    out = ROOT / "experiments" / "results" / f"tpu_{a.chip}"
    for b in (int(x) for x in a.batches.split(",")):
        t0 = time.perf_counter()
        path = out / f"xla_{a.slice}_b{b}.hlo.txt.gz"
        text = reference_hlo(a.slice, b, a.chip).replace(f"{ROOT}/", "")  # its stack frames' files
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
        print(f"batch {b}: {path.relative_to(ROOT)} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
