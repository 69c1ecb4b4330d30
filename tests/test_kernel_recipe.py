"""A model's own megakernel ([megakernel]), formats that say how the matrix unit is fed, the latent
projections' own format family and model files built on other files."""
import dataclasses

import pytest

from perfmodel.engine.megakernel import kernel_terms, simulate_megakernel
from perfmodel.engine.terms import op_compute_s, op_feeds, op_weights
from perfmodel.graph.ops import build
from perfmodel.spec.arch import derive, from_dict
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.formats import FORMATS, format_from_dict
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.util.errors import SpecError

TPU, GB200 = load_hardware("tpu-v7"), load_hardware("gb200")
MS = load_model("muse-spark")
B1 = Deployment(devices=8, tp=8, ep=1, batch=1, context=160)


def collective(g, name):
    j = g.name.index(name)
    return g.coll_kind[j], g.coll_bytes[j], int(g.coll_group[j])


def test_muse_spark_collectives_follow_its_kernel():
    """At batch 1 an activation travels as 8 rows (whole sublane tiles; the micro-benchmarks' [8, 8192]
    o-proj all-reduce), the routed experts' reduction as one row per (token, expert) pair (their
    [64, 4096] at batch 8), the post-expert projection output-sharded and all-gathered; bf16 wire."""
    g = build(MS, B1)
    assert collective(g, "attn_all_reduce") == ("all_reduce", 8 * 8192 * 2, 8)
    assert collective(g, "latent_all_gather") == ("all_gather", 8 * 4096 * 2, 8)
    assert collective(g, "expert_all_reduce") == ("all_reduce", 8 * 4096 * 2, 8)
    assert collective(g, "moe_all_gather") == ("all_gather", 8 * 8192 * 2, 8)
    assert "moe_all_reduce" not in g.name and "embedding_all_reduce" not in g.name  # embedding in XLA glue
    g8 = build(MS, Deployment(devices=8, tp=8, ep=1, batch=8, context=160))
    assert collective(g8, "expert_all_reduce")[1] == 64 * 4096 * 2 and collective(g8, "attn_all_reduce")[1] == 8 * 8192 * 2
    first = derive("muse-spark", megakernel={"collective_wire": "f32"})
    assert collective(build(first, B1), "attn_all_reduce")[1] == 8 * 8192 * 4


def _expert_cost(m, d, megakernel=False):
    g = build(m, d)
    j = g.name.index("routed_experts")
    dtype, rows = op_feeds(g, TPU)
    w = op_weights(g, m.formats["routed_expert"].bytes_per_value)
    return dtype[j], rows[j], op_compute_s(g, TPU, w, megakernel=megakernel)[j]


NVFP4 = derive("muse-spark", formats={"routed_expert": "nvfp4"})
PLAIN = {"value_bits": 4, "scale_dtype": "e4m3", "block": [1, 16]}  # NVFP4's bytes, fed without scale rows


def plain(dtype):
    return derive("muse-spark", custom_formats={f"nvfp4-{dtype}": {**PLAIN, "compute_dtype": dtype}},
                  formats={"routed_expert": f"nvfp4-{dtype}"})


def test_a_block_diagonal_feed_costs_its_rows_or_the_bf16_dequant_dot():
    """NVFP4 experts on TPU v7 are fed as fp8 with 32 LHS rows per batch row (Inferact's path). With
    every row on the same experts, batch 4 streams 128 rows per weight tile: above the fp8 push
    (flat up to about 70 rows) but below the bf16 push, so the block-diagonal dot costs about 1.8x an
    fp8 feed without scale rows (the slice micro-benchmark: 1.0 us at B=1, 1.6 us at B=4). At batch 8
    its 256 rows cost more than dequantising to bf16 first, which the kernel then does (fp4.py
    DEQUANT_MIN_BATCH = 8): the cost is the bf16 dot's plus the vector unit's dequantisation of each
    of the 8 experts' two matrices (components.vpu_dequant_s)."""
    for batch, lo, hi in ((1, 0.99, 1.01), (4, 1.6, 2.0)):
        d = Deployment(devices=8, tp=8, ep=1, batch=batch, context=160, routing_correlation=1.0)
        nv, fp8 = _expert_cost(NVFP4, d), _expert_cost(plain("fp8"), d)
        assert nv[:2] == ("fp8", 32) and fp8[:2] == ("fp8", 1)
        assert lo < nv[2] / fp8[2] < hi
    d8 = Deployment(devices=8, tp=8, ep=1, batch=8, context=160, routing_correlation=1.0)
    dequant = 2 * MS.moe.top_k * TPU.components["vpu_dequant_s"]
    assert _expert_cost(NVFP4, d8)[2] == pytest.approx(_expert_cost(plain("bf16"), d8)[2] + dequant, rel=1e-6)
    assert _expert_cost(plain("bf16"), d8)[2] > 1.9 * _expert_cost(plain("fp8"), d8)[2]


