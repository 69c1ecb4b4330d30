"""Prefill and mixed steps: the op graph of prompt chunks (causal attention, KV writes, the head's
sampled rows), mixed decode + prefill steps, and their costs on both engines."""
import dataclasses

import numpy as np
import pytest

from perfmodel.engine.terms import op_weights
from perfmodel.graph import ops
from perfmodel.graph.prefill import StepShape, prompt_chunks, step_graph
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.prefill import prefill, step_cost
from perfmodel.util.errors import SpecError

LLAMA = load_model("llama-3.1-8b")
D1 = Deployment(devices=1, tp=1, engine="multikernel")


def by_name(g, name):
    return [j for j, n in enumerate(g.name) if n == name]


def test_attended_is_the_mean_causal_span():
    for context, rows, window in [(0, 1, 0), (0, 7, 0), (100, 64, 0), (0, 300, 128), (100, 50, 128), (500, 9, 128)]:
        brute = np.mean([min(context + r + 1, window or 10**9) for r in range(rows)])
        assert ops.attended(context, rows, window) == pytest.approx(brute, rel=1e-12)


def test_gqa_prompt_chunk_flops_and_kv_bytes():
    """A chunk of C tokens after P cached: each row attends P + r + 1 tokens, 2 (hd + vd) FLOPs
    per head and token pair; the P cached entries are read and the C new ones written."""
    a, C, P = LLAMA.attn("gqa"), 512, 1024
    g = step_graph(LLAMA, D1, StepShape(chunks=1, chunk_tokens=C, chunk_context=P, finishing=1))
    j = by_name(g, "gqa_attention")[0]
    pairs = sum(P + r + 1 for r in range(C))
    assert g.flops[j] == pytest.approx(2 * a.heads * 2 * a.head_dim * pairs)
    assert g.kv_bytes[j] == pytest.approx((P + C) * a.kv_heads * 2 * a.head_dim * 2)


def test_chunking_keeps_the_work_of_the_prompt():
    """The causal pairs of a prompt are the same however it is chunked: N (N + 1) / 2; so are
    the matmul FLOPs; only the last chunk reaches the lm_head, for one row."""
    N = 3000
    total = {}
    for chunk in (None, 1024, 700):
        graphs = [step_graph(LLAMA, D1, StepShape(chunks=1, chunk_tokens=c, chunk_context=p, finishing=int(c + p == N)))
                  for c, p in prompt_chunks(N, chunk)]
        attn = sum(g.flops[by_name(g, "gqa_attention")].sum() for g in graphs)
        mm = sum(g.flops[g.static_bytes > 0].sum() for g in graphs)
        heads = [len(by_name(g, "lm_head")) for g in graphs]
        assert heads == [0] * (len(graphs) - 1) + [1]
        total[chunk] = (attn, mm)
    a = LLAMA.attn("gqa")
    pairs = N * (N + 1) / 2
    for attn, mm in total.values():
        assert attn == pytest.approx(len(LLAMA.layers) * 2 * a.heads * 2 * a.head_dim * pairs, rel=1e-12)
        assert mm == pytest.approx(total[None][1], rel=1e-12)


def test_head_samples_only_the_finishing_rows():
    g = step_graph(LLAMA, D1, StepShape(decode=3, context=100, chunks=1, chunk_tokens=50, chunk_context=0, finishing=1))
    j = by_name(g, "lm_head")[0]
    assert g.flops[j] == pytest.approx(2 * 4 * LLAMA.hidden * LLAMA.vocab)  # 3 decode rows + 1
    assert g.head_rows == 4 and g.tokens == 53
    w = op_weights(g)
    assert w[j] == pytest.approx(LLAMA.hidden * LLAMA.vocab)  # the weights, whatever the rows


