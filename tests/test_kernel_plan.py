"""The megakernel's DMA plan as data: the static stream's layout, plan structure, bytes from
first principles and against the analytic model's op graph, ring prefetch across layers, the
full-scale Kimi K3 plan (descriptors, padding, the model's prediction of it), errors, and the
`perfmodel_kernels.run` CLI."""
import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from perfmodel_kernels import layout, plan, reference, run, shard, stream, tuned
from perfmodel_kernels.specs import slice_spec
from perfmodel.graph import ops
from perfmodel.graph.dmaplan import bytes_by_layer_family
from perfmodel.spec.arch import WEIGHT_FAMILIES, derive
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.loaders import load_model
from perfmodel.util.errors import SpecError

STATIC = ("attention", "dense_ffn", "shared_expert", "latent_projection", "router", "lm_head")


def cfg_(**kw):
    base = dict(batch=4, max_context=64, depth=6, expert_slots=2, cache_block=16, bank_rows=256)
    return layout.KernelConfig(**(base | kw))


def test_plan_structure(spec):
    p = plan.dma_plan(spec, cfg_(), [12, 11, 10], [3, 5, 0, 17])
    assert [c.order for c in p] == list(range(len(p)))
    assert {c.family for c in p} <= set(WEIGHT_FAMILIES) | {"kv_cache", "state"}
    assert all(0 <= c.layer <= len(spec.layers) + 1 for c in p)
    assert all(c.routed == (c.family == "routed_expert") for c in p)
    # a cache window's read is all overhead (padding == bytes); any other copy carries data
    assert all(c.bytes > 0 and 0 <= c.padding < c.bytes + (c.family == "kv_cache")
               and c.peer == -1 for c in p)


def test_plan_bytes_from_first_principles(spec):
    """Ring banks carry every static weight once plus their zeros; the routed copies are whole
    experts in their layout; cache, state and embedding copies are what the kernel moves (a
    token's embedding row: the bf16 tile holding it, its other rows padding)."""
    cfg, distinct, pos = cfg_(), [12, 11, 10], [3, 5, 0, 17]
    p = plan.dma_plan(spec, cfg, distinct, pos)
    fam = {f: sum(c.bytes for c in p if c.family == f) for f in {c.family for c in p}}
    ring = [c for c in p if c.ring]
    static_params = sum(mm.params for l in spec.layers for mm in spec.layer_matmuls(l)
                        if mm.family != "routed_expert") + spec.hidden * spec.vocab
    assert sum(c.bytes for c in ring) == 2 * static_params + sum(c.padding for c in ring)
    assert sum(c.bytes for c in ring) == 2 * cfg.tile * layout.static_stream(spec, cfg).rows
    vectors = plan.overhead_bytes(p)["vectors"]
    assert sum(fam[f] for f in STATIC) == sum(c.bytes for c in ring) + vectors
    # the vectors carry every small parameter, padded to 16-row blocks per layer
    small = spec.params_by_family()
    n_small = small["attention"] - sum(mm.params for l in spec.layers
                                       for mm in spec.layer_matmuls(l) if mm.family == "attention")
    n_small += spec.count(ffn="moe") * spec.moe.experts
    assert 2 * n_small <= vectors < 2 * n_small + (len(spec.layers) + 1) * 2 * 16 * 128 * 2
    lay = layout.expert_layout(spec, cfg)
    assert fam["routed_expert"] == sum(distinct) * sum(lay.bytes())
    m, a, b = spec.moe, spec.kda, cfg.batch
    d = spec.mla.kv_lora_rank + spec.mla.qk_rope_dim
    blocks = sum(math.ceil(q / cfg.cache_block) for q in pos)
    window = layout.cache_window(cfg) * d * 2   # read and written back per sequence
    assert fam["kv_cache"] == blocks * cfg.cache_block * d * 2 + b * 2 * window
    per_seq = a.heads * a.head_dim ** 2 * 4 + (a.conv_width - 1) * 3 * a.heads * a.head_dim * 2
    assert fam["state"] == spec.count(attention="kda") * 2 * b * per_seq
    emb = [c for c in p if c.family == "embedding"]
    assert fam["embedding"] == b * stream.ROW_TILE * spec.hidden * 2
    assert sum(c.bytes - c.padding for c in emb) == b * spec.hidden * 2