def test_explain_names_the_dot_the_kernel_takes():
    """NVFP4 experts at batch 8 (every row on one expert set): dequantised to bf16 first; at batch 4
    the block-diagonal fp8 dot; the whole-batch rows named where they apply."""
    from perfmodel.step.explain import explain
    said = {}
    for batch in (4, 8):
        d = Deployment(devices=8, tp=8, ep=1, batch=batch, context=160, routing_correlation=1.0)
        ops = explain(NVFP4, TPU, d, 3, "routed_experts")["ops"]
        said[batch] = next(t["term"] for t in ops[0]["terms"] if t["term"].startswith("matmul"))
    assert "fed as fp8" in said[4] and "32 LHS rows per batch row" in said[4] and "dequantised" not in said[4]
    assert "dequantised to bf16 first" in said[8]
    assert all("each expert's dots over the whole batch" in t for t in said.values())
    d = Deployment(devices=8, tp=8, ep=1, batch=4, context=160, expert_slots=2)  # a GPU: rows are no term
    ops = explain(NVFP4, GB200, d, 3, "routed_experts")["ops"]
    assert not any("whole batch" in t["term"] for t in ops[0]["terms"])


def test_a_megakernel_runs_each_experts_dots_over_the_whole_batch():
    """[megakernel] expert_rows = "batch" (the muse-spark preset): at batch 4 with independent routing
    each expert gets about one row, but the kernel's dots take all 4 (x 32 block-diagonal rows), as
    the slice micro-benchmark at B=4 measures; the multi-kernel engine's grouped dots take the routed
    rows. At batch 1 both are one row; beyond the MXU's row tile (16 rows) the rows routed to each
    expert; a model whose kernel keeps "routed" (kimi-k3) is costed as before."""
    d4 = Deployment(devices=8, tp=8, ep=1, batch=4, context=160)
    mega, multi = _expert_cost(NVFP4, d4, megakernel=True)[2], _expert_cost(NVFP4, d4)[2]
    assert mega > 1.5 * multi
    d1 = Deployment(devices=8, tp=8, ep=1, batch=1, context=160)
    assert _expert_cost(NVFP4, d1, megakernel=True)[2] == _expert_cost(NVFP4, d1)[2]
    d32 = Deployment(devices=8, tp=8, ep=1, batch=32, context=160)
    assert _expert_cost(NVFP4, d32, megakernel=True)[2] == _expert_cost(NVFP4, d32)[2]
    kimi = load_model("kimi-k3")
    assert kimi.megakernel.expert_rows == "routed" and MS.megakernel.expert_rows == "batch"
    dk = Deployment(devices=32, tp=32, ep=8, batch=8, context=4096)
    assert _expert_cost(kimi, dk, megakernel=True)[2] == _expert_cost(kimi, dk)[2]
    from perfmodel.spec.recipe import from_table
    with pytest.raises(SpecError) as e:
        from_table({"expert_rows": "all"})
    assert e.value.field == "megakernel.expert_rows" and "routed, batch" in str(e.value)


def test_an_nvfp4_expert_is_five_copies():
    """Its matrices, their block scales and its global scales (fp4.py COPIES = 5); int4: four."""
    assert build(NVFP4, B1).expert_descriptors == 5 and build(MS, B1).expert_descriptors == 4


