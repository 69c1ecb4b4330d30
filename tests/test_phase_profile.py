"""The model against a real megakernel's phase profile (Inferact's Muse Spark kernel on one TPU7x
host, TP8, batch 1; perfmodel/data/phase_profiles/musespark.json), phase by phase, for its final
and its first kernel (the first one's differences are settings of the model's [megakernel])."""
import functools
import json

import pytest

from perfmodel.cli.main import main
from perfmodel.graph import ops
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.arch import derive
from perfmodel.step.phases import (attention_parts, compare, kernel_model, kv_prefetch_gain, load_profile,
                                   over_harness, phases, profile_deployment, profile_deployments, skip)
from perfmodel.util.errors import SpecError

PROFILE = load_profile("musespark")
HW = load_hardware("tpu-v7")
# what the composition reproduces today (tolerance: 10 % a phase, 5 % the layer total and fixed cost)
MET = {"final": ("layer", "dense_ring", "collectives", "expert_stream", "routing", "fixed", "lm_head",
                 "dispatch_glue_barrier_prime", "xla_embedding"),
       "first": ("layer", "collectives", "expert_stream", "attention", "routing", "fixed")}


@functools.cache
def rows() -> dict:
    return {k: {r["phase"]: r for r in v["phases"]} for k, v in compare(PROFILE, HW).items()}


@pytest.mark.parametrize("kernel,phase", [(k, p) for k, ps in MET.items() for p in ps])
def test_phase_within_tolerance(kernel, phase):
    r = rows()[kernel][phase]
    assert abs(r["error"]) <= r["tolerance"], r


@pytest.mark.xfail(strict=True, reason="the composition's attribution is not yet the kernel's: the final kernel's "
                   "attention hides under the o projection's ring loads; README 'Checked against a real megakernel'")
@pytest.mark.parametrize("kernel,phase", [(k, p) for k in ("final", "first")
                                          for p in ("dense_ring", "collectives", "expert_stream", "attention",
                                                    "routing", "fixed") if p not in MET[k]
                                          and p in rows()[k]])
def test_phase_not_yet_within_tolerance(kernel, phase):
    r = rows()[kernel][phase]
    assert abs(r["error"]) <= r["tolerance"], r


@pytest.mark.xfail(strict=True, reason="a copy issued mid-layer waits behind less of the ring in the model than in "
                   "the kernel; README 'Checked against a real megakernel'")
def test_the_kv_prefetch_gains_what_the_kernel_measured():
    """Issuing the attention's KV tiles at the layer's start instead of inside the attention gained
    the real kernel 4.5 us a layer (the profile's `stated`, a check nothing is fitted to)."""
    gain = kv_prefetch_gain(PROFILE, HW) * 1e6
    assert gain == pytest.approx(PROFILE["stated"]["kv_prefetch_gain_us_per_layer"], rel=0.10)


def test_the_kv_prefetch_gain_is_taken_on_the_kernel_it_was_measured_on():
    """The stated gain's kernel is the first one with the bf16 wire on top: the gain is that kernel's
    layer with its tiles issued inside the attention less its layer with them issued at its start,
    and it is positive (the tiles issued late wait behind the ring's queued copies)."""
    first = PROFILE["kernels"]["first"]
    model = {kv: kernel_model(first, {"collective_wire": "bf16", "kv_prefetch": kv}) for kv in (True, False)}
    layer = {kv: over_harness(PROFILE, lambda d, kv=kv: phases(model[kv], HW, d)["layer"]) for kv in (True, False)}
    assert kv_prefetch_gain(PROFILE, HW) == pytest.approx(layer[False] - layer[True], rel=1e-12)
    assert layer[False] - layer[True] > 1e-6


