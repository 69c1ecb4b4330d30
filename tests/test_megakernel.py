"""The Pallas megakernel against the pure-JAX reference, in Pallas TPU interpret mode on CPU with
race detection on, for the MINI configuration derived from kimi-k3 (dense first layer, KDA and
MLA attention, 16-expert latent MoE with shared experts).

Tolerances (bf16 weights, f32 accumulation, f32 elementwise math in both): the kernel sums a
matmul tile by tile (f32 partial sums over 128-row tiles) where XLA sums in one dot, so f32
results differ in the last bits; whenever such a value is cast to bf16 as the next matmul's
operand (relative step 2^-8 = 0.39 %) the rounding may differ by one bf16 ulp, and these flips
propagate through ~20 matmuls. Observed worst cases on MINI are about 1.5e-2 absolute on logits
of magnitude ~4 and one bf16 ulp on cached latents. We allow |kernel - reference| <= 5e-2 +
2e-2 |reference| for logits and states (several ulps of bf16 at these magnitudes, still two
orders of magnitude below the logits' spread), and require the greedy tokens to agree wherever
the reference's top-2 logit margin exceeds 0.1.
"""
import base64
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interp_state

from perfmodel_kernels import chip, layout, megakernel, plan, reference, vmem
from perfmodel_kernels.specs import ODD_SIZED
from perfmodel.spec.arch import derive
from perfmodel.util.errors import SpecError

ATOL, RTOL, MARGIN = 5e-2, 2e-2, 0.1
CONTEXT = 32


def reference_distinct(spec, weights, cache, tokens, positions, accepted=None):
    """Distinct experts picked per MoE layer by the reference (same phases as its step)."""
    flat, positions, accepted, rows = reference.verify_inputs(
        len(positions), tokens, positions, accepted)
    x, out = reference.embed(weights, flat), []
    for layer, lw in zip(spec.layers, weights["layers"]):
        x, cache = reference.attention(spec, layer, lw, cache, x, positions, accepted, rows)
        if layer.ffn == "moe":
            h = reference.rms_norm(x, lw["ffn_norm"])
            _, ids = reference.route(reference.mm(h, lw["router"]), lw["router_bias"],
                                     spec.moe.top_k)
            out.append(len(np.unique(np.asarray(ids))))
        x = reference.ffn(spec, layer, lw, x)
    return out


def run_both(spec, weights, cfg, steps, seed=1, reference_weights=None):
    """Teacher-forced decode: both engines get the reference's tokens; checks every step.
    reference_weights: what the reference runs (default `weights`; quantised experts: their
    dequantised values). cfg.rows > 1: verify blocks of seeded random tokens (a stand-in
    drafter) with a seeded accepted count per sequence in [0, rows] (0 and rows both occur
    over the steps); positions advance by the accepted rows."""
    packed = layout.pack_weights(weights, cfg)
    weights = weights if reference_weights is None else reference_weights
    rng = np.random.default_rng(seed)
    rows = cfg.rows
    shape = (cfg.batch,) if rows == 1 else (cfg.batch, rows)
    tokens = jnp.asarray(rng.integers(0, spec.vocab, shape), jnp.int32)
    positions = jnp.asarray(rng.integers(0, CONTEXT - (steps + 1) * rows, cfg.batch), jnp.int32)
    r_cache = reference.init_cache(spec, cfg.batch, CONTEXT)
    k_cache = reference.init_cache(spec, cfg.batch, CONTEXT)
    interpret = pltpu.InterpretParams(detect_races=True)
    for step in range(steps):
        accepted = None if rows == 1 else \
            jnp.asarray((np.arange(cfg.batch) + step * 3) % (rows + 1), jnp.int32)
        want_distinct = reference_distinct(spec, weights, r_cache, tokens, positions, accepted)
        r_next, r_logits, r_cache = reference.decode_step(weights, r_cache, tokens, positions,
                                                          accepted)
        k_next, k_logits, k_cache, distinct = megakernel.decode_step(
            spec, cfg, packed, k_cache, tokens, positions, accepted, interpret=interpret)
        assert not interp_state.races.races_found
        assert k_logits.shape == r_logits.shape and k_next.shape == r_next.shape
        np.testing.assert_allclose(k_logits, r_logits, atol=ATOL, rtol=RTOL)
        top2 = np.sort(np.asarray(r_logits), axis=-1)[..., -2:]
        clear = top2[..., 1] - top2[..., 0] > MARGIN
        np.testing.assert_array_equal(np.asarray(k_next)[clear], np.asarray(r_next)[clear])
        for name in r_cache:
            np.testing.assert_allclose(np.asarray(k_cache[name], np.float32),
                                       np.asarray(r_cache[name], np.float32),
                                       atol=ATOL, rtol=RTOL, err_msg=name)
        assert [int(d) for d in distinct] == want_distinct
        if rows == 1:
            tokens, positions = r_next, positions + 1
        else:
            tokens = jnp.asarray(rng.integers(0, spec.vocab, shape), jnp.int32)
            positions = positions + accepted
    return distinct