def test_muse_spark_bytes_per_rank_are_the_profiles():
    """76 MiB of bf16 dense weights per layer per rank (q, kv, gate, o, pre, router hi/lo, post) and
    3.19 MiB per int4 expert per rank (group-128 f32 scales), as the phase profile states."""
    g = build(MS, B1)
    layer = g.layer == 3
    assert g.static_bytes[layer].sum() == 76 * 2**20
    expert = g.routed_bytes[layer].sum() / 8
    assert expert == pytest.approx(3.1875 * 2**20) and g.expert_descriptors == 4  # values + scales, 2 matrices


def test_latent_projections_have_their_own_format():
    m = derive("muse-spark", formats={"latent_projection": "int8-channel", "shared_expert": "fp8"})
    g = build(m, B1)
    j = g.name.index("latent_down")
    assert g.fmt[j].name == "int8-channel" and g.static_bytes[j] == pytest.approx((8192 * 4096 + 4 * 4096) / 8)
    assert m.weight_bytes_by_family()["shared_expert"] == 0  # Muse Spark has no shared experts


def test_formats_say_how_the_matrix_unit_is_fed():
    """Native where the chip's matrix unit takes the operand, else the format's named fallback; no
    silent bf16: a format without a fallback the chip takes is an error naming it."""
    tpu, gpu = frozenset({"bf16", "f32", "int8", "fp8", "int4"}), frozenset({"bf16", "f32", "fp8", "fp4"})
    assert FORMATS["nvfp4"].feed(gpu) == ("fp4", 1) and FORMATS["nvfp4"].feed(tpu) == ("fp8", 32)
    assert FORMATS["mxfp4"].feed(tpu) == ("fp8", 16)
    assert FORMATS["int4-g128-f32"].feed(tpu) == ("int4", 4) and FORMATS["int4-g128-f32"].feed(gpu) == ("bf16", 1)
    strict = format_from_dict("fp4-only", {"value_bits": 4, "compute_dtype": "fp4"}, "custom_formats.fp4-only")
    with pytest.raises(SpecError, match="fallback"):
        strict.feed(tpu, "tpu-v7")


def test_the_recipe_is_the_megakernels_only():
    """The multi-kernel engine runs the generic layout: one row per token, an all-reduce after the
    row-sharded post-expert projection, the embedding gathered and all-reduced."""
    import dataclasses
    g = build(MS, dataclasses.replace(B1, engine="multikernel"))
    assert collective(g, "attn_all_reduce")[1] == 8192 * 2 and "moe_all_reduce" in g.name
    assert "entry_barrier" not in g.name and "embedding_all_reduce" in g.name


def test_a_chip_without_the_operand_or_a_fallback_is_refused():
    m = derive("muse-spark", custom_formats={"fp4-only": {"value_bits": 4, "compute_dtype": "fp4"}},
               formats={"routed_expert": "fp4-only"})
    from perfmodel.step.predict import predict
    with pytest.raises(SpecError) as e:
        predict(m, TPU, B1)
    assert e.value.field == "format fp4-only"
    assert predict(m, GB200, Deployment(devices=8, tp=8, ep=1, engine="multikernel")).step_s > 0


def test_a_model_file_may_be_based_on_another_file(tmp_path):
    (tmp_path / "a.toml").write_text('base = "muse-spark"\nname = "a"\n[megakernel]\ncollective_wire = "f32"\n')
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "b.toml").write_text('base = "../a.toml"\nname = "b"\n[megakernel]\ntop_k = "iterative_argmax"\n')
    b = load_model(str(sub / "b.toml"))
    assert (b.name, b.megakernel.collective_wire, b.megakernel.top_k, b.megakernel.collective_rows) == \
        ("b", "f32", "iterative_argmax", 8)
    (tmp_path / "c.toml").write_text('base = "d.toml"\nname = "c"\n')
    (tmp_path / "d.toml").write_text('base = "c.toml"\nname = "d"\n')
    with pytest.raises(SpecError, match="cycle"):
        load_model(str(tmp_path / "c.toml"))
    (tmp_path / "e.toml").write_text('base = "missing.toml"\nname = "e"\n')
    with pytest.raises(SpecError, match="file not found"):
        load_model(str(tmp_path / "e.toml"))