def test_phases_are_the_mean_over_the_harness_timed_steps():
    """The harness times 128 steps at positions 183-310 (validate_musespark_decode.py bench): 73 read
    one 256-token KV tile, 55 read two. A phase is the steps' mean, so the model's is the
    steps-weighted mean over the two groups; the second tile is a second K and V copy behind the
    ring's queued loads in the first kernel, whose attention reads its tiles itself."""
    groups = profile_deployments(PROFILE)
    assert [(d.context, w) for d, w in groups] == [(219, pytest.approx(73 / 128)), (283, pytest.approx(55 / 128))]
    assert profile_deployment(PROFILE) == groups[0][0]  # the larger group stands for the harness alone
    first = kernel_model(PROFILE["kernels"]["first"])
    one, two = (phases(first, HW, d)["attention"] for d, _ in groups)
    assert two > one
    assert rows()["first"]["attention"]["predicted_us"] == pytest.approx((73 * one + 55 * two) / 128 * 1e6)
    assert over_harness(PROFILE, lambda d: {"x": d.context})["x"] == pytest.approx((73 * 219 + 55 * 283) / 128)


def test_the_first_kernels_differences_are_settings():
    """Each setting moves its own phase the way its mechanism says: f32 wire doubles the bytes of
    every collective (more collective time), no KV prefetch makes the attention wait for its copy
    (first-byte latency and its bytes); the layer pays for both."""
    final, first = (rows()[k] for k in ("final", "first"))
    assert first["collectives"]["predicted_us"] > final["collectives"]["predicted_us"] + 5
    assert first["attention"]["predicted_us"] > final["attention"]["predicted_us"] + 1.5
    assert first["layer"]["predicted_us"] > final["layer"]["predicted_us"] + 5


def test_greedy_in_xla_glue_replaces_the_in_kernel_pick():
    """The first kernel picks its greedy token in XLA glue after the kernel: the head's in-kernel
    argmax and the all-gather of its pairs give way to one glue step at the embedding glue's
    measured cost (components.xla_sampling_time), paid once per step, outside the layers."""
    final = PROFILE["kernels"]["final"]
    d = profile_deployment(PROFILE)
    glue = {**final, "megakernel": {"sampling": "xla"}}
    g_kernel, g_glue = (ops.build(kernel_model(e), d) for e in (final, glue))
    assert {"argmax", "argmax_all_gather"} <= set(g_kernel.name) and "xla_sampling" not in g_kernel.name
    assert "xla_sampling" in g_glue.name and "argmax" not in g_glue.name and "argmax_all_gather" not in g_glue.name
    a, b = (phases(kernel_model(e), HW, d) for e in (final, glue))
    assert b["layer"] == pytest.approx(a["layer"], rel=1e-9)
    head = b["step"] - a["step"]  # the glue step less the in-kernel pick it replaces (a few us)
    assert HW.components["xla_embedding_s"] - 10e-6 < head < HW.components["xla_embedding_s"]


def test_the_iterative_argmax_is_exposed_by_the_held_back_refills():
    """The first kernel's iterative argmax costs 8 rounds against the rank-based top-k's 2
    (components.topk_time). Without held-back refills part of its extra rounds hides under the ring's
    refills (about 0.3 us); the profile's row ("baseline 2.7 once exposed") carries the final kernel's
    held refills, which leave nothing in flight to hide them under: skipping them saves the rounds."""
    final, first = (rows()[k] for k in ("final", "first"))
    assert first["routing"]["megakernel"] == {"defer_refills_rows": 4} and first["routing"]["reading"]
    assert first["routing"]["predicted_us"] > final["routing"]["predicted_us"] + 1.0
    own = PROFILE["kernels"]["first"]
    hidden = phases(kernel_model(own), HW, profile_deployment(PROFILE))["routing"]
    assert hidden * 1e6 < first["routing"]["predicted_us"] - 0.2  # its own settings alone hide some


