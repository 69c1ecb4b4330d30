"""The compiled megakernel simulator (perfmodel.engine.megakernel_sim) against the Python event loop it
replaced (reference_eventloop.py): the same timeline, to 1e-9 relative, on a fixed corpus of 200
random configurations (models, chips, DMA modes and limits on the copies in service, layouts, batch,
context, ring depth, slots, on-chip size, expert tiles, held-back refills), and the batched sweep
path against the scalar one."""
import functools
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from perfmodel.engine import megakernel, megakernel_sim
from perfmodel.engine.megakernel import simulate_megakernel
from perfmodel.engine.terms import op_weights
from perfmodel.graph import ops
from perfmodel.search import batch
from perfmodel.spec.deployment import Deployment, validate
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.predict import predict
from perfmodel.util.errors import SpecError
from reference_eventloop import simulate_megakernel as reference

REL = 1e-9
MODELS = ("kimi-k3-mini", "kimi-k3", "deepseek-v3", "qwen3-next-80b-a3b", "llama-3.2-1b", "gpt-oss-120b",
          "kimi-linear-48b", "nemotron-3-nano-30b-a3b", "muse-spark", "docs/examples/muse-spark-first-kernel.toml")
CHIPS = ("tpu-v7", "tpu-v6e", "gb200", "h100")
CORPUS = 200


def draw(rng: random.Random):
    """One random configuration, or None when it cannot run (the corpus draws again)."""
    model = load_model(rng.choice(MODELS))
    hw = load_hardware(rng.choice(CHIPS))
    devices = rng.choice([1, 2, 4, 8, 16, 32])
    tp = rng.choice([t for t in (1, 2, 4, 8, 16, 32) if devices % t == 0])
    changes = {"dma_sharing": rng.choice(["fifo", "shared"]), "dma_concurrent_copies": rng.choice([0, 0, 1, 2, 5])}
    if rng.random() < 0.5:
        changes["onchip_bytes"] = rng.choice([8, 16, 32, 64, 128]) * 2**20
    if rng.random() < 0.3:
        changes["dma_tile_bytes"] = rng.choice([1, 2, 4]) * 2**20
    hw = hw.replace(**changes)
    d = Deployment(devices=devices, tp=tp, engine="megakernel", batch=rng.choice([1, 2, 3, 8, 32]),
                   context=rng.choice([0, 100, 4096, 65536]), ep=rng.choice([None, 1, devices]),
                   prefetch_bytes=rng.choice([None, rng.uniform(0.5, 0.9) * hw.onchip_bytes, 3 * hw.dma_tile_bytes]),
                   expert_slots=rng.choice([None, 1, 2, 3, 8]))
    try:
        validate(model, hw, d)
        g = ops.build(model, d)
        w = op_weights(g, model.formats["routed_expert"].bytes_per_value)
        top_k = model.moe.top_k if model.moe else 1
        want = reference(g, hw, d, top_k, record=True, weights=w)
    except SpecError:
        return None
    return g, hw, d, top_k, w, want


@functools.cache
def corpus():
    rng, out = random.Random(20261201), []
    while len(out) < CORPUS:
        case = draw(rng)
        if case is not None:
            out.append(case)
    return out


def close(a, b) -> bool:
    a, b = np.asarray(a, float), np.asarray(b, float)
    return a.shape == b.shape and bool(np.all(np.abs(a - b) <= REL * np.maximum(np.abs(a), np.abs(b)) + 1e-18))


def test_corpus_covers_the_mechanisms():
    cases = corpus()
    assert len(cases) == CORPUS
    hws = [hw for _, hw, *_ in cases]
    assert {hw.dma_sharing for hw in hws} == {"fifo", "shared"}
    assert any(hw.dma_sharing == "shared" and hw.dma_concurrent_copies > 1 for hw in hws)  # copies waiting
    assert any(0 < g.tokens <= g.recipe.defer_refills_rows for g, *_ in cases)  # refills held back
    assert {hw.name for hw in hws} >= {"tpu-v7", "gb200"}  # remote-copy collectives and library ones
    assert any(want.sizing.tiles_per_expert > 1 for *_, want in cases)  # experts streamed through slots in tiles
    assert sum(g.routed_bytes.sum() > 0 for g, *_ in cases) >= CORPUS // 3