# (batch, depth, slots, steps, bank rows, chip, tile); MINI's stream is 52 banks of 256 rows at
# TPU7x's 256 lanes (13 a layer), so depth 1 waits for every bank, 14 prefetches across layers,
# 60 holds the stream; v5e's MXU is 128 wide (twice the banks, 8-row bf16 tiles)
CASES = [(2, 3, 4, 2, 256, "7x", 256),
         (3, 4, 2, 2, 256, "v5e", 128),
         pytest.param(1, 1, 1, 2, 256, "7x", 256, marks=pytest.mark.slow),
         pytest.param(4, 14, 2, 1, 512, "7x", 256, marks=pytest.mark.slow),
         pytest.param(8, 60, 3, 1, 1024, "7x", 256, marks=pytest.mark.slow),
         pytest.param(3, 5, 2, 1, 512, "7x", 512, marks=pytest.mark.slow),
         pytest.param(8, 8, 3, 1, 1024, "v5e", 128, marks=pytest.mark.slow)]


@pytest.mark.parametrize("batch,depth,slots,steps,bank_rows,target,tile", CASES)
def test_megakernel_matches_reference(spec, weights, batch, depth, slots, steps, bank_rows,
                                      target, tile):
    cfg = layout.KernelConfig(batch=batch, max_context=CONTEXT, depth=depth,
                              expert_slots=slots, tile=tile, cache_block=16, bank_rows=bank_rows,
                              chip=target)
    run_both(spec, weights, cfg, steps)