def test_the_dense_ring_is_the_ring_alone():
    """A kernel cannot skip its ring (decode_megakernel.py SKIPPABLE), so its phase is a decoder layer
    with the collectives, experts, attention and routing skipped: on the profiled kernel without
    held-back refills the ring alone is its bytes at the DMA engine's rate, 38 copies of a 2 MiB
    bank (76 MiB per layer per rank) each paying one descriptor, and the next layer's vectors the
    layer copies as it starts (10 descriptors, 193 KiB). Held back, the refills the router
    and the latent projection would issue wait for the (skipped) experts' end, which comes at once,
    and go out in one burst: served round-robin, K at a time (dma_concurrent_copies), the burst's
    first bank lands later than one served alone, by less than K - 1 banks' time per layer."""
    final = PROFILE["kernels"]["final"]
    unheld = {**final, "megakernel": {**final["megakernel"], "defer_refills_rows": 0}}
    c = HW.components
    per_bank = 2**21 / c["dma_bandwidth_bytes_per_s"] + c["dma_descriptor_s"]
    vec = kernel_model(final).megakernel.layer_vector_bytes
    vectors = sum(vec) / c["dma_bandwidth_bytes_per_s"] + len(vec) * c["dma_descriptor_s"]
    alone = phases(kernel_model(unheld), HW, profile_deployment(PROFILE))["dense_ring"]
    assert len(vec) == 10 and alone == pytest.approx(38 * per_bank + vectors, rel=0.01)
    held = phases(kernel_model(final), HW, profile_deployment(PROFILE))["dense_ring"]
    assert alone < held < alone + (HW.dma_concurrent_copies - 1) * per_bank
    with pytest.raises(SpecError):
        skip(ops.build(kernel_model(PROFILE["kernels"]["final"]), profile_deployment(PROFILE)), "dense_ring")


def test_phases_are_what_skipping_them_saves():
    """The layer total is a decoder layer on the timeline; the fixed cost what the layers leave of
    the step; lm_head and the glue are inside it."""
    entry = PROFILE["kernels"]["final"]
    p = phases(kernel_model(entry), HW, profile_deployment(PROFILE))
    assert p["fixed"] == pytest.approx(p["step"] - 62 * p["layer"])
    assert p["dispatch_glue_barrier_prime"] == pytest.approx(p["fixed"] - p["lm_head"])
    assert 0 < p["xla_embedding"] < p["dispatch_glue_barrier_prime"] < p["fixed"]


def test_the_attention_parts_say_what_the_layer_waits_on():
    """Why the final kernel's attention misses (README, "Still off"): its compute is hidden (the o
    projection after it waits for its ring loads) and its phase is nearly all the write-back's
    wait; in the first kernel, whose attention reads its KV tiles itself, behind the ring's queued
    loads, the compute after that wait is on the layer's path whole. A kernel that writes nothing
    back inside the layer has no write-back part."""
    core = HW.components["attention_core_s"]
    final, first = (over_harness(PROFILE, lambda d, k=k: attention_parts(kernel_model(PROFILE["kernels"][k]), HW, d))
                    for k in ("final", "first"))
    assert final["compute"] < 0.1 * core
    assert final["writeback"] == pytest.approx(rows()["final"]["attention"]["predicted_us"] * 1e-6, rel=0.01)
    assert first["compute"] == pytest.approx(core, rel=0.01) and first["writeback"] == 0
    untiled = derive("muse-spark", megakernel={"kv_tile_tokens": 0})
    assert attention_parts(untiled, HW, profile_deployment(PROFILE))["writeback"] == 0