def test_the_first_kernel_example_is_the_profiles_first_kernel():
    """docs/examples/muse-spark-first-kernel.toml (a file on the preset) and the profile's first
    kernel (the preset with five settings) are the same model."""
    from perfmodel.step.phases import kernel_model, load_profile
    example = load_model("docs/examples/muse-spark-first-kernel.toml")
    assert example.megakernel == kernel_model(load_profile("musespark")["kernels"]["first"]).megakernel


def test_the_final_container_example_says_how_each_family_is_fed():
    """docs/examples/muse-spark-nvfp4-int8.toml: NVFP4 experts (five copies an expert: two
    matrices, two block-scale arrays, the global scales) fed as fp8 against 32 LHS rows per batch
    row at batch 4 and dequantised to bf16 first at 8; int8 dense projections and lm_head with
    per-column scales, pushed at the bf16 rate (a 2 MiB bank holds twice the values); the router
    bf16 as in the preset."""
    from perfmodel.graph.ops import expert_descriptors
    from perfmodel.step.explain import explain
    m = load_model("docs/examples/muse-spark-nvfp4-int8.toml")
    f = m.formats
    assert (f["routed_expert"].name, f["attention"].name, f["lm_head"].name, f["router"].name) == \
        ("nvfp4", "int8-channel", "int8-channel", "bf16")
    assert expert_descriptors(m) == 5 and m.megakernel == MS.megakernel
    said = {}
    for batch in (4, 8):
        d = Deployment(devices=8, tp=8, ep=1, batch=batch, context=160, routing_correlation=1.0)
        terms = explain(m, TPU, d, 3, "routed_experts")["ops"][0]["terms"]
        said[batch] = next(t["term"] for t in terms if t["term"].startswith("matmul"))
    assert "32 LHS rows per batch row" in said[4] and "dequantised to bf16 first" in said[8]
    g = build(m, B1)
    q = g.name.index("q_proj")
    assert g.static_bytes[q] == pytest.approx(build(MS, B1).static_bytes[q] / 2, rel=0.01)


def test_recipe_round_trips_and_rejects_unknown_fields():
    from perfmodel.spec.arch import to_dict
    assert from_dict(to_dict(MS)).megakernel == MS.megakernel
    with pytest.raises(SpecError) as e:
        derive("muse-spark", megakernel={"top_k": "sort"})
    assert e.value.field == "megakernel.top_k"
    with pytest.raises(SpecError) as e:
        derive("muse-spark", megakernel={"sampling": "host"})
    assert e.value.field == "megakernel.sampling" and "kernel, xla" in str(e.value)


def test_a_streamed_matmul_issues_one_dot_per_ring_bank():
    """Muse Spark's kernel consumes every 2 MiB ring bank with one MXU dot: q_proj's 16 MiB bf16
    weights are 8 banks, so 7 dots beyond the one the push time counts, each the fitted
    `mxu_dot_issue_s`; k_proj (2 MiB: one bank), norms (no bank of weights) and the routed experts
    (not in the ring) issue none; without TPU components there is no such term."""
    g = build(MS, B1)
    dots = kernel_terms(g, TPU)["bank_dots"]
    first = lambda name: g.name.index(name)
    issue = TPU.components["mxu_dot_issue_s"]
    assert g.static_bytes[first("q_proj")] == 16 * 2**20
    assert dots[first("q_proj")] == pytest.approx(7 * issue)
    for name in ("k_proj", "attn_norm", "routed_experts"):
        assert dots[first(name)] == 0.0
    assert "bank_dots" not in kernel_terms(g, GB200)


