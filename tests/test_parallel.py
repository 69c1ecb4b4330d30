"""The megakernel on a mesh of virtual CPU devices (one pallas_call per device under shard_map,
collectives as remote DMAs) against the single-device reference, in Pallas TPU interpret mode
with race detection.

Each case runs in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the
flag must be set before JAX starts, and the other tests run on one device). The spec is MINI
with 8 KDA and 8 MLA heads so that every sharded width divides by 8. Layout names: "TPn" =
attention, dense FFN, shared experts and lm_head split over n devices; "xEPg" = routed experts
owned by g groups of n/g devices each (each expert's width split over its group).

Tolerances as tests/test_megakernel.py (bf16 operands, f32 accumulation): the device-local
partial sums and the collectives' summation order differ from XLA's single dot in the last f32
bits, which can flip one bf16 rounding of a later matmul operand.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

ATOL, RTOL, MARGIN = 5e-2, 2e-2, 0.1


def check(tp: int, ep: int, hierarchical: bool, steps: int, rows: int = 1) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interp_state

    from kernels import layout, parallel, reference
    from perfmodel.spec.arch import derive

    spec = derive("kimi-k3-mini", kda={"heads": 8}, mla={"heads": 8})
    weights = reference.init_weights(spec, 0)
    cfg = layout.KernelConfig(batch=2, max_context=32, depth=3, expert_slots=2, cache_block=8,
                              hierarchical=hierarchical, rows=rows)
    dspec, step = parallel.make_step(spec, cfg, tp, ep,
                                     pltpu.InterpretParams(detect_races=True, on_race="warn"))
    packed = parallel.pack(weights, cfg, dspec)
    tokens, positions = jnp.array([3, 7], jnp.int32), jnp.array([5, 9], jnp.int32)
    accepted = None
    if rows > 1:  # a verify block; the second sequence keeps none of its rows
        tokens = (tokens[:, None] + 5 * jnp.arange(rows)) % spec.vocab
        accepted = jnp.array([rows - 1, 0], jnp.int32)
    r_cache = reference.init_cache(spec, 2, 32)
    k_cache = parallel.shard_cache(reference.init_cache(spec, 2, 32), dspec)
    for _ in range(steps):
        r_next, r_logits, r_cache = reference.decode_step(weights, r_cache, tokens, positions,
                                                          accepted)
        k_next, k_logits, k_cache, distinct = step(packed, k_cache, tokens, positions, accepted)
        jax.block_until_ready(k_logits)
        assert not interp_state.races.races_found
        np.testing.assert_allclose(k_logits, r_logits, atol=ATOL, rtol=RTOL)
        top2 = np.sort(np.asarray(r_logits), axis=-1)[..., -2:]
        clear = top2[..., 1] - top2[..., 0] > MARGIN
        np.testing.assert_array_equal(np.asarray(k_next)[clear], np.asarray(r_next)[clear])
        got = parallel.unshard_cache(k_cache, dspec)
        for name in r_cache:
            np.testing.assert_allclose(np.asarray(got[name], np.float32),
                                       np.asarray(r_cache[name], np.float32),
                                       atol=ATOL, rtol=RTOL, err_msg=name)
        # every device of an expert group fetches the group's picked experts
        d = np.asarray(distinct)
        groups = d.reshape(ep, tp // ep, -1)
        assert (groups == groups[:, :1]).all()
        tokens, positions = r_next, positions + (1 if rows == 1 else accepted)
    print("ok")


def run_case(tp, ep, hierarchical=False, steps=1, rows=1):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, __file__, str(tp), str(ep), str(int(hierarchical)),
                          str(steps), str(rows)], env=env, capture_output=True, text=True,
                         timeout=3000)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_tp2_matches_reference():
    run_case(2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,hierarchical", [
    (8, 8, False),   # TP8: each expert on one device
    (8, 4, False),   # TP2 x EP4: experts in 4 groups of 2 devices
    (8, 2, False),   # TP4 x EP2: experts in 2 groups of 4 devices
    (8, 8, True),    # TP8 with sibling-core-first all-reduce
    (4, 4, True),
], ids=["TP8", "TP2xEP4", "TP4xEP2", "TP8-hierarchical", "TP4-hierarchical"])
def test_mesh_matches_reference(tp, ep, hierarchical):
    run_case(tp, ep, hierarchical)


@pytest.mark.slow
def test_tp4_ep2_verify_rows_match_reference():
    """Verify blocks of 3 rows (one sequence keeps 2, the other none) on TP4 x EP2."""
    run_case(4, 2, rows=3, steps=2)


@pytest.mark.slow
def test_run_cli_on_virtual_devices():
    out = subprocess.run([sys.executable, "-m", "kernels.run", "--devices", "2", "--ep", "1",
                          "--batch", "2", "--steps", "1", "--context", "16", "--depth", "3",
                          "--interpret"], capture_output=True, text=True, timeout=3000,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "on 2 device(s)" in out.stdout and "collective receive buffers" in out.stdout
    assert "DMA plan of step 1" in out.stdout and "timings are not measured" in out.stdout


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    check(int(sys.argv[1]), int(sys.argv[2]), bool(int(sys.argv[3])), int(sys.argv[4]),
          int(sys.argv[5]))