def plan_and_model(spec, device_spec, cfg, ctx, devices, ep=None):
    """(the plan of one device, the op graph, the model's bytes per device: static + kv +
    routed, with the model's own distinct-expert count)."""
    g = ops.build(spec, Deployment(devices=devices, tp=devices, ep=ep, batch=cfg.batch,
                                   context=ctx))
    distinct = [round(g.distinct_experts)] * spec.count(ffn="moe")
    p = plan.dma_plan(device_spec, cfg, distinct, [ctx] * cfg.batch)
    model = sum(g.static_bytes) + sum(g.kv_bytes) + distinct[0] * spec.count(ffn="moe") * \
        sum(mm.params // mm.experts for mm in layout.expert_matmuls(device_spec)) * \
        spec.formats["routed_expert"].bytes_per_value
    return p, g, model


def test_plan_matches_the_analytic_model(spec):
    """Plan bytes = the op graph's static + routed + kv bytes + the plan's zeros, small vectors
    and cache-window rows, for one device, context L a multiple of cache_block; per layer the kv
    bytes agree beside the window's rows."""
    p, g, model = plan_and_model(spec, spec, cfg_(max_context=64), 48, 1)
    over = plan.overhead_bytes(p)
    assert over["cache_window"] > 0
    assert sum(c.bytes for c in p) == model + over["padding"] + over["vectors"] + \
        over["cache_window"]
    per_layer = bytes_by_layer_family(p)
    for layer in range(len(spec.layers) + 2):
        kv = sum(v for (l, f), v in per_layer.items() if l == layer and f in ("kv_cache", "state"))
        window = sum(c.padding for c in p if c.layer == layer and c.family == "kv_cache")
        assert kv - window == sum(g.kv_bytes[g.layer == layer])


def test_ring_prefetches_across_layers(spec):
    """When layer 2's router has run, exactly `depth` banks beyond those consumed are in flight
    (the ring does not stop at layer or phase boundaries)."""
    for depth in (1, 6, 30):
        cfg = cfg_(depth=depth)
        p = plan.dma_plan(spec, cfg)
        first_routed = next(c.order for c in p if c.routed)
        issued = sum(1 for c in p[:first_routed] if c.ring)
        s = layout.static_stream(spec, cfg)
        consumed = s.first_bank[(2, "router")] + layout.part(spec, cfg, ("moe", "router")).banks
        assert issued == min(consumed + depth, len(s.banks))


def test_every_bank_once_in_stream_order(spec):
    cfg = cfg_(depth=3)
    banks = layout.static_stream(spec, cfg).banks
    ring = [c for c in plan.dma_plan(spec, cfg) if c.ring]
    assert [(c.layer, c.family, c.bytes, c.padding) for c in ring] == \
        [(b.layer, b.family, 2 * b.rows * cfg.tile, b.padding_bytes) for b in banks]
    assert all(c.bytes <= cfg.bank_bytes for c in ring)


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
    (dict(device=1), "device"),
])
def test_plan_errors(spec, kw, field):
    with pytest.raises(SpecError) as e:
        plan.dma_plan(spec, cfg_(), **kw)
    assert e.value.field == field


def test_summary_table(spec):
    text = plan.summary(spec, plan.dma_plan(spec, cfg_()))
    assert "layer_04" in text and "routed_expert" in text
    assert text.splitlines()[-1].startswith("total")


def _groups(d_in, widths):
    return [stream.Group(tuple(f"m{k}" for k in range(len(widths))), tuple(widths), d_in,
                         "attention")]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 700), st.lists(st.integers(1, 600), min_size=1, max_size=3),
       st.sampled_from([256, 384, 1024]))