# (batch, rows, steps): verify blocks; accepted counts cycle through 0..rows per sequence
ROWS = [(3, 4, 2), pytest.param(2, 8, 2, marks=pytest.mark.slow),
        pytest.param(5, 2, 2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("batch,rows,steps", ROWS)
def test_verify_rows_match_reference(spec, weights, batch, rows, steps):
    """Verify blocks (causal within the block, caches / KDA state updated by the accepted rows
    only) against the reference, race detection on."""
    cfg = layout.KernelConfig(batch=batch, max_context=CONTEXT, depth=4, expert_slots=3,
                              cache_block=16, rows=rows)
    run_both(spec, weights, cfg, steps, seed=7)


@pytest.mark.slow
def test_megakernel_many_steps_batch8(spec, weights):
    cfg = layout.KernelConfig(batch=8, max_context=CONTEXT, depth=30, expert_slots=4,
                              cache_block=16)
    run_both(spec, weights, cfg, steps=3, seed=3)


@pytest.mark.slow
def test_megakernel_odd_sized_spec():
    """Widths that do not fill 128-wide tiles (transposed tails, bank gaps), 6 layers, 32
    experts top-6."""
    spec = derive("kimi-k3", **ODD_SIZED)
    cfg = layout.KernelConfig(batch=3, max_context=CONTEXT, depth=7, expert_slots=3,
                              cache_block=16, bank_rows=384)
    run_both(spec, reference.init_weights(spec, seed=2), cfg, steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("layers", [
    dict(layers=2, attention={"default": "kda", "mla_layers": [1]},
         ffn={"dense_layers": [1, 2], "dense_width": 256}),         # no MoE layer
    dict(layers=2, attention={"default": "mla"}, ffn={"dense_layers": []}),  # MLA + MoE only
], ids=["no-moe", "mla-moe-only"])
def test_megakernel_other_layer_mixes(layers):
    spec = derive("kimi-k3", **(ODD_SIZED | layers))
    cfg = layout.KernelConfig(batch=2, max_context=CONTEXT, depth=3, cache_block=16)
    run_both(spec, reference.init_weights(spec, seed=3), cfg, steps=2)


def test_plan_matches_kernel_counts(spec, weights):
    """The plan for the kernel's own distinct-expert counts moves exactly those experts."""
    cfg = layout.KernelConfig(batch=2, max_context=CONTEXT, depth=3, expert_slots=4,
                              cache_block=16)
    distinct = run_both(spec, weights, cfg, steps=1, seed=5)
    p = plan.dma_plan(spec, cfg, [int(d) for d in distinct])
    routed = [c for c in p if c.routed]
    assert sum(c.bytes for c in routed) == int(sum(distinct)) * sum(
        layout.expert_layout(spec, cfg).bytes())
    assert all(c.family == "routed_expert" for c in routed)


def test_vmem_budget_refuses_oversized_ring(spec):
    cfg = layout.KernelConfig(batch=8, max_context=CONTEXT, depth=512, cache_block=16)
    with pytest.raises(SpecError) as e:
        vmem.check_vmem(spec, cfg)
    msg = str(e.value)
    budget = sum(b.bytes for b in vmem.buffers(spec, cfg))
    excess = budget - (cfg.target.vmem_bytes - vmem.MARGIN_BYTES)
    assert e.value.field == "vmem" and "weight ring" in msg and f"{excess:,} B too many" in msg
    assert "for the compiler" in msg


def test_vmem_budget_counts_what_mosaic_held_for_the_kda_update():
    """Compiled ahead of time for a v5e, the TP8-core slice at batch 8 with 8 banks of 32768 rows
    ran out of VMEM (Mosaic used 132.5 MiB of 128): the budget refuses it, counting about two
    more KDA states a batch row for the recurrence's update; with 6 such banks it fits."""
    from perfmodel_kernels.specs import slice_spec
    tp8 = slice_spec("k3-tp8-core", "mxfp4")
    cfg = lambda depth: layout.KernelConfig(batch=8, max_context=2048, depth=depth,  # noqa: E731
                                            expert_slots=2, cache_block=256, bank_rows=32768, chip="v5e")
    with pytest.raises(SpecError, match="vmem"):
        vmem.check_vmem(tp8, cfg(8))
    fits = vmem.check_vmem(tp8, cfg(6))
    extra = next(b for b in fits.buffers if "intermediates" in b.name)
    assert extra.bytes == 2 * 8 * 12 * 128 * 128 * 4   # two f32 [batch, heads, dk, dv] states


def test_vmem_budget_keeps_the_compiler_margin(spec):
    """A configuration that fits the chip's whole VMEM but not VMEM less the margin is refused;
    the margin is the 6 MiB Inferact's TPU7x kernel leaves (explicit buffers <= 58 MiB)."""
    assert vmem.MARGIN_BYTES == (64 - 58) << 20
    cfg = layout.KernelConfig(batch=1, max_context=CONTEXT, depth=2, cache_block=16)
    fits = vmem.check_vmem(spec, cfg)
    assert fits.total_bytes < fits.limit_bytes == fits.capacity_bytes - vmem.MARGIN_BYTES
    with pytest.raises(SpecError, match="too many"):
        vmem.check_vmem(spec, cfg, capacity_bytes=fits.total_bytes + vmem.MARGIN_BYTES - 1)
    assert vmem.check_vmem(spec, cfg, capacity_bytes=fits.total_bytes + vmem.MARGIN_BYTES)
    for field in ("depth", "expert_slots", "bank_rows"):
        with pytest.raises(SpecError) as e:
            layout.KernelConfig(batch=1, **{field: 0})
        assert e.value.field == field and "0" in str(e.value)
    with pytest.raises(SpecError, match="bank_rows"):
        layout.KernelConfig(batch=1, bank_rows=200)


def test_embedding_rows_are_picked_exactly(spec, weights):
    """The table is 2-D, its vocabulary padded with zero rows to whole bf16 tiles; a token's row
    picked from the tile it is copied in is its bf16 row bit for bit (signed zeros, every
    finite pattern), the padding rows zero."""
    assert layout.embed_rows(derive("kimi-k3-mini", vocab=1001)) == 1008
    packed = layout.pack_weights(weights, layout.KernelConfig(batch=1, cache_block=16))
    rows = layout.embed_rows(spec)
    assert packed.embed.shape == (rows, spec.hidden) and rows % chip.tile_rows(jnp.bfloat16) == 0
    bp, n, h, tile = 8, 6, 256, chip.tile_rows(jnp.bfloat16)
    bits = np.random.default_rng(0).integers(0, 1 << 16, (bp, tile, h), dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0x8000   # no inf / NaN; -0.0 instead
    tok = np.array([0, 15, 16, 37, rows - 1, 9, 0, 0], np.int32)

    def kernel(tok_ref, tiles_ref, out_ref):
        out_ref[...] = megakernel.pick_rows(tok_ref, tiles_ref, n)
    got = pl.pallas_call(kernel, jax.ShapeDtypeStruct((bp, h), jnp.float32),
                         in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                                   pl.BlockSpec(memory_space=pltpu.VMEM)],
                         interpret=pltpu.InterpretParams())(tok, bits.view(jnp.bfloat16))
    want = np.zeros((bp, h), np.float32)
    want[:n] = bits.view(jnp.bfloat16)[np.arange(n), tok[:n] % tile].astype(np.float32)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))


def test_padded_bytes_follow_tpu_tiling():
    tpu7x, v5e = chip.chip("7x"), chip.chip("v5e")
    assert vmem.padded_bytes((8, 1, 256), jnp.bfloat16, tpu7x) == 8 * 16 * 256 * 2
    assert vmem.padded_bytes((8, 1, 256), jnp.bfloat16, v5e) == 8 * 8 * 256 * 2
    for target in (tpu7x, v5e):
        assert vmem.padded_bytes((3, 100), jnp.float32, target) == 8 * 128 * 4
        assert vmem.padded_bytes((16,), jnp.int32, target) == 8 * 128 * 4


def test_bad_inputs_raise_spec_error(spec, weights):
    cfg = layout.KernelConfig(batch=2, max_context=CONTEXT, cache_block=16)
    packed = layout.pack_weights(weights, cfg)
    cache = reference.init_cache(spec, 2, CONTEXT)
    with pytest.raises(SpecError, match="tokens.shape"):
        megakernel.decode_step(spec, cfg, packed, cache, jnp.zeros(3, jnp.int32),
                               jnp.zeros(2, jnp.int32))
    with pytest.raises(SpecError, match="positions"):
        megakernel.decode_step(spec, cfg, packed, cache, jnp.zeros(2, jnp.int32),
                               jnp.array([0, CONTEXT], jnp.int32))
    with pytest.raises(SpecError, match="tokens"):
        megakernel.decode_step(spec, cfg, packed, cache, jnp.array([0, spec.vocab], jnp.int32),
                               jnp.zeros(2, jnp.int32))
    with pytest.raises(SpecError, match="max_context"):
        layout.KernelConfig(batch=1, max_context=30, cache_block=16)
    with pytest.raises(SpecError, match="tile"):
        layout.KernelConfig(batch=1, tile=100)
    with pytest.raises(SpecError, match="MXU width"):  # 128 lanes but half the TPU7x MXU
        vmem.check_vmem(spec, layout.KernelConfig(batch=1, tile=384, chip="7x"))
    assert vmem.check_vmem(spec, layout.KernelConfig(batch=1, tile=128, chip="v5e"))
    with pytest.raises(SpecError, match="chip"):
        layout.KernelConfig(batch=1, chip="v99")
    with pytest.raises(SpecError, match="wire"):
        layout.KernelConfig(batch=1, wire="f16")


@pytest.mark.parametrize("rows", [1, 4])
def test_kernel_lowers_to_mosaic_for_tpu7x(spec, weights, rows):
    """Without a TPU, export the step for TPU7x (one row per sequence, and verify blocks of 4):
    every op of the kernel body must have a Pallas TPU (Mosaic) lowering, and the named scopes
    become trace markers in the Mosaic module. (Mosaic's own layout passes run only on a TPU
    host.)"""
    cfg = layout.KernelConfig(batch=4, max_context=CONTEXT, depth=6, cache_block=16, rows=rows,
                              bank_rows=256)
    packed = layout.pack_weights(weights, cfg)
    cache = reference.init_cache(spec, cfg.batch, CONTEXT)
    z = jnp.zeros(cfg.batch, jnp.int32)
    step = jax.jit(lambda p, c, t, q: megakernel.make_step(spec, cfg)(
        p, c, jnp.broadcast_to(t[:, None], (cfg.batch, rows)) if rows > 1 else t, q))
    tpu = AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=tpu)):
        exported = export.export(step, platforms=["tpu"])(packed, cache, z, z)
    text = exported.mlir_module()
    assert text.count("tpu_custom_call") == 1
    body = base64.b64decode(re.search(r'\\22body\\22: \\22([A-Za-z0-9+/=]+)', text).group(1))
    markers = {m.decode() for m in re.findall(rb"layer/\w+|\w+", body)}
    assert {"embed", "head", "router", "experts", "layer/attention", "layer/ffn", "norm",
            "vector_start", "write_back_wait", "state_store", "core", "tile_wait", "window",
            "window_wait"} <= markers