@pytest.mark.parametrize("chunk", range(4))
def test_compiled_simulator_equals_the_event_loop(chunk):
    cases = corpus()[chunk::4]
    for g, hw, d, top_k, w, want in cases:
        got = simulate_megakernel(g, hw, d, top_k, record=True, weights=w)
        where = f"{hw.name} {hw.dma_sharing} {d}"
        assert close(got.step_s, want.step_s), where
        assert close(got.dma_bytes, want.dma_bytes), where
        assert close(got.start_s, want.start_s) and close(got.end_s, want.end_s), where
        for cause, v in want.wait_s.items():
            assert close(got.wait_s[cause], v), (cause, where)
        assert got.sizing.tiles_per_expert == want.sizing.tiles_per_expert
        assert [e[:3] for e in got.events] == [e[:3] for e in want.events], where
        assert close([e[3:] for e in got.events], [e[3:] for e in want.events]), where


def test_batched_sweep_rows_equal_scalar_predictions():
    """batch.evaluate simulates configurations sharing an op graph together (run_many); each row
    equals the scalar predict of the same configuration, filtered rows included."""
    rng = random.Random(7)
    model, chip = load_model("kimi-k3"), load_hardware("tpu-v7")
    settings = [{"devices": 32, "tp": 32, "ep": 8, "engine": rng.choice(["megakernel"] * 3 + ["multikernel"]),
                 "batch": rng.choice([1, 8]), "context": rng.choice([4096, 131072]),
                 "prefetch_mib": rng.choice([None, 4, 24, 48]), "expert_slots": rng.choice([None, 1, 3, 8]),
                 "vmem_mib": rng.choice([None, 32, 128]), "dma_sharing": rng.choice([None, "fifo"]),
                 "steps_per_call": rng.choice([None, 1, 64])}
                for _ in range(60)]
    rows = batch.evaluate(model, chip, settings)
    assert {r["status"] for r in rows} == {"ok", "filtered"}
    for s, r in zip(settings, rows):
        d, hw = batch.configure(chip, s)
        try:
            p = predict(model, hw, d)
        except SpecError as e:
            assert r["status"] == "filtered" and r["reason"] == str(e)
            continue
        assert r["status"] == "ok", (s, r["reason"])
        assert close(r["step_s"], p.step_s) and close(r["tokens_per_s"], p.tokens_per_s), s
        assert close(r["hbm_utilisation"], p.hbm_utilisation) and r["bound"] == p.bound, s
        for cause, v in p.breakdown_s.items():
            assert close(r[f"{cause}_s"], v), (cause, s)


def test_plain_python_loops_equal_the_compiled_ones():
    """The loops as plain Python (PERFMODEL_LOOPS=python, or a small `expect`) and compiled give the
    same timeline, bit for bit: the same operations in the same order."""
    for g, hw, d, top_k, w, _ in corpus()[:12]:
        s = megakernel.sizing(g, hw, d, top_k)
        a = megakernel.cached_arrays(g, hw, None, w)
        args = (a.eng, a.t0, a.overhead, s.banks, s.slots, s.tiles_per_expert, *a.args())
        plain, compiled = megakernel_sim._PLAIN["_run"](*args), megakernel_sim._run(*args)
        for x, y in zip(plain, compiled):
            assert np.array_equal(x, y), (hw.name, d)


def test_the_compiled_loops_take_plain_scalars():
    """One signature per compiled loop: Python ints where floats are declared are converted, not
    compiled for afresh (the disk cache holds one entry per loop)."""
    g, hw, d, top_k, w, _ = corpus()[0]
    s = megakernel.sizing(g, hw, d, top_k)
    a = megakernel.cached_arrays(g, hw, None, w)
    want = megakernel_sim.run(a.eng, a.t0, 0.0, np.int64(s.banks), np.int64(s.slots), np.int64(1), *a.args())
    got = megakernel_sim.run(a.eng, a.t0, 0, int(s.banks), int(s.slots), True, *a.args())
    assert got[5] == want[5]
    assert all(len(megakernel_sim._COMPILED[name].signatures) == 1 for name in ("_run", "_run_many"))


def test_loops_are_chosen_once_per_process_unless_asked():
    code = ("from perfmodel.engine import megakernel_sim as ms; import sys; "
            "print(ms.expect(int(sys.argv[1])), ms.expect(10), ms.loops())")
    def mode(steps: int, env: str | None = None) -> list[str]:
        e = {k: v for k, v in os.environ.items() if k != "PERFMODEL_LOOPS"} | ({"PERFMODEL_LOOPS": env} if env else {})
        return subprocess.run([sys.executable, "-c", code, str(steps)], capture_output=True, text=True, check=True,
                              env=e).stdout.split()
    # a small first job runs plain Python; a large one loads the compiled loops and keeps them
    assert mode(95) == ["python", "python", "python"]
    assert mode(megakernel_sim.BREAK_EVEN_LAYER_STEPS) == ["compiled", "compiled", "compiled"]
    assert mode(10**6, env="python") == ["python", "python", "python"]
    with pytest.raises(SpecError) as e:
        megakernel_sim.loops("fast")
    assert e.value.field == "loops"