def test_items_reassemble_the_fused_matrix(d_in, widths, bank_rows):
    """Blocks ([d_in, T]) and the transposed tail chunks of a group rebuild the concatenated
    matrix exactly; every other row of the slab is zero; only blocks starting on a 128-row
    boundary straddle banks; the zero count is the slab minus the weights."""
    t = 256
    p = stream.place(("kda", "attention"), _groups(d_in, widths), t, bank_rows)
    rng = np.random.default_rng(d_in)
    w = {f"m{k}": rng.standard_normal((d_in, n)).astype(np.float32) for k, n in enumerate(widths)}
    slab = stream.pack_part(p, w)
    full, got, used = np.concatenate(list(w.values()), axis=1), np.zeros((d_in, sum(widths))), \
        np.zeros(p.rows, bool)
    g = p.groups[0]
    for it in p.items:
        rows = slab[it.row:it.row + it.rows]
        used[it.row:it.row + it.rows] = True
        if it.kind == "block":
            got[:, it.index * t:(it.index + 1) * t] = rows[:d_in]
            assert not rows[d_in:].any()
        else:
            r, lo = g.tail(t), it.index * t
            got[lo:lo + t, g.blocks(t) * t:] = rows[:r, :min(t, d_in - lo)].T
            assert not rows[r:].any() and not rows[:, min(t, d_in - lo):].any()
        first, last = it.row // bank_rows, (it.row + it.rows - 1) // bank_rows
        assert first == last or (it.kind == "block" and it.row % stream.SPLIT == 0)
    np.testing.assert_array_equal(got, full.astype(slab.dtype))
    assert not slab[~used].any()
    assert sum(p.bank_padding_bytes()) == 2 * (p.rows * t - d_in * sum(widths))


def test_vectors_round_trip(spec):
    """Packed small vectors unpack to the reference weights, layer by layer."""
    w = reference.init_weights(spec, seed=4)
    cfg = cfg_()
    packed = layout.pack_weights(w, cfg)
    for i, layer in enumerate((*spec.layers, None)):
        src = {"final_norm": w["final_norm"]} if layer is None else w["layers"][i]
        for name, entry in layout.vector_layout(spec, layer).items():
            got = np.asarray(layout.unpack_vector(packed.vectors[i], entry))
            want = np.asarray(src[name], np.float32).reshape(got.shape)
            np.testing.assert_array_equal(got, want, err_msg=f"{i} {name}")
    assert packed.static.shape == (layout.static_stream(spec, cfg).rows, cfg.tile)
    assert packed.experts.shape == (3, 16, layout.expert_layout(spec, cfg).rows[0], cfg.tile)


# ----- the full-scale plan (Kimi K3, TP32 x EP8) --------------------------------------------------

def k3_config(batch):
    t = tuned.tuned("kimi-k3", 32)
    return layout.KernelConfig(batch=batch, max_context=4352, depth=t.depth, bank_rows=t.bank_rows,
                               expert_slots=t.expert_slots, wire=t.wire, host_devices=8)


def test_kimi_k3_plan_is_few_large_copies():
    """Kimi K3 on 32 devices (TP32, experts in 8 groups), batch 1, 4096 cached tokens: at most
    2,000 weight descriptors per device per step and under 1 % zero bytes; the model's
    prediction of this plan, with one dot a streamed matmul as its own kernel issues, is within
    10 % of its prediction of its own default megakernel, and the kernel's own dots (one per lane
    tile of output, each `mxu_dot_issue_s`) make it slower;
    the tuned configuration fits the VMEM budget; one-shot all-reduces below 8 rows, as the
    model file's shard_collective_rows say."""
    r = plan.report(load_model("kimi-k3"), k3_config(1), 32, 8, 4096)
    assert r["weight_descriptors_per_device"] <= 2000
    assert r["padding_fraction"] < 0.01
    assert abs(r["one_dot_step_s"] / r["model_step_s"] - 1) < 0.10 and r["predicted_step_s"] > r["one_dot_step_s"]
    assert r["vmem_bytes"] <= r["vmem_limit_bytes"] and r["kernel"]["all_reduce"] == "one_shot"
    assert r["kernel"]["expert_feed"] == "fp8" and r["kernel"]["expert_scale_rows"] == 256 // 32
    kinds = r["weight_descriptors_by_kind"]
    assert kinds["ring banks"] + kinds["routed experts"] + kinds["vectors"] + 1 == \
        r["weight_descriptors_per_device"]
    # one DMA per MXFP4 expert (codes and e8m0 scales in one block)
    assert kinds["routed experts"] == round(92 * r["distinct_experts_per_layer"])