def test_trace_does_not_grow_with_layers():
    """The layer loop is traced once per kind: 4 and 64 layers give kernel jaxprs within 10 %."""
    cfg = layout.KernelConfig(batch=2, max_context=CONTEXT, depth=3, cache_block=16)
    sizes = []
    for n in (4, 64):
        spec = derive("kimi-k3-mini", layers=n,
                      attention={"default": "kda", "mla_layers": list(range(4, n + 1, 4))})
        sizes.append(megakernel.kernel_equations(spec, cfg))
    assert abs(sizes[1] - sizes[0]) <= 0.1 * sizes[0], sizes


@pytest.mark.slow
def test_tpu_script_smoke_on_cpu(tmp_path):
    """The TPU VM script's whole pipeline in interpret mode on MINI (`--dry-run`): checks, speed
    runs of kernel and XLA reference, sweeps and a trace, each recorded as it comes, a note that
    its timings are not TPU timings, and `--report` reprints the table from the file."""
    import json
    import subprocess
    import sys
    root = __file__.rsplit("/tests/", 1)[0]
    path = tmp_path / "tpu_megakernel.json"
    out = subprocess.run([sys.executable, "experiments/tpu_megakernel.py", "--dry-run",
                          "--out", str(path)], capture_output=True, text=True, timeout=3000,
                         cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(path.read_text())
    assert "interpret mode" in res["note"]
    kinds = {r["kind"] for r in res["runs"]}
    assert {"check", "packing", "megakernel", "xla", "trace"} <= kinds
    assert all(r["tokens_equal"] and r["config"]["expert_slots"] >= 1
               for r in res["runs"] if r["kind"] == "check")
    assert any(r.get("sweep") for r in res["runs"])
    assert all(r["plan_bytes"] > 0 for r in res["runs"] if r["kind"] == "megakernel")
    assert len(res["kernel_source"]) == 12 and all(r["kernel_source"] == res["kernel_source"] for r in res["runs"])
    # a speed run keeps the picks of each step its slope spans (one in interpret mode), the last
    # its `distinct_experts`: the validation predicts their mean
    timed = [r for r in res["runs"] if r["kind"] in ("megakernel", "xla")]
    assert timed and all(len(r["distinct_experts_steps"]) == 1 and r["distinct_experts_steps"][-1]
                         == r["distinct_experts"] and len(r["distinct_experts"]) == 3 for r in timed)
    # a parsed trace keeps the experts each of its 3 steps picked, one count per MoE layer, its
    # steps' positions and the kernel's expert decode: enough to be predicted on its own
    traces = [r for r in res["runs"] if r["kind"] == "trace" and "error" not in r]
    assert traces and all(len(r["distinct_experts_steps"]) == 3 and all(len(s) == 3 for s in r["distinct_experts_steps"])
                          and len(r["positions"]) == r["batch"] and "expert_decode" in r for r in traces)
    rep = subprocess.run([sys.executable, "experiments/tpu_megakernel.py", "--report", "--out",
                          str(path)], capture_output=True, text=True, timeout=300, cwd=root)
    assert rep.returncode == 0 and "| slice | experts | batch |" in rep.stdout
    assert "greedy tokens equal in" in rep.stdout.strip().splitlines()[-1]


def test_tpu_script_stamps_each_run_with_the_code_it_ran(tmp_path):
    """Every recorded run names its commit and the hash of the kernel's code (`kernel_source`:
    perfmodel_kernels/*.py, in any order; any byte changes it), so runs merged from several calls
    keep which kernel they ran (validate_tpu's sweeps compare only runs of one code)."""
    import importlib.util
    import json
    root = __file__.rsplit("/tests/", 1)[0]
    spec = importlib.util.spec_from_file_location("tpu_megakernel_script", f"{root}/experiments/tpu_megakernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    files = {"a.py": b"x = 1\n", "b.py": b"y = 2\n"}
    assert mod.kernel_source(files) == mod.kernel_source(dict(reversed(files.items())))
    assert mod.kernel_source(dict(files, **{"b.py": b"y = 3\n"})) != mod.kernel_source(files)
    here = mod.kernel_source()
    assert len(here) == 12 and here != mod.kernel_source(files)
    rec = mod.Recorder(tmp_path / "r.json", {"commit": "abc1234", "kernel_source": here})
    rec.add({"kind": "megakernel", "batch": 1})
    run, = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert run == {"commit": "abc1234", "kernel_source": here, "kind": "megakernel", "batch": 1}


def test_check_verdict_bounds_only_decided_steps():
    """A check passes when tokens agree where the reference's top-2 logits are clear and logits
    are within the bound on the steps whose routing is decided; a near-tied router step's error
    is reported but not bounded, and a check with no decided step does not pass."""
    import importlib.util
    root = __file__.rsplit("/tests/", 1)[0]
    spec = importlib.util.spec_from_file_location("tpu_megakernel_script", f"{root}/experiments/tpu_megakernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    step = lambda err, same=True, top2=0.5, router=0.01: dict(  # noqa: E731
        logit_error=err, tokens_equal=same, top2_margin=top2, router_margin=router)
    tied = mod.ROUTER_MARGIN / 4
    r = mod.verdict([step(0.02, False, top2=0.01), step(0.43, False, 0.06, tied), step(0.02)])
    assert r["ok"] and r["logit_error"] == 0.43 and r["logit_error_decided"] == 0.02
    assert r["decided_steps"] == 2 and not r["tokens_equal"]
    assert not mod.verdict([step(0.02), step(0.2)])["ok"]                  # a decided step over
    assert not mod.verdict([step(0.02), step(0.02, False)])["ok"]          # clear tokens differ
    assert not mod.verdict([step(0.0, router=tied)])["ok"]                 # nothing decided
    assert mod.verdict([step(0.01, router=None)])["ok"]                    # dense: always decided


def test_tpu_script_skips_what_the_budget_left_uncompiled(capsys):
    """A program `warm_compile` did not start for the budget is not compiled inside its part
    either (that ran a call past its timeout on the chip): its part drops it, named."""
    import importlib.util
    from collections import namedtuple
    root = __file__.rsplit("/tests/", 1)[0]
    spec = importlib.util.spec_from_file_location("tpu_megakernel_script", f"{root}/experiments/tpu_megakernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = namedtuple("cfg", "batch depth expert_slots bank_rows")   # hashable, as KernelConfig
    b1, b8 = (cfg(b, 6, 2, 32768) for b in (1, 8))
    work = {"check": [b1], "speed": [b1, b8], "sweep": [], "trace": [b1, b8], "xla": [16], "xla_trace": [],
            "with_xla": True}
    compiled = {("step", b1): {}, ("loop", b1): {}, ("xla", 1): {}, ("loop", b8): {}}   # xla 8 and 16 cut
    kept = mod.compiled_ahead(work, compiled)
    assert kept == dict(work, speed=[b1], trace=[b1, b8], xla=[])
    out = capsys.readouterr().out
    assert "budget: xla batch 8 not compiled ahead, skipped" in out and "xla batch 16" in out


def test_tpu_script_runs_every_part_at_the_slots_it_is_given(monkeypatch):
    """`--expert-slots` replaces the tuned slots in every part (the sweep still varies them from
    there), `--check-batches` picks the batches the tokens are checked at, and a config the kernel
    refuses on the chip (a v5e here) is dropped before any weight is drawn."""
    import importlib.util
    from types import SimpleNamespace
    from perfmodel_kernels import chip
    monkeypatch.setattr(chip, "DEFAULT", "v5e")   # the chip the lent TPU runs: no TPU attached here
    root = __file__.rsplit("/tests/", 1)[0]
    spec = importlib.util.spec_from_file_location("tpu_megakernel_script", f"{root}/experiments/tpu_megakernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a = SimpleNamespace(expert_slots=4, check_batches="1,8", formats="mxfp4", xla_batches="", xla_trace_batches="",
                        sweep_batches="8", depths="", slots="4,6", bank_rows="", rings="")
    work = mod.slice_work(a, ["check", "speed", "sweep", "trace"], "k3-tp32-core", 0, "mxfp4", [1, 8], None,
                          sweep=True)
    assert [(c.batch, c.expert_slots) for c in work["check"]] == [(1, 4), (8, 4)]
    assert {c.expert_slots for c in work["speed"] + work["trace"]} == {4}
    assert [(c.batch, c.expert_slots) for c in work["sweep"]] == [(8, 6)]   # 4 is the run's own
    a.slots, a.sweep_batches = "6", "1"   # 6 slots are more than a batch-1 step's 4 picks: dropped, named
    assert mod.slice_work(a, ["sweep"], "k3-tp32-core", 0, "mxfp4", [1], None, sweep=True)["sweep"] == []
    a.expert_slots, a.slots = None, "3,4"   # on TP8-core 4 slots of MXFP4 experts exceed the v5e's VMEM
    assert [c.expert_slots for c in mod.slice_work(a, ["sweep"], "k3-tp8-core", 0, "mxfp4", [1], None,
                                                   sweep=True)["sweep"]] == [3]
    a.expert_slots = None
    tuned = mod.kernel_cfg_for("k3-tp32-core", 1, False).expert_slots
    assert {c.expert_slots for c in mod.slice_work(a, ["speed"], "k3-tp32-core", 0, "mxfp4", [1], None,
                                                   sweep=False)["speed"]} == {tuned}


def test_tpu_script_keeps_the_picks_of_the_steps_its_slope_spans(capsys):
    """A speed run records the picks of the longer call's steps after its first (which the
    one-step call also runs), as many as `--steps`; more steps than the loop keeps are refused
    before the TPU is looked for."""
    import importlib.util
    from perfmodel_kernels.reference import PICKS_KEPT
    root = __file__.rsplit("/tests/", 1)[0]
    spec = importlib.util.spec_from_file_location("tpu_megakernel_script", f"{root}/experiments/tpu_megakernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    picks = np.zeros((PICKS_KEPT, 3), np.int32)
    picks[:4] = [[9, 9, 9], [1, 2, 3], [4, 5, 6], [7, 8, 9]]   # steps 0-3 of a 1 + 3 step call
    assert mod.slope_picks(picks, 3) == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    with pytest.raises(SystemExit) as e:
        mod.main(["--steps", str(PICKS_KEPT)])
    assert e.value.code == 2 and f"--steps: {PICKS_KEPT}" in capsys.readouterr().err
