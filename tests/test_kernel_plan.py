"""The megakernel's DMA plan as data: structure, bytes from first principles and against the
analytic model's op graph, ring prefetch across layers, errors, and the `kernels.run` CLI."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kernels import layout, plan, reference, run
from perfmodel.graph import ops
from perfmodel.graph.dmaplan import bytes_by_layer_family
from perfmodel.spec.arch import WEIGHT_FAMILIES
from perfmodel.spec.deployment import Deployment
from perfmodel.util.errors import SpecError

STATIC = ("attention", "dense_ffn", "shared_expert", "latent_projection", "router", "lm_head")


def cfg_(**kw):
    base = dict(batch=4, max_context=64, depth=6, expert_slots=2, cache_block=16)
    return layout.KernelConfig(**(base | kw))


def test_plan_structure(spec):
    p = plan.dma_plan(spec, cfg_(), [12, 11, 10], [3, 5, 0, 17])
    assert [c.order for c in p] == list(range(len(p)))
    assert {c.family for c in p} <= set(WEIGHT_FAMILIES) | {"kv_cache", "state"}
    assert all(0 <= c.layer <= len(spec.layers) + 1 for c in p)
    assert all(c.routed == (c.family == "routed_expert") for c in p)
    assert all(c.bytes > 0 for c in p)


def test_plan_bytes_from_first_principles(spec):
    cfg, distinct, pos = cfg_(), [12, 11, 10], [3, 5, 0, 17]
    p = plan.dma_plan(spec, cfg, distinct, pos)
    fam = {f: sum(c.bytes for c in p if c.family == f) for f in {c.family for c in p}}
    t = cfg.tile
    static_mms = [mm for l in spec.layers for mm in spec.layer_matmuls(l)
                  if mm.family != "routed_expert"]
    padded = sum(math.ceil(mm.d_in / t) * math.ceil(mm.d_out / t) * t * t * 2 for mm in static_mms)
    lm_head = spec.hidden * spec.vocab * 2
    over = plan.overhead_bytes(spec, cfg, distinct)
    assert sum(fam[f] for f in STATIC) == padded + lm_head + over["vectors"]
    per_expert = 2 * spec.moe.latent_dim * 3 * spec.moe.expert_width
    routed_pad = sum(distinct) * (layout.tiles_per_expert(spec, cfg) * cfg.bank_bytes - per_expert)
    assert padded + lm_head == 2 * sum(mm.params for mm in static_mms) + lm_head \
        + over["tile_padding"] - routed_pad
    # the vectors carry every small parameter, padded to 16-row blocks per layer
    small = spec.params_by_family()
    n_small = small["attention"] - sum(mm.params for mm in static_mms if mm.family == "attention")
    n_small += spec.count(ffn="moe") * spec.moe.experts
    assert 2 * n_small <= over["vectors"] < 2 * n_small + (len(spec.layers) + 1) * 2 * 16 * 128 * 2
    m, a, b = spec.moe, spec.kda, cfg.batch
    assert fam["routed_expert"] == sum(distinct) * layout.tiles_per_expert(spec, cfg) * t * t * 2
    d = spec.mla.kv_lora_rank + spec.mla.qk_rope_dim
    blocks = sum(math.ceil(q / cfg.cache_block) for q in pos)
    assert fam["kv_cache"] == blocks * cfg.cache_block * d * 2 + b * d * 2
    per_seq = a.heads * a.head_dim ** 2 * 4 + (a.conv_width - 1) * 3 * a.heads * a.head_dim * 2
    assert fam["state"] == spec.count(attention="kda") * 2 * b * per_seq
    assert fam["embedding"] == b * spec.hidden * 2


def plan_and_model(spec, device_spec, cfg, ctx, devices):
    """(the plan of one device, the op graph, the model's bytes per device: static + kv +
    routed, with the model's own distinct-expert count, and that count per MoE layer)."""
    g = ops.build(spec, Deployment(devices=devices, tp=devices, batch=cfg.batch, context=ctx))
    distinct = [round(g.distinct_experts)] * spec.count(ffn="moe")
    p = plan.dma_plan(device_spec, cfg, distinct, [ctx] * cfg.batch)
    model = sum(g.static_bytes) + sum(g.kv_bytes) + distinct[0] * spec.count(ffn="moe") * \
        sum(mm.params // mm.experts for mm in layout.expert_matmuls(device_spec)) * \
        spec.formats["routed_expert"].bytes_per_value
    over = plan.overhead_bytes(device_spec, cfg, distinct)
    return p, g, model + over["tile_padding"] + over["vectors"]


def test_plan_matches_the_analytic_model(spec):
    """Per layer, plan bytes = the op graph's static + routed + kv bytes + the plan's overhead
    (tile padding, small vectors), for one device, context L a multiple of cache_block."""
    p, g, want = plan_and_model(spec, spec, cfg_(max_context=64), 48, 1)
    assert sum(c.bytes for c in p) == want
    per_layer = bytes_by_layer_family(p)
    for layer in range(len(spec.layers) + 2):
        kv = sum(v for (l, f), v in per_layer.items() if l == layer and f in ("kv_cache", "state"))
        assert kv == sum(g.kv_bytes[g.layer == layer])


def test_ring_prefetches_across_layers(spec):
    """When layer 2's router has run, exactly `depth` static tiles beyond those consumed are in
    flight (the ring does not stop at layer or phase boundaries)."""
    for depth in (1, 6, 30):
        cfg = cfg_(depth=depth)
        p = plan.dma_plan(spec, cfg)
        first_routed = next(c.order for c in p if c.routed)
        issued = sum(1 for c in p[:first_routed] if "[tile" in c.name)
        consumed = 0
        for tm in layout.static_stream(spec, cfg):
            consumed += tm.tiles
            if tm.layer == 2 and tm.mm.name == "latent_down":
                break
        n_tiles = sum(tm.tiles for tm in layout.static_stream(spec, cfg))
        assert issued == min(consumed + depth, n_tiles)


def test_every_static_tile_once_in_stream_order(spec):
    cfg = cfg_(depth=3)
    p = plan.dma_plan(spec, cfg)
    tiles = [c for c in p if "[tile" in c.name]
    stream = [(tm.layer, tm.mm.name, k) for tm in layout.static_stream(spec, cfg)
              for k in range(tm.tiles)]
    assert [(c.layer, c.name) for c in tiles] == [(l, f"{n}[tile {k}]") for l, n, k in stream]
    assert all(c.bytes == cfg.bank_bytes for c in tiles)


def test_plan_totals_do_not_depend_on_depth_or_slots(spec):
    totals = {sum(c.bytes for c in plan.dma_plan(spec, cfg_(depth=d, expert_slots=s)))
              for d, s in [(1, 1), (6, 2), (194, 4)]}
    assert len(totals) == 1


def test_plan_defaults(spec):
    cfg = cfg_()
    p = plan.dma_plan(spec, cfg)
    n_exp = sum(1 for c in p if c.routed)
    assert n_exp == spec.count(ffn="moe") * min(spec.moe.experts, cfg.batch * spec.moe.top_k)
    blocks = sum(1 for c in p if "cache block" in c.name)
    assert blocks == cfg.batch * math.ceil((cfg.max_context - 1) / cfg.cache_block)


@pytest.mark.parametrize("kw,field", [
    (dict(distinct_experts=[1, 2]), "distinct_experts"),
    (dict(distinct_experts=[1, 2, 99]), "distinct_experts"),
    (dict(positions=[0, 1]), "positions"),
    (dict(positions=[0, 1, 2, 64]), "positions"),
])
def test_plan_errors(spec, kw, field):
    with pytest.raises(SpecError) as e:
        plan.dma_plan(spec, cfg_(), **kw)
    assert e.value.field == field


def test_summary_table(spec):
    text = plan.summary(spec, plan.dma_plan(spec, cfg_()))
    assert "layer_04" in text and "routed_expert" in text
    assert text.splitlines()[-1].startswith("total")


@pytest.mark.slow
def test_run_cli_interpret(capsys):
    assert run.main(["--batch", "2", "--steps", "2", "--depth", "3", "--context", "16",
                     "--interpret"]) == 0
    out = capsys.readouterr().out
    assert "VMEM budget" in out and "DMA plan of step 1" in out and "layer_04" in out
    assert "timings are not measured" in out
    rows = out.split("tokens (one row per sequence):")[1].strip().splitlines()[:2]
    assert all(len(r.split()) == 3 for r in rows)


@pytest.mark.slow
def test_run_cli_verify_rows(capsys):
    assert run.main(["--batch", "2", "--steps", "2", "--depth", "3", "--context", "16",
                     "--rows", "3", "--accepted", "2", "--interpret"]) == 0
    out = capsys.readouterr().out
    assert "batch 2 x 3 rows" in out and "DMA plan of step 1" in out
    rows = out.split("tokens (one row per sequence):")[1].strip().splitlines()[:2]
    assert all(len(r.split()) == 2 * 2 + 1 for r in rows)  # 2 kept rows a step + the last


def test_run_cli_errors(capsys):
    assert run.main(["--depth", "5000", "--interpret"]) == 2
    assert "too many" in capsys.readouterr().err
    assert run.main(["--rows", "4", "--accepted", "0", "--interpret"]) == 2
    assert "accepted" in capsys.readouterr().err
    assert run.main(["--rows", "9", "--interpret"]) == 2
    assert "rows" in capsys.readouterr().err
    assert run.main(["--steps", "100", "--context", "16", "--interpret"]) == 2
    if not __import__("jax").devices()[0].platform == "tpu":
        assert run.main(["--steps", "1"]) == 2
        assert "no TPU" in capsys.readouterr().err


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(1, 300), st.sampled_from([128, 256]))
def test_tiles_reassemble_the_matrix(d_in, d_out, t):
    """Column block outer, row tile inner, zero padding: the kernel's accumulation order."""
    w = np.arange(d_in * d_out, dtype=np.float32).reshape(d_in, d_out) + 1
    tiles = layout._tile_matrix(w, t)
    rows, cols = math.ceil(d_in / t), math.ceil(d_out / t)
    assert tiles.shape == (rows * cols, t, t)
    full = np.block([[tiles[j * rows + i] for j in range(cols)] for i in range(rows)])
    np.testing.assert_array_equal(full[:d_in, :d_out], w)
    assert not full[d_in:].any() and not full[:, d_out:].any()  # the padding is zeros


def test_vectors_round_trip(spec):
    """Packed small vectors unpack to the reference weights, layer by layer."""
    w = reference.init_weights(spec, seed=4)
    packed = layout.pack_weights(w, cfg_())
    for i, layer in enumerate((*spec.layers, None)):
        src = {"final_norm": w["final_norm"]} if layer is None else w["layers"][i]
        for name, entry in layout.vector_layout(spec, layer).items():
            got = np.asarray(layout.unpack_vector(packed.vectors[i], entry))
            want = np.asarray(src[name], np.float32).reshape(got.shape)
            np.testing.assert_array_equal(got, want, err_msg=f"{i} {name}")
    assert packed.static.shape[0] == sum(tm.tiles for tm in layout.static_stream(spec, cfg_()))
    assert packed.experts.shape == (3, 16, 2, 256, 256)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_full_scale_plan_matches_the_analytic_model(fmt):
    """Kimi K3 (routed experts in MXFP4 as the preset, or bf16) on 32 devices, TP32: one
    device's plan bytes = the op graph's per-device static + routed + kv bytes + the plan's
    overhead."""
    from kernels import shard
    from perfmodel.spec.arch import derive
    full = derive("kimi-k3", formats={"routed_expert": fmt})
    cfg = cfg_(max_context=256, depth=16, cache_block=64)
    p, _, want = plan_and_model(full, shard.device_spec(full, 32), cfg, 192, 32)
    assert sum(c.bytes for c in p) == want


def test_cache_row_written_after_its_tile_reads_completed(spec):
    """In program order, an MLA layer's new cache rows are issued only after the kernel waited
    for every cache tile read of that layer (a write into a range still being read would race)."""
    events = plan.dma_events(spec, cfg_(), positions=[17, 33, 0, 63])
    for layer in (l.index for l in spec.layers if l.attention == "mla"):
        ev = [(i, kind, name) for i, (kind, lyr, name) in enumerate(events) if lyr == layer]
        reads = [i for i, k, n in ev if k == "start" and n.startswith("latent cache block")]
        waited = [i for i, k, n in ev if k == "wait" and n == "latent cache block"]
        writes = [i for i, k, n in ev if k == "start" and n == "latent cache row (write)"]
        assert reads and waited and len(writes) == 4
        assert max(reads) < waited[0] < min(writes)


def test_verify_rows_plan(spec):
    """rows 4: the cache blocks are read per sequence as for one row, one new cache row is
    written per accepted row, embedding rows and the most experts a step can fetch scale with
    the token rows, and every row write still follows the tile reads of its layer."""
    cfg, pos, acc = cfg_(rows=4), [3, 5, 0, 17], [2, 0, 4, 1]
    p = plan.dma_plan(spec, cfg, positions=pos, accepted=acc)
    one = plan.dma_plan(spec, cfg_(), positions=pos)
    d = spec.mla.kv_lora_rank + spec.mla.qk_rope_dim
    writes = [c for c in p if c.name == "latent cache row (write)"]
    assert len(writes) == spec.count(attention="mla") * sum(acc)
    blocks = lambda q: [c for c in q if "cache block" in c.name]
    assert [c.bytes for c in blocks(p)] == [c.bytes for c in blocks(one)]
    assert sum(c.bytes for c in p if c.family == "kv_cache") == \
        sum(c.bytes for c in blocks(p)) + spec.count(attention="mla") * sum(acc) * d * 2
    assert sum(c.bytes for c in p if c.family == "embedding") == 4 * 4 * spec.hidden * 2
    assert sum(c.routed for c in p) == spec.count(ffn="moe") * min(spec.moe.experts,
                                                                   16 * spec.moe.top_k)
    events = plan.dma_events(spec, cfg, positions=pos, accepted=acc)
    for layer in (l.index for l in spec.layers if l.attention == "mla"):
        ev = [(i, k, n) for i, (k, lyr, n) in enumerate(events) if lyr == layer]
        waited = [i for i, k, n in ev if k == "wait" and n == "latent cache block"]
        writes = [i for i, k, n in ev if k == "start" and n == "latent cache row (write)"]
        assert len(writes) == sum(acc) and waited[0] < min(writes)
    with pytest.raises(SpecError, match="accepted"):
        plan.dma_plan(spec, cfg, accepted=[5, 0, 0, 0])
    with pytest.raises(SpecError, match="positions"):
        plan.dma_plan(spec, cfg, positions=[61, 0, 0, 0])  # rows 61..64 > max_context 64
    with pytest.raises(SpecError, match="rows"):
        layout.KernelConfig(batch=1, rows=9)