def test_the_attention_moves_its_cache_in_tiles_and_waits_for_the_write_back_before_the_next_collective():
    """Muse Spark's attention reads each row's KV cache as 256-token K and V tiles and writes the
    patched last tiles back; the kernel waits for them after the o projection, before its all-reduce
    (attention.py, wait_cache_writes). At 160 cached tokens and batch 1 that is one tile a cache:
    per layer per rank 256 tokens x 2 kv heads x (64 + 64) values x 2 bytes = 128 KiB read in 2
    descriptors, and the same written back in 2; at batch 4, 8 each. The write-back is issued as
    the attention starts; the o all-reduce starts no earlier than it lands. A kernel without the
    setting reads the 161 tokens as one copy and writes nothing back; a negative tile is refused."""
    tile = 256 * 2 * (64 + 64) * 2
    g = build(MS, B1)
    attention = g.name.index("gqa_attention")
    assert g.kv_bytes[attention] == tile
    assert set(g.writeback) == set(g.kv_copies) == {layer.index for layer in MS.layers}
    assert g.writeback[31] == (tile, 2) and g.kv_copies[31] == 2
    g4 = build(MS, Deployment(devices=8, tp=8, ep=1, batch=4, context=160))
    assert g4.writeback[31] == (4 * tile, 8) and g4.kv_copies[31] == 8
    d = Deployment(devices=8, tp=8, ep=1, batch=1, context=160, engine="megakernel")
    g = build(MS, d)
    tl = simulate_megakernel(g, TPU, d, MS.moe.top_k, record=True)
    at = lambda lane, name: next((e[3], e[4]) for e in tl.events if e[:3] == (lane, name, 31))
    wb_issue, wb_landed = at("dma", "kv_writeback")
    core, all_reduce = at("compute", "gqa_attention"), at("link", "attn_all_reduce")
    assert core[0] + TPU.components["dma_latency_s"] == pytest.approx(wb_issue)
    assert all_reduce[0] >= wb_landed > core[1]
    plain = derive("muse-spark", megakernel={"kv_tile_tokens": 0})
    g0 = build(plain, d)
    assert g0.writeback == g0.kv_copies == {}
    assert g0.kv_bytes[attention] == 161 * 2 * (64 + 64) * 2
    assert not any(e[1] == "kv_writeback" for e in simulate_megakernel(g0, TPU, d, 8, record=True).events)
    with pytest.raises(SpecError) as e:
        derive("muse-spark", megakernel={"kv_tile_tokens": -1})
    assert e.value.field == "megakernel.kv_tile_tokens"


def test_the_attention_core_pays_a_latency_a_sequence_and_one_a_cache_tile_it_walks():
    """Kimi K3's MLA core walks each sequence's latent cache in the kernel's tiles: at 1028 cached
    tokens, 5 tiles of 256 a sequence (the new rows scored apart), 20 at batch 4; its core term is
    sequences x attention_core_s + tiles x attention_tile_s (the v5e's, fitted to the kernel's MLA
    core on the chip). A KDA layer's recurrence walks none: on the v5e (its KDA core measured) it is
    one latency and its FLOPs on the vector unit, all sequences at once (components.recurrence_time,
    in its compute); on tpu-v7 (no vector rate) a latency a sequence. Without tiles, no tile term."""
    v5e = load_hardware("tpu-v5e")
    c = v5e.components
    tiled = derive("kimi-k3", megakernel={"attention_tile_tokens": 256}, formats={"routed_expert": "int8"})
    for batch, per in ((1, 5), (4, 20)):
        d = Deployment(devices=32, tp=32, ep=8, batch=batch, context=1028, engine="megakernel")
        g = build(tiled, d)
        mla = [l.index for l in tiled.layers if l.attention == "mla"]
        kda = [l.index for l in tiled.layers if l.attention == "kda"]
        assert {g.core_tiles[i] for i in mla} == {per} and not any(i in g.core_tiles for i in kda)
        core = kernel_terms(g, v5e)["attention_core"]
        j = next(j for j, (n, l) in enumerate(zip(g.name, g.layer)) if n == "mla_attention" and l == mla[0])
        k = next(j for j, (n, l) in enumerate(zip(g.name, g.layer)) if n == "kda_recurrence" and l == kda[0])
        assert core[j] == pytest.approx(batch * c["attention_core_s"] + per * c["attention_tile_s"])
        assert core[k] == 0.0
        assert op_compute_s(g, v5e, megakernel=True)[k] == pytest.approx(
            c["attention_core_s"] + g.flops[k] / c["vpu_flops_per_s"])
        assert kernel_terms(g, TPU)["attention_core"][k] == pytest.approx(batch * TPU.components["attention_core_s"])
    g0 = build(derive("kimi-k3", megakernel={"attention_tile_tokens": 0}), d)
    assert g0.core_tiles == {}