def test_the_plan_counts_the_dots_its_matmuls_issue():
    """At a v5e's 128-lane tile the K3 TP32-core slice's KDA attention issues 128 dots while each
    part fits one bank: its fused input group (q, k, v, gate 384 columns each, decay_a 128, beta 3)
    13 whole blocks and, for beta's 3-column remainder, one dot per 128-wide chunk of its 7168
    inputs (56), decay_b 3, o_proj 56 (7168 / 128); its MLA attention 153. In 16384-row banks a
    block that straddles a bank end is split there, a dot a piece: the input group's 13 blocks of
    7168 rows hold the bank ends at 16384 x 1..5 (6 more dots in the layer with o_proj's one).
    The op graph built from the plan carries them on each group's first member, and `explain`
    says so."""
    spec = slice_spec("k3-tp32-core", "mxfp4")
    whole = layout.KernelConfig(batch=1, max_context=2048, depth=2, expert_slots=2, cache_block=256,
                                bank_rows=262144, chip="v5e")   # every part in one bank
    dots = plan.matmul_dots(spec, whole)
    assert (dots["kda/q_proj"], dots["kda/beta_proj"], dots["kda/decay_b"], dots["kda/o_proj"]) == (13 + 56, 0, 3, 56)
    assert sum(v for k, v in dots.items() if k.startswith("kda/")) == 128
    assert sum(v for k, v in dots.items() if k.startswith("mla/")) == 153
    cfg = dataclasses.replace(whole, depth=8, bank_rows=16384)
    dots = plan.matmul_dots(spec, cfg)
    assert dots["kda/q_proj"] == 13 + 56 + 5 and sum(v for k, v in dots.items() if k.startswith("kda/")) == 128 + 6
    kp = plan.as_kernel_plan(spec, spec, cfg, plan.dma_plan(spec, cfg, [4, 4, 4], [1028]), 1028)
    from perfmodel.step.predict import plan_deployment, plan_model
    g = ops.build(plan_model(spec, kp), plan_deployment(kp))
    kda = next(l.index for l in spec.layers if l.attention == "kda")
    assert sum(g.dots[(g.layer == kda) & (np.array(g.phase) == "attention")]) == 134 + 1 + 1  # + norm, recurrence
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.step.explain import explain
    ops_ = explain(plan_model(spec, kp), load_hardware("tpu-v5e"), plan_deployment(kp), kda)["ops"]
    q = next(o for o in ops_ if o["op"] == "q_proj")
    assert any(t["term"].startswith("matmul weight push (74 dots)") for t in q["terms"])


@pytest.mark.slow
@pytest.mark.parametrize("batch", [2, 4, 8])
def test_kimi_k3_plan_predicted_like_the_model(batch):
    r = plan.report(load_model("kimi-k3"), k3_config(batch), 32, 8, 4096)
    assert abs(r["one_dot_step_s"] / r["model_step_s"] - 1) < 0.10 and r["predicted_step_s"] > r["one_dot_step_s"]
    assert r["padding_fraction"] < 0.01 and r["vmem_bytes"] <= r["vmem_limit_bytes"]
    assert r["kernel"]["all_reduce"] == ("rs_ag" if batch == 8 else "one_shot")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_full_scale_plan_matches_the_analytic_model(fmt):
    """Kimi K3 (routed experts in MXFP4 as the preset, or bf16) on 32 devices, TP32 x EP8: one
    device's HBM plan bytes = the op graph's per-device static + routed + kv bytes + the
    plan's zeros, small vectors and cache-window rows."""
    full = derive("kimi-k3", formats={"routed_expert": fmt})
    cfg = dataclasses.replace(k3_config(4), max_context=256, cache_block=64)
    p, _, model = plan_and_model(full, shard.device_spec(full, 32, 8), cfg, 192, 32, 8)
    hbm = [c for c in p if c.peer < 0]
    over = plan.overhead_bytes(p)
    assert sum(c.bytes for c in hbm) == model + over["padding"] + over["vectors"] + \
        over["cache_window"]


