"""Fixtures shared by the tests: the MINI spec derived from kimi-k3 and its weights (the kernel
tests), and the recorded H200 run (the GPU trace tests)."""
import json
import os
import shutil
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from perfmodel.engine import megakernel_sim
from perfmodel.spec.loaders import load_model

# the suite predicts thousands of steps: compiled loops (the plain-Python mode has its own test)
megakernel_sim.compile_loops()


@pytest.fixture(scope="session")
def spec():
    return load_model("kimi-k3-mini")


@pytest.fixture(scope="session")
def weights(spec):
    from perfmodel_kernels import reference  # jax only for the tests that ask for weights
    return reference.init_weights(spec, seed=0)


@pytest.fixture
def h200_runs(tmp_path) -> Path:
    """The runs directory of a real H200 capture (experiments/validate_gpu.py, 2026-12-04: the compiled
    reference step of kimi-k3-host-small at batch 1, context 256, its trace and HLO), unpacked."""
    with tarfile.open(Path(__file__).parent / "data" / "h200_trace.tar.xz") as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / "h200"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a browser test may not skip (a missing Chromium fails the run), nor a test
    with a mark named in PERFMODEL_REQUIRED_MARKS (make test-oldest: aot, a missing libtpu)."""
    outcome = yield
    rep = outcome.get_result()
    required = {"browser", *filter(None, os.environ.get("PERFMODEL_REQUIRED_MARKS", "").split(","))}
    marks = [m for m in required if item.get_closest_marker(m)]
    if rep.skipped and os.environ.get("CI") == "true" and marks:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else rep.longrepr
        rep.outcome, rep.longrepr = "failed", f"CI=true and the {marks[0]} test skipped: {reason}"


def pytest_collection_modifyitems(config, items):
    """A test marked tpu needs a TPU chip: skipped without one (the check opens JAX's backends
    only when such a test is selected)."""
    chip = [item for item in items if item.get_closest_marker("tpu")]
    if chip and not _tpu_attached():
        for item in chip:
            item.add_marker(pytest.mark.skip(reason="needs a TPU chip attached (pytest -m tpu on a TPU VM)"))


def _tpu_attached() -> bool:
    import importlib.util
    if importlib.util.find_spec("libtpu") is None:
        return False
    import jax
    try:
        return bool(jax.devices("tpu"))
    except RuntimeError:  # libtpu found no chip
        return False


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        shutil.rmtree(session.config.rootpath / "test-output" / "fuzz-counts", ignore_errors=True)


def pytest_terminal_summary(terminalreporter, config):
    """The fuzz suite's case counts, summed over the xdist workers."""
    files = sorted((config.rootpath / "test-output" / "fuzz-counts").glob("*.json"))
    if files:
        total = sum((Counter(json.loads(f.read_text())) for f in files), Counter())
        terminalreporter.write_line("fuzz cases run: " + ", ".join(f"{k} {v}" for k, v in total.items())
                                    + f"; total {sum(total.values())}")