def test_each_layer_copies_the_next_layers_vectors_as_it_starts():
    """Muse Spark's kernel copies each layer's ten small vectors (three norms [1, 8192] bf16, four
    residual gates [1, 8192] f32, two expert norms [1, 4096] bf16, the router bias [1, 256] f32: 193
    KiB) one DMA apiece, issued as the layer before starts (decode_megakernel.py prefetch_vectors),
    ahead of that layer's KV tiles; no op waits for them within the layer. Layer 0 (the glue before
    the first decoder layer) copies layer 1's, the last decoder layer none. Without the setting no
    such copy; an entry that is not a positive integer is refused."""
    from perfmodel.engine.megakernel import uniform_stream
    d = Deployment(devices=8, tp=8, ep=1, batch=1, context=160, engine="megakernel")
    g = build(MS, d)
    n = len(MS.layers)
    st = uniform_stream(g, 2**21)
    assert st.vectors == {layer: (193 * 1024.0, 10) for layer in range(n)}
    tl = simulate_megakernel(g, TPU, d, MS.moe.top_k, record=True)
    copies = {e[2]: e[3] for e in tl.events if e[:2] == ("dma", "layer_vectors")}
    assert sorted(copies) == list(range(n))
    first_op = {e[2]: e[3] for e in reversed(tl.events) if e[0] == "compute"}
    lat = TPU.components["dma_latency_s"]
    assert copies[31] == pytest.approx(first_op[31] + lat)
    kv = next(e[3] for e in tl.events if e[:3] == ("dma", "kv_cache/state", 31))
    assert kv >= copies[31]  # issued after them
    plain = derive("muse-spark", megakernel={"layer_vector_bytes": []})
    assert not any(e[1] == "layer_vectors" for e in simulate_megakernel(build(plain, d), TPU, d, 8, record=True).events)
    for bad in ([0], [-1], [1.5], "16384"):
        with pytest.raises(SpecError) as e:
            derive("muse-spark", megakernel={"layer_vector_bytes": bad})
        assert e.value.field == "megakernel.layer_vector_bytes"
    with pytest.raises(SpecError) as e:
        derive("muse-spark", megakernel={"expert_groups": -1})
    assert e.value.field == "megakernel.expert_groups"


def test_recipe_settings_start_from_a_model_file_without_the_table(tmp_path):
    """experiments/recipe_settings.py's generic row is what a model file written without
    [megakernel] predicts, its last row the preset's own prediction, and a setting's row that
    setting alone on the generic kernel: the 8-row payloads of Muse Spark's collectives lengthen
    the batch-1 step (each collective moves eight rows where one would do) and leave batch 8 as is."""
    import sys
    from pathlib import Path
    import tomllib
    from perfmodel.step.phases import load_profile, profile_deployment
    from perfmodel.step.predict import predict
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "experiments"))
    from recipe_settings import settings_effect
    out = settings_effect("muse-spark", (1, 8))
    data = tomllib.loads((root / "perfmodel" / "presets" / "models" / "muse-spark.toml").read_text())
    data.pop("megakernel")
    d = profile_deployment(load_profile("musespark"))
    plain = {b: predict(from_dict(data), TPU, dataclasses.replace(d, batch=b)).step_s for b in (1, 8)}
    assert out["generic"] == pytest.approx(plain, rel=1e-12)
    assert out["whole"][1] == pytest.approx(predict(MS, TPU, d).step_s, rel=1e-12)
    _, rows8 = out["settings"]["collective_rows"]
    assert rows8[1] > 1.05 * out["generic"][1] and rows8[8] == pytest.approx(out["generic"][8], rel=1e-9)
    assert "expert_groups" not in out["settings"]