# ----- orderings and verify rows ------------------------------------------------------------------

def test_cache_row_written_after_its_tile_reads_completed(spec):
    """In program order, an MLA layer's new cache rows (a window of whole tiles per sequence,
    read, patched and written back) are issued only after the kernel waited for every cache tile
    read of that layer (a write into a range still being read would race)."""
    events = plan.dma_events(spec, cfg_(), positions=[17, 33, 0, 63])
    for layer in (l.index for l in spec.layers if l.attention == "mla"):
        ev = [(i, kind, name) for i, (kind, lyr, name) in enumerate(events) if lyr == layer]
        reads = [i for i, k, n in ev if k == "start" and n.startswith("latent cache block")]
        waited = [i for i, k, n in ev if k == "wait" and n == "latent cache block"]
        writes = [i for i, k, n in ev if k == "start" and
                  n.startswith("latent cache window (write)")]
        assert reads and waited and len(writes) == 4
        assert max(reads) < waited[0] < min(writes)


def test_verify_rows_plan(spec):
    """rows 4: the cache blocks are read per sequence as for one row, one window of whole tiles
    holding the new rows is read and written back per sequence that keeps a row, embedding rows and the most experts a step can fetch scale with
    the token rows, and every row write still follows the tile reads of its layer."""
    cfg, pos, acc = cfg_(rows=4), [3, 5, 0, 17], [2, 0, 4, 1]
    p = plan.dma_plan(spec, cfg, positions=pos, accepted=acc)
    one = plan.dma_plan(spec, cfg_(), positions=pos)
    d = spec.mla.kv_lora_rank + spec.mla.qk_rope_dim
    writes = [c for c in p if c.name.startswith("latent cache window (write)")]
    keeping = sum(a > 0 for a in acc)
    assert len(writes) == spec.count(attention="mla") * keeping
    blocks = lambda q: [c for c in q if "cache block" in c.name]
    assert [c.bytes for c in blocks(p)] == [c.bytes for c in blocks(one)]
    window = layout.cache_window(cfg)   # 32 rows: 4 rows from any position fit in two tiles
    assert window == 32
    assert sum(c.bytes for c in p if c.family == "kv_cache") == \
        sum(c.bytes for c in blocks(p)) + spec.count(attention="mla") * keeping * 2 * window * d * 2
    assert sum(c.bytes for c in p if c.family == "embedding") == \
        4 * 4 * stream.ROW_TILE * spec.hidden * 2
    assert sum(c.routed for c in p) == spec.count(ffn="moe") * min(spec.moe.experts,
                                                                   16 * spec.moe.top_k)
    events = plan.dma_events(spec, cfg, positions=pos, accepted=acc)
    for layer in (l.index for l in spec.layers if l.attention == "mla"):
        ev = [(i, k, n) for i, (k, lyr, n) in enumerate(events) if lyr == layer]
        waited = [i for i, k, n in ev if k == "wait" and n == "latent cache block"]
        writes = [i for i, k, n in ev if k == "start" and
                  n.startswith("latent cache window (write)")]
        assert len(writes) == keeping and waited[0] < min(writes)
    with pytest.raises(SpecError, match="accepted"):
        plan.dma_plan(spec, cfg, accepted=[5, 0, 0, 0])
    with pytest.raises(SpecError, match="positions"):
        plan.dma_plan(spec, cfg, positions=[61, 0, 0, 0])  # rows 61..64 > max_context 64
    with pytest.raises(SpecError, match="rows"):
        layout.KernelConfig(batch=1, rows=9)