def test_explain_prints_the_profile_beside_the_prediction(capsys):
    assert main(["explain", "--profile", "musespark"]) == 0
    text = capsys.readouterr().out
    assert "final kernel" in text and "first kernel" in text and "dense_ring" in text and "measured us" in text
    assert main(["explain", "--profile", "musespark", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["phase_profile"]
    assert set(out["kernels"]) == {"final", "first"}
    r = {x["phase"]: x for x in out["kernels"]["final"]["phases"]}
    assert r["layer"]["measured_us"] == 55 and r["layer"]["predicted_us"] > 0 and "REPORT.md" in r["layer"]["source"]
    assert main(["explain", "--profile", "nope"]) == 2
    assert "routing: predicted with defer_refills_rows = 4 as well" in text  # a row's own settings, named
    assert "stated gains of single changes" in text and "first, collective_wire = bf16" in text
    (check,) = out["checks"]
    assert check["check"] == "kv_prefetch_gain" and check["measured_us"] == 4.5 and "E4" in check["source"]
    assert check["predicted_us"] == pytest.approx(kv_prefetch_gain(PROFILE, HW) * 1e6)
    parts = out["kernels"]["first"]["attention_parts_us"]
    assert parts["compute"] == pytest.approx(HW.components["attention_core_s"] * 1e6, rel=0.01)
    assert f"leaving out its compute alone saves {parts['compute']:.2f} us" in text


@pytest.mark.parametrize("change,err", [
    (lambda p: p["stated"].pop("kv_prefetch_gain_kernel"),
     "stated.kv_prefetch_gain_kernel=None: a stated gain needs the kernel"),
    (lambda p: p["stated"]["kv_prefetch_gain_kernel"].update(kernel="zzz"),
     "stated.kv_prefetch_gain_kernel.kernel='zzz': one of the profile's kernels: final, first"),
    (lambda p: p["stated"].update(kv_prefetch_gain_us_per_layer=-1),
     "stated.kv_prefetch_gain_us_per_layer=-1: must be > 0"),
    (lambda p: p["kernels"]["first"]["phases"][4].update(megakernel=5), "phases[4].megakernel=5: must be a table"),
    (lambda p: p["harness"]["timed_steps"][0].update(steps=0), "timed_steps[0].steps=0: must be"),
    (lambda p: p["harness"]["timed_steps"][1].pop("context"), "timed_steps[1].context"),
    (lambda p: p["harness"].update(timed_steps=[]), "timed_steps=[]"),
    (lambda p: p["harness"]["timed_steps"][0].update(context=-1), "timed_steps[0].context=-1: must be"),
    (lambda p: p["harness"]["deployment"].update(zzz=3), "harness.deployment.zzz=3: unknown key"),
    (lambda p: p["kernels"]["final"]["phases"][0].pop("per"), "phases[0].per=None: required key is missing"),
    (lambda p: p["kernels"]["final"]["phases"][0].pop("source"), "phases[0].source=None: required key is missing"),
    (lambda p: p["kernels"]["final"]["phases"][0].update(phase="zzz"), "phases[0].phase='zzz': must be one of"),
    (lambda p: p["kernels"]["final"]["phases"][0].update(per="step"),
     "kernels.final.phases[0].per='step': the layer phase is per layer"),
    (lambda p: p["kernels"]["final"].update(model="nope"), "p.json: model='nope': unknown preset"),
    (lambda p: p["kernels"]["first"]["phases"][4]["megakernel"].update(zzz=1), "p.json: megakernel.zzz=1: unknown"),
    (lambda p: p["stated"]["kv_prefetch_gain_kernel"]["megakernel"].update(collective_wire="f8"),
     "p.json: megakernel.collective_wire='f8': must be one of")])
def test_a_bad_profile_field_is_named(tmp_path, capsys, change, err):
    """A stated gain names a kernel of the profile, a row's own settings are a table, the timed
    steps' groups are whole step counts at non-negative contexts, the deployment has only the keys
    a profiled megakernel takes, a row names a known phase per what it is, with its source, and
    a kernel's model loads: else exit 2 naming the field (a user's own profile file)."""
    bad = json.loads(json.dumps(PROFILE))
    change(bad)
    (tmp_path / "p.json").write_text(json.dumps(bad))
    assert main(["explain", "--profile", str(tmp_path / "p.json")]) == 2
    assert err in capsys.readouterr().err
