"""The seed fit sees only its training points: changing every held-out reported value (batches 2
and 4, the speculative-decoding pair) changes no fitted value and no prediction; and nothing is
fitted for the TPU."""
import dataclasses

from perfmodel.fit import seed
from perfmodel.fit.measurements import seed_measurements
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.predict import predict


def test_held_out_values_steer_nothing():
    ms = seed_measurements()
    hw = {m.platform: load_hardware(m.hardware) for m in ms}
    moved = [dataclasses.replace(m, tokens_per_s=m.tokens_per_s * 3.0) if seed.role(m) == "held-out" else m
             for m in ms]
    assert sum(a != b for a, b in zip(ms, moved)) == 6
    fitted, again = seed.fit(ms, hw), seed.fit(moved, hw)
    assert fitted == again and set(fitted) == {"gb200.graph_kernel_overlap_s"}
    model = load_model(seed.MODEL)
    for m in ms:
        h = seed._apply(fitted, hw, m.platform)
        assert predict(model, h, seed.deployment_for(m)).tokens_per_s == \
            predict(model, seed._apply(again, hw, m.platform), seed.deployment_for(m)).tokens_per_s


def test_training_values_do_steer_the_fit():
    """The same fit does move when a training point moves (the test above could not pass vacuously)."""
    ms = seed_measurements()
    hw = {m.platform: load_hardware(m.hardware) for m in ms}
    moved = [dataclasses.replace(m, tokens_per_s=m.tokens_per_s * 1.3)
             if m.platform == "gb200" and seed.role(m) == "fitted" else m for m in ms]
    assert seed.fit(moved, hw) != seed.fit(ms, hw)