def test_mixed_step_is_one_graph_of_all_rows():
    """B decode rows + a chunk of C: matmuls over B + C rows, weights read once, one attention
    op holding both groups' work."""
    B, L, C = 8, 2000, 256
    mixed = step_graph(LLAMA, D1, StepShape(decode=B, context=L, chunks=1, chunk_tokens=C, chunk_context=0, finishing=1))
    dec = step_graph(LLAMA, D1, StepShape(decode=B, context=L))
    pre = step_graph(LLAMA, D1, StepShape(chunks=1, chunk_tokens=C, chunk_context=0, finishing=1))
    assert len(by_name(mixed, "gqa_attention")) == len(LLAMA.layers)
    for name in ("gqa_attention", "q_proj", "down"):
        jm, jd, jp = (by_name(g, name) for g in (mixed, dec, pre))
        assert mixed.flops[jm].sum() == pytest.approx(dec.flops[jd].sum() + pre.flops[jp].sum())
        assert mixed.kv_bytes[jm].sum() == pytest.approx(dec.kv_bytes[jd].sum() + pre.kv_bytes[jp].sum())
    weights = lambda g: g.static_bytes[np.array(g.name) != "embedding_gather"].sum()  # gathered rows aside
    assert weights(mixed) == pytest.approx(weights(dec))


def test_decode_graph_unchanged_by_row_groups():
    """The default graph and the same step given as one decode group are the same op for op."""
    d = dataclasses.replace(D1, batch=5, context=777)
    a = ops.build(LLAMA, d)
    b = ops.build(LLAMA, d, (ops.Rows(5, 1, 777),), 5)
    for f in ("flops", "static_bytes", "kv_bytes", "act_bytes", "coll_bytes"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_mla_prefill_runs_the_cheaper_form():
    """MLA: a long prompt's causal attention costs less expanded (per-head keys and values,
    qk_nope + qk_rope / v_head per pair) than absorbed (kv_lora + rope / kv_lora per pair)."""
    m = load_model("deepseek-v3")
    a = m.attn("mla")
    d = Deployment(devices=8, tp=8, engine="multikernel")
    g = step_graph(m, d, StepShape(chunks=1, chunk_tokens=4096, chunk_context=0, finishing=1))
    j = by_name(g, "mla_attention")[0]
    hl, span = a.heads // 8, 4096 + (4096 + 1) / 2 - 4096
    expanded = 2 * 4096 * hl * span * (a.qk_nope_dim + a.qk_rope_dim + a.v_head_dim)
    absorbed = 4096 * hl * span * (4 * a.kv_lora_rank + 2 * a.qk_rope_dim)
    assert expanded < absorbed and g.flops[j] == pytest.approx(expanded)


def test_megakernel_step_is_xla_prefill_then_megakernel_decode():
    m, hw = load_model("kimi-k3-mini"), load_hardware("tpu-v7")
    mega = Deployment(devices=1, tp=1, engine="megakernel")
    shape = StepShape(decode=4, context=512, chunks=1, chunk_tokens=128, chunk_context=0, finishing=1)
    c = step_cost(m, hw, mega, shape)
    multi = dataclasses.replace(mega, engine="multikernel")
    assert c.prefill_s == pytest.approx(step_cost(m, hw, multi, shape.prefill).step_s)
    assert c.decode_s == pytest.approx(step_cost(m, hw, mega, shape.decode_only).step_s)


def test_ttft_grows_with_the_prompt_and_chunking_costs_weight_reads():
    hw = load_hardware("h100")
    t = [prefill(LLAMA, hw, D1, n).ttft_s for n in (128, 1024, 8192)]
    assert t[0] < t[1] < t[2]
    # compute-bound: 8x the tokens, at least 8x the time (attention grows faster)
    assert t[2] > 8 * t[1]
    whole, chunked = prefill(LLAMA, hw, D1, 4096), prefill(LLAMA, hw, D1, 4096, 512)
    assert len(chunked.chunk_s) == 8 and chunked.ttft_s > whole.ttft_s


def test_prefill_refuses_a_prompt_that_does_not_fit():
    with pytest.raises(SpecError, match="does not fit"):
        prefill(LLAMA, load_hardware("h100"), D1, 10**7)
    with pytest.raises(SpecError, match="chunk"):
        prompt_chunks(100, 0)