def test_mesh_plan_lists_the_collectives_remote_copies():
    """On TP8 x EP4 of MINI with 8 heads, one device's plan lists one remote copy per peer per
    exchange: an all-gather to 7 peers, a one-shot all-reduce (2 token rows, below the model
    file's 8) to 7 peers; remote copies carry their peer and collective, not HBM bytes."""
    full = derive("kimi-k3-mini", kda={"heads": 8}, mla={"heads": 8})
    d = shard.device_spec(full, 8, 4)
    p = plan.dma_plan(d, cfg_(batch=2, max_context=32, cache_block=16), device=3)
    remote = [c for c in p if c.peer >= 0]
    assert remote and all(c.family == "activation" and c.peer != 3 for c in remote)
    emb = [c for c in remote if c.name.startswith("embedding")]
    assert sorted(c.peer for c in emb) == [0, 1, 2, 4, 5, 6, 7]
    assert {c.collective for c in remote} == {"all_gather", "all_reduce one_shot"}
    assert len([c for c in p if c.peer < 0]) == len(p) - len(remote)


# ----- the CLI ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_run_cli_interpret(capsys):
    assert run.main(["--batch", "2", "--steps", "2", "--depth", "3", "--context", "16",
                     "--bank-rows", "256", "--interpret"]) == 0
    out = capsys.readouterr().out
    assert "VMEM budget" in out and "DMA plan of step 1" in out and "layer_04" in out
    assert "timings are not measured" in out
    rows = out.split("tokens (one row per sequence):")[1].strip().splitlines()[:2]
    assert all(len(r.split()) == 3 for r in rows)


@pytest.mark.slow
def test_run_cli_verify_rows(capsys):
    assert run.main(["--batch", "2", "--steps", "2", "--depth", "3", "--context", "32",
                     "--rows", "3", "--accepted", "2", "--interpret"]) == 0
    out = capsys.readouterr().out
    assert "batch 2 x 3 rows" in out and "DMA plan of step 1" in out
    rows = out.split("tokens (one row per sequence):")[1].strip().splitlines()[:2]
    assert all(len(r.split()) == 2 * 2 + 1 for r in rows)  # 2 kept rows a step + the last


def test_run_cli_plan_only_json(capsys):
    assert run.main(["--batch", "2", "--plan-only", "--json", "--context", "48"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["preset"] == "kimi-k3-mini" and r["batch"] == 2 and r["context"] == 48
    for key in ("weight_descriptors_per_device", "padding_fraction", "predicted_step_s",
                "model_step_s"):
        assert r[key] is not None and r[key] >= 0, key
    assert r["predicted_step_s"] > 0 and r["model_step_s"] > 0


def test_run_cli_errors(capsys):
    assert run.main(["--depth", "5000", "--interpret"]) == 2
    assert "too many" in capsys.readouterr().err
    assert run.main(["--rows", "4", "--accepted", "0", "--interpret"]) == 2
    assert "accepted" in capsys.readouterr().err
    assert run.main(["--rows", "9", "--interpret"]) == 2
    assert "rows" in capsys.readouterr().err
    assert run.main(["--steps", "100", "--context", "16", "--interpret"]) == 2
    assert run.main(["--bank-rows", "100", "--plan-only"]) == 2
    assert "bank_rows" in capsys.readouterr().err
    if not __import__("jax").devices()[0].platform == "tpu":
        assert run.main(["--steps", "1"]) == 2
        assert "no TPU" in capsys.readouterr().err
    # sizes refused before any work, each in one line naming the option and value
    assert run.main(["--plan-only", "--batch", "1048576"]) == 2
    err = capsys.readouterr().err
    assert "batch=1048576" in err and len(err.strip().splitlines()) == 1
    assert run.main(["--devices", "0", "--plan-only"]) == 2
    assert "devices=0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        run.main(["--batch", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("python -m perfmodel_kernels.run: error: argument --batch")
    assert len(err.strip().splitlines()) == 1
